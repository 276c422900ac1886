"""What a benchmark row's figures are measured against, and the arithmetic they must satisfy: the datasheets' dense
bf16 peaks of the GPUs the GPU check meets, and :func:`consistency` (tokens per step, tokens/s and MFU multiplied
back together; issue 40, where a row's micro-batch, step time, tokens/s and MFU did not multiply)."""

from __future__ import annotations

import re
from typing import Any

DATASHEET_BF16: list[tuple[str, str, float, str]] = [
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", 756e12,
     "NVIDIA H100 Tensor Core GPU datasheet: BF16 Tensor Core 1,513 TFLOPS with sparsity"),
    (r"\bH100\b(?!.*\bNVL\b)", "H100 SXM", 989e12,
     "NVIDIA H100 Tensor Core GPU datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity"),
    (r"\bH200\b(?!.*\bNVL\b)", "H200", 989e12,
     "NVIDIA H200 Tensor Core GPU datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity"),
    (r"\bA100\b", "A100", 312e12, "NVIDIA A100 Tensor Core GPU datasheet: BF16 Tensor Core 312 TFLOPS "
                                   "(624 with sparsity)"),
]
"""(pattern on ``torch.cuda.get_device_name``, card, dense bf16 FLOP/s, source): the dense figure is half the
datasheet's "with sparsity" one. A card not listed gets no datasheet MFU."""
AGREE = 0.01
"""Relative tolerance of a row's own arithmetic (:func:`consistency`): tokens/s against tokens per step over the step
time, MFU against tokens/s x FLOPs per token over the peak."""


def datasheet_peak(device_name: str) -> dict[str, Any] | None:
    """``{"card", "bf16_flops", "source"}`` of the first :data:`DATASHEET_BF16` entry matching ``device_name``."""
    for pattern, card, flops, source in DATASHEET_BF16:
        if re.search(pattern, device_name):
            return {"card": card, "bf16_flops": flops, "source": source}
    return None


def consistency(row: dict[str, Any], datasheet: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The arithmetic a row must satisfy, each ``{"name", "ok", "what"}`` (what: the two sides): tokens per step =
    micro-batch x grad_accum x world size x sequence length (data parallelism, every sample seq_len tokens);
    tokens/s = tokens per step / step time and MFU = tokens/s x FLOPs per token / (peak x world size), both within
    :data:`AGREE` (the datasheet MFU too, with the datasheet's peak). A check whose figures the row lacks is left
    out."""
    checks: list[dict[str, Any]] = []

    def check(name: str, got: Any, want: Any, text: str) -> None:
        if isinstance(got, (int, float)) and isinstance(want, (int, float)):
            ok = abs(got - want) <= AGREE * abs(want)
            checks.append({"name": name, "ok": ok, "got": got, "want": want,
                           "what": f"{text}: {got:.6g} vs {want:.6g}"})

    r, world = row, row.get("world_size") or 1
    if None not in (r.get("micro_batch_size"), r.get("seq_len")):
        check("tokens_per_step", r.get("tokens_per_step"),
              r["micro_batch_size"] * (r.get("grad_accum") or 1) * world * r["seq_len"],
              "tokens per step = micro-batch x grad_accum x world x seq_len")
    if r.get("tokens_per_step") is not None and r.get("step_ms"):
        check("tokens_per_s", r.get("tokens_per_s"), r["tokens_per_step"] / (r["step_ms"] / 1e3),
              "tokens/s = tokens per step / step time")
    if r.get("tokens_per_s") is not None and r.get("flops_per_token"):
        model_flops = r["tokens_per_s"] * r["flops_per_token"]
        if r.get("peak_flops"):
            check("mfu", r.get("mfu"), model_flops / (r["peak_flops"] * world),
                  "MFU = tokens/s x FLOPs per token / (peak x world)")
        if datasheet:
            check("mfu_datasheet", r.get("mfu_datasheet"), model_flops / (datasheet["bf16_flops"] * world),
                  "datasheet MFU = tokens/s x FLOPs per token / (datasheet peak x world)")
    return checks
