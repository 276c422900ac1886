"""The experts of an MoE layer computed grouped (one ``torch._grouped_mm`` per matrix) against looped (one matmul per
expert), forward + backward, and their difference.

    python benchmarks/moe_experts.py [--device cpu|cuda] [--reps 7] [--threads 1] [--smoke] [--json]

``GroupedExperts`` (torch_handle/model/moe.py) receives the N·k assignments of a micro-batch sorted by expert, with
the count per expert, and runs every expert's SwiGLU FFN over its run of rows. The loop is the readable reference:
``x.split(counts)`` (one host read of the counts), then three matmuls per expert; the grouped path runs each of the
three matrices as one ``torch._grouped_mm`` over all experts with the end offsets of their runs (no host read, one
kernel; Megablocks, Gale et al. 2022, and torchtitan's MoE do the same).

Timed: ``GroupedExperts._grouped`` and ``._looped`` forward + backward (gradients of the input and the three stacked
weights), the two interleaved in each repetition, median of ``--reps`` after one warm-up, fp32 and bf16 (a dtype
without a grouped kernel on the device gets the error's first line instead). The rows per expert are drawn from a softmax over Gaussian logits (some experts
busy, some nearly idle, one with no rows at all), as a router early in training gives. Shapes: presets/moe.toml's
experts (E 8, C 256, F 256, 8 × 128 tokens, top-2) and a Qwen 3 MoE-like layer (E 64, C 1024, F 768, 16 K tokens on
CUDA / 256 on a CPU, top-8). ``--json``: one object per case instead of the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import _common  # noqa: F401 - puts this checkout first on sys.path
import torch

from torch_handle.model.moe import GroupedExperts

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def shapes(device: str, smoke: bool) -> list[tuple[str, int, int, int, int, int]]:
    """(name, E, C, F, tokens N, top_k) of the cases."""
    if smoke:
        return [("tiny", 4, 32, 32, 64, 2)]
    return [("moe.toml", 8, 256, 256, 8 * 128, 2),
            ("Qwen3-MoE-like", 64, 1024, 768, 16384 if device == "cuda" else 256, 8)]


def counts_of(n_rows: int, n_experts: int, gen: torch.Generator) -> torch.Tensor:
    """(E,) int64 rows per expert summing to ``n_rows``, uneven, the last expert empty."""
    share = torch.softmax(torch.randn(n_experts, generator=gen), 0)
    share[-1] = 0.0
    counts = torch.floor(share / share.sum() * n_rows).long()
    counts[0] += n_rows - int(counts.sum())
    return counts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(device: torch.device, dtype: torch.dtype, E: int, C: int, F: int, N: int, k: int,
             reps: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    experts = GroupedExperts(E, C, F, "swiglu").to(device=device, dtype=dtype)
    counts = counts_of(N * k, E, gen).to(device)
    x = torch.randn(N * k, C, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(N * k, C, generator=gen).to(device=device, dtype=dtype)

    def fwd_bwd(path: str) -> tuple[float, list[torch.Tensor]]:
        xi = x.detach().requires_grad_(True)
        experts.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        y = getattr(experts, path)(xi, counts)
        y.backward(dy)
        _sync(device)
        return time.perf_counter() - start, [y.detach(), xi.grad, *(p.grad for p in experts.parameters())]

    out: dict[str, Any] = {"E": E, "C": C, "F": F, "tokens": N, "top_k": k, "rows": N * k,
                           "empty_experts": int((counts == 0).sum())}
    try:
        fwd_bwd("_grouped")
    except (RuntimeError, NotImplementedError) as exc:  # no grouped kernel for this dtype / device
        return {**out, "grouped_error": str(exc).splitlines()[0][:160]}
    fwd_bwd("_looped")
    times: dict[str, list[float]] = {"_grouped": [], "_looped": []}
    for _ in range(reps):
        for path in times:
            times[path].append(fwd_bwd(path)[0])
    _, grouped = fwd_bwd("_grouped")
    _, looped = fwd_bwd("_looped")
    rel = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))
              for a, b in zip(grouped, looped))
    g, lo = statistics.median(times["_grouped"]) * 1e3, statistics.median(times["_looped"]) * 1e3
    return {**out, "grouped_ms": round(g, 3), "looped_ms": round(lo, 3), "speedup": round(lo / g, 2),
            "max_rel_diff": rel}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads on a CPU (a worker's is 1)")
    ap.add_argument("--smoke", action="store_true", help="one tiny case, two repetitions (the tests' version)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    reps = 2 if args.smoke else args.reps
    dtypes = ["fp32", "bf16"]
    rows = []
    for name, E, C, F, N, k in shapes(device.type, args.smoke):
        for dt in dtypes:
            rows.append({"case": name, "dtype": dt, **run_case(device, DTYPES[dt], E, C, F, N, k, reps)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"experts fwd+bwd on {device} (torch {torch.__version__}), median of {reps}")
    print(f"{'case':<16} {'dtype':<5} {'E':>3} {'rows':>7} {'grouped ms':>11} {'looped ms':>10} {'speed-up':>8} "
          f"{'max rel diff':>12}")
    for r in rows:
        if "grouped_error" in r:
            print(f"{r['case']:<16} {r['dtype']:<5} {r['E']:>3} {r['rows']:>7}  grouped: {r['grouped_error']}")
            continue
        print(f"{r['case']:<16} {r['dtype']:<5} {r['E']:>3} {r['rows']:>7} {r['grouped_ms']:>11.3f} "
              f"{r['looped_ms']:>10.3f} {r['speedup']:>7.2f}x {r['max_rel_diff']:>12.2e}")


if __name__ == "__main__":
    main()
