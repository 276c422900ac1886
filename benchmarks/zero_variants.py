"""Hand-written ZeRO-2/3 (`scratch-fsdp`) beside DeepSpeed ZeRO-2/3 and FSDP2, side by side in one run.

    python benchmarks/zero_variants.py [--d-model 256] [--n-layers 4] [--steps 10] [--precision fp32]

Runs `handle run` on 2 ranks (gloo on CPU) for each case with the same model, data and seed, then prints, from
rank 0's step events after the first `--skip` steps: median step time and tokens/s, all-gather and
reduce-scatter calls and MB per step and the exposed communication `comm_s` (scratch-fsdp only: the library
strategies do not report theirs), and rank 0's model-state bytes (parameters + gradients + optimizer state,
from its last memory record), with tokens/s relative to FSDP2.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from _common import bench_args, bench_preset, handle_run, read_events, step_medians

CASES = {
    "fsdp (FSDP2)": ["strategy.name=fsdp"],
    "deepspeed ZeRO-2": ["strategy.name=deepspeed", "strategy.zero_stage=2"],
    "deepspeed ZeRO-3": ["strategy.name=deepspeed", "strategy.zero_stage=3"],
    "scratch ZeRO-2": ["strategy.name=scratch-fsdp", "strategy.zero_stage=2"],
    "scratch ZeRO-3": ["strategy.name=scratch-fsdp", "strategy.zero_stage=3"],
    "scratch ZeRO-3 prefetch": ["strategy.name=scratch-fsdp", "strategy.zero_stage=3", "strategy.prefetch=true"],
    "scratch ZeRO-3 keep": ["strategy.name=scratch-fsdp", "strategy.zero_stage=3",
                            "strategy.reshard_after_forward=false"],
}
KEYS = ("step_time_s", "tokens_per_s", "allgather_calls", "allgather_bytes", "reducescatter_calls",
        "reducescatter_bytes", "comm_s")


def measure(preset: Path, sets: list[str], skip: int) -> dict:
    run_dir = handle_run(preset, sets)
    memory = [e["memory"][0] for e in read_events(run_dir, "step") if e.get("memory")][-1]
    state = sum(memory[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
    return {**step_medians(run_dir, skip, KEYS), "model_state_bytes": state}


def main() -> None:
    a = bench_args(__doc__, CASES, d_model=256, n_layers=4, steps=10, precision="fp32")
    with tempfile.TemporaryDirectory() as tmp:
        preset = bench_preset(Path(tmp), a, "fsdp", log_every=1)
        rows = {}
        for name in a.cases.split(","):
            rows[name] = measure(preset, CASES[name], a.skip)
            print(f"measured {name}: {rows[name]['step_time_s']:.3f} s/step", file=sys.stderr)
    base = rows.get("fsdp (FSDP2)", {}).get("tokens_per_s")
    if a.json:
        for name, r in rows.items():
            print(json.dumps({"case": name, **r, "vs_fsdp2": r["tokens_per_s"] / base if base else None}))
        return
    print(f"2 ranks, gloo, {a.precision}, decoder d_model={a.d_model} n_layers={a.n_layers} seq_len={a.seq_len} "
          f"micro_batch_size={a.micro_batch_size}; medians over steps {a.skip + 1}..{a.steps}")
    print("| case | step time (s) | tokens/s | vs FSDP2 | all-gathers/step | MB | reduce-scatters/step | MB | "
          "exposed comm_s | model state, rank 0 (MB) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

    def fmt(x, spec, scale=1.0):
        return "-" if x is None else format(x / scale, spec)

    for name, r in rows.items():
        speed = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"| {name} | {fmt(r['step_time_s'], '.3f')} | {fmt(r['tokens_per_s'], ',.0f')} | {speed} | "
              f"{fmt(r['allgather_calls'], '.0f')} | {fmt(r['allgather_bytes'], '.1f', 2**20)} | "
              f"{fmt(r['reducescatter_calls'], '.0f')} | {fmt(r['reducescatter_bytes'], '.1f', 2**20)} | "
              f"{fmt(r['comm_s'], '.3f')} | {fmt(r['model_state_bytes'], '.1f', 2**20)} |")


if __name__ == "__main__":
    main()
