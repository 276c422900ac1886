"""Step 5 of ``benchmarks/gpu_check.py``: what long sequences and large vocabularies cost on one device (issues 48
and 49), the figures only a GPU gives.

* ``loss-memory``: ``benchmarks/loss_memory.py --json``, the output layer and loss path whole against chunked
  (``training.loss_impl``) at Llama 3's and Qwen's vocabularies, seq_len 2,048, micro-batches 1 and 4: peak and
  transient memory, ``handle estimate``'s figure over the measured one, and the chunked path's time over the full
  one's (issue 49's targets: transient <= 0.25x, time <= 1.05x, estimate within 10%).
* ``long-context``: the longest power-of-two ``seq_len`` at which ``presets/long-context.toml`` (the llama preset
  with packed documents) trains on one device, cp 1, micro-batch 1: ``handle estimate``'s device bytes at doubling
  lengths pick the longest that fits :data:`MEMORY_FRACTION` of the device, a real run confirms it, halving on
  CUDA out of memory (issue 48's "longest seq_len for the llama preset on one device").

The CPU smoke version runs both at toy sizes (a made-up device budget), so that a GPU session finds them working.
Standard library only; each figure comes from a CLI command or a benchmark's ``--json`` lines.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

MEMORY_FRACTION = 0.85
"""Share of the device the estimate may fill (``gpu_check.MEMORY_FRACTION``: the estimate leaves out the allocator's
caching and the CUDA context)."""
MAX_DOUBLINGS = 8
"""Estimates at most: seq_len from the preset's up to 2^8 times it."""
MAX_RUNS = 3
"""Runs at most to confirm the longest seq_len (halving on out of memory)."""
LONG_PRESET = "presets/long-context.toml"
ONE_DEVICE = ["parallel.cp=1", "launch.nproc_per_node=1", "training.micro_batch_size=1"]


def loss_memory_row(smoke: bool, out: Path, run: Callable[[list[str], Path, float], tuple[int | None, str]],
                    timeout_s: float) -> dict[str, Any]:
    """The ``loss-memory`` row: one entry per (vocabulary, micro-batch) of ``benchmarks/loss_memory.py --json``."""
    shape = (["--vocabs", "512", "--seq-len", "64", "--d-model", "32", "--micro-batches", "1", "--rounds", "1",
              "--device", "cpu"] if smoke else ["--rounds", "5"])
    cmd = [sys.executable, "benchmarks/loss_memory.py", "--json", *shape]
    rc, text = run(cmd, out / "logs" / "loss-memory.log", timeout_s)
    cases = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    keep = ("vocab", "micro_batch", "seq_len", "logits_fp32_bytes", "peak_ratio", "transient_ratio", "time_ratio",
            "full_estimate_ratio", "chunked_estimate_ratio", "full_s", "chunked_s",
            "fp32_accumulate", "weight_grad_error", "hidden_grad_error")  # the last two on CUDA only
    cases = [{k: c.get(k) for k in keep} for c in cases]
    note = "; ".join(f"V {c['vocab']:,} B {c['micro_batch']}: transient {c['transient_ratio']:.3f}x, time "
                     f"{c['time_ratio']:.2f}x" for c in cases if c["transient_ratio"] is not None
                     and c["time_ratio"] is not None)
    row = {"id": "loss-memory", "step": 5, "title": "loss path: chunked ÷ full (benchmarks/loss_memory.py)",
           "returncode": rc, "command": " ".join(cmd[1:]), "cases": cases,
           "status": "ok" if rc == 0 and cases else "failed", "note": note or f"exit {rc}: see logs/loss-memory.log"}
    return row


def longest_fit(estimates: list[dict[str, Any]], memory: int, fraction: float = MEMORY_FRACTION) -> int | None:
    """The longest ``seq_len`` among ``estimates`` (``{"seq_len", "device_bytes"}``, in increasing seq_len) whose
    device bytes fit ``fraction`` of ``memory``; None when none does."""
    fits = [e["seq_len"] for e in estimates if e["device_bytes"] <= fraction * memory]
    return max(fits) if fits else None


def long_context_row(smoke: bool, memory: int, runner: Any, preset_seq_len: int) -> dict[str, Any]:
    """The ``long-context`` row: the estimate's doubling search, then runs from its choice down (``runner``:
    ``gpu_check.Runner``, its ``estimate_bytes`` and ``train``)."""
    title = f"{LONG_PRESET}, 1 {'CPU process' if smoke else 'GPU'}, cp 1: the longest power-of-two seq_len"
    row: dict[str, Any] = {"id": "long-context", "step": 5, "title": title}
    extra = ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2", "model.d_ff=128",
             "data.vocab_size=512", "training.steps=2", "training.log_every=1", "training.eval_every=0",
             "training.checkpoint_every=0"] if smoke else ["training.steps=8", "training.eval_every=0",
                                                           "training.checkpoint_every=0"]
    overrides = [*ONE_DEVICE, *extra]
    estimates: list[dict[str, Any]] = []
    seq_len = preset_seq_len
    for _ in range(MAX_DOUBLINGS + 1):
        found = runner.estimate_bytes(LONG_PRESET, [*overrides, f"data.seq_len={seq_len}"], f"long-T{seq_len}")
        estimates.append({"seq_len": seq_len, "device_bytes": found["device_bytes"]})
        if found["device_bytes"] > MEMORY_FRACTION * memory:
            break
        seq_len *= 2
    chosen = longest_fit(estimates, memory)
    row.update(estimates=estimates, device_memory_bytes=memory, fraction=MEMORY_FRACTION)
    if chosen is None:
        return {**row, "status": "failed", "message": f"no seq_len from {preset_seq_len} fits the estimate's budget"}
    attempts: list[dict[str, Any]] = []
    while True:
        ran = runner.train(f"long-T{chosen}", LONG_PRESET, [*overrides, f"data.seq_len={chosen}"], 1)
        attempts.append({"seq_len": chosen, "status": ran["status"], "oom": ran["oom"]})
        if ran["status"] == "ok" or not ran["oom"] or chosen <= preset_seq_len or len(attempts) >= MAX_RUNS:
            break
        chosen //= 2
    row.update(ran, attempts=attempts, longest_seq_len=chosen if ran["status"] == "ok" else None,
               note=f"seq_len {chosen:,} trains on one device (estimate's choice "
                    f"{attempts[0]['seq_len']:,}); tokens/s {ran.get('tokens_per_s') or 0:,.0f}")
    return row
