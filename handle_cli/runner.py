"""``handle run``'s terminal side: live progress, warnings and the final summary of a run that
:mod:`torch_handle.launch.run` prepares and supervises; the detached launcher of ``--tui``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from handle_cli.common import EXIT_FAILED, EXIT_FINISHED, EXIT_STOPPED
from handle_cli.eval_tasks import tasks_line
from torch_handle.config.loader import Preset
from torch_handle.errors import RunDirError
from torch_handle.launch.run import Interrupt, SupervisedRun
from torch_handle.observe.fields import (FROZEN_PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES, PARAM_BYTES,
                                         TRAINABLE_PARAM_BYTES, Kind, Level, Status)
from torch_handle.observe.data_mix import shares_text
from torch_handle.observe.state import RunState
from torch_handle.rundir import read_run_info
from torch_handle.common.run_layout import RunLayout
from torch_handle.common.text import clean, fmt_duration  # log/event text never reaches the terminal raw
from torch_handle.common.units import fmt_bytes


EXIT_CODES = {Status.FINISHED: EXIT_FINISHED, Status.FAILED: EXIT_FAILED, Status.STOPPED: EXIT_STOPPED}
INTERRUPTED = {
    Interrupt.KILLED_BEFORE_TRAINING: "\nstopping: the workers have not started training (no checkpoint to write)",
    Interrupt.STOP_REQUESTED: "\nstopping after the current step (checkpoint first); press Ctrl-C again to kill",
    Interrupt.KILLED: "killing the workers",
}
"""What ``handle run`` says on stderr after each interrupt."""


def _fmt_loss(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "n/a (not finite)"


def progress_line(s: RunState) -> str:
    """``step 5/10 | loss 2.5000 | val 2.6000 | 1,234 tok/s | lr 1.00e-03 | ETA 00:05`` (parts without a value
    yet are left out; the ETA is the time left at the recent step times, ``--:--`` until there is one)."""
    total = s.steps_total or "?"
    parts = [f"step {s.step}/{total}"]
    if (loss := s.last_loss) is not None:
        parts.append(f"loss {loss:.4f}")
    if (val := s.last_val_loss) is not None:
        parts.append(f"val {val:.4f}")
    if (tokens_per_s := s.last(s.tokens_per_s)) is not None:
        parts.append(f"{tokens_per_s:,.0f} tok/s")
    if (lr := s.last(s.lr)) is not None:
        parts.append(f"lr {lr:.2e}")
    parts.append(f"ETA {fmt_duration(s.time_left_s())}")
    return " | ".join(parts)


def summary_text(s: RunState, run_dir: Path, info: dict) -> str:
    """The final summary: status and message from ``info`` (run.json), figures from the events; cleaned text."""
    lines = [f"{info.get('status', '?')}: {run_dir}"]
    if info.get("message"):
        lines.append(f"  {clean(info['message'])}")
    if (loss := s.last_loss) is not None:
        val = s.last_val_loss
        lines.append(f"  steps {s.step}   final train loss {loss:.4f}"
                     + (f"   val loss {s.first_val_loss:.4f} -> {val:.4f}" if val is not None else ""))
    if s.mean_tokens_per_s:
        # elapsed: from the launch to the end, as the dashboard's header says (RunState.elapsed_s)
        lines.append(f"  mean {s.mean_tokens_per_s:,.0f} tokens/s   elapsed {fmt_duration(s.elapsed_s(info))}")
    if totals := s.source_totals:  # a data mixture: the share of the tokens each source gave
        lines.append(f"  data mix {shares_text(totals)}   ({sum(totals.values()):,} tokens)")
    if info.get("strategy"):
        # run.json's record (preset.toml's for an older run), with the strategy the workers reported
        layout = RunLayout.from_run(run_dir, info, s.layout_degrees).with_strategy(s.event_strategy, s.event_zero_stage)
        world = f", world size {layout.world_size}" if layout.dp is not None else ""  # else the label names it
        finetune = f", {s.finetune}" if s.finetune else ""  # QLoRA named as such, not as its preset's name
        lines.append(f"  {layout.label()}{world}, optimizer {info.get('optimizer')}{finetune}")
    for rank, peak in sorted(s.peak_memory.items()):
        model_state = sum(peak.get(key, 0) for key in (PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES))
        cuda = peak.get("cuda_max_allocated_bytes")
        extra = f"   cuda peak {fmt_bytes(cuda)}" if cuda is not None else ""
        frozen = peak.get(FROZEN_PARAM_BYTES)  # a LoRA run: its frozen base apart from what trains
        split = f" ({fmt_bytes(peak.get(TRAINABLE_PARAM_BYTES, 0))} trainable, {fmt_bytes(frozen)} frozen)" \
            if frozen else ""
        lines.append(f"  rank {rank}: params {fmt_bytes(peak.get('param_bytes', 0))}{split}  grads "
                     f"{fmt_bytes(peak.get('grad_bytes', 0))}  optimizer {fmt_bytes(peak.get('optimizer_bytes', 0))}"
                     f"  (model state {fmt_bytes(model_state)})  rss {fmt_bytes(peak.get('rss_bytes', 0))}{extra}")
    return "\n".join(lines)


def precision_lines(preset: Preset, run_dir: Path) -> list[str]:
    """``precision: fp32 (auto → fp32: bf16 matmul 0.02× fp32 on this CPU)`` from run.json (the launcher's
    resolution, :func:`torch_handle.launch.precision.resolve_for_run`), and its ``warning:`` line if any."""
    info = _run_info(run_dir)
    reason = info.get("precision_reason")
    lines = [f"precision: {preset.training.precision}" + (f" ({clean(reason, 200)})" if reason else "")]
    if info.get("precision_warning"):
        lines.append(f"warning: {clean(info['precision_warning'], 300)}")
    return lines


def start_lines(preset: Preset, run_dir: Path) -> list[str]:
    """What ``handle run`` says before the workers start: :func:`precision_lines`; with tp > 1 ``tensor
    parallelism: tp 2, scratch (auto → scratch: ...)`` (the reason of this launch's choice, else run.json's); a
    ``warning:`` line when the ranks oversubscribe this node's CPU cores
    (:func:`torch_handle.launch.cores.node_warning`)."""
    from torch_handle.config.tp_impl import KEY, REASON_FIELD
    from torch_handle.launch.cores import node_warning

    lines = precision_lines(preset, run_dir)
    impl = preset.parallel.tp_impl
    if preset.parallel.tp > 1:
        why = preset.resolved.get(KEY) or str(_run_info(run_dir).get(REASON_FIELD) or "")
        why = why if why.startswith(f"auto → {impl}:") else ""  # run.json's, of an implementation a resume changed
        lines.append(f"tensor parallelism: tp {preset.parallel.tp}, {impl}" + (f" ({clean(why, 200)})" if why else ""))
    oversubscribed = node_warning(preset)
    if oversubscribed:
        lines.append(f"warning: {oversubscribed}")
    return lines


def _run_info(run_dir: Path) -> dict:
    try:
        return read_run_info(run_dir)
    except RunDirError:
        return {}


def supervise(preset: Preset, run_dir: Path, *, quiet: bool = False) -> int:
    """Run torchrun on the prepared ``run_dir`` until it ends (:class:`torch_handle.launch.run.SupervisedRun`),
    printing progress, warnings and the summary unless ``quiet``; returns the exit code (0 finished, 1 failed, 130
    stopped).

    Signals (SIGINT, SIGTERM): once the workers train, the first one asks them to stop after the current step with
    a checkpoint (the STOP file; on any node of a multi-node run it stops every node); before that (rendezvous,
    start-up: no step would come to answer it) and at a second one, the process tree is terminated at once.
    """
    run = SupervisedRun(preset, run_dir)

    def on_signal(signum, frame):
        done = run.interrupt()
        if not quiet:
            click.echo(INTERRUPTED[done], err=True)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    tty = sys.stdout.isatty() and not quiet
    last_printed = 0.0
    if not quiet:
        click.echo(f"run directory: {run_dir}\nlogs: {run_dir}/logs/rank*.log   dashboard: handle tui {run_dir}")
        for line in start_lines(preset, run_dir):
            click.echo(line, err=line.startswith("warning:"))
    try:
        run.start()
        while True:
            rc, events = run.poll()
            for event in [] if quiet else events:
                if event.get("kind") == Kind.LOG and event.get("level") in (Level.WARNING, Level.ERROR):
                    click.echo(("\r\033[K" if tty else "")
                               + f"{clean(event['level'])}: {clean(event.get('message', ''))}")
                elif event.get("kind") == Kind.EVAL and not tty:
                    click.echo(f"step {event.get('step')}: val loss {_fmt_loss(event.get('val_loss'))}")
                elif event.get("kind") == Kind.TASKS:  # an in-loop evaluation's scores ([eval]): seldom, worth a line
                    click.echo(("\r\033[K" if tty else "") + tasks_line(event))
                elif event.get("kind") == Kind.HANG:  # the watchdog's (launch.hang_timeout_s): where ranks wait
                    click.echo(("\r\033[K" if tty else "") + f"error: {clean(event.get('message', 'hang'))}")
            now = time.monotonic()
            if tty:
                click.echo("\r\033[K" + progress_line(run.state), nl=False)
            elif not quiet and run.state.step and now - last_printed > 5:
                click.echo(progress_line(run.state))
                last_printed = now
            if rc is not None:
                break
            time.sleep(0.2)
        info = run.finish(rc)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if not quiet:
        if tty:
            click.echo("")
        click.echo(summary_text(run.state, run_dir, info))
        if info.get("status") == Status.FAILED:
            click.echo(f"error: run failed: {clean(info.get('message', ''))} (logs: {run_dir}/logs)", err=True)
        elif info.get("status") == Status.STOPPED:
            launch = run.preset.launch
            node = f" --set launch.node_rank={launch.node_rank}" if launch.nnodes > 1 else ""
            click.echo(f"resume with: handle run --resume {run_dir}{node}")
    return EXIT_CODES.get(info.get("status"), 1)


def spawn_detached(run_dir: Path) -> None:
    """Start ``handle supervise-run RUN_DIR`` in its own session, so closing the dashboard leaves the run going."""
    log = open(Path(run_dir) / "logs" / "handle.log", "ab")
    subprocess.Popen([sys.executable, "-m", "handle_cli", "supervise-run", str(run_dir)], stdin=subprocess.DEVNULL,
                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
