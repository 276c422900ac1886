"""``handle runs``: the runs under an output directory, one line each, newest first (``lost`` included)."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import click


def run_summary(run_dir: Path, now: float | None = None) -> dict[str, Any]:
    """One run as a JSON-ready mapping: ``name``, ``path``, ``status`` (``lost`` for a run whose launcher is gone,
    ``hung`` for a live run whose newest event is the watchdog's ``hang``, ``unreadable`` for a broken run.json),
    ``strategy``, ``world_size``, ``layout`` (dp, tp, pp, their implementations, the strategy and ``label``, the line
    every view shows: :meth:`torch_handle.common.run_layout.RunLayout.record`, from run.json's record, or preset.toml or
    the strategy alone for an older run; dp, tp and pp null when not known), ``step``, ``steps``, ``loss``,
    ``val_loss``, ``tokens_per_s`` (the newest, global), ``start_time`` (unix s), ``age_s`` (s since the start),
    ``message``, ``hang`` (the message of the newest ``hang`` event, also after the run moved on or ended; null without
    one), ``evals`` (the newest ``handle eval --tasks`` results: ``file``, ``step``, ``scores`` task -> metric ->
    value; null without one). Reads run.json, the end of events.jsonl and the newest evals/*.json only."""
    from torch_handle.observe.fields import Status
    from torch_handle.observe.state import RunState
    from torch_handle.observe.tail import tail_events
    from torch_handle.rundir import RunDirError, read_run_status
    from torch_handle.observe.telemetry import EVENTS_FILE
    from torch_handle.infer.downstream import latest_results

    now = time.time() if now is None else now
    try:
        info = read_run_status(run_dir)
    except RunDirError:
        info = {"status": Status.UNREADABLE}
    state = RunState(Path(run_dir), info=info)
    state.apply(tail_events(Path(run_dir) / EVENTS_FILE))
    start = info.get("start_time") if isinstance(info.get("start_time"), (int, float)) else state.first_time
    return {"name": Path(run_dir).name, "path": str(run_dir), "status": state.status, "strategy": state.strategy,
            "world_size": state.world_size, "layout": state.run_layout.record(), "step": state.step,
            "steps": state.steps_total,
            "loss": state.last_loss, "val_loss": state.last_val_loss, "tokens_per_s": state.last(state.tokens_per_s),
            "start_time": start, "age_s": None if start is None else max(0.0, now - start),
            "message": state.message, "hang": state.hang["message"] if state.hang else None,
            "evals": latest_results(run_dir)}


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def _eval_cell(evals: dict[str, Any] | None) -> str:
    """The newest task scores, short: the first task's first metric, ``+N`` more tasks, the step."""
    from torch_handle.common.text import clean

    if not evals or not evals["scores"]:
        return "-"
    task, metrics = next(iter(evals["scores"].items()))
    metric, value = next(iter(metrics.items()))
    more = f" +{len(evals['scores']) - 1}" if len(evals["scores"]) > 1 else ""
    at = f" @{evals['step']}" if evals.get("step") is not None else ""
    return clean(f"{task} {metric} {value:.3f}{more}{at}", 60)


@click.command("runs")
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="A JSON list of objects (the same fields, raw numbers).")
def runs(directory: Path | None, as_json: bool) -> None:
    """The runs under DIRECTORY (default ./runs), newest first, one line each: name, status, layout (dp × tp × pp,
    their implementations and the strategy: `dp 2 × tp 2 (ddp; tp scratch)`), world size, step/total, last train
    and val loss, tokens/s, start time (local) and age; and where a run has `handle eval --tasks` results, the
    newest one's first score (EVAL; `--json`: `evals`).

    A run whose run.json still says running but whose launcher is gone (kill -9, a reboot) and whose heartbeat
    is older than 10 s shows as `lost`; continue it with `handle run --resume RUN_DIR`. A live run whose
    watchdog reported a hang (launch.hang_timeout_s) and that has not moved since shows as `hung`; see its
    logs/stacks-*.txt, or take them again with `handle stacks RUN_DIR`.

    \b
    Examples:
      handle runs                    # ./runs
      handle runs /data/runs --json  # for scripts: jq '.[] | select(.status == "lost") | .path'
    """
    from handle_cli.common import fail
    from torch_handle.rundir import list_runs
    from torch_handle.common.text import clean

    directory = directory or Path("runs")
    if not directory.is_dir():
        fail(f"{directory}: no such directory (runs are under [run] output_dir, default ./runs)")
    rows = [run_summary(p) for p in reversed(list_runs(directory))]
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    if not rows:
        click.echo(f"{directory}: no runs yet (start one with: handle run presets/zero2.toml)")
        return
    evals = any(r["evals"] for r in rows)  # the EVAL column only where some run has task scores
    table = [("NAME", "STATUS", "LAYOUT", "WS", "STEP", "LOSS", "VAL", "TOK/S", "STARTED", "AGE") + (("EVAL",) * evals)]
    for r in rows:
        started = (datetime.fromtimestamp(r["start_time"]).strftime("%Y-%m-%d %H:%M")
                   if isinstance(r["start_time"], (int, float)) else "?")
        layout = r["layout"]["label"] if r["layout"]["dp"] is not None else r["strategy"]  # unknown: the strategy
        table.append((clean(r["name"], 60), clean(r["status"], 12), clean(layout or "?", 80),
                      str(r["world_size"] or "?"), f"{r['step']}/{r['steps'] or '?'}", _num(r["loss"], ".4f"),
                      _num(r["val_loss"], ".4f"), _num(r["tokens_per_s"], ",.0f"), started, _age(r["age_s"]))
                     + ((_eval_cell(r["evals"]),) * evals))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
