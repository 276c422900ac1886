"""Normalisation layers: LayerNorm (torch's) and RMSNorm, and the switch between them (``TransformerArgs.norm``).

RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization") drops LayerNorm's re-centring: it divides
each vector by its root mean square and scales it by a learned gain, with no mean and no bias. One reduction
instead of two, and (the paper's finding) the same quality: re-scaling invariance, not re-centring, is what
normalisation buys. Llama, Qwen and most decoders trained since 2023 use it.

Shape letters: B batch, T sequence length, C normalised channels (d_model, or d_k for the per-head q/k norm).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torch_handle.model.args import NORMS, Norm, check_choice


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x², last dim) + eps) · g (Zhang & Sennrich 2019, eq. 4), computed in fp32.

    The mean square is taken in float32 whatever x's dtype, and the normalised vector is cast back to x's dtype
    before the gain multiplies it: the order Llama's and Qwen's ``*RMSNorm`` use, so that bf16 weights give their
    results. ``torch.nn.RMSNorm`` computes the same function (the tests check it).

    Args:
        dim: C, the size of the last dimension.
        eps: added to the mean square (1e-5 in Llama 2 and 3, 1e-6 in Qwen 3).

    Shape:
        (..., C) -> (..., C), x's dtype (or the promotion of x's and the gain's).

    Raises:
        ValueError: dim < 1 or eps <= 0.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        if dim < 1 or eps <= 0:
            raise ValueError(f"RMSNorm needs dim >= 1 and eps > 0, got dim={dim}, eps={eps}")
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))  # the gain g, (C,)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., C), unit RMS
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def build_norm(kind: Norm, dim: int, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    """The norm ``kind`` names over the last ``dim`` channels: ``nn.LayerNorm(dim, eps, bias=bias)`` or
    ``RMSNorm(dim, eps)`` (which never has a bias).

    Raises:
        ValueError: an unknown ``kind`` (the message lists the valid ones).
    """
    check_choice("norm", kind, NORMS)
    return nn.LayerNorm(dim, eps=eps, bias=bias) if kind == "layernorm" else RMSNorm(dim, eps)
