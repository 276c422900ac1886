"""Check ``handle plan``'s predictions against short real runs: speed order and memory.

    python benchmarks/plan_check.py [--preset presets/zero2.toml] [--nproc 4] [--measure 4] [--steps 8]
                                    [--set training.micro_batch_size=8 ...]

Times ``handle plan PRESET --nproc N --json`` without --measure (the planner alone: enumeration, validation, memory
estimates; twice, the second with warm caches), then runs ``handle plan ... --measure TOP`` (fp32, the TOP first
layouts for --steps steps each through handle run's launcher, medians after 2 warm-up steps) and prints, per measured
layout, predicted beside measured tokens/s, model states and saved activations of the largest rank; the Spearman
rank correlation of the two speed orders; whether the planner's first choice is within 10% of the fastest measured;
whether every memory figure is within 5% (states) and 10% (activations). The default is the demo's decoder
(``make demo``: presets/zero2.toml, 4.2 M parameters). Ranks beyond the cores share them: the header says so, with
the load average, since other processes on the machine change the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, sets


def run_plan(args: list[str]) -> tuple[dict, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "handle_cli", "plan", *args, "--json"], capture_output=True,
                          text=True, cwd=ROOT, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise SystemExit(f"handle plan {' '.join(args)} failed (exit {proc.returncode})\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout), wall


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="presets/zero2.toml")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--measure", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    a = parser.parse_args()
    overrides = ["training.precision=fp32", *a.overrides]
    base = [a.preset, "--nproc", str(a.nproc), *sets(*overrides)]
    cores = os.cpu_count() or 1
    print(f"plan_check {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {a.preset} on {a.nproc} processes, "
          f"{cores} cores ({'oversubscribed: ranks share cores' if a.nproc > cores else 'one core or more each'}), "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    walls = []
    for _ in range(2):
        planned, wall = run_plan(base)
        walls.append(wall)
    print(f"handle plan {' '.join(base)}: {len(planned['layouts'])} layouts fit, {len(planned['dropped'])} dropped; "
          f"{walls[0]:.1f} s, then {walls[1]:.1f} s (wall, python start and torch import included)")
    print(f"peak: {planned['peak']['source']}; links: {planned['links']['source']}")
    with tempfile.TemporaryDirectory() as tmp:
        out, wall = run_plan([*base, "--measure", str(a.measure), "--steps", str(a.steps), "--output-dir",
                              str(Path(tmp))])
    records, c = out["measured"], out["comparison"]
    print(f"handle plan {' '.join(base)} --measure {a.measure} --steps {a.steps}: {wall:.0f} s, load average "
          f"{os.getloadavg()[0]:.1f} at the end\n")
    head = ("#", "layout", "tok/s pred", "tok/s meas", "meas/pred", "states MiB pred", "meas", "err",
            "saved act. MiB pred", "meas", "err")
    rows = [head]
    for i, r in enumerate(records, 1):
        ratio = r["tokens_per_s"] / r["predicted_tokens_per_s"] if r["tokens_per_s"] else None
        rows.append((str(i), r["label"], f"{r['predicted_tokens_per_s']:,.0f}",
                     "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}",
                     "-" if ratio is None else f"{ratio:.2f}", mib(r["predicted_state_bytes"]), mib(r["state_bytes"]),
                     pct(r["error_state_bytes"]), mib(r["predicted_activation_bytes"]), mib(r["activation_bytes"]),
                     pct(r["error_activation_bytes"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for n, row in enumerate(rows):
        print("| " + " | ".join(cell.ljust(w) if i == 1 else cell.rjust(w) for i, (cell, w) in
                                enumerate(zip(row, widths))) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    states = [abs(r["error_state_bytes"]) for r in records if r["error_state_bytes"] is not None]
    acts = [abs(r["error_activation_bytes"]) for r in records if r["error_activation_bytes"] is not None]
    rho = "n/a" if c["spearman"] is None else f"{c['spearman']:+.2f}"
    ratio = c["first_choice_ratio"]
    print(f"\nSpearman rank correlation (predicted vs measured tokens/s): {rho}")
    print(f"fastest measured: {c['fastest']}; first choice {c['first_choice']}: "
          + ("n/a" if ratio is None else f"{ratio:.0%} of it ({'within' if ratio >= 0.9 else 'NOT within'} 10%)"))
    print(f"memory: states within {max(states):.1%} (goal 5%), saved activations within {max(acts):.1%} (goal 10%)"
          if states and acts else "memory: not measured")


if __name__ == "__main__":
    main()
