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
PARTS = ("data", "forward", "backward", "sync", "optimizer")
"""The step's parts, as the step events time them (``data_s`` ...), in the table's order."""
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


def compare(rows: list[dict[str, Any]]) -> None:
    """Notes relating runs to the 1-GPU eager runs: compile's speed-up (``X-compile`` against ``X-eager``: GPT-2,
    the Llama-shaped model) and the 2-rank runs' tokens/s per device against GPT-2's eager run."""
    ok = {r["id"]: r for r in rows if r["status"] == "ok" and r.get("tokens_per_s")}
    for r in ok.values():
        eager = ok.get(r["id"].removesuffix("-compile") + "-eager") if r["id"].endswith("-compile") else None
        if eager is not None:
            r["vs_eager"] = r["tokens_per_s"] / eager["tokens_per_s"]
            r["note"] = f"{r['vs_eager']:.2f} x eager"
        elif r["id"] in ("zero2-2", "fsdp-2") and "gpt2-eager" in ok:
            r["vs_eager"] = r["tokens_per_s"] / (ok["gpt2-eager"]["tokens_per_s"] * (r.get("world_size") or 1))
            r["note"] = f"per device {r['vs_eager']:.2f} x the 1-device eager run"


def binary(n: int) -> str:
    """``2048`` -> ``"2 KiB"``, ``3 << 29`` -> ``"1.5 GiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _outcome(attempt: dict[str, Any]) -> str:
    return "ok" if attempt["status"] == "ok" else "OOM" if attempt["oom"] else "failed"


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The rows as a markdown table (what docs/gpu.md's Results section shows)."""
    head = ["step", "check", "status", "world", "micro-batch", "seq len", "vocab", "tokens/step", "ms/step", "tokens/s",
            "GFLOP/token", "peak TFLOP/s", "data / fwd / bwd / sync / opt ms", "MFU (measured peak)", "MFU (datasheet)",
            "CUDA max alloc", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        parts = r.get("breakdown_ms") or {}
        split = " / ".join(f"{parts[p]:.1f}" for p in PARTS if p in parts) or "-"
        mem = r.get("cuda_max_allocated_bytes")
        note = r.get("note") or r.get("message") or ""
        if r.get("estimate"):
            e = r["estimate"]
            tried = ", ".join(f"{a['micro_batch_size']} {_outcome(a)}" for a in e["attempts"])
            note = f"estimate: {e['micro_batch_size']} fit; ran {tried}" + (f"; {note}" if note else "")
        flops, peak = r.get("flops_per_token"), r.get("peak_flops")
        cells = [str(r["step"]), r["title"], r["status"], _cell(r.get("world_size"), "d"),
                 _cell(r.get("micro_batch_size"), "d"), _cell(r.get("seq_len"), ",d"), _cell(r.get("vocab_size"), ",d"),
                 _cell(r.get("tokens_per_step"), ",.0f"), _cell(r.get("step_ms"), ".1f"),
                 _cell(r.get("tokens_per_s"), ",.0f"), _cell(None if flops is None else flops / 1e9, ".3f"),
                 _cell(None if peak is None else peak / 1e12, ".3g"), split, _cell(r.get("mfu"), ".1%"),
                 _cell(r.get("mfu_datasheet"), ".1%"),
                 "-" if mem is None else binary(mem), " ".join(str(note).split()).replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
