"""Key/value cache for incremental decoding (eval only), beside the model: what each attention module keeps
between decoding steps, so a step feeds only the new tokens.

``KVCache`` (one per generation) holds a ``LayerCache`` per decoder layer, which holds an ``AttentionCache`` for
self-attention (appending) and one for cross-attention (static). It holds the H_kv key/value heads (fewer than
the H query heads under grouped-query attention: the cache is H / H_kv times smaller), keys already rotated by
their positions under RoPE. Shape letters: B batch, H_kv key/value heads, S cached positions, d_k channels per head,
T new positions.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class AttentionCache:
    """What one ``MultiHeadAttention`` keeps between incremental decoding steps: its keys and values.

    Self-attention (``static=False``): each call appends the new positions' keys/values, so a step feeds only
    the new token. Cross-attention (``static=True``): the keys/values of the encoder memory are projected on
    the first call and reused afterwards (the memory passed later is ignored).

    Attributes:
        k, v: (B, H_kv, S, d_k) or None before the first call.
    """

    def __init__(self, static: bool = False) -> None:
        self.static = static
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    @property
    def length(self) -> int:
        """S, the positions held: the position of the next key of a self-attention cache."""
        return 0 if self.k is None else self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the cached keys and values."""
        return 0 if self.k is None else self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def ready(self) -> bool:
        """A static cache that holds its keys/values: the caller projects only the queries."""
        return self.static and self.k is not None

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the keys/values of this call, k and v (B, H_kv, T, d_k), and return all of them: (B, H_kv, S + T,
        d_k) after the S cached ones for self-attention, k and v themselves for a static cache."""
        if not self.static and self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (LongTensor (B',), repeats allowed: beam search)."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


class LayerCache:
    """A ``DecoderLayer``'s caches: ``self_attn`` (appending) and ``cross_attn`` (static, encoder-decoder)."""

    def __init__(self) -> None:
        self.self_attn = AttentionCache()
        self.cross_attn = AttentionCache(static=True)


class KVCache:
    """Key/value cache for incremental decoding (eval only): one ``LayerCache`` per decoder layer, the
    target padding mask of the positions seen so far, and their number (``length``: the position offset
    of the next tokens). Pass the same object to successive ``DecoderLM.forward`` / ``EncoderDecoder.decode``
    calls, feeding only the new tokens; the logits equal those of recomputing the whole prefix.

    Args:
        n_layers: decoder layers of the model (``KVCache.for_model(model)`` counts them).
    """

    def __init__(self, n_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(n_layers)]
        self.padding_mask: Tensor | None = None  # bool (B, length), True = pad; None while nothing is padded
        self.length = 0

    @classmethod
    def for_model(cls, model: nn.Module) -> KVCache:
        return cls(len(model.layers) if hasattr(model, "layers") else len(model.decoder_layers))

    def extend_padding(self, mask: Tensor | None, new: int) -> Tensor | None:
        """Append the ``new`` tokens' padding mask, bool (B, new) or None when none of them is padded, and return
        the whole (B, length + new) one, or None while no position seen so far is padded (attention then needs
        no mask tensor). The first padded position turns the earlier ones into explicit False columns, and a
        later call without padding appends False columns."""
        if mask is None and self.padding_mask is None:
            return None
        rows = mask if mask is not None else self.padding_mask
        if mask is None:
            mask = torch.zeros(rows.shape[0], new, dtype=torch.bool, device=rows.device)
        if self.padding_mask is None:
            self.padding_mask = torch.zeros(rows.shape[0], self.length, dtype=torch.bool, device=rows.device)
        self.padding_mask = torch.cat([self.padding_mask, mask], 1)
        return self.padding_mask

    @property
    def nbytes(self) -> int:
        """Bytes of every cached key and value (what grouped-query attention shrinks)."""
        return sum(layer.self_attn.nbytes + layer.cross_attn.nbytes for layer in self.layers)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (LongTensor (B',)) of every cached tensor (beam search, finished rows)."""
        for layer in self.layers:
            layer.self_attn.reorder(index)
            layer.cross_attn.reorder(index)
        if self.padding_mask is not None:
            self.padding_mask = self.padding_mask.index_select(0, index)
