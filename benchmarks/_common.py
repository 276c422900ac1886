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


def bench_args(doc: str, cases: dict[str, list[str]], *, d_model: int, n_layers: int, steps: int,
               precision: str) -> Any:
    """The command line the strategy benchmarks share: the decoder's size, steps, precision, ``--cases``."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=d_model)
    ap.add_argument("--n-layers", type=int, default=n_layers)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--skip", type=int, default=2, help="leave out the first steps (warm-up)")
    ap.add_argument("--precision", default=precision, choices=["fp32", "bf16"])
    ap.add_argument("--cases", default=",".join(cases), help="comma-separated subset of: " + ", ".join(cases))
    ap.add_argument("--json", action="store_true", help="one JSON object per case instead of the table")
    return ap.parse_args()


def bench_preset(directory: Path, a: Any, strategy: str, log_every: int) -> Path:
    """A 2-rank preset of :func:`bench_args`' decoder (8 heads, d_ff 4 d_model, vocabulary 4096)."""
    model = {"d_model": a.d_model, "n_heads": 8, "n_layers": a.n_layers, "d_ff": 4 * a.d_model, "norm_first": True}
    training = {"steps": a.steps, "micro_batch_size": a.micro_batch_size, "precision": a.precision,
                "eval_steps": 1, "log_every": log_every}
    return write_preset(directory, model=model, data={"seq_len": a.seq_len, "vocab_size": 4096},
                        training=training, strategy={"name": strategy}, launch={"nproc_per_node": 2})
