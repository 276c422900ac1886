"""Rotary position embeddings (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding").

Instead of adding a position vector to the token embedding, RoPE rotates each query and key by an angle that grows
with its position. Split a head's d_k channels into d_k/2 pairs; pair i of the vector at position m turns by
m·θ_i radians, θ_i = theta^(-2i/d_k) (§3.2, eq. 15; theta = 10000 in the paper). A rotation preserves lengths, and
the dot product of a query rotated by m·θ with a key rotated by n·θ depends on m - n only (§3.4.1): attention
scores see relative positions, though every vector is rotated by its absolute one. Nothing is learned and nothing
is added to the residual stream, so the model has no position table and no length it was built for.

Which channels form a pair is a convention. The paper (and GPT-J, and Meta's original Llama code with complex
numbers) pairs neighbours (0, 1), (2, 3), ...; Hugging Face's Llama and Qwen pair channel j with channel j + d_k/2
("rotate half"). The two differ by a fixed permutation of each head's Q and K weight rows, so a checkpoint converts
either way; this module uses the rotate-half pairing so that weights map 1:1 to ``transformers``.

Shape letters: B batch, H heads, T positions, d_k channels per head.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rope_frequencies(d_k: int, theta: float = 10000.0, device: torch.device | str | None = None) -> Tensor:
    """θ_i = theta^(-2i/d_k) for i = 0 .. d_k/2 - 1: float32 (d_k/2,), radians per position.

    Computed as ``transformers``' default RoPE computes its ``inv_freq`` (float32 exponent, then the power), so
    the angles agree to the last bit."""
    return 1.0 / (theta ** (torch.arange(0, d_k, 2, dtype=torch.float32, device=device) / d_k))


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension: (..., d_k) -> (..., d_k). With channel j
    paired to channel j + d_k/2, ``x·cos + rotate_half(x)·sin`` turns every pair by its angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: Tensor, d_k: int, theta: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles of ``positions`` (any shape (...), integer or float): each float32 (..., d_k), the
    d_k/2 angles position · θ_i repeated for both halves (channel j and j + d_k/2 share an angle)."""
    angles = positions.float()[..., None] * rope_frequencies(d_k, theta, positions.device)  # (..., d_k/2)
    angles = torch.cat((angles, angles), dim=-1)  # (..., d_k)
    return angles.cos(), angles.sin()


def rope_table(max_len: int, d_k: int, theta: float = 10000.0, device: torch.device | str | None = None
               ) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles of positions 0 .. max_len - 1 (:func:`rope_cos_sin`): each float32 (max_len, d_k).

    A model computes it once (``_TransformerModel``'s ``rope_cos`` / ``rope_sin`` buffers) and hands it to every
    attention, which slices its positions' rows, as litgpt (``GPT.rope_cache``) and torchtitan (``freqs_cis``) do.
    Computed inside the attention instead, the angles are a pointwise chain of ``arange``, ``pow``, ``cos`` and
    ``sin`` that Inductor fuses into every (B, H, T, d_k) rotation and recomputes in backward: B·H times the
    transcendental work, 11 of 330 ms a step for presets/llama.toml compiled (docs/performance.md)."""
    return rope_cos_sin(torch.arange(max_len, device=device, dtype=torch.float32), d_k, theta)


class RotaryEmbedding(nn.Module):
    """Rotate queries or keys by their positions (rotate-half pairing; see the module docstring).

    Holds no parameters and no buffers. The angles come from the model's table (:func:`rope_table`, handed to
    ``forward`` as ``table``: rows sliced, nothing computed) or, without one, are computed in float32 at the call
    (T·d_k/2 multiplications: a layer used on its own). Either way they are fp32-accurate angles cast to x's dtype
    at the use, as ``transformers`` does, so a bf16 model rotates as an fp32 one would round.

    Args:
        d_k: channels per head; must be even (channels rotate in pairs).
        theta: the base of the frequencies (``TransformerArgs.rope_theta``).

    Shape:
        forward(x (B, H, T, d_k), offset) -> (B, H, T, d_k) in x's dtype; forward(x, positions=(B, T)) rotates row
        b's vector t by its own position ``positions[b, t]`` (packed documents: positions restart at 0 at each
        document, as in torchtitan's document masking and Hugging Face's packing with ``position_ids``).

    Raises:
        ValueError: an odd d_k, or theta <= 1.
    """

    def __init__(self, d_k: int, theta: float = 10000.0) -> None:
        super().__init__()
        if d_k % 2 or theta <= 1:
            raise ValueError(f"RoPE rotates channel pairs: head_dim must be even and rope_theta > 1, got "
                             f"head_dim={d_k}, rope_theta={theta}")
        self.d_k, self.theta = d_k, theta

    def cos_sin(self, T: int, offset: int, device: torch.device, dtype: torch.dtype,
                positions: Tensor | None = None, table: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin of the angles of positions offset .. offset + T - 1: each (T, d_k) in ``dtype``; with
        ``positions`` (B, T) (integer), of those positions: each (B, 1, T, d_k), broadcast over the heads. From
        ``table`` (:func:`rope_table`, at least offset + T rows) when given, else computed here."""
        if table is None:
            if positions is None:
                positions = torch.arange(offset, offset + T, device=device, dtype=torch.float32)  # (T,)
            cos, sin = rope_cos_sin(positions, self.d_k, self.theta)  # (..., T, d_k)
        elif positions is None:
            cos, sin = (t[offset:offset + T] for t in table)  # (T, d_k)
        else:
            cos, sin = (t[positions] for t in table)  # (B, T, d_k)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, d_k)
        return cos.to(dtype), sin.to(dtype)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None,
                table: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """x (B, H, T, d_k), the vectors of positions offset .. offset + T - 1 (``offset``: the positions a key/value
        cache holds), or of ``positions`` (B, T) when given -> x rotated, (B, H, T, d_k). ``table``: the model's
        (cos, sin) of every position (:func:`rope_table`)."""
        cos, sin = self.cos_sin(x.shape[-2], offset, x.device, x.dtype, positions, table)  # broadcast over B, H
        return x * cos + rotate_half(x) * sin

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, theta={self.theta}"
