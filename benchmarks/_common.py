"""What the benchmarks share: ``handle`` in a subprocess, small presets, and what a run wrote.

A benchmark runs as ``python benchmarks/<name>.py`` (this folder is then first on ``sys.path``); importing this
module also puts the repository first, so that a benchmark imports this checkout's ``torch_handle``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def handle(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> str:
    """The stdout of ``python -m handle_cli ARGS`` run in ``cwd``; exits with the output's tail when it fails."""
    proc = subprocess.run([sys.executable, "-m", "handle_cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"handle {' '.join(args)} failed (exit {proc.returncode})\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return proc.stdout


def sets(*overrides: str) -> list[str]:
    """``--set A --set B ...``"""
    return [x for s in overrides for x in ("--set", s)]


def handle_run(preset: Path, overrides: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None) -> Path:
    """``handle run PRESET --set ...``: the run directory it printed."""
    out = handle("run", str(preset), *sets(*overrides), cwd=cwd, env=env)
    run_dir = Path(next(ln for ln in out.splitlines() if ln.startswith("run directory: ")).split(": ", 1)[1])
    return run_dir if run_dir.is_absolute() else cwd / run_dir


def read_events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """Rank 0's events of a run (only those of ``kind`` when given)."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in events if kind is None or e["kind"] == kind]


def write_preset(directory: Path, **tables: dict[str, Any]) -> Path:
    """``directory/bench.toml``: a preset whose runs go to ``directory/runs`` and that never evaluates or
    checkpoints (a benchmark times steps), with ``tables`` (``model={"d_model": 64}``) added."""
    import tomli_w

    preset = {"run": {"output_dir": str(directory / "runs")}, **tables}
    preset["training"] = {"eval_every": 0, "checkpoint_every": 0, **tables.get("training", {})}
    path = directory / "bench.toml"
    path.write_text(tomli_w.dumps(preset), encoding="utf-8")
    return path


def step_medians(run_dir: Path, skip: int, keys: tuple[str, ...]) -> dict[str, Any]:
    """Medians of the numeric ``keys`` over a run's step events after the first ``skip`` (None where a key is
    absent), plus the last step's ``loss`` and ``layout``. Exits with a message when no step is left."""
    steps = read_events(run_dir, "step")[skip:]
    if not steps:
        raise SystemExit(f"no steps after the first {skip}: raise --steps")

    def med(key: str) -> float | None:
        xs = [e[key] for e in steps if isinstance(e.get(key), (int, float))]
        return statistics.median(xs) if xs else None

    return {**{k: med(k) for k in keys}, "loss": steps[-1]["loss"], "layout": steps[-1].get("layout")}
