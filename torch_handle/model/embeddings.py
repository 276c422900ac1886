"""Step 1 of the model: tokens to vectors. A token embedding scaled by √d_model, plus a fixed sinusoidal position
table (Vaswani et al. 2017, §3.4 and §3.5); or, for a model with rotary positions (``rope.py``), the embedding
alone (``PositionsInAttention``).

Shape letters: B batch, T sequence length, C = d_model channels, V vocabulary size.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def embed_tokens(embed: nn.Embedding, ids: Tensor, scale: bool = True) -> Tensor:
    """Token embedding times √C (Vaswani et al. 2017, §3.4), or unscaled (``scale=False``: Llama, GPT-2): ids
    LongTensor (B, T) -> (B, T, C).

    With the table initialised N(0, 1/C) (the model's ``_reset_parameters``) the scaled embeddings have unit
    variance, and a tied output projection starts with O(1) logits.
    """
    x = embed(ids)  # (B, T, C)
    return x * math.sqrt(embed.embedding_dim) if scale else x


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sinusoidal position table (Vaswani et al. 2017, §3.5)::

        PE[pos, 2i]   = sin(pos / 10000^(2i / d_model))
        PE[pos, 2i+1] = cos(pos / 10000^(2i / d_model))

    The table is a persistent buffer: it is saved in the ``state_dict`` and follows the module
    through ``.to(device)`` / ``.to(dtype)``, but it is not a parameter, so no optimizer sees it.

    Args:
        d_model: embedding width C.
        max_len: longest sequence the table covers.

    Shape:
        forward(x): x is (B, T, C) float; returns (B, T, C) in x's dtype. With ``position_ids`` (B, T) each token
        gets the row of its own position (packed documents, positions restarting at 0 at each document).

    Raises:
        ValueError: if offset + T > max_len.
    """

    pe: Tensor

    def __init__(self, d_model: int, max_len: int = 5000) -> None:
        super().__init__()
        self.d_model = d_model
        self.max_len = max_len
        # Computed in float64 so large positions keep their precision before the float32 cast.
        position = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (max_len, 1)
        div_term = torch.exp(
            torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model)
        )  # (ceil(C/2),)
        pe = torch.zeros(max_len, d_model, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term[: d_model // 2])  # odd C has one fewer cos column
        self.register_buffer("pe", pe.to(torch.float32), persistent=True)  # (max_len, C)

    def forward(self, x: Tensor, offset: int = 0, position_ids: Tensor | None = None) -> Tensor:
        """x (B, T, C) -> x + PE[offset : offset + T]; ``offset`` is the number of positions before x (the
        length of a key/value cache when decoding incrementally). With ``position_ids`` (B, T): x + PE[position_ids]
        (B, T, C)."""
        T = x.shape[1]
        if offset + T > self.max_len:
            raise ValueError(f"sequence length {offset + T} exceeds positional-encoding max_len {self.max_len}")
        if position_ids is not None:
            return x + self.pe[position_ids].to(x.dtype)  # (B, T, C)
        return x + self.pe[offset:offset + T].to(x.dtype)  # (T, C) broadcasts over B

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}"


class PositionsInAttention(nn.Module):
    """The position step of a model with rotary positions: adds nothing. Each attention rotates its queries and keys
    by their positions (``rope.RotaryEmbedding``), so the embeddings enter the layers as they are.

    A module all the same, so that both kinds of model have the same parts in the same places (a pipeline's first
    stage and the tensor-parallel plan find ``pos_encoding`` in both), and so that both refuse the same lengths.

    Args:
        max_len: longest sequence accepted (RoPE itself has no limit: see ``TransformerArgs.max_len``).

    Shape:
        forward(x (B, T, C), offset, position_ids) -> x (the positions are the attention's).

    Raises:
        ValueError: if offset + T > max_len.
    """

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len

    def forward(self, x: Tensor, offset: int = 0, position_ids: Tensor | None = None) -> Tensor:
        if offset + x.shape[1] > self.max_len:
            raise ValueError(f"sequence length {offset + x.shape[1]} exceeds max_len {self.max_len}")
        return x

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}"
