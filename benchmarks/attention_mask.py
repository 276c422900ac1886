"""Attention forward + backward with a mask tensor (the path before the fast path) against ``is_causal`` only.

    python benchmarks/attention_mask.py [--device cpu|cuda] [--reps 7] [--threads 1] [--smoke] [--json]

Before the fast path every batch of a model with a ``pad_id`` carried a key-padding mask (``ids == pad_id``), all
False for language-model windows, so ``MultiHeadAttention`` built a (B, 1, T, T) bool mask in every layer and
``F.scaled_dot_product_attention`` got it as ``attn_mask``: no flash kernel (the SDPA documentation: a mask tensor
rules it out; Dao et al. 2022, "FlashAttention"). Now an unpadded batch passes no mask, and SDPA gets
``is_causal=True`` alone. The old path is forced here by an explicit all-False ``key_padding_mask``.

Timed: ``MultiHeadAttention._attend`` (q, k, v (B, H, T, d_k) in, (B, H, T, d_k) out; the part that changed, without
the projections) forward + backward, the two paths interleaved in each repetition, median of ``--reps`` after one
warm-up, with ``--threads`` intra-op threads (1: a torchrun worker's ``OMP_NUM_THREADS=1``). Shapes: the demo's
model (presets/zero2.toml: d_model 256, 4 heads, seq_len 128, micro-batch 8) and GPT-2 small's attention (12 heads
of 64, T 1024, batch 1 on the CPU, 8 on CUDA), fp32 and bf16. On the CPU also the kernel CPU training with dropout
uses (the reference with the model's own dropout, 0.1), which never calls SDPA: there the saving is the padding
mask's (B, 1, T, T) AND and its empty-row fix-up. ``--json``: one object per case instead of the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import _common  # noqa: F401 - puts this checkout first on sys.path
import torch

from torch_handle.model.attention import MultiHeadAttention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def shapes(device: str, smoke: bool) -> list[tuple[str, int, int, int, int]]:
    """(name, B, H, T, d_k) of the cases."""
    if smoke:
        return [("tiny", 2, 2, 32, 16)]
    return [("demo (zero2)", 8, 4, 128, 64), ("GPT-2 small", 8 if device == "cuda" else 1, 12, 1024, 64)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_case(B: int, H: int, T: int, d_k: int, dtype: torch.dtype, device: str, reps: int,
              dropout: float = 0.0) -> dict[str, float]:
    """Median seconds of ``_attend`` forward + backward over ``reps``: ``mask`` (all-False key-padding mask) and
    ``causal`` (none), interleaved.

    Raises:
        RuntimeError: the two paths' outputs differ by more than the dtype's rounding (dropout 0 only).
    """
    mha = MultiHeadAttention(H * d_k, H, dropout=dropout).to(device).train()
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d_k, generator=g, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(B, H, T, d_k, generator=g, device=device, dtype=dtype)
    paths = {"mask": torch.zeros(B, T, dtype=torch.bool, device=device), "causal": None}

    def run(kpm: torch.Tensor | None) -> tuple[float, torch.Tensor]:
        _sync(device)
        t0 = time.perf_counter()
        out = mha._attend(q, k, v, kpm, causal=True, offset=0)
        out.backward(grad)
        _sync(device)
        return time.perf_counter() - t0, out.detach()

    outs = {name: run(kpm)[1] for name, kpm in paths.items()}  # warm-up
    if dropout == 0.0 and not torch.allclose(outs["mask"].float(), outs["causal"].float(), atol=2e-2, rtol=2e-2):
        raise RuntimeError(f"the paths differ: {(outs['mask'].float() - outs['causal'].float()).abs().max()}")
    times: dict[str, list[float]] = {name: [] for name in paths}
    for rep in range(reps):
        for name, kpm in list(paths.items())[::1 if rep % 2 else -1]:  # each path goes first in half the reps
            times[name].append(run(kpm)[0])
    return {name: statistics.median(xs) for name, xs in times.items()}


def cases(device: str, smoke: bool) -> list[dict[str, Any]]:
    """What to time: every shape in fp32 and bf16 with SDPA; on the CPU also the dropout path."""
    out = []
    for name, B, H, T, d_k in shapes(device, smoke):
        for precision in DTYPES:
            out.append({"case": f"{name} {precision}", "B": B, "H": H, "T": T, "d_k": d_k, "precision": precision,
                        "kernel": "sdpa", "dropout": 0.0})
            if device == "cpu":
                out.append({**out[-1], "case": f"{name} {precision}, dropout 0.1", "kernel": "reference + dropout",
                            "dropout": 0.1})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    ap.add_argument("--smoke", action="store_true", help="one tiny shape, 2 repetitions (tests, gpu_check's smoke)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    reps = 2 if a.smoke else a.reps
    if a.device == "cuda":
        where = torch.cuda.get_device_name()
    else:
        where = f"CPU, {a.threads} thread(s), oneDNN ISA {torch.backends.cpu.get_cpu_capability()}"
    if not a.json:
        print(f"torch {torch.__version__}, {where}; median of {reps} reps, forward + backward of _attend\n")
        print("| case | B x H x T x d_k | kernel | mask tensor (before) ms | is_causal, no mask (after) ms "
              "| speed-up |\n| --- | --- | --- | ---: | ---: | ---: |")
    for c in cases(a.device, a.smoke):
        t = time_case(c["B"], c["H"], c["T"], c["d_k"], DTYPES[c["precision"]], a.device, reps, c["dropout"])
        row = {**c, "device": where, "mask_ms": t["mask"] * 1e3, "causal_ms": t["causal"] * 1e3,
               "speedup": t["mask"] / t["causal"]}
        if a.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"| {c['case']} | {c['B']} x {c['H']} x {c['T']} x {c['d_k']} | {c['kernel']} | "
                  f"{row['mask_ms']:.2f} | {row['causal_ms']:.2f} | {row['speedup']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
