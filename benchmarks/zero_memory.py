"""Per-rank model-state bytes under DeepSpeed stage 0-3 and FSDP2, side by side in one run.

    python benchmarks/zero_memory.py [--precision bf16|fp32|both] [--d-model 64] [--steps 2]

Runs `handle run` on 2 ranks (gloo) for a few steps per strategy, then prints rank 0's param/grad/optimizer
bytes from the step event's `memory` list and each one's ratio to DeepSpeed stage 0. ZeRO (Rajbhandari et al.
2020) predicts 0.5x optimizer bytes for stages 1-2 and 0.5x parameter bytes for stage 3 on 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _common import handle_run, read_events, write_preset

CASES = {
    "DeepSpeed stage 0": ["strategy.zero_stage=0"],
    "ZeRO-1": ["strategy.zero_stage=1"],
    "ZeRO-2": ["strategy.zero_stage=2"],
    "ZeRO-3": ["strategy.zero_stage=3"],
    "FSDP2": ["strategy.name=fsdp"],
    "DDP": ["strategy.name=ddp"],
}


def measure(preset: Path, sets: list[str], precision: str, steps: int) -> dict:
    run_dir = handle_run(preset, [*sets, f"training.precision={precision}"])
    last = [e for e in read_events(run_dir, "step") if e.get("memory")][-1]
    return {**last["memory"][0], "optimizer": json.loads((run_dir / "run.json").read_text()).get("optimizer")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", choices=["bf16", "fp32", "both"], default="both")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = {"d_model": a.d_model, "n_heads": 4, "n_layers": 2, "d_ff": 4 * a.d_model, "norm_first": True}
        preset = write_preset(Path(tmp), model=model, data={"seq_len": 32, "vocab_size": 512},
                              training={"steps": a.steps, "micro_batch_size": 4, "log_every": 1},
                              strategy={"name": "deepspeed"}, launch={"nproc_per_node": 2})
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
