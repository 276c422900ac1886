"""Runs that span nodes, the launchers' side: one run directory per node, or one shared by all.

Each node of a multi-node run (``launch.nnodes > 1``) runs its own ``handle run`` with its own run directory
path, on a shared filesystem or on local disks (the workers find out which: :mod:`torch_handle.checkpoint.shared_dirs`).
The first node to reach a ``--run-dir`` creates it; on a shared filesystem the other nodes join it (same preset but
for ``launch.node_rank``, run still active). Only node 0's launcher (or, in a directory no node 0 joined, the node
that created it) writes run.json's launcher fields and settles its final status; global rank 0 writes the events.

No torch import (the CLI imports this module).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch_handle.errors import RunDirError
from torch_handle.observe.fields import Status

if TYPE_CHECKING:
    from torch_handle.config.loader import Preset


def with_node_rank(preset: Preset, node_rank: int) -> Preset:
    """A copy of ``preset`` with ``launch.node_rank`` set (a multi-node run directory's preset.toml holds 0)."""
    out = copy.deepcopy(preset)
    out.launch.node_rank = node_rank
    return out


def create_or_join_run_dir(preset: Preset, info: dict[str, Any], run_dir: Path) -> tuple[Path, bool]:
    """The run directory ``run_dir`` of this node of a multi-node run (``launch.nnodes > 1``): created with
    ``preset.toml`` (``node_rank`` 0) and run.json ``info`` plus this launcher's record
    (:func:`torch_handle.rundir.launcher_record`) when no other node created it first (an atomic rename decides),
    else joined after :func:`check_joinable`.

    Returns:
        ``(run_dir, created)``.

    Raises:
        RunDirError: one line, when the output directory cannot be written or ``run_dir`` may not be joined.
    """
    from torch_handle.config.loader import dump_preset
    from torch_handle.rundir import RunDirExists, create_run_dir, launcher_record

    node = preset.launch.node_rank
    try:
        created = create_run_dir(Path(preset.run.output_dir), preset.run.name, dump_preset(with_node_rank(preset, 0)),
                                 {**info, **launcher_record(node)}, run_dir)
        return created, True
    except RunDirExists:
        pass
    check_joinable(Path(run_dir), preset)
    return Path(run_dir), False


def check_joinable(run_dir: Path, preset: Preset) -> None:
    """Refuse to join ``run_dir`` unless it is the same multi-node run, still active: the same preset but for
    ``launch.node_rank``, a status of starting/running (not finished, failed, stopped or lost), and no other node
    0 when this is node 0.

    Raises:
        RunDirError: one line naming the directory, what differs, and what to do instead.
    """
    from torch_handle.config.loader import dump_preset, load_preset
    from torch_handle.checkpoint.resume import diff
    from torch_handle.rundir import ACTIVE, PRESET_FILE, is_lost, read_run_info

    info = read_run_info(run_dir)
    ours = with_node_rank(preset, 0)
    try:
        theirs_text = (Path(run_dir) / PRESET_FILE).read_text(encoding="utf-8")
    except OSError as e:
        raise RunDirError(f"{run_dir}: cannot read {PRESET_FILE} ({e.strerror or e})") from None
    if theirs_text != dump_preset(ours):
        try:
            changes = diff(load_preset(Path(run_dir) / PRESET_FILE), ours)
        except Exception:  # noqa: BLE001 - the message only loses its detail
            changes = {}
        key = min(changes, default=None)
        what = f" ({key} = {changes[key][0]!r} there, {changes[key][1]!r} here)" if key else ""
        raise RunDirError(f"{run_dir}: already exists with another preset{what}: every node of a run uses the same "
                          f"preset (only launch.node_rank differs); give this run another --run-dir")
    status = info.get("status")
    more = " --set training.steps=M (more steps)" if status == Status.FINISHED else ""
    resume = f"--resume {run_dir} --set launch.node_rank=R{more} on every node"
    if status not in ACTIVE:
        raise RunDirError(f"{run_dir}: already exists and is {status}: continue it with {resume}, or give a new "
                          f"run another --run-dir")
    if is_lost(run_dir, info):
        raise RunDirError(f"{run_dir}: is lost (its launcher is gone): continue it with {resume}")
    nodes = preset.launch.nnodes
    if preset.launch.node_rank == 0 and info.get("launcher_node_rank") == 0:
        raise RunDirError(f"{run_dir}: node 0 of this run has started already (launcher pid "
                          f"{info.get('launcher_pid')}): give every other node its own rank, "
                          f"--set launch.node_rank=1..{nodes - 1}")


def owns_run_dir(info: dict[str, Any], preset: Preset) -> bool:
    """Whether this node's launcher settles run.json (see :meth:`torch_handle.launch.supervisor.Launch.owns_run_info`): on
    one node always; on several, node 0, or the node recorded as its launcher (its own directory)."""
    launch = preset.launch
    return launch.nnodes == 1 or launch.node_rank == 0 or info.get("launcher_node_rank") == launch.node_rank
