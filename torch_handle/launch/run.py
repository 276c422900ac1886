"""A run's lifecycle: prepare its directory, launch it, watch it until run.json is settled.

:func:`prepare_run` validates a preset (or a ``--resume`` with its overrides) and creates or reopens the run
directory; :class:`SupervisedRun` starts torchrun on it (:class:`torch_handle.launch.supervisor.Launch`), reads its
events, answers interrupts, and once a resumed run made its first step makes its changed preset the run's
(:func:`torch_handle.checkpoint.resume.promote`). The caller (``handle run``, ``handle bench scaling``) only prints.

What is written where (see :mod:`torch_handle.rundir`): ``preset.toml`` and ``run.json`` at creation;
``preset.resume.toml`` and run.json's ``resume_pending`` by a resume; ``preset.toml`` replaced by
``preset.resume.toml`` and run.json's ``resumes`` list extended at the resumed run's first step.

No torch import here.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch_handle.common.precision import AUTO
from torch_handle.common.run_layout import LAYOUT_KEY, RunLayout
from torch_handle.launch.data_identity import check_resume as check_resume_data
from torch_handle.checkpoint.resume import (PENDING, RESUME_PRESET, diff, finished_problem,
                                            frozen_changes, layout_adjustments, promote, resumed_mapping,
                                            write_side_preset)
from torch_handle.config.loader import Preset, dump_preset, load_preset
from torch_handle.config.schema import PLUGIN_TABLES, plugin_name
from torch_handle.config.tp_impl import AUTO as TP_AUTO, KEY as TP_KEY, REASON_FIELD
from torch_handle.errors import PresetError, RunDirError
from torch_handle.launch.multinode import create_or_join_run_dir, owns_run_dir, with_node_rank
from torch_handle.launch.precision import resolve_for_run
from torch_handle.launch.supervisor import Launch
from torch_handle.observe.fields import Kind, Status
from torch_handle.observe.state import FINETUNE_KEY, RunState
from torch_handle.observe.tail import EventReader
from torch_handle.observe.telemetry import EVENTS_FILE
from torch_handle.registry import get_registry
from torch_handle.rundir import (ACTIVE, PRESET_FILE, create_run_dir, launcher_alive, launcher_record,
                                 modify_run_info, output_dir_problem, read_run_info)


def check_inputs(preset: Preset, *, resume: bool = False) -> None:
    """Cheap checks of what a run will read, before anything starts, through the plugins' ``preflight`` hooks:
    the dataset's (missing paths, undecodable text) and, unless ``resume`` of a run without ``[finetune]`` (the
    checkpoint holds the weights then), the model's (``[model] init_from``: the directory and the shape its
    config.json gives). Nothing when the plugins have none.

    Raises:
        DataError, CheckpointError: one line naming the path and the problem.
        PresetError: a plugin is not registered.
    """
    from torch_handle.launch.base_tokenizer import check_base_tokenizer

    registry = get_registry()
    preflight = registry.get("dataset", preset.data.name).preflight
    if preflight is not None:
        preflight(preset.data.options)
    check_base_tokenizer(preset)  # a base's embeddings index its own tokenizer's ids
    preflight = registry.get("model", preset.model.name).preflight
    # a LoRA run reads its frozen base (init_from) on every resume: its checkpoints hold the adapters alone
    if preflight is not None and (not resume or preset.finetune.method != "none"):
        preflight(preset.model.options, preset)


def prepare_data(preset: Preset, progress: Callable[[Any], None] | None = None) -> Any:
    """Ready the run's data before any worker starts, through the dataset's launcher ``prepare`` hook (``text`` and
    ``pydoc``: their token shards, prepared once into the cache, :mod:`torch_handle.data.cache`; the workers only
    open them, so no rank waits at a collective while another prepares). ``progress`` receives
    :class:`torch_handle.data.prepare.Progress` while it prepares. Returns the data's
    :class:`~torch_handle.data.shards.DataIdentity`, or None (no hook, or not known before the workers build it).

    Raises:
        DataError: bad input found while preparing (one line; nothing prepared is kept).
    """
    from torch_handle.data.cache import cache_root

    hook = get_registry().get("dataset", preset.data.name).prepare
    return hook(preset.data.options, cache_root(preset.run.output_dir), progress) if hook is not None else None


def prepare_run(preset: str | None, overrides: tuple[str, ...], run_dir: Path | None,
                resume_dir: Path | None, note: Callable[[str], None] | None = None,
                progress: Callable[[Any], None] | None = None) -> tuple[Preset, Path]:
    """Validate everything, then create (or reopen) the run directory: ``(preset, run directory)``. Nothing is
    written on bad input.

    A new run (``preset``, a path or a bare preset name) gets ``run_dir``, or ``<output_dir>/<name>-<UTC time>``,
    holding ``preset.toml`` (the resolved preset) and ``run.json`` (status ``starting``). A multi-node run
    (``launch.nnodes > 1``) given ``run_dir`` creates it, or joins it when another node of the same run created it
    first on a shared filesystem (:func:`torch_handle.launch.multinode.create_or_join_run_dir`); its
    ``preset.toml`` holds ``node_rank`` 0, and each node's launcher uses its own. ``resume_dir``: see
    :func:`prepare_resume` (``preset`` is then None; ``note`` receives what a resume changed on its own).

    ``training.precision = "auto"`` is resolved here, once, before anything is written
    (:func:`torch_handle.launch.precision.resolve_for_run`): ``preset.toml`` holds the concrete precision and
    run.json ``precision`` and ``precision_reason`` (and ``precision_warning`` for an explicit bf16 on a CPU that
    emulates it). run.json's ``layout`` is the run's dp × tp × pp, their implementations and its strategy
    (:meth:`torch_handle.common.run_layout.RunLayout.record`), for the views that do not load the preset. A
    ``model.init_from`` directory with a tokenizer gives the dataset its tokenizer when the preset names none
    (:func:`torch_handle.launch.base_tokenizer.resolve_base_tokenizer`; said through ``note``). A node
    joining a multi-node run's shared directory takes the precision of its ``preset.toml``. A
    ``parallel.tp_impl = "auto"`` was resolved when the preset loaded (:mod:`torch_handle.config.tp_impl`):
    ``preset.toml`` holds the implementation and run.json its reason, ``tp_impl_reason``. The data is prepared
    (:func:`prepare_data`, with ``progress``) after every check and before the run directory is written.

    Raises:
        PresetError, DataError, RunDirError: one line each (``handle run``: exit code 2).
    """
    if resume_dir is not None:
        return prepare_resume(Path(resume_dir), overrides, note, progress)
    assert preset is not None
    from torch_handle.launch.base_tokenizer import resolve_base_tokenizer

    loaded = load_preset(preset, overrides)
    check_inputs(loaded)
    loaded, tokenizer_note = resolve_base_tokenizer(loaded)
    if tokenizer_note and note is not None:
        note(tokenizer_note)
    if problem := output_dir_problem(Path(loaded.run.output_dir)):  # before the data is prepared
        raise RunDirError(problem)
    prepare_data(loaded, progress)
    join = Path(run_dir) if loaded.launch.nnodes > 1 and run_dir is not None else None
    loaded, precision = resolve_for_run(loaded, join)
    info = {"status": Status.STARTING, "name": loaded.run.name, "preset": str(loaded.source),
            "strategy": loaded.strategy.name, "zero_stage": getattr(loaded.strategy.options, "zero_stage", None),
            "world_size": loaded.world_size, "steps": loaded.training.steps, "start_time": time.time(),
            "end_time": None, "restarts": 0, LAYOUT_KEY: RunLayout.from_preset(loaded).record(), **precision,
            **({REASON_FIELD: loaded.resolved[TP_KEY]} if TP_KEY in loaded.resolved else {}),
            **({FINETUNE_KEY: {"method": loaded.finetune.method, "rank": loaded.finetune.rank}}
               if loaded.finetune.method != "none" else {})}
    if loaded.launch.nnodes > 1:
        if run_dir is not None:
            directory, _ = create_or_join_run_dir(loaded, info, Path(run_dir))
            return loaded, directory
        info.update(launcher_record(loaded.launch.node_rank))  # a directory of this node's own
        directory = create_run_dir(Path(loaded.run.output_dir), loaded.run.name,
                                   dump_preset(with_node_rank(loaded, 0)), info)
        return loaded, directory
    directory = create_run_dir(Path(loaded.run.output_dir), loaded.run.name, dump_preset(loaded), info, run_dir)
    return loaded, directory


def prepare_resume(resume_dir: Path, overrides: tuple[str, ...], note: Callable[[str], None] | None = None,
                   progress: Callable[[Any], None] | None = None) -> tuple[Preset, Path]:
    """Check a ``--resume`` (with its ``--set`` overrides) against the run, then mark it resuming.

    Every check comes first. Reported together, one line each: every setting that may not change on a resume
    (:func:`torch_handle.checkpoint.resume.frozen_changes`), the preset's problems, and a finished run that would
    train nothing (:func:`torch_handle.checkpoint.resume.finished_problem`); then a live launcher, then missing data.
    Any of them raises with the run directory untouched. A change of layout first resets the ``[parallel]``
    settings that only made sense for the old one, and names the run's settings it puts into effect
    (:func:`torch_handle.checkpoint.resume.layout_adjustments`; each said through ``note``). The data is prepared
    (:func:`prepare_data`) and its identity compared with the newest checkpoint's. Then accepted changes
    go to ``preset.resume.toml``, not ``preset.toml`` (a stale one is removed), and run.json gets status
    ``running``, ``resumed`` + 1 and ``resume_pending`` (see :mod:`torch_handle.checkpoint.resume`). On a
    multi-node run only the node that owns the shared directory writes; the others validate.

    Raises:
        RunDirError, PresetError, DataError: one line per problem (``handle run``: exit code 2).
    """
    info = read_run_info(resume_dir)
    current = load_preset(resume_dir / PRESET_FILE)
    asked = resumed_mapping(resume_dir, current, overrides)  # None: a malformed --set, which loading reports
    extra, notes = layout_adjustments(current, asked, overrides) if asked is not None else ([], [])
    overrides = (*overrides, *extra)
    try:
        loaded, invalid = load_preset(resume_dir / PRESET_FILE, overrides) if overrides else current, None
    except PresetError as e:
        loaded, invalid = None, e
    # --set training.precision=auto: the run's own, which may not change
    if loaded is not None and loaded.training.precision == AUTO:
        loaded.training.precision = current.training.precision
    if asked is not None and asked["training"].get("precision") == AUTO:
        asked["training"]["precision"] = current.training.precision
    if asked is not None:
        plugins = {table: plugin_name(table, asked.get(table)) for table in PLUGIN_TABLES}
        frozen = frozen_changes(resume_dir, current, diff(current, loaded or asked), plugins)
        steps = loaded.training.steps if loaded is not None else asked.get("training", {}).get("steps")
        finished = [why] if (why := finished_problem(resume_dir, info, steps)) else []
        if frozen or finished:  # what may not change at all, then the preset's problems, then the steps
            raise RunDirError("\n".join([*frozen, *(str(invalid).splitlines() if invalid else []), *finished]))
    if invalid is not None:
        raise invalid
    loaded = keep_tp_impl(resume_dir / PRESET_FILE, current, loaded, overrides)
    nodes = loaded.launch.nnodes > 1
    if nodes and not any(o.partition("=")[0].strip() == "launch.node_rank" for o in overrides):
        raise RunDirError(f"{resume_dir}: a run on {loaded.launch.nnodes} nodes: give this node's rank, "
                          f"--resume {resume_dir} --set launch.node_rank=R (0 on the node of rdzv_endpoint)")
    owner = owns_run_dir(info, loaded)  # False: another node's launcher prepares this shared directory
    if owner and info.get("status") in ACTIVE and launcher_alive(info):
        raise RunDirError(f"{resume_dir}: is still running (launcher pid {info['launcher_pid']})")
    stored = with_node_rank(loaded, 0) if nodes else loaded  # a multi-node run's preset.toml holds node_rank 0
    changes = diff(current, stored)
    check_inputs(loaded, resume=True)
    check_resume_data(resume_dir, prepare_data(loaded, progress))  # the checkpoint's data and tokenizer still
    for line in notes if note is not None else ():
        note(line)
    if not owner:
        return loaded, resume_dir
    write_side_preset(resume_dir, stored if changes else None)  # None: drops a stale one of a failed resume
    record = launcher_record(loaded.launch.node_rank) if nodes and loaded.launch.node_rank > 0 else {}
    pending = {"time": time.time(), **({REASON_FIELD: loaded.resolved[TP_KEY]} if TP_KEY in loaded.resolved else {})}
    modify_run_info(resume_dir, lambda now: {**now, "status": Status.RUNNING, "message": "", **record,
                                             "resumed": now.get("resumed", 0) + 1, PENDING: pending})
    return loaded, resume_dir


def keep_tp_impl(path: Path, current: Preset, loaded: Preset, overrides: tuple[str, ...]) -> Preset:
    """A resume's ``--set parallel.tp_impl=auto``: the run's own implementation (``current``'s) where it runs the
    resumed layout, so that auto never switches a resumed run's implementation when it need not; else ``loaded``,
    whose reason says why the other one was chosen (the switch is recorded in run.json's ``resumes``, as any
    change). ``path``: the run's preset.toml, reloaded with the own implementation to check it."""
    own = current.parallel.tp_impl
    if TP_KEY not in loaded.resolved or own == TP_AUTO or loaded.parallel.tp_impl == own:
        return loaded
    try:
        kept = load_preset(path, (*overrides, f"parallel.tp_impl={own}"))
    except PresetError:  # the own one cannot run this layout: auto's choice stands, with its reason
        return loaded
    kept.training.precision = loaded.training.precision
    kept.resolved[TP_KEY] = f"auto → {own}: the resumed run's own implementation, which runs this layout"
    return kept


class Interrupt(enum.Enum):
    """What :meth:`SupervisedRun.interrupt` did."""

    KILLED_BEFORE_TRAINING = "killed before training"
    """The workers had not reached the training loop (no step would answer a STOP file): the tree was
    terminated."""
    STOP_REQUESTED = "stop requested"
    """The STOP file: the workers stop after the current step, with a checkpoint."""
    KILLED = "killed"
    """A second interrupt: the tree was terminated."""


class SupervisedRun:
    """One launch of a prepared run directory, watched until run.json is settled.

    ``start()``, then ``poll()`` until it returns an exit code, then ``finish(rc)``; ``interrupt()`` from a
    signal handler. ``state`` folds every event read so far (the preset's step total until the workers report
    theirs).
    """

    def __init__(self, preset: Preset, run_dir: Path):
        run_dir = Path(run_dir)
        node_rank = preset.launch.node_rank
        if (run_dir / RESUME_PRESET).exists():  # a resume with changes: its preset, not the run's (--tui path)
            preset = load_preset(run_dir / RESUME_PRESET)
            preset.launch.node_rank = node_rank  # a multi-node run's files hold node_rank 0: this node's own
        self.preset, self.run_dir = preset, run_dir
        before = read_run_info(run_dir)
        self.pending = PENDING in before and owns_run_dir(before, preset)
        """A resume waits for its first step to be promoted (another node's launcher promotes a shared one)."""
        self._began = before.get("train_start_time")
        self.launch = Launch(preset, run_dir)
        self.reader = EventReader(run_dir / EVENTS_FILE)
        # no status from run.json: the caller's summary reports the launcher's
        self.state = RunState(run_dir, info={"steps": preset.training.steps})
        self.interrupts = 0
        self._started = 0.0

    def training(self) -> bool:
        """Whether the workers of this launch reached the training loop (they answer a STOP file at a step)."""
        try:
            info = read_run_info(self.run_dir)
        except RunDirError:
            return False
        return info.get("status") == Status.RUNNING and info.get("train_start_time") != self._began

    def start(self) -> None:
        """Start torchrun (run.json: status ``running`` and the launcher's pid)."""
        self._started = time.time()
        self.launch.start()

    def poll(self) -> tuple[int | None, list[dict[str, Any]]]:
        """``(torchrun's exit code or None while it runs, the events written since the last poll)``; a pending
        resume whose first step is among them is promoted."""
        rc = self.launch.poll()
        events = self.reader.poll()
        self.state.apply(events)
        if self.pending:
            first = next((e for e in events if e.get("kind") == Kind.STEP and isinstance(e.get("step"), int)
                          and (e.get("time") or 0) >= self._started), None)
            if first is not None:
                promote(self.run_dir, first["step"] - 1)
                self.pending = False
        return rc, events

    def interrupt(self) -> Interrupt:
        """A SIGINT/SIGTERM: the first asks the workers to stop after the current step with a checkpoint (the STOP
        file; on any node of a multi-node run it stops every node), or terminates the tree at once before they
        train; the second terminates it."""
        self.interrupts += 1
        if self.interrupts == 1 and self.launch.proc is not None and not self.training():
            self.launch.kill(grace_s=2.0)
            return Interrupt.KILLED_BEFORE_TRAINING
        if self.interrupts == 1:
            self.launch.request_stop()
            return Interrupt.STOP_REQUESTED
        self.launch.kill()
        return Interrupt.KILLED

    def finish(self, returncode: int) -> dict[str, Any]:
        """After torchrun exited: the last events, no process left, run.json settled
        (:meth:`torch_handle.launch.supervisor.Launch.finish`); a pending resume of a run that finished is
        promoted. Returns run.json (this node's view on a node that does not own it)."""
        self.state.apply(self.reader.poll())
        self.launch.reap()
        info = self.launch.finish(returncode)
        if self.pending and info.get("status") == Status.FINISHED:  # nothing left to do: the resume worked too
            promote(self.run_dir, self.state.step)
        return info
