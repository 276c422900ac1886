"""The run directory: what a run wrote, readable by the CLI, the dashboard and a resumed run.

    runs/<name>-<UTC timestamp>/
        preset.toml     the fully resolved preset (what actually ran)
        run.json        status, strategy, world size, pids, times, restarts, resumes
        .run.json.lock  empty; its flock serializes the writers of run.json (:func:`run_info_lock`)
        heartbeat       touched every few seconds by the launcher(s) (and rank 0) while the run is alive
        events.jsonl    rank-0 telemetry (names: torch_handle.observe.fields; written by torch_handle.observe.telemetry)
        heartbeats/     rank<R>.json: each rank's progress counter, step and phase (torch_handle.observe.heartbeat)
        logs/           rank<N>.log per rank, launcher.log for torchrun itself (launcher-node<R>.log: node R),
                        stacks-<UTC time>.txt from the hang watchdog or `handle stacks`
        checkpoints/    step-<N>/ written atomically, newest complete one wins
        tokenizer.json  the BPE tokenizer the run used
        model.safetensors, tensorboard/, traces/

No torch import here.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from torch_handle.common.fsio import read_json_object, write_json_atomic
from torch_handle.common.testhooks import RUN_INFO_DELAY_ENV, parse_seconds
from torch_handle.errors import RunDirError

log = logging.getLogger(__name__)


class RunDirExists(RunDirError):
    """The run directory asked for (``--run-dir``) exists already."""

PRESET_FILE = "preset.toml"
RUN_FILE = "run.json"
LOCK_FILE = ".run.json.lock"
"""Hidden, empty, created by the first write of run.json after the run directory: :func:`run_info_lock`."""
LOCK_TIMEOUT_S = 30.0
"""How long a writer of run.json waits for the lock before it writes without it (logged; see :func:`run_info_lock`)."""
STOP_FILE = "STOP"
"""Created by ``handle run`` on the first Ctrl-C: the workers finish the step, checkpoint and exit."""
HEARTBEAT_FILE = "heartbeat"
"""Its mtime is the last sign of life of the launcher (every :data:`HEARTBEAT_S`) or of rank 0 (every step)."""
HEARTBEAT_S = 2.0
LOST_AFTER_S = 10.0
"""A run whose run.json says it is active, whose launcher is gone and whose heartbeat is older than this
(seconds) is lost: killed without a chance to record it (``kill -9``, a reboot)."""
ACTIVE = ("starting", "running", "restarting", "restarted")
"""Statuses of run.json that claim a live launcher (the values of ``torch_handle.observe.fields.Status``)."""


def touch_heartbeat(run_dir: Path) -> None:
    """Set the mtime of ``RUN_DIR/heartbeat`` to now (best effort: a full disk must not stop the run)."""
    try:
        (Path(run_dir) / HEARTBEAT_FILE).touch()
    except OSError:
        pass


def launcher_alive(info: dict[str, Any]) -> bool:
    """Whether the launcher recorded in run.json (``launcher_pid``, ``launcher_create_time``) still runs; a
    reused pid (another start time) or a zombie counts as gone."""
    import psutil

    pid = info.get("launcher_pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return False
    try:
        p = psutil.Process(pid)
        created = info.get("launcher_create_time")
        if isinstance(created, (int, float)) and abs(p.create_time() - created) > 1.0:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_lost(run_dir: Path, info: dict[str, Any], now: float | None = None) -> bool:
    """True when run.json says the run is active but nothing keeps it: the launcher is gone and the heartbeat
    (or, without one, run.json) is older than :data:`LOST_AFTER_S` seconds. False without a recorded launcher."""
    if info.get("status") not in ACTIVE or not isinstance(info.get("launcher_pid"), int):
        return False
    now = time.time() if now is None else now
    beats = []
    for name in (HEARTBEAT_FILE, RUN_FILE):
        try:
            beats.append((Path(run_dir) / name).stat().st_mtime)
        except OSError:
            pass
    if beats and now - max(beats) < LOST_AFTER_S:
        return False
    return not launcher_alive(info)


def read_run_status(run_dir: Path) -> dict[str, Any]:
    """:func:`read_run_info` with ``status`` ``"lost"`` for a lost run (:func:`is_lost`); for displays.

    Raises:
        RunDirError: when ``run_dir`` is not a run directory.
    """
    info = read_run_info(run_dir)
    if is_lost(run_dir, info):
        info["status"] = "lost"
    return info



def read_run_info(run_dir: Path) -> dict[str, Any]:
    """The contents of ``run.json``.

    Raises:
        RunDirError: when ``run_dir`` is not a run directory.
    """
    path = Path(run_dir) / RUN_FILE
    if not Path(run_dir).is_dir():
        what = "no such directory" if not Path(run_dir).exists() else "not a directory"
        raise RunDirError(f"{run_dir}: not a run directory ({what})")
    try:
        return read_json_object(path, RunDirError)
    except FileNotFoundError:
        raise RunDirError(f"{run_dir}: not a run directory (no {RUN_FILE})") from None


_held = threading.local()
"""The run directories whose lock this thread holds (``paths``): a nested :func:`run_info_lock` does not wait for
itself."""


@contextlib.contextmanager
def run_info_lock(run_dir: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold the exclusive lock of ``run_dir``'s run.json writers: ``flock(LOCK_EX)`` on ``.run.json.lock``
    (:data:`LOCK_FILE`, created here when missing). Every read-modify-write of run.json happens under it
    (:func:`modify_run_info`); readers need none, since each write replaces run.json atomically.

    Why: run.json has several writers, each reading it, changing some fields and writing it back whole. Without
    the lock one writer's update can silently undo another's. Seen: a resumed run's launcher promotes the resume
    (:func:`torch_handle.checkpoint.resume.promote`, at the first step event it polls) while rank 0 finishes. The
    launcher read run.json (status ``running``, the resumed worker's ``train_start_time``, ``end_time`` None and the
    ``step`` of the run it continues: 6 in test_pipeline_checkpoint's copy), then rank 0 wrote its closing update
    (``finished``, ``end_time``, ``step``), then the launcher wrote its stale copy with the ``resumes`` entry over
    it: the closing update was gone, and after torchrun exited 0 the launcher found a non-final status and
    settled the run ``failed`` ("torchrun exited with code 0"). The other order loses the launcher's update
    instead (the ``resumes`` entry, and ``resume_pending`` stays).

    The lock is an advisory ``flock``, released by the kernel when its holder exits or dies (no stale lock is
    left), reentrant within a thread, and best effort: where the filesystem cannot lock (``ENOLCK``,
    ``EOPNOTSUPP``: Lustre without ``-o flock``) or the lock file cannot be created, or the lock is not free
    within ``timeout_s`` (default :data:`LOCK_TIMEOUT_S`), the writer goes on without it, as before, and logs
    why. On NFS, Linux emulates flock with byte-range locks that hold across clients (not with
    ``local_lock=flock``, where they hold per node). A shared multi-node run directory has all its writers on node
    0 anyway (its launcher and global rank 0), so a node-local lock serializes them too.

    Raises:
        Nothing of its own; the body's exceptions pass through.
    """
    key = os.path.abspath(run_dir)
    held = _held.__dict__.setdefault("paths", set())
    if key in held:
        yield
        return
    fd = _acquire(Path(run_dir), LOCK_TIMEOUT_S if timeout_s is None else timeout_s)
    held.add(key)
    try:
        yield
    finally:
        held.discard(key)
        if fd is not None:
            os.close(fd)  # releases the flock


def _acquire(run_dir: Path, timeout_s: float) -> int | None:
    """An open descriptor of ``run_dir``'s lock file holding ``LOCK_EX``, or None (logged) when it cannot be had."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        log.warning("%s: run.json written without its lock (%s)", run_dir, e.strerror or e)
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.002)
                continue
            why = f"still held by another writer after {timeout_s:g} s"
        except OSError as e:
            why = e.strerror or str(e)
        log.warning("%s: run.json written without its lock (%s)", run_dir, why)
        os.close(fd)
        return None


def modify_run_info(run_dir: Path, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> dict[str, Any]:
    """Read run.json, ``change`` it and write it back, all under :func:`run_info_lock`: no other writer's update
    between the read and the write is lost. ``change(info)`` gets the current contents and returns the new ones
    (it may change ``info`` and return it), or None to leave run.json as it is. Returns run.json's contents after.

    Raises:
        RunDirError: when ``run_dir`` is not a run directory (nothing is created in it).
        OSError: when run.json cannot be written.
    """
    if not (Path(run_dir) / RUN_FILE).is_file():
        read_run_info(run_dir)  # raises: a path that is no run directory gets no lock file
    with run_info_lock(run_dir):
        info = read_run_info(run_dir)
        new = change(info)
        if new is None:
            return info
        delay = parse_seconds(os.environ.get(RUN_INFO_DELAY_ENV, ""))
        if delay:
            time.sleep(delay)  # tests: widen the window a lost update needs (the lock closes it)
        write_json_atomic(Path(run_dir) / RUN_FILE, new)
        return new


def update_run_info(run_dir: Path, **fields: Any) -> dict[str, Any]:
    """Set ``fields`` in run.json (:func:`modify_run_info`); returns its contents after.

    Raises:
        RunDirError: when ``run_dir`` is not a run directory.
        OSError: when run.json cannot be written.
    """
    return modify_run_info(run_dir, lambda info: {**info, **fields})


def utc_stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")


def output_dir_problem(output_dir: Path) -> str | None:
    """Why runs cannot be created under ``output_dir`` (a file; under a file; an existing ancestor that is not
    writable), found without creating anything; None when they can."""
    output_dir = Path(output_dir)
    if output_dir.exists():
        if not output_dir.is_dir():
            return f"{output_dir}: output directory is a file, not a directory (set [run] output_dir)"
        return None if os.access(output_dir, os.W_OK | os.X_OK) else f"{output_dir}: output directory is not writable"
    ancestor = next(a for a in output_dir.absolute().parents if a.exists())
    if not ancestor.is_dir():
        return f"{output_dir}: cannot create output directory (Not a directory)"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{output_dir}: cannot create output directory (Permission denied)"
    return None


def create_run_dir(output_dir: Path, name: str, preset_toml: str, info: dict[str, Any],
                   run_dir: Path | None = None) -> Path:
    """Create a run directory with ``preset.toml`` and ``run.json`` in one step.

    Everything is written into a hidden temporary directory that is renamed into place, so a failure leaves
    nothing half-written. Two runs started in the same second get distinct names.

    Raises:
        RunDirError: when the output directory cannot be written or ``run_dir`` exists already.
    """
    output_dir = Path(output_dir)
    if problem := output_dir_problem(output_dir):
        raise RunDirError(problem)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"{output_dir}: cannot create output directory ({e.strerror or e})") from None
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise RunDirError(f"{output_dir}: output directory is not writable")
    if run_dir is not None and Path(run_dir).exists():
        raise RunDirExists(f"{run_dir}: already exists; use --resume {run_dir} to continue it")
    tmp = Path(output_dir) / f".tmp-{name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        tmp.mkdir()
        (tmp / "logs").mkdir()
        (tmp / "checkpoints").mkdir()
        (tmp / PRESET_FILE).write_text(preset_toml, encoding="utf-8")
        write_json_atomic(tmp / RUN_FILE, info)
        if run_dir is not None:
            Path(run_dir).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(tmp, run_dir)  # atomic: of two launchers creating one directory, one wins
            except OSError:
                if not Path(run_dir).exists():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
                raise RunDirExists(f"{run_dir}: already exists; use --resume {run_dir} to continue it") from None
            return Path(run_dir)
        base = output_dir / f"{name}-{utc_stamp()}"
        for i in range(1000):
            target = base if i == 0 else base.with_name(f"{base.name}-{i}")
            try:
                os.rename(tmp, target)  # atomic, and fails if target exists and is not empty
                return target
            except OSError:
                if not target.exists():
                    raise
        raise RunDirError(f"{output_dir}: too many runs named {base.name}")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RunDirError(f"{output_dir}: cannot write run directory ({e.strerror or e})") from None


def launcher_record(node_rank: int = 0) -> dict[str, Any]:
    """run.json's fields that name this process as the run's launcher (``launcher_pid``, its create time, and the
    ``launcher_node_rank`` of a multi-node run: which node's launcher settles run.json)."""
    import psutil

    return {"launcher_pid": os.getpid(), "launcher_create_time": psutil.Process().create_time(),
            "launcher_node_rank": node_rank}


def list_runs(output_dir: Path) -> list[Path]:
    """Run directories under ``output_dir``, oldest first (by start time in run.json, else mtime)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    runs = [p for p in output_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / RUN_FILE).exists()]

    def started(p: Path) -> float:
        try:
            return float(read_run_info(p).get("start_time") or 0)
        except RunDirError:
            return p.stat().st_mtime

    return sorted(runs, key=lambda p: (started(p), p.name))


def newest_run(output_dir: Path) -> Path | None:
    runs = list_runs(output_dir)
    return runs[-1] if runs else None
