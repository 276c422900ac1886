"""``handle profile RUN``: what a run's torch.profiler traces say -- top operators, the time split into compute /
communication / data / optimizer / other, how much communication overlapped compute, the memory peak.
Torch-free: it reads the Chrome trace JSON (``torch_handle.observe.profile_summary``)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from handle_cli.common import fail


@click.command()
@click.argument("run_dir", metavar="RUN", type=click.Path(path_type=Path))
@click.option("--rank", default=0, show_default=True, type=click.IntRange(min=0), help="Whose traces to read.")
@click.option("--all", "all_traces", is_flag=True,
              help="Add up every trace file of the rank (one per profiling cycle) instead of only the newest.")
@click.option("--top", default=10, show_default=True, type=click.IntRange(min=1), help="Operators to list.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--pipeline", is_flag=True,
              help="Draw a pipeline-parallel step as it ran (from events.jsonl) instead of reading traces.")
@click.option("--step", type=click.IntRange(min=1), default=None,
              help="With --pipeline: the step to draw (default: the last step with a timeline).")
@click.option("--width", default=80, show_default=True, type=click.IntRange(min=40),
              help="With --pipeline: columns of the chart.")
@click.option("--routing", is_flag=True,
              help="Summarise a mixture-of-experts run's routing per MoE layer (from events.jsonl) instead.")
def profile(run_dir: Path, rank: int, all_traces: bool, top: int, as_json: bool, pipeline: bool, step: int | None,
            width: int, routing: bool) -> None:
    """Summarise the torch.profiler traces of RUN for one rank.

    Reads RUN/traces/rank<R>/*.pt.trace.json (written with [profiler] name = "torch"; the same files open in
    Perfetto and TensorBoard's profiler) and prints: the top operators by self time (CPU self time, or CUDA
    kernel time on GPU), the recorded steps' time split into compute / communication / data / optimizer /
    other (from the trainer's handle/... ranges and the collectives), the share of communication that
    overlapped compute, and the memory peak (with profile_memory on). Times in milliseconds.

    \b
    Example:
      handle run presets/ddp.toml --set profiler.name=torch --set 'profiler.ranks=[0,1]'
      handle profile runs/ddp-20260101-120000 --rank 1 --top 15
      handle profile runs/ddp-20260101-120000 --json | jq .split

    With --pipeline (a run with [parallel] pp > 1): the schedule of one step as it actually ran, one row per
    pipeline rank (per stage with pp_stages_per_rank > 1), F<mb>/B<mb>/W<mb> cells, ~ receive waits, · idle;
    then busy / wait / idle per rank and the measured bubble next to the schedule's theory. Timelines (the
    spans) are recorded on log steps only (training.log_every): --step N between them draws the nearest step
    that has spans, after a note on stderr naming the steps that do. --json prints the step's pipeline dict
    (--step N's own figures, without spans, when it has none).

    \b
    Example:
      handle run tiny.toml --set launch.nproc_per_node=2 --set parallel.pp=2 --set parallel.pp_schedule=1f1b
      handle profile runs/tiny-20260101-120000 --pipeline --step 4

    With --routing (a run with [model] n_experts > 0): per MoE layer, the smallest and largest share of the
    layer's token assignments an expert got over the run, the experts that got none (dead), the share of
    assignments dropped by the capacity, and the aux loss, the max/mean load and the z loss of the first and last
    10 steps; then the dead and hot (at least 1.5x the mean load) experts of the last 10 steps. --json prints the
    figures as one object.

    \b
    Example:
      handle run presets/moe.toml --set training.steps=50
      handle profile runs/moe-20260101-120000 --routing
    """
    if pipeline or routing:
        (_routing(run_dir, as_json) if routing else _pipeline(run_dir, step, as_json, width))
        return
    from torch_handle.observe.profile_summary import TraceError, find_traces, format_summary, summarize_files
    from torch_handle.rundir import read_run_info

    read_run_info(run_dir)  # one line (exit 2) when RUN is not a run directory
    paths = find_traces(run_dir, rank)
    if not paths:
        others = sorted(p.name for p in (run_dir / "traces").glob("rank*") if p.is_dir() and any(p.iterdir()))
        have = f" (traces exist for: {', '.join(others)})" if others else ""
        fail(f"{run_dir}: no traces for rank {rank} in {run_dir / 'traces' / f'rank{rank}'}{have}; record them with "
             f"handle run PRESET --set profiler.name=torch --set 'profiler.ranks=[{rank}]'")
    try:
        summary = summarize_files(paths if all_traces else paths[-1:], top=top)
    except TraceError as e:
        fail(str(e))
    summary["rank"] = rank
    summary["run_dir"] = str(run_dir)
    click.echo(json.dumps(summary) if as_json else format_summary(summary, rank))


def _pipeline(run_dir: Path, step: int | None, as_json: bool, width: int) -> None:
    from torch_handle.common.run_layout import RunLayout
    from torch_handle.observe.pipeline_view import (format_pipeline, has_timeline, nearest_drawn, pipeline_steps,
                                                    steps_text)
    from torch_handle.observe.tail import EventReader
    from torch_handle.observe.telemetry import EVENTS_FILE
    from torch_handle.rundir import read_run_info

    info = read_run_info(run_dir)
    events = EventReader(run_dir / EVENTS_FILE).poll()
    steps = pipeline_steps(events)
    if not steps:
        fail(f"{run_dir}: no pipeline steps in {EVENTS_FILE} (a run with [parallel] pp > 1 writes them, e.g. "
             f"--set launch.nproc_per_node=2 --set parallel.pp=2)")
    drawn = [(n, p) for n, p in steps if has_timeline(p)]
    if step is None:
        if not drawn:
            fail(f"{run_dir}: no step with a pipeline timeline (they are recorded on log steps: training.log_every)")
        step, chosen = drawn[-1]
    else:
        chosen = next((p for n, p in reversed(drawn) if n == step), None)
        figures = next((p for n, p in reversed(steps) if n == step), None)
        if chosen is None and figures is None:
            have = ", ".join(str(n) for n, _ in drawn[-10:]) or "none"
            fail(f"{run_dir}: --step {step} has no pipeline figures; steps with a timeline: {have}")
        if chosen is None:  # a step between log steps: its figures, no spans
            note = (f"note: step {step} kept no spans: a pipeline timeline is recorded on log steps only "
                    f"({_log_every(run_dir)}); steps with spans: {steps_text(n for n, _ in drawn)}")
            if as_json or not drawn:  # the data asked for, without a chart
                click.echo(note, err=True)
                chosen = figures
            else:
                step, chosen = nearest_drawn(drawn, step)
                click.echo(f"{note}; drawing step {step}, the nearest", err=True)
    # rows by global rank, as handle estimate and the dashboard name them (rank 0's pipeline: dp 0, tp 0)
    degrees = next((e.get("layout") for e in reversed(events) if e.get("kind") == "step"), None)
    layout = RunLayout.from_run(run_dir, info if isinstance(info, dict) else {}, degrees)
    click.echo(json.dumps(chosen) if as_json else format_pipeline(chosen, width=width, step=step,
                                                                  ranks=layout.pipeline_ranks()))


def _routing(run_dir: Path, as_json: bool) -> None:
    from torch_handle.observe.routing_view import format_summary, routing_steps, summarize
    from torch_handle.observe.tail import EventReader
    from torch_handle.observe.telemetry import EVENTS_FILE
    from torch_handle.rundir import read_run_info

    read_run_info(run_dir)  # one line (exit 2) when RUN is not a run directory
    steps = routing_steps(EventReader(run_dir / EVENTS_FILE).poll())
    if not steps:
        fail(f"{run_dir}: no routing figures in {EVENTS_FILE} (a mixture-of-experts run writes them with every "
             f"step: [model] n_experts > 0, e.g. presets/moe.toml)")
    summary = {"run_dir": str(run_dir), **summarize(steps)}
    click.echo(json.dumps(summary) if as_json else format_summary(summary))


def _log_every(run_dir: Path) -> str:
    """``training.log_every = 4`` from the run's preset.toml; the key alone when it cannot be read."""
    from torch_handle.common.fsio import read_toml
    from torch_handle.rundir import PRESET_FILE

    training = (read_toml(run_dir / PRESET_FILE) or {}).get("training")
    value = training.get("log_every") if isinstance(training, dict) else None
    return f"training.log_every = {value}" if isinstance(value, int) else "training.log_every"
