"""What measuring the step breakdown costs: tokens/s with the phase timer (and its profiler ranges) on and off,
side by side in one process.

    python benchmarks/breakdown_overhead.py [--blocks 30] [--steps-per-block 5] [--d-model 64] [--threads 1]

Builds the real ``Trainer`` in a gloo group of world size 1 (CPU, fp32, the default ``single`` strategy) and
runs blocks of optimizer steps in three modes, interleaved in a rotating order so that the machine's noise
(other processes, frequency changes) falls on every mode alike:

- ``off``: no phase timer, no ``record_function`` ranges;
- ``ranges``: only the ``handle/<phase>`` ranges (what the profiler sees; no profiler active);
- ``on``: ranges plus the timer (the default in runs).

Prints each mode's median and best tokens/s over its blocks and their relative difference to ``off``, and the
median relative difference within each round (less sensitive to drifts). Tokens/s is the block's tokens over
the block's wall time. On a shared machine that noise is larger than the effect, so the script also times the
instrumentation alone -- ``begin``, the step's phases (grad_accum 2: 8 phases) and ``read`` in a tight loop,
without a model -- which bounds what it adds to a step, deterministically.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from _common import write_preset

MODES = ("off", "ranges", "on")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=30, help="blocks per mode")
    ap.add_argument("--steps-per-block", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a rank of a 2-process CPU run has 1)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from torch_handle.config.loader import dump_preset, load_preset
    from torch_handle.registry import get_registry
    from torch_handle.rundir import create_run_dir
    from torch_handle.train.strategy import DistContext
    from torch_handle.train.trainer import Trainer
    from torch_handle.launch.run import prepare_data

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="breakdown-"))
    model = {"d_model": args.d_model, "n_heads": 4, "n_layers": 2, "d_ff": 4 * args.d_model, "dropout": 0.0}
    training = {"steps": 100000, "micro_batch_size": 8, "grad_accum": 2, "precision": "fp32", "log_every": 10}
    preset = load_preset(write_preset(tmp, model=model, data={"seq_len": 64, "vocab_size": 512}, training=training))
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    run_dir = create_run_dir(tmp / "runs", "bench", dump_preset(preset), {"status": "starting"})
    prepare_data(preset)  # what the launcher does before the workers start
    trainer = Trainer(preset, run_dir, ctx, get_registry())
    trainer._peak = lambda: None  # mfu is not compared here: skip measuring the device peak
    trainer.build()
    trainer.strategy.train(True)
    batches = trainer.batches()

    def block(mode: str) -> float:
        trainer.timer.enabled = mode == "on"
        trainer.timer.ranges = mode != "off"
        tokens, start = 0, time.perf_counter()
        for _ in range(args.steps_per_block):
            tokens += trainer.train_step(batches)["tokens"]
        return tokens / (time.perf_counter() - start)

    for mode in MODES:  # warm-up: allocator, first-touch, kernel selection
        block(mode)
    results: dict[str, list[float]] = {m: [] for m in MODES}
    pairs: dict[str, list[float]] = {m: [] for m in MODES[1:]}
    for i in range(args.blocks):
        order = MODES[i % 3:] + MODES[:i % 3]
        got = {m: block(m) for m in order}
        for m in MODES:
            results[m].append(got[m])
        for m in MODES[1:]:
            pairs[m].append(got[m] / got["off"] - 1)
    trainer.events.close()
    dist.destroy_process_group()

    med = {m: statistics.median(v) for m, v in results.items()}
    best = {m: max(v) for m, v in results.items()}
    step_s = 2 * 8 * 64 / med["off"]  # grad_accum x micro_batch x seq_len tokens per step
    cost = {m: instrumentation_cost(m) for m in MODES}
    out = {"threads": args.threads, "d_model": args.d_model, "blocks": args.blocks,
           "steps_per_block": args.steps_per_block, "median_tokens_per_s": med, "best_tokens_per_s": best,
           "relative_to_off": {m: med[m] / med["off"] - 1 for m in MODES[1:]},
           "best_relative_to_off": {m: best[m] / best["off"] - 1 for m in MODES[1:]},
           "median_pairwise_relative": {m: statistics.median(v) for m, v in pairs.items()},
           "step_s": step_s, "instrumentation_s_per_step": cost,
           "instrumentation_share": {m: (cost[m] - cost["off"]) / step_s for m in MODES}}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{args.blocks} blocks x {args.steps_per_block} steps per mode, d_model {args.d_model}, "
          f"{args.threads} thread(s), CPU fp32, world size 1")
    for m in MODES:
        rel = "" if m == "off" else (f"  {out['relative_to_off'][m]:+.2%} vs off; best blocks "
                                     f"{out['best_relative_to_off'][m]:+.2%}; median within a round "
                                     f"{out['median_pairwise_relative'][m]:+.2%}")
        print(f"  {m:>6}: median {med[m]:>8,.0f}  best {best[m]:>8,.0f} tokens/s{rel}")
    print(f"instrumentation alone per step ({step_s * 1000:.1f} ms/step):")
    for m in MODES:
        print(f"  {m:>6}: {cost[m] * 1e6:.1f} us ({(cost[m] - cost['off']) * 1e6:+.1f} us vs off) = "
              f"{out['instrumentation_share'][m]:+.4%} of a step")


def instrumentation_cost(mode: str, reps: int = 5000, repeats: int = 7) -> float:
    """Seconds per step that ``mode``'s timer and ranges cost by themselves (grad_accum 2: 8 phases); the best of
    ``repeats`` loops of ``reps`` steps (the least disturbed by other processes)."""
    from torch_handle.train.phases import PhaseTimer

    timer = PhaseTimer("cpu", enabled=mode == "on", ranges=mode != "off")
    names = ("data", "forward", "backward") * 2 + ("sync", "optimizer")
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(reps):
            timer.begin()
            for name in names:
                with timer.phase(name):
                    pass
            timer.read()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


if __name__ == "__main__":
    main()
