"""Training precisions by name (``training.precision``, ``bench comm --dtype``, the peak-FLOP/s cache keys) and
the torch dtype of each. torch is imported inside :func:`torch_dtype` only, so that the CLI can import this module
without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each precision."""


def torch_dtype(precision: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``, ``"fp16"`` -> ``torch.float16``, ``"fp32"`` -> ``torch.float32``.

    Raises:
        ValueError: a name not in :data:`PRECISIONS`.
    """
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if precision not in dtypes:
        raise ValueError(f"unknown precision {precision!r} (valid: {', '.join(PRECISIONS)})")
    return dtypes[precision]
