"""Training precisions by name (``training.precision``, ``bench comm --dtype``, the peak-FLOP/s cache keys) and
the torch dtype of each. ``training.precision`` also accepts ``"auto"`` (:data:`ConfigPrecision`), which the
launcher resolves to one of them (:mod:`torch_handle.launch.precision`). torch is imported inside
:func:`torch_dtype` only, so that the CLI can import this module without it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
"""The concrete precisions: what a run computes in, and what keys the peak caches."""
AUTO = "auto"
ConfigPrecision = Literal["auto", "fp32", "bf16", "fp16"]
"""What ``training.precision`` accepts: a concrete precision, or ``auto`` (chosen by the launcher on the machine)."""
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_DEFAULT_FPMATH_MODE",
           "DNNL_DEFAULT_FPMATH_MODE")
"""Environment variables that change which CPU kernels torch and oneDNN use, hence a measured figure."""
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


def isa_env() -> str:
    """``ONEDNN_MAX_CPU_ISA=AVX2,...`` of the :data:`ISA_ENV` variables that are set, or ``""``."""
    return ",".join(f"{k}={os.environ[k]}" for k in ISA_ENV if os.environ.get(k))
