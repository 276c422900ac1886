"""Per-rank model-state bytes under DeepSpeed stage 0-3 and FSDP2, side by side in one run.

    python benchmarks/zero_memory.py [--precision bf16|fp32|both] [--d-model 64] [--steps 2]

Runs `handle run` on 2 ranks (gloo) for a few steps per strategy, then prints rank 0's param/grad/optimizer
bytes from the step event's `memory` list and each one's ratio to DeepSpeed stage 0. ZeRO (Rajbhandari et al.
2020) predicts 0.5x optimizer bytes for stages 1-2 and 0.5x parameter bytes for stage 3 on 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PRESET = """
[run]
output_dir = "{out}"
[model]
d_model = {d_model}
n_heads = 4
n_layers = 2
d_ff = {d_ff}
norm_first = true
[data]
seq_len = 32
vocab_size = 512
[training]
steps = {steps}
micro_batch_size = 4
eval_every = 0
checkpoint_every = 0
log_every = 1
[strategy]
name = "deepspeed"
[launch]
nproc_per_node = 2
"""

CASES = {
    "DeepSpeed stage 0": ["strategy.zero_stage=0"],
    "ZeRO-1": ["strategy.zero_stage=1"],
    "ZeRO-2": ["strategy.zero_stage=2"],
    "ZeRO-3": ["strategy.zero_stage=3"],
    "FSDP2": ["strategy.name=fsdp"],
    "DDP": ["strategy.name=ddp"],
}


def measure(preset: Path, sets: list[str], precision: str, steps: int) -> dict:
    args = [x for s in [*sets, f"training.precision={precision}"] for x in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "handle_cli", "run", str(preset), *args], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(sets)}\n{proc.stdout}\n{proc.stderr}")
    run_dir = Path(next(ln for ln in proc.stdout.splitlines() if ln.startswith("run directory: ")).split(": ", 1)[1])
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    last = [e for e in events if e["kind"] == "step" and e.get("memory")][-1]
    return {**last["memory"][0], "optimizer": json.loads((run_dir / "run.json").read_text()).get("optimizer")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", choices=["bf16", "fp32", "both"], default="both")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        preset = Path(tmp) / "bench.toml"
        preset.write_text(PRESET.format(out=Path(tmp) / "runs", d_model=a.d_model, d_ff=4 * a.d_model, steps=a.steps))
        for precision in (["bf16", "fp32"] if a.precision == "both" else [a.precision]):
            rows = {name: measure(preset, sets, precision, a.steps) for name, sets in CASES.items()}
            base = rows["DeepSpeed stage 0"]
            print(f"\n{precision}, 2 ranks, rank 0 bytes (ratio to DeepSpeed stage 0)")
            print(f"{'strategy':<18} {'param_bytes':>20} {'grad_bytes':>20} {'optimizer_bytes':>22}  optimizer")
            for name, r in rows.items():
                cells = [f"{r[k]:>11,} ({r[k] / base[k]:.2f}x)" for k in ("param_bytes", "grad_bytes", "optimizer_bytes")]
                print(f"{name:<18} {cells[0]:>20} {cells[1]:>20} {cells[2]:>22}  {r['optimizer']}")


if __name__ == "__main__":
    main()
