"""`handle run` (DeepSpeed ZeRO-2, 2 ranks) against the hand-written PyTorch loop, side by side in one invocation.

    python benchmarks/fast_path.py [--steps 30] [--skip 5] [--rounds 3] [--precision bf16] [--baseline DIR]
                                   [--case NAME=table.key=value,table.key=value ...]

Both sides train the P1 model (presets/zero2.toml: decoder d_model 256, 4 heads, 4 layers, d_ff 1024, seq_len 128,
vocabulary 4096, micro-batch 8 per rank, dropout 0.1) on 2 ranks with gloo and OMP_NUM_THREADS=1, so a step is the
same global batch of 2 × 8 × 128 = 2048 tokens. The hand loop is benchmarks/hand_loop.py (nn.TransformerEncoderLayer,
DDP, AdamW, bf16 autocast). The cases run interleaved, ``--rounds`` times (hand, handle, [baseline], [cases], hand,
...), so load from other processes hits all of them alike; each case's figure is the median over rounds of the
median tokens/s (global, all ranks) of the steps after the first ``--skip``; the best step of all rounds is
shown too (least disturbed by other load on a shared machine). ``--baseline DIR`` adds `handle run`
from another copy of the source tree (e.g. the code before a change; DIR must hold ``handle_plugins`` -> plugins)
via PYTHONPATH. ``--case`` adds `handle run` with ``--set`` overrides. Prints a markdown table with the ratio of
every case to the hand loop, and the load average at the start and the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import ROOT, handle_run, read_events

HERE = Path(__file__).resolve().parent


def _env(pythonpath: str | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def hand(steps: int, skip: int, precision: str) -> tuple[float, float]:
    """Global tokens/s of benchmarks/hand_loop.py on 2 ranks: (median, best step) over the steps after ``skip``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29613",
           str(HERE / "hand_loop.py"), "--steps", str(steps), "--skip", str(skip), "--precision", precision]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT,
                          check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"hand loop failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    r = json.loads(line)
    return r["tokens_per_s"], r["best_tokens_per_s"]


def handle(out: Path, steps: int, skip: int, precision: str, sets: list[str],
           tree: str | None = None) -> tuple[float, float]:
    """Global tokens/s of `handle run presets/zero2.toml`: (median, best) of rank 0's step events after ``skip``."""
    base = ["run.output_dir=" + str(out), f"training.steps={steps}", f"training.precision={precision}",
            "training.eval_every=0", "training.eval_steps=1", "training.checkpoint_every=0",
            "training.log_every=1000"]
    cwd = Path(tree) if tree else ROOT
    run_dir = handle_run(cwd / "presets" / "zero2.toml", [*base, *sets], cwd=cwd, env=_env(tree))
    xs = [e["tokens_per_s"] for e in read_events(run_dir, "step")][skip:]
    if not xs:
        raise SystemExit(f"no steps after the first {skip}: raise --steps")
    return statistics.median(xs), max(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--baseline", help="another source tree to run `handle run` from (PYTHONPATH)")
    ap.add_argument("--case", action="append", default=[], help="NAME=table.key=value,... (`handle run --set`)")
    ap.add_argument("--no-handle", action="store_true", help="leave out the default `handle run` case")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    load0 = os.getloadavg()
    cases: dict[str, Any] = {"hand loop": lambda out: hand(a.steps, a.skip, a.precision)}
    if not a.no_handle:
        cases["handle run (ZeRO-2)"] = lambda out: handle(out, a.steps, a.skip, a.precision, [])
    if a.baseline:
        cases["handle run (baseline tree)"] = lambda out: handle(out, a.steps, a.skip, a.precision, [], a.baseline)
    for spec in a.case:
        name, _, sets = spec.partition("=")
        cases[name] = functools.partial(lambda s, out: handle(out, a.steps, a.skip, a.precision, s), sets.split(","))
    results: dict[str, list[float]] = {name: [] for name in cases}
    best: dict[str, list[float]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name, fn in cases.items():
                med, top = fn(Path(tmp))
                results[name].append(med)
                best[name].append(top)
                print(f"round {r + 1}: {name}: {results[name][-1]:,.0f} tokens/s  (load {os.getloadavg()[0]:.2f})",
                      file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    base = statistics.median(results["hand loop"])
    rows = {name: statistics.median(xs) for name, xs in results.items()}
    tops = {name: max(xs) for name, xs in best.items()}
    base_top = tops["hand loop"]
    if a.json:
        for name, v in rows.items():
            print(json.dumps({"case": name, "tokens_per_s": v, "ratio": v / base, "all": results[name],
                              "best_tokens_per_s": tops[name], "best_ratio": tops[name] / base_top}))
    print(f"\n{a.precision}, {a.steps} steps (first {a.skip} skipped), {a.rounds} rounds interleaved; "
          f"load average {load0[0]:.2f} at start, {load1[0]:.2f} at end\n")
    print("| case | tokens/s (median of rounds) | per round | vs hand loop | best step tokens/s | vs hand loop |\n"
          "| --- | ---: | --- | ---: | ---: | ---: |")
    for name, v in rows.items():
        print(f"| {name} | {v:,.0f} | {' / '.join(f'{x:,.0f}' for x in results[name])} | {v / base:.2f}x | "
              f"{tops[name]:,.0f} | {tops[name] / base_top:.2f}x |")


if __name__ == "__main__":
    main()
