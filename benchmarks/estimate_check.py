"""Check ``handle estimate``'s model-state formulas against real runs, on every rank.

    python benchmarks/estimate_check.py [--nproc 4] [--d-model 48] [--n-heads 3] [--vocab 509]
                                        [--precision bf16,fp32] [--cases zero1,zero3,fsdp,...]

Runs ``handle run`` for each case (2 steps, log_every = 1, gloo) and prints, per rank, the measured
param/grad/optimizer bytes (the ``memory`` list of the last step event) next to
``torch_handle.plan.estimate.model_state_bytes`` for the same preset. Odd sizes exercise DeepSpeed's paddings and
partition boundaries and FSDP2's uneven dim-0 chunks; a large ``--vocab`` puts whole partitions inside the
embedding. DeepSpeed refuses fp16 on a CPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _common import handle_run, read_events, write_preset

CASES = {
    "ddp": ["strategy.name=ddp"], "fsdp": ["strategy.name=fsdp"],
    "scratch-ddp": ["strategy.name=scratch-ddp"],
    "scratch-ddp+zero1": ["strategy.name=scratch-ddp", "strategy.shard_optimizer=true"],
    **{f"zero{s}": ["strategy.name=deepspeed", f"strategy.zero_stage={s}"] for s in range(4)},
    **{f"zero{s}+offload": ["strategy.name=deepspeed", f"strategy.zero_stage={s}", "strategy.offload_optimizer=cpu"]
       for s in (1, 2, 3)},
    "zero3+offload+param": ["strategy.name=deepspeed", "strategy.zero_stage=3", "strategy.offload_optimizer=cpu",
                            "strategy.offload_param=cpu"],
}
KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes")


def measure(preset: Path, sets: list[str]) -> list[dict]:
    return [e for e in read_events(handle_run(preset, sets), "step") if e.get("memory")][-1]["memory"]


def main() -> None:
    from torch_handle.plan import estimate as E
    from torch_handle.config.loader import load_preset
    from torch_handle.registry import get_registry

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=48)
    ap.add_argument("--n-heads", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=509)
    ap.add_argument("--precision", default="bf16,fp32")
    ap.add_argument("--cases", default="ddp,zero1,zero2,zero3,fsdp,scratch-ddp+zero1,zero1+offload,zero3+offload")
    a = ap.parse_args()
    variants = {v.label: v for v in E.COMPARE_VARIANTS}
    registry = get_registry()
    mismatches = 0
    with tempfile.TemporaryDirectory() as tmp:
        model = {"d_model": a.d_model, "n_heads": a.n_heads, "n_layers": 2, "d_ff": 4 * a.d_model + 4,
                 "norm_first": True}
        preset = write_preset(Path(tmp), model=model, data={"seq_len": 32, "vocab_size": a.vocab},
                              training={"steps": 2, "micro_batch_size": 4, "log_every": 1},
                              launch={"nproc_per_node": a.nproc})
        for precision in a.precision.split(","):
            loaded = load_preset(preset, ["strategy.name=ddp", f"training.precision={precision}"], registry)
            shape = E.model_shape(loaded, registry)
            for case in a.cases.split(","):
                for mem in measure(preset, [*CASES[case], f"training.precision={precision}"]):
                    s = E.model_state_bytes(shape, variants[case], precision, a.nproc, mem["rank"])
                    est = (s.param, s.grad, s.optimizer)
                    got = tuple(mem[k] for k in KEYS)
                    mismatches += est != got
                    print(f"{precision} {case:<20} rank {mem['rank']}  measured {got}  estimated {est}  "
                          f"{'equal' if est == got else 'DIFFERENT'}", flush=True)
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
