"""``handle run``: prepare the run directory, supervise torchrun, show progress and the final summary."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from handle_cli.common import EXIT_FAILED, EXIT_FINISHED, EXIT_STOPPED
from torch_handle.config.loader import Preset, dump_preset, load_preset
from torch_handle.rundir import (ACTIVE, PRESET_FILE, RunDirError, create_run_dir, launcher_alive, read_run_info,
                                 update_run_info)
from torch_handle.observe.fields import Kind, Level, Status
from torch_handle.observe.state import RunState
from torch_handle.observe.tail import EventReader
from torch_handle.observe.telemetry import EVENTS_FILE
from torch_handle.common.text import clean, fmt_bytes, fmt_duration  # text from logs and events never reaches the terminal raw


EXIT_CODES = {Status.FINISHED: EXIT_FINISHED, Status.FAILED: EXIT_FAILED, Status.STOPPED: EXIT_STOPPED}


def prepare_run(preset: str | None, overrides: tuple[str, ...], run_dir: Path | None,
                resume_dir: Path | None) -> tuple[Preset, Path]:
    """Validate everything, then create (or reopen) the run directory. Nothing is written on bad input.

    A multi-node run (``launch.nnodes > 1``) given a ``--run-dir`` creates it, or joins it when another node of the
    same run created it first on a shared filesystem (:func:`torch_handle.launch.multinode.create_or_join_run_dir`);
    its ``preset.toml`` holds ``node_rank`` 0, and each node's launcher uses its own.
    """
    if resume_dir is not None:
        return _prepare_resume(Path(resume_dir), overrides)
    assert preset is not None
    loaded = load_preset(preset, overrides)
    _check_data(loaded)
    info = {"status": Status.STARTING, "name": loaded.run.name, "preset": str(loaded.source),
            "strategy": loaded.strategy.name, "zero_stage": getattr(loaded.strategy.options, "zero_stage", None),
            "world_size": loaded.world_size, "steps": loaded.training.steps, "start_time": time.time(),
            "end_time": None, "restarts": 0}
    if loaded.launch.nnodes > 1:
        from torch_handle.launch.multinode import create_or_join_run_dir, with_node_rank
        from torch_handle.rundir import launcher_record

        if run_dir is not None:
            directory, _ = create_or_join_run_dir(loaded, info, Path(run_dir))
            return loaded, directory
        info.update(launcher_record(loaded.launch.node_rank))  # a directory of this node's own
        directory = create_run_dir(Path(loaded.run.output_dir), loaded.run.name,
                                   dump_preset(with_node_rank(loaded, 0)), info)
        return loaded, directory
    directory = create_run_dir(Path(loaded.run.output_dir), loaded.run.name, dump_preset(loaded), info, run_dir)
    return loaded, directory


def _prepare_resume(resume_dir: Path, overrides: tuple[str, ...]) -> tuple[Preset, Path]:
    """Check a ``--resume`` (with its ``--set`` overrides) against the run, then mark it resuming.

    Every check comes first: a live launcher, a preset that does not load, a setting that may not change on a
    resume (:func:`torch_handle.checkpoint.resume.check_changes`), missing data. Any of them raises with the run directory
    untouched. Accepted changes go to ``preset.resume.toml``, not ``preset.toml`` (see :mod:`torch_handle.checkpoint.resume`).

    Raises:
        RunDirError, PresetError, DataError: one line each (exit code 2).
    """
    from torch_handle.launch.multinode import owns_run_dir, with_node_rank
    from torch_handle.checkpoint.resume import PENDING, check_changes, write_side_preset
    from torch_handle.rundir import launcher_record

    info = read_run_info(resume_dir)
    current = load_preset(resume_dir / PRESET_FILE)
    loaded = load_preset(resume_dir / PRESET_FILE, overrides) if overrides else current
    nodes = loaded.launch.nnodes > 1
    if nodes and not any(o.partition("=")[0].strip() == "launch.node_rank" for o in overrides):
        raise RunDirError(f"{resume_dir}: a run on {loaded.launch.nnodes} nodes: give this node's rank, "
                          f"--resume {resume_dir} --set launch.node_rank=R (0 on the node of rdzv_endpoint)")
    owner = owns_run_dir(info, loaded)  # False: another node's launcher prepares this shared directory
    if owner and info.get("status") in ACTIVE and launcher_alive(info):
        raise RunDirError(f"{resume_dir}: is still running (launcher pid {info['launcher_pid']})")
    stored = with_node_rank(loaded, 0) if nodes else loaded  # a multi-node run's preset.toml holds node_rank 0
    changes = check_changes(resume_dir, current, stored)
    _check_data(loaded)
    if not owner:
        return loaded, resume_dir
    write_side_preset(resume_dir, stored if changes else None)  # None: drops a stale one of a failed resume
    record = launcher_record(loaded.launch.node_rank) if nodes and loaded.launch.node_rank > 0 else {}
    update_run_info(resume_dir, status=Status.RUNNING, message="", resumed=info.get("resumed", 0) + 1,
                    **{PENDING: {"time": time.time()}}, **record)
    return loaded, resume_dir


def _check_data(preset: Preset) -> None:
    """Cheap data checks before anything starts (missing paths), through the dataset plugin's own hook."""
    from torch_handle.registry import get_registry

    preflight = get_registry().get("dataset", preset.data.name).preflight
    if preflight is not None:
        preflight(preset.data.options)


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
        # elapsed: from the first event to the last one (a resumed run counts its earlier attempts too)
        lines.append(f"  mean {s.mean_tokens_per_s:,.0f} tokens/s   elapsed "
                     f"{fmt_duration((s.last_time or 0) - (s.first_time or 0))}")
    if info.get("strategy"):
        stage = f" ZeRO-{info['zero_stage']}" if info.get("zero_stage") is not None else ""
        lines.append(f"  {info['strategy']}{stage}, world size {info.get('world_size')}, "
                     f"optimizer {info.get('optimizer')}")
    for rank, peak in sorted(s.peak_memory.items()):
        model_state = peak.get("param_bytes", 0) + peak.get("grad_bytes", 0) + peak.get("optimizer_bytes", 0)
        cuda = peak.get("cuda_max_allocated_bytes")
        extra = f"   cuda peak {fmt_bytes(cuda)}" if cuda is not None else ""
        lines.append(f"  rank {rank}: params {fmt_bytes(peak.get('param_bytes', 0))}  grads "
                     f"{fmt_bytes(peak.get('grad_bytes', 0))}  optimizer {fmt_bytes(peak.get('optimizer_bytes', 0))}"
                     f"  (model state {fmt_bytes(model_state)})  rss {fmt_bytes(peak.get('rss_bytes', 0))}{extra}")
    return "\n".join(lines)


def supervise(preset: Preset, run_dir: Path, *, quiet: bool = False) -> int:
    """Run torchrun on ``run_dir`` until it ends; returns the exit code (0 finished, 1 failed, 130 stopped).

    Signals (SIGINT, SIGTERM): once the workers train, the first one asks them to stop after the current step with
    a checkpoint (the STOP file; on any node of a multi-node run it stops every node); before that (rendezvous,
    start-up: no step would come to answer it) and at a second one, the process tree is terminated at once.
    """
    from torch_handle.launch.supervisor import Launch
    from torch_handle.launch.multinode import owns_run_dir
    from torch_handle.checkpoint.resume import PENDING, RESUME_PRESET, promote

    node_rank = preset.launch.node_rank
    if (Path(run_dir) / RESUME_PRESET).exists():  # a resume with changes: its preset, not the run's (--tui path)
        preset = load_preset(Path(run_dir) / RESUME_PRESET)
        preset.launch.node_rank = node_rank  # a multi-node run's files hold node_rank 0: this node's own
    before = read_run_info(run_dir)
    pending = PENDING in before and owns_run_dir(before, preset)  # another node's launcher promotes a shared one
    began = before.get("train_start_time")

    def training() -> bool:
        """Whether the workers of this launch reached the training loop (they answer a STOP file at a step)."""
        try:
            info = read_run_info(run_dir)
        except RunDirError:
            return False
        return info.get("status") == Status.RUNNING and info.get("train_start_time") != began

    launch = Launch(preset, run_dir)
    reader = EventReader(Path(run_dir) / EVENTS_FILE)
    # the preset's total until the workers report theirs; no status from run.json: the summary's is the launcher's
    state = RunState(Path(run_dir), info={"steps": preset.training.steps})
    interrupts = 0

    def on_signal(signum, frame):
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1 and launch.proc is not None and not training():
            if not quiet:
                click.echo("\nstopping: the workers have not started training (no checkpoint to write)", err=True)
            launch.kill(grace_s=2.0)
        elif interrupts == 1:
            launch.request_stop()
            if not quiet:
                click.echo("\nstopping after the current step (checkpoint first); press Ctrl-C again to kill",
                           err=True)
        else:
            if not quiet:
                click.echo("killing the workers", err=True)
            launch.kill()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    tty = sys.stdout.isatty() and not quiet
    last_printed = 0.0
    if not quiet:
        click.echo(f"run directory: {run_dir}\nlogs: {run_dir}/logs/rank*.log   dashboard: handle tui {run_dir}")
    try:
        started = time.time()
        launch.start()
        while True:
            rc = launch.poll()
            events = reader.poll()
            state.apply(events)
            if pending:  # the resumed run made its first step: its preset becomes the run's
                first = next((e for e in events if e.get("kind") == Kind.STEP and isinstance(e.get("step"), int)
                              and (e.get("time") or 0) >= started), None)
                if first is not None:
                    promote(run_dir, first["step"] - 1)
                    pending = False
            for event in [] if quiet else events:
                if event.get("kind") == Kind.LOG and event.get("level") in (Level.WARNING, Level.ERROR):
                    click.echo(("\r\033[K" if tty else "")
                               + f"{clean(event['level'])}: {clean(event.get('message', ''))}")
                elif event.get("kind") == Kind.EVAL and not tty:
                    click.echo(f"step {event.get('step')}: val loss {_fmt_loss(event.get('val_loss'))}")
                elif event.get("kind") == Kind.HANG:  # the watchdog's (launch.hang_timeout_s): where ranks wait
                    click.echo(("\r\033[K" if tty else "") + f"error: {clean(event.get('message', 'hang'))}")
            now = time.monotonic()
            if tty:
                click.echo("\r\033[K" + progress_line(state), nl=False)
            elif not quiet and state.step and now - last_printed > 5:
                click.echo(progress_line(state))
                last_printed = now
            if rc is not None:
                break
            time.sleep(0.2)
        state.apply(reader.poll())
        launch.reap()
        info = launch.finish(rc)
        if pending and info.get("status") == Status.FINISHED:  # nothing left to do: the resume worked too
            promote(run_dir, state.step)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if not quiet:
        if tty:
            click.echo("")
        click.echo(summary_text(state, run_dir, info))
        if info.get("status") == Status.FAILED:
            click.echo(f"error: run failed: {clean(info.get('message', ''))} (logs: {run_dir}/logs)", err=True)
        elif info.get("status") == Status.STOPPED:
            node = f" --set launch.node_rank={preset.launch.node_rank}" if preset.launch.nnodes > 1 else ""
            click.echo(f"resume with: handle run --resume {run_dir}{node}")
    return EXIT_CODES.get(info.get("status"), 1)


def spawn_detached(run_dir: Path) -> None:
    """Start ``handle supervise-run RUN_DIR`` in its own session, so closing the dashboard leaves the run going."""
    log = open(Path(run_dir) / "logs" / "handle.log", "ab")
    subprocess.Popen([sys.executable, "-m", "handle_cli", "supervise-run", str(run_dir)], stdin=subprocess.DEVNULL,
                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
