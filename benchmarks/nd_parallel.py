"""Data × tensor × pipeline parallelism on 8 ranks against one process: the losses, the gradient norms, tokens/s.

    python benchmarks/nd_parallel.py [--steps 10] [--strategy ddp] [--pp-impl scratch] [--out nd_parallel.json]

Runs ``handle run`` with a small decoder (d_model 64, 4 heads, 4 layers, d_ff 256, 512-word vocabulary, pre-LN,
fp32, dropout 0) twice: in one process with grad_accum 8, and as dp 2 × tp 2 × pp 2 on 8 processes (hand-written
TP with sequence parallelism inside each of 2 pipeline stages, the stages wrapped by ``--strategy`` over their
2 data-parallel replicas, grad_accum 4 so that both see the same 16 sequences a step). Every process gets 1
intra-op thread; on a machine with fewer cores than 8 the figure that matters is the agreement, not the speed.

Prints, per step, both losses and gradient norms and their relative differences, then the largest of each and
the median tokens/s of both runs; writes them as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _common import handle_run, read_events, write_preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    ap.add_argument("--pp-impl", choices=["scratch", "native"], default="scratch")
    ap.add_argument("--out", type=Path, default=Path("nd_parallel.json"))
    a = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        preset = write_preset(
            Path(tmp), model={"d_model": 64, "n_heads": 4, "n_layers": 4, "d_ff": 256, "norm_first": True,
                              "dropout": 0.0},
            data={"seq_len": 32, "vocab_size": 512},
            training={"steps": a.steps, "micro_batch_size": 2, "precision": "fp32", "log_every": 1},
            strategy={"name": "single"}, launch={"nproc_per_node": 1})
        one = handle_run(preset, ["training.grad_accum=8"], env=env)
        nd = handle_run(preset, ["launch.nproc_per_node=8", "training.grad_accum=4", f"strategy.name={a.strategy}",
                                 "parallel.tp=2", "parallel.tp_impl=scratch", "parallel.sequence_parallel=true",
                                 "parallel.pp=2", f"parallel.pp_impl={a.pp_impl}", "parallel.pp_schedule=1f1b"],
                        env=env)
        ref, got = read_events(one, "step"), read_events(nd, "step")
    rows = []
    print(f"{'step':>4}  {'loss 1 proc':>12}  {'loss dp2xtp2xpp2':>16}  {'rel':>8}  {'norm rel':>8}")
    for a_, b in zip(ref, got):
        loss_rel = abs(b["loss"] - a_["loss"]) / a_["loss"]
        norm_rel = abs(b["grad_norm"] - a_["grad_norm"]) / a_["grad_norm"]
        rows.append({"step": a_["step"], "loss_one": a_["loss"], "loss_nd": b["loss"], "loss_rel": loss_rel,
                     "grad_norm_rel": norm_rel})
        print(f"{a_['step']:>4}  {a_['loss']:>12.6f}  {b['loss']:>16.6f}  {loss_rel:>8.1e}  {norm_rel:>8.1e}")
    speed = {name: statistics.median(e["tokens_per_s"] for e in events[2:])
             for name, events in (("one", ref), ("nd", got))}
    summary = {"layout": got[-1].get("layout"), "strategy": a.strategy, "pp_impl": a.pp_impl,
               "max_loss_rel": max(r["loss_rel"] for r in rows), "max_grad_norm_rel": max(r["grad_norm_rel"] for r in rows),
               "tokens_per_s": speed, "cores": os.cpu_count()}
    print(json.dumps(summary, indent=1))
    a.out.write_text(json.dumps({"steps": rows, **summary}, indent=1))
    if summary["max_loss_rel"] > 1e-5:
        sys.exit(f"the losses differ by {summary['max_loss_rel']:.1e} > 1e-5")


if __name__ == "__main__":
    main()
