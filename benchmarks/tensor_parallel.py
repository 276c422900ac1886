"""Tensor parallelism on 2 ranks against one process: tokens/s, and the counted TP bytes against the formula.

    python benchmarks/tensor_parallel.py [--rounds 2] [--steps 3] [--micro-batch-size 8] [--precision fp32,bf16]
                                         [--out tensor_parallel.json]

Runs ``handle run`` with the demo's decoder (``presets/single.toml``'s [model]: d_model 256, 4 heads, 4 layers,
d_ff 1024, pre-LN) for each case: ``single`` (1 process), ``tp = 2`` native (DTensor) and ``tp = 2`` scratch
(the hand-written layers), each with and without sequence parallelism (SP), every process on 1 intra-op thread
(OMP_NUM_THREADS=1; gloo on CPU). The cases take turns within each of ``--rounds`` rounds, so a machine shared
with other work slows them alike. From rank 0's step events after the first ``--skip`` steps it prints:

* tokens/s: the median over steps of a run, then the median over rounds; the ratio to ``single`` and, for
  scratch, to native with the same SP setting (the goal of issue 19: scratch >= 0.9x native);
* for scratch, ``tp_comm_calls`` and ``tp_comm_bytes`` per step against
  :func:`torch_handle.parallel.tensor.mappings.step_volume`. In fp32 they are equal. Under bf16 autocast the
  row-parallel linears' outputs are 16-bit, so g's all-reduce (or SP's reduce-scatter, and the all-gather of its
  gradient) moves 2-byte elements, while what enters a TP region (the LayerNorm's or the embedding's fp32 output)
  and its gradient stay fp32: the formula with ``element_bytes=4``, less half of those row-parallel transfers,
  is the bf16 count (the "bf16 rule" column).

Writes every run's figures and the table's as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from _common import ROOT, handle_run, step_medians, write_preset

CASES = {
    "single": ["launch.nproc_per_node=1", "parallel.tp=1"],
    "native": ["parallel.tp_impl=native", "parallel.sequence_parallel=false"],
    "native + SP": ["parallel.tp_impl=native", "parallel.sequence_parallel=true"],
    "scratch": ["parallel.tp_impl=scratch", "parallel.sequence_parallel=false"],
    "scratch + SP": ["parallel.tp_impl=scratch", "parallel.sequence_parallel=true"],
}


def sp_grad_elements(model_table: dict, seq_len: int) -> int:
    """Elements of the gradients that sequence parallelism all-reduces once a step: the parameters of the plan's
    NORM modules and the biases of its ROWWISE linears (:func:`torch_handle.parallel.tensor.layers.
    all_reduce_sp_grads`), counted on the one-process decoder."""
    from torch_handle.model.args import TransformerArgs
    from torch_handle.model.parallelize import replicated_numel
    from torch_handle.model.transformer import DecoderLM

    fields = {k: v for k, v in model_table.items() if k in TransformerArgs.__dataclass_fields__}
    return replicated_numel(DecoderLM(TransformerArgs(vocab_size=512, max_len=seq_len, **fields)))


def expected(a: argparse.Namespace, model: dict, sp: bool, precision: str, sp_grads: int) -> dict[str, int]:
    """The scratch path's TP calls and bytes per step: the formula (fp32), and the bf16 rule."""
    from torch_handle.parallel.tensor.mappings import step_volume

    want = step_volume(n_layers=model["n_layers"], micro_batch_size=a.micro_batch_size, seq_len=a.seq_len,
                       d_model=model["d_model"], sequence_parallel=sp, element_bytes=4,
                       sp_grad_elements=sp_grads if sp else 0)
    if precision == "bf16":  # per TP region, the row-parallel output (and under SP its gradient) is 2 bytes wide
        half = a.micro_batch_size * a.seq_len * model["d_model"] * 2
        want = {**want, "bytes": want["bytes"] - 2 * model["n_layers"] * half * (2 if sp else 1)}
    return want


def measure(preset: Path, overrides: list[str], skip: int, env: dict[str, str]) -> dict:
    t0 = time.perf_counter()
    run_dir = handle_run(preset, overrides, env=env)
    wall = time.perf_counter() - t0
    return {**step_medians(run_dir, skip, ("tokens_per_s", "step_time_s", "tp_comm_calls", "tp_comm_bytes", "tp_comm_s")), "wall_s": wall}


def table(a: argparse.Namespace, rows: dict[str, dict[str, dict]], model: dict) -> list[str]:
    out = [f"decoder d_model={model['d_model']} n_heads={model['n_heads']} n_layers={model['n_layers']} "
           f"d_ff={model['d_ff']}; micro-batch {a.micro_batch_size} x {a.seq_len} tokens; 1 thread per process, gloo; "
           f"medians over steps {a.skip + 1}..{a.steps}, then over {a.rounds} round(s)",
           "| precision | case | tokens/s | vs single | vs native | TP calls/step | TP MB/step | expected MB | "
           "counted = expected | tp_comm_s |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for precision, cases in rows.items():
        base = cases.get("single", {}).get("tokens_per_s")
        for name, r in cases.items():
            native = cases.get(name.replace("scratch", "native"), {}).get("tokens_per_s")
            vs_native = f"{r['tokens_per_s'] / native:.2f}x" if name.startswith("scratch") and native else "-"
            vs_single = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
            comm = exp = same = secs = "-"
            calls = "-"
            if r.get("tp_comm_bytes") is not None:
                calls = f"{r['tp_comm_calls']:.0f}"
                comm = f"{r['tp_comm_bytes'] / 1e6:.3f}"
                exp = f"{r['expected']['bytes'] / 1e6:.3f}"
                same = "yes" if (r["tp_comm_calls"], r["tp_comm_bytes"]) == (
                    r["expected"]["calls"], r["expected"]["bytes"]) else "NO"
                if precision == "bf16":
                    same += " (bf16 rule)"
                secs = f"{r['tp_comm_s']:.3f}"
            out.append(f"| {precision} | {name} | {r['tokens_per_s']:,.0f} | {vs_single} | {vs_native} | {calls} | "
                       f"{comm} | {exp} | {same} | {secs} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="every case once per round, in turn")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--skip", type=int, default=1, help="leave out the first steps (warm-up)")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--precision", default="fp32,bf16")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    a = ap.parse_args()
    model = tomllib.loads((ROOT / "presets" / "single.toml").read_text(encoding="utf-8"))["model"]
    sp_grads = sp_grad_elements(model, a.seq_len)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    precisions, names = a.precision.split(","), a.cases.split(",")
    runs: dict[str, dict[str, list[dict]]] = {p: {n: [] for n in names} for p in precisions}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        preset = write_preset(Path(tmp), model=model, data={"seq_len": a.seq_len},
                              training={"steps": a.steps, "micro_batch_size": a.micro_batch_size, "log_every": 1000,
                                        "eval_steps": 1},
                              parallel={"tp": 2}, launch={"nproc_per_node": 2})
        for i in range(a.rounds):
            for precision in precisions:
                for name in names:
                    r = measure(preset, [*CASES[name], f"training.precision={precision}"], a.skip, env)
                    runs[precision][name].append(r)
                    print(f"round {i + 1} {precision} {name}: {r['tokens_per_s']:,.0f} tokens/s "
                          f"({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    rows: dict[str, dict[str, dict]] = {}
    for precision, cases in runs.items():
        rows[precision] = {}
        for name, rs in cases.items():
            r = {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                 **{k: rs[-1][k] for k in ("tp_comm_calls", "tp_comm_bytes", "layout")},
                 "tp_comm_s": statistics.median(x["tp_comm_s"] for x in rs) if rs[-1]["tp_comm_s"] is not None
                 else None}
            if name.startswith("scratch"):
                r["expected"] = expected(a, model, name.endswith("SP"), precision, sp_grads)
            rows[precision][name] = r
    lines = table(a, rows, model)
    print("\n".join(lines))
    print(f"whole benchmark: {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    if a.out:
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "model": model,
                                     "sp_grad_elements": sp_grads, "rows": rows, "runs": runs, "table": lines},
                                    indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
