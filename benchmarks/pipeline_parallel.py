"""Pipeline parallelism on 2 ranks: tokens/s, the measured bubble against theory, first-stage activation bytes.

    python benchmarks/pipeline_parallel.py [--microbatches 2,4,8,16] [--schedules gpipe,1f1b]
                                           [--impls native,scratch] [--steps 6] [--skip 2] [--rounds 1]
                                           [--vocab-size 512] [--out pipeline_parallel.json]

Runs ``handle run`` with the demo's decoder (``presets/single.toml``'s [model]: d_model 256, 4 heads, 4 layers,
d_ff 1024, pre-LN) in fp32, dropout 0, one step = ``--samples`` sequences of ``--seq-len`` tokens: once in one
process (``single``), then with ``pp = 2`` on 2 ranks (2 layers per stage) for every m, schedule and
implementation (native: ``torch.distributed.pipelining``; scratch: the hand-written engine), every process on 1
intra-op thread (OMP_NUM_THREADS=1; gloo on CPU). The vocabulary is ``--vocab-size`` (default 512, not the demo
dataset's 4096): the output projection runs on the last stage, and with 4096 entries it costs more than a layer,
so the two stages would be unequal and the bubble would measure that imbalance rather than the schedule's.

From rank 0's step events after the first ``--skip`` steps (medians over steps, then over ``--rounds``):

* tokens/s, and the ratio of scratch to native with the same schedule and m (issue 20's goal: >= 0.9x);
* ``pipeline.bubble`` (1 - busy / (p x window): every second a stage did not compute, receive waits included)
  against ``pipeline.bubble_theory`` ((p - 1) / (m + p - 1)) and their relative difference (goal: within 25% for
  m >= 4);
* the first stage's peak activation bytes (``pipeline.ranks[0].activation_peak_bytes``, counted on the first
  step) against ``handle estimate``'s prediction for the same preset.

Writes every run's figures and the table as JSON to ``--out``.
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

from _common import ROOT, handle_run, read_events, write_preset


def measure(preset: Path, overrides: list[str], skip: int, env: dict[str, str]) -> dict:
    """Medians over a run's step events after ``skip``: tokens/s, bubble and its theory; the first stage's
    activation peak."""
    t0 = time.perf_counter()
    run_dir = handle_run(preset, overrides, env=env)
    steps = read_events(run_dir, "step")[skip:]
    if not steps:
        raise SystemExit(f"no steps after the first {skip}: raise --steps")
    out = {"tokens_per_s": statistics.median(e["tokens_per_s"] for e in steps), "wall_s": time.perf_counter() - t0}
    pipes = [e["pipeline"] for e in steps if "pipeline" in e]
    if pipes:
        out["bubble"] = statistics.median(p["bubble"] for p in pipes)
        out["bubble_theory"] = pipes[-1]["bubble_theory"]
        out["activation_peak_bytes"] = pipes[-1]["ranks"][0].get("activation_peak_bytes")
    return out


def estimated_first_stage(preset: Path, overrides: list[str]) -> int:
    """``handle estimate``'s activation_saved_bytes of pipeline rank 0 for the same preset and overrides."""
    from handle_cli.estimate_cmd import layout_overrides
    from torch_handle.config.loader import load_preset
    from torch_handle.plan.estimate import estimate_preset
    from torch_handle.registry import get_registry

    loaded = load_preset(preset, layout_overrides(overrides), get_registry())
    rows = estimate_preset(loaded, get_registry(), [2])
    return next(r for r in rows if r.pp_rank == 0).activation.saved


def table(a: argparse.Namespace, model: dict, single: float, rows: dict[tuple[str, int, str], dict]) -> list[str]:
    out = [f"decoder d_model={model['d_model']} n_heads={model['n_heads']} n_layers={model['n_layers']} "
           f"d_ff={model['d_ff']}, vocabulary {a.vocab_size}, fp32; a step = {a.samples} x {a.seq_len} tokens; "
           f"pp = 2 on 2 ranks, 1 thread per process, gloo; medians over steps {a.skip + 1}..{a.steps}, then over "
           f"{a.rounds} round(s); one process: {single:,.0f} tokens/s",
           "| schedule | m | impl | tokens/s | vs one process | scratch / native | bubble | theory | "
           "bubble vs theory | first-stage activations | estimate |",
           "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (schedule, m, impl), r in rows.items():
        native = rows.get((schedule, m, "native"), {}).get("tokens_per_s")
        ratio = f"{r['tokens_per_s'] / native:.2f}x" if impl == "scratch" and native else "-"
        rel = (r["bubble"] - r["bubble_theory"]) / r["bubble_theory"]
        peak = r.get("activation_peak_bytes")
        measured = f"{peak / 2**20:.2f} MiB" if peak is not None else "-"
        out.append(f"| {schedule} | {m} | {impl} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / single:.2f}x | "
                   f"{ratio} | {r['bubble']:.3f} | {r['bubble_theory']:.3f} | {rel:+.0%} | {measured} | "
                   f"{r['estimate'] / 2**20:.2f} MiB |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", default="2,4,8,16")
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--impls", default="native,scratch")
    ap.add_argument("--rounds", type=int, default=1, help="every case once per round, in turn")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2, help="leave out the first steps (warm-up)")
    ap.add_argument("--samples", type=int, default=16, help="sequences per step (m must divide it)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    a = ap.parse_args()
    model = {**tomllib.loads((ROOT / "presets" / "single.toml").read_text(encoding="utf-8"))["model"],
             "dropout": 0.0}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ms = [int(x) for x in a.microbatches.split(",")]
    cases = [(s, m, i) for s in a.schedules.split(",") for m in ms for i in a.impls.split(",")]
    singles: list[float] = []
    runs: dict[tuple[str, int, str], list[dict]] = {c: [] for c in cases}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        preset = write_preset(Path(tmp), model=model, data={"seq_len": a.seq_len, "vocab_size": a.vocab_size},
                              training={"steps": a.steps, "micro_batch_size": a.samples, "precision": "fp32",
                                        "log_every": 1000, "eval_steps": 1})
        estimates = {}
        for schedule, m, _ in cases:
            sets = ["parallel.pp=2", f"parallel.pp_schedule={schedule}", f"parallel.pp_microbatches={m}"]
            estimates.setdefault((schedule, m), estimated_first_stage(preset, sets))
        for i in range(a.rounds):
            singles.append(measure(preset, ["launch.nproc_per_node=1"], a.skip, env)["tokens_per_s"])
            print(f"round {i + 1} single: {singles[-1]:,.0f} tokens/s", file=sys.stderr, flush=True)
            for schedule, m, impl in cases:
                sets = ["launch.nproc_per_node=2", "parallel.pp=2", f"parallel.pp_impl={impl}",
                        f"parallel.pp_schedule={schedule}", f"parallel.pp_microbatches={m}"]
                r = measure(preset, sets, a.skip, env)
                runs[schedule, m, impl].append(r)
                print(f"round {i + 1} {schedule} m={m} {impl}: {r['tokens_per_s']:,.0f} tokens/s, bubble "
                      f"{r['bubble']:.3f} (theory {r['bubble_theory']:.3f}) ({r['wall_s']:.0f} s)",
                      file=sys.stderr, flush=True)
    rows = {}
    for (schedule, m, impl), rs in runs.items():
        rows[schedule, m, impl] = {
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
            "bubble": statistics.median(x["bubble"] for x in rs), "bubble_theory": rs[-1]["bubble_theory"],
            "activation_peak_bytes": rs[-1]["activation_peak_bytes"], "estimate": estimates[schedule, m]}
    single = statistics.median(singles)
    lines = table(a, model, single, rows)
    print("\n".join(lines))
    print(f"whole benchmark: {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    if a.out:
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "model": model,
                                     "single_tokens_per_s": singles, "table": lines,
                                     "runs": [{"schedule": s, "m": m, "impl": i, "runs": rs}
                                              for (s, m, i), rs in runs.items()]}, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
