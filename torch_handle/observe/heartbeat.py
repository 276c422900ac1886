"""Per-rank heartbeats: what each worker is doing, and whether it still moves.

Each rank writes ``RUN_DIR/heartbeats/rank<R>.json`` (atomically, by ``os.replace``) from a daemon thread every
:func:`beat_interval` seconds: ``rank``, ``local_rank``, ``node_rank``, ``pid``, ``create_time``, ``host``,
``thread_id`` (the main thread's ``threading.get_ident()``), ``stacks`` (its faulthandler file), ``progress`` (a
counter), ``step`` (optimizer steps done), ``phase`` (what the main thread is doing: ``import``, ``init``,
``data``, ``build``, ``peak``, ``resume``, ``eval``, ``train_step``, ``checkpoint``, ``export``, ``close``),
``busy``, ``time`` (unix s of this write) and ``progress_time`` (unix s of the last advance). The main thread
only sets plain attributes (:func:`beat`, a few hundred nanoseconds); ``progress`` advances when the main thread
calls :func:`beat`, so a rank blocked in a collective (or in anything else) shows no progress. A phase entered
with ``busy=True`` (:func:`busy`) is local work that needs no peer -- importing torch, the tokenizer built by
local rank 0 while the others wait, rank 0's matmul peak measurement -- and advances ``progress`` on every write
while it lasts; so does a main thread that is importing a module and has moved since the last write (an import
is local work too). Each rank writes into its own node's run directory.

Each worker also registers ``faulthandler.register(SIGUSR1, all_threads=True)`` writing to
``RUN_DIR/logs/rank<R>.stacks`` before its first heartbeat, so any process named in a heartbeat file answers
SIGUSR1 with its Python stacks (:mod:`torch_handle.observe.stacks`; a process that has not registered would be
killed by SIGUSR1: only pids from heartbeat files, checked against their start time, are ever signalled).

Readers (:class:`RankBeat`, :func:`read_heartbeats`, :func:`live_beats`): the launcher's hang detection
(:mod:`torch_handle.launch.hang`) and ``handle stacks``. Standard library and psutil only.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from torch_handle.common.fsio import write_json_atomic

HEARTBEATS_DIR = "heartbeats"


# ---------------------------------------------------------------------------------------------------------------
# worker side: writing
# ---------------------------------------------------------------------------------------------------------------


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / HEARTBEATS_DIR / f"rank{rank}.json"


def stack_file(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank``'s faulthandler writes its stacks on SIGUSR1 (appended, one dump after another)."""
    return Path(run_dir) / "logs" / f"rank{rank}.stacks"


def beat_interval(hang_timeout_s: float) -> float:
    """Seconds between two heartbeat writes: a fifth of the hang timeout, between 0.2 and 2 s (so a stall is
    seen at most ``hang_timeout_s`` + this + the launcher's 0.5 s read interval after the last progress)."""
    return min(2.0, max(0.2, hang_timeout_s / 5))


class Heartbeat:
    """One rank's heartbeat file and stack-dump handler (see the module docstring).

    ``start()`` registers faulthandler for SIGUSR1 on ``logs/rank<R>.stacks``, writes the first beat and starts
    the writer thread; the main thread then calls :meth:`beat` (or the module's :func:`beat`). Writing never
    raises: a full disk must not stop the run (the watchdog then sees no progress from this rank).
    """

    def __init__(self, run_dir: Path, rank: int, local_rank: int = 0, node_rank: int = 0, interval_s: float = 2.0):
        self.run_dir, self.rank, self.local_rank, self.node_rank = Path(run_dir), rank, local_rank, node_rank
        self.path = heartbeat_path(run_dir, rank)
        self.interval_s = interval_s
        self.progress = 0
        self.step = 0
        self.phase = "start"
        self.busy_phase = False
        self.progress_time = time.time()
        self._busy_ticks = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stacks = None
        self._static: dict[str, Any] = {}
        self._main_ident = threading.main_thread().ident
        self._last_frame: tuple[Any, ...] | None = None

    def start(self) -> "Heartbeat":
        import psutil

        self.path.parent.mkdir(parents=True, exist_ok=True)
        stacks = stack_file(self.run_dir, self.rank)
        stacks.parent.mkdir(parents=True, exist_ok=True)
        self._stacks = open(stacks, "a", encoding="utf-8")  # kept open: faulthandler writes to its fd
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True, chain=False)
        self._static = {"rank": self.rank, "local_rank": self.local_rank, "node_rank": self.node_rank,
                        "pid": os.getpid(), "create_time": psutil.Process().create_time(),
                        "host": socket.gethostname(), "thread_id": threading.main_thread().ident,
                        "stacks": str(stacks.relative_to(self.run_dir))}
        self.write()
        self._thread = threading.Thread(target=self._run, name="handle-heartbeat", daemon=True)
        self._thread.start()
        return self

    def beat(self, phase: str | None = None, step: int | None = None, busy: bool = False) -> None:
        """Progress on the main thread: advance the counter; ``phase``/``step`` replace the current ones (a phase
        given without ``busy`` is not busy)."""
        self.progress += 1
        self.progress_time = time.time()
        if phase is not None:
            self.phase, self.busy_phase = phase, busy
        if step is not None:
            self.step = step

    def snapshot(self) -> dict[str, Any]:
        return {**self._static, "progress": self.progress + self._busy_ticks, "step": self.step,
                "phase": self.phase, "busy": self.busy_phase, "time": round(time.time(), 3),
                "progress_time": round(self.progress_time, 3)}

    def write(self) -> None:
        try:
            write_json_atomic(self.path, self.snapshot(), indent=None)
        except OSError:
            pass

    def _importing(self) -> bool:
        """Whether the main thread is importing and has moved since the last look: its stack goes through
        ``importlib``'s ``_find_and_load`` and its innermost frame (or line) changed. Imports are local work
        (torch's lazy ``torch._dynamo`` import inside DDP's constructor takes seconds on a loaded machine); a stuck
        import does not move, so it still counts as a stall."""
        frame = sys._current_frames().get(self._main_ident) if self._main_ident is not None else None
        if frame is None:
            return False
        key = (id(frame), frame.f_code, frame.f_lineno)
        moved, self._last_frame = key != self._last_frame, key
        depth = 0
        while moved and frame is not None and depth < 500:
            if frame.f_code.co_name == "_find_and_load":
                return True
            frame, depth = frame.f_back, depth + 1
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            # declared local work, or an import that moves: the main thread computes, it waits for no peer
            if self.busy_phase or self._importing():
                self._busy_ticks += 1
                self.progress_time = time.time()
            self.write()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the writer thread and wait up to ``timeout_s`` for it: a write in progress completes, so an exiting
        process (``os._exit`` ends daemon threads wherever they are) leaves no temporary file behind."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


_current: Heartbeat | None = None


def start_heartbeat(run_dir: Path, rank: int, local_rank: int = 0, node_rank: int = 0,
                    interval_s: float = 2.0) -> Heartbeat:
    """Start this process's heartbeat (phase ``import``, busy); :func:`beat` and :func:`busy` then report to it."""
    global _current
    hb = Heartbeat(run_dir, rank, local_rank, node_rank, interval_s)
    hb.phase, hb.busy_phase = "import", True
    _current = hb.start()
    return hb


def current() -> Heartbeat | None:
    return _current


def beat(phase: str | None = None, step: int | None = None, busy: bool = False) -> None:
    """:meth:`Heartbeat.beat` of this process's heartbeat; nothing without one (tests, benchmarks)."""
    if _current is not None:
        _current.beat(phase, step, busy)


@contextlib.contextmanager
def busy(phase: str) -> Iterator[None]:
    """A stretch of local work that needs no peer (progress advances on every heartbeat while it lasts); the
    previous phase is restored (not busy) after it."""
    hb = _current
    if hb is None:
        yield
        return
    previous = hb.phase
    hb.beat(phase, busy=True)
    try:
        yield
    finally:
        hb.beat(previous)


# ---------------------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RankBeat:
    """One rank's heartbeat file as read (see the module docstring for the fields)."""

    rank: int
    pid: int
    create_time: float
    host: str
    progress: int
    step: int = 0
    phase: str = "?"
    local_rank: int = 0
    node_rank: int = 0
    thread_id: int | None = None
    time: float = 0.0
    progress_time: float = 0.0
    stacks: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RankBeat":
        """Raises ValueError/TypeError/KeyError for a file that is not a heartbeat."""
        return cls(rank=int(data["rank"]), pid=int(data["pid"]), create_time=float(data["create_time"]),
                   host=str(data.get("host", "")), progress=int(data["progress"]), step=int(data.get("step") or 0),
                   phase=str(data.get("phase") or "?"), local_rank=int(data.get("local_rank") or 0),
                   node_rank=int(data.get("node_rank") or 0),
                   thread_id=int(data["thread_id"]) if data.get("thread_id") is not None else None,
                   time=float(data.get("time") or 0.0), progress_time=float(data.get("progress_time") or 0.0),
                   stacks=str(data.get("stacks") or ""))

    def local(self) -> bool:
        return self.host == socket.gethostname()

    def alive(self) -> bool:
        """On this host, running (not a zombie), and the very process that wrote the file (same start time)."""
        import psutil

        if not self.local():
            return False
        try:
            p = psutil.Process(self.pid)
            return abs(p.create_time() - self.create_time) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def read_heartbeats(run_dir: Path) -> dict[int, RankBeat]:
    """rank -> its heartbeat, for every readable ``heartbeats/rank<R>.json`` (unreadable ones are skipped: a
    writer's ``os.replace`` never leaves half a file, a foreign file is not a heartbeat)."""
    out: dict[int, RankBeat] = {}
    directory = Path(run_dir) / HEARTBEATS_DIR
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if not re.fullmatch(r"rank\d+\.json", name):
            continue
        try:
            beat_ = RankBeat.from_json(json.loads((directory / name).read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError, KeyError):
            continue
        out[beat_.rank] = beat_
    return out


REMOTE_FRESH_S = 30.0
"""A heartbeat written on another host counts as live when it is younger than this (seconds)."""


def live_beats(run_dir: Path, now: float | None = None) -> tuple[list[RankBeat], list[RankBeat]]:
    """``(local, remote)``: the heartbeats whose process is alive on this host, and the fresh ones written on
    another host (a run directory on a shared filesystem); stale files of ended processes are left out."""
    now = time.time() if now is None else now
    local, remote = [], []
    for b in read_heartbeats(run_dir).values():
        if not b.local():
            if now - b.time < REMOTE_FRESH_S:
                remote.append(b)
        elif b.alive():
            local.append(b)
    return local, remote
