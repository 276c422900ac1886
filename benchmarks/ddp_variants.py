"""PyTorch DDP against each hand-written data-parallel mode (`scratch-ddp`), side by side in one run.

    python benchmarks/ddp_variants.py [--d-model 512] [--n-layers 8] [--steps 12] [--precision bf16]

Runs `handle run` on 2 ranks (gloo on CPU) for each case with the same model, data and seed, then prints, from
rank 0's step events after the first `--skip` steps (allocation and bucket set-up): median step time, tokens/s,
all-reduce calls and bytes per step, exposed communication `comm_s` (the wait for gradients after backward),
and the speed-up over `naive`. A model with many small parameters (d_model 512, 8 layers: ~100 tensors) is
where per-parameter all-reduces, flattening and buckets differ most.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from _common import bench_args, bench_preset, handle_run, step_medians

CASES = {
    "ddp (PyTorch)": ["strategy.name=ddp"],
    "naive": ["strategy.name=scratch-ddp", "strategy.sync=naive"],
    "flat": ["strategy.name=scratch-ddp", "strategy.sync=flat"],
    "overlap": ["strategy.name=scratch-ddp", "strategy.sync=overlap"],
    "bucketed": ["strategy.name=scratch-ddp", "strategy.sync=bucketed"],
    "bucketed 4 MiB": ["strategy.name=scratch-ddp", "strategy.sync=bucketed", "strategy.bucket_mb=4"],
    "bucketed + ZeRO-1": ["strategy.name=scratch-ddp", "strategy.sync=bucketed", "strategy.shard_optimizer=true"],
}


def measure(preset: Path, sets: list[str], skip: int) -> dict:
    t0 = time.perf_counter()
    run_dir = handle_run(preset, sets)
    wall = time.perf_counter() - t0
    return {**step_medians(run_dir, skip, ("step_time_s", "tokens_per_s", "allreduce_calls", "allreduce_bytes", "comm_s")), "wall_s": wall}


def main() -> None:
    a = bench_args(__doc__, CASES, d_model=512, n_layers=8, steps=12, precision="bf16")
    with tempfile.TemporaryDirectory() as tmp:
        preset = bench_preset(Path(tmp), a, "ddp", log_every=1000)
        rows = {}
        for name in a.cases.split(","):
            rows[name] = measure(preset, CASES[name], a.skip)
            print(f"measured {name}: {rows[name]['step_time_s']:.3f} s/step", file=sys.stderr)
    base = rows.get("naive", {}).get("tokens_per_s")
    if a.json:
        for name, r in rows.items():
            print(json.dumps({"case": name, **r, "speedup_vs_naive": r["tokens_per_s"] / base if base else None}))
        return
    print(f"2 ranks, gloo, {a.precision}, decoder d_model={a.d_model} n_layers={a.n_layers} seq_len={a.seq_len} "
          f"micro_batch_size={a.micro_batch_size}; medians over steps {a.skip + 1}..{a.steps}")
    print("| case | step time (s) | tokens/s | all-reduce calls/step | MB/step | exposed comm_s | vs naive |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    for name, r in rows.items():
        mb = r["allreduce_bytes"] / 2**20 if r["allreduce_bytes"] is not None else None
        speed = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"| {name} | {fmt(r['step_time_s'], '.3f')} | {fmt(r['tokens_per_s'], ',.0f')} | "
              f"{fmt(r['allreduce_calls'], '.0f')} | {fmt(mb, '.1f')} | {fmt(r['comm_s'], '.3f')} | {speed} |")


if __name__ == "__main__":
    main()
