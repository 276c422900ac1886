"""When a run hangs: per-rank heartbeats, the launcher's watchdog, and the Python stacks of live workers.

Heartbeats (worker side, :class:`Heartbeat`). Each rank writes ``RUN_DIR/heartbeats/rank<R>.json`` (atomically,
by ``os.replace``) from a daemon thread every :func:`beat_interval` seconds: ``rank``, ``local_rank``,
``node_rank``, ``pid``, ``create_time``, ``host``, ``thread_id`` (the main thread's ``threading.get_ident()``),
``progress`` (a counter), ``step`` (optimizer steps done), ``phase`` (what the main thread is doing: ``import``,
``init``, ``data``, ``build``, ``peak``, ``resume``, ``eval``, ``train_step``, ``checkpoint``, ``export``,
``close``), ``busy``, ``time`` (unix s of this write) and ``progress_time`` (unix s of the last advance). The
main thread only sets plain attributes (:func:`beat`, a few hundred nanoseconds); ``progress`` advances when the
main thread calls :func:`beat`, so a rank blocked in a collective (or in anything else) shows no progress. A
phase entered with ``busy=True`` (:func:`busy`) is local work that needs no peer -- importing torch, the tokenizer
built by local rank 0 while the others wait, rank 0's matmul peak measurement -- and advances ``progress`` on
every write while it lasts; so does a main thread that is importing a module and has moved since the last write
(an import is local work too). Each rank writes into its own node's run directory.

Each worker also registers ``faulthandler.register(SIGUSR1, all_threads=True)`` writing to
``RUN_DIR/logs/rank<R>.stacks`` before its first heartbeat, so any process named in a heartbeat file answers
SIGUSR1 with its Python stacks (a process that has not registered would be killed by SIGUSR1: only pids from
heartbeat files, checked against their start time, are ever signalled).

The watchdog (launcher side, :class:`HangWatchdog`): when no local rank's ``progress`` has changed for
``launch.hang_timeout_s`` seconds, the launcher takes every local rank's stacks (:func:`take_stacks`: ``py-spy
dump --native`` when ``py-spy`` is on PATH, for native frames too, else SIGUSR1 and the faulthandler file) into
``logs/stacks-<UTC time>.txt``, names where each rank waits (:func:`waiting_point`: ``rank 0 in all_reduce
(trainer.py:262 train_step)``), and appends a ``hang`` event to ``events.jsonl`` (:func:`append_event`). It fires
once per stall and again only after some rank advanced. ``handle stacks RUN`` takes the same dump on demand
(:func:`live_beats` + :func:`take_stacks`).

NCCL's flight recorder (:func:`flight_recorder_env`): the launcher sets its environment variables for the workers
unless the user set them, so a collective timeout (``launch.timeout_s``) dumps each rank's recent collectives to
``RUN_DIR/logs/nccl_trace_rank_<R>``, and a hang seen by the watchdog asks for the same dump through the
per-rank pipe ``logs/nccl_trace_rank_<R>.pipe`` (:func:`trigger_flight_recorder`).

Standard library and psutil only: no torch, no UI library.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import linecache
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from torch_handle.common.fsio import write_json_atomic, write_text_atomic

HEARTBEATS_DIR = "heartbeats"
STACKS_PREFIX = "stacks-"
PY_SPY_ENV = "HANDLE_PY_SPY"
"""``0`` keeps the stack dumps on faulthandler even when ``py-spy`` is on PATH."""
FLIGHT_RECORDER_ENTRIES = 2000
"""``TORCH_NCCL_TRACE_BUFFER_SIZE``: collectives kept per rank in the ring buffer (PyTorch's recommended value)."""
FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"


# ---------------------------------------------------------------------------------------------------------------
# worker side: the heartbeat
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

    def stop(self) -> None:
        self._stop.set()


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
# launcher side: reading heartbeats, deciding
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


@dataclass
class Stall:
    """What :meth:`HangWatchdog.observe` returns when it fires."""

    stalled_s: float
    """Seconds since the last local rank advanced."""
    ranks: list[RankBeat]


class HangWatchdog:
    """Decides when the local ranks hang: none of them has advanced (another ``progress`` value, or another
    process for the rank) for ``timeout_s`` seconds of ``clock``.

    ``observe(beats)`` is called with the live local ranks' heartbeats, as often as one likes; it returns a
    :class:`Stall` once per stall (the first call at or past the timeout) and None otherwise. A rank seen for the
    first time counts as an advance; a rank that is gone is forgotten; with no rank at all nothing is decided.
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s, self.clock = timeout_s, clock
        self._last: dict[int, tuple[tuple[int, float, int], float]] = {}
        self._fired = False

    def observe(self, beats: Iterable[RankBeat]) -> Stall | None:
        now = self.clock()
        beats = list(beats)
        current = {b.rank: b for b in beats}
        for rank in [r for r in self._last if r not in current]:
            del self._last[rank]
        advanced = False
        for rank, b in current.items():
            key = (b.pid, b.create_time, b.progress)
            prev = self._last.get(rank)
            if prev is None or prev[0] != key:
                self._last[rank] = (key, now)
                advanced = True
        if advanced or not self._last:
            self._fired = False
        if not self._last:
            return None
        stalled = now - max(t for _, t in self._last.values())
        if stalled >= self.timeout_s and not self._fired:
            self._fired = True
            return Stall(stalled, sorted(beats, key=lambda b: b.rank))
        return None

    def last_advance(self) -> float | None:
        """``clock()`` time of the newest advance of any watched rank (None before any)."""
        return max((t for _, t in self._last.values()), default=None)


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


def stacks_of_run(run_dir: Path, timeout_s: float = 3.0) -> "StacksReport":
    """``handle stacks``: the stacks of every live rank of the running ``run_dir`` on this host, into a new
    ``logs/stacks-<time>.txt``.

    Raises:
        RunDirError: ``run_dir`` is not a run directory, is not running, or has no live worker on this host.
    """
    from torch_handle.errors import RunDirError
    from torch_handle.rundir import ACTIVE, read_run_status

    info = read_run_status(run_dir)
    status = info.get("status")
    if status not in ACTIVE:
        raise RunDirError(f"{run_dir}: not running (status {status}); stacks come from the workers of a live run")
    local, remote = live_beats(run_dir)
    if not local:
        where = f"; its ranks run on {', '.join(sorted({b.host for b in remote}))}" if remote else ""
        raise RunDirError(f"{run_dir}: no live worker on this host yet (no heartbeat in {HEARTBEATS_DIR}/ "
                          f"of a running process){where}")
    try:
        return take_stacks(run_dir, local, "on demand (handle stacks)", remote=remote, timeout_s=timeout_s)
    except OSError as e:
        raise RunDirError(f"{run_dir}/logs: cannot write the stacks file ({e.strerror or e})") from None


# ---------------------------------------------------------------------------------------------------------------
# stacks: parsing and summarising
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Frame:
    file: str
    line: int
    func: str

    @property
    def python(self) -> bool:
        """A Python frame (py-spy ``--native`` adds C/C++ frames: no ``.py`` file, often line 0)."""
        return self.file.endswith(".py") or self.file.startswith("<")

    @property
    def short(self) -> str:
        return f"{Path(self.file).name}:{self.line}"

    def source(self) -> str:
        """The frame's source line, read here (the run's files are on this host), or ``""``."""
        return linecache.getline(self.file, self.line).strip() if self.python and self.line > 0 else ""


@dataclass
class ThreadStack:
    ident: int | None
    """``threading.get_ident()`` of the thread (faulthandler's and py-spy's thread id)."""
    frames: list[Frame]
    """Innermost first."""
    name: str = ""
    current: bool = False
    """faulthandler's "Current thread": the one that took the signal."""


_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[(.*?)\])?.*\(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str) -> list[ThreadStack]:
    """The threads of one ``faulthandler`` dump (``Thread 0x... (most recent call first):`` blocks of
    ``File "F", line N in FUNC`` lines); lines it does not know (``...``, ``<no Python frame>``) are skipped."""
    threads: list[ThreadStack] = []
    for line in text.splitlines():
        if m := _FH_THREAD.match(line):
            threads.append(ThreadStack(int(m.group(2), 16), [], name=m.group(3) or "",
                                       current=m.group(1) == "Current thread"))
        elif (m := _FH_FRAME.match(line)) and threads:
            threads[-1].frames.append(Frame(m.group(1), int(m.group(2)), m.group(3).strip()))
    return threads


def parse_py_spy_json(text: str) -> list[ThreadStack]:
    """The threads of ``py-spy dump --json`` (a list of traces: ``thread_id``, ``thread_name``, ``frames`` with
    ``name``, ``filename``, ``line``, innermost first).

    Raises:
        ValueError: when ``text`` is not such a list.
    """
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("py-spy --json: expected a list of stack traces")
    threads = []
    for trace in data:
        if not isinstance(trace, dict):
            continue
        frames = [Frame(str(f.get("filename") or f.get("module") or "?"), int(f.get("line") or 0),
                        str(f.get("name") or "?")) for f in trace.get("frames") or [] if isinstance(f, dict)]
        ident = trace.get("thread_id")
        threads.append(ThreadStack(int(ident) if isinstance(ident, int) else None, frames,
                                   name=str(trace.get("thread_name") or "")))
    return threads


def main_thread(threads: list[ThreadStack], thread_id: int | None) -> ThreadStack | None:
    """The main thread: the one with ``thread_id`` (from the heartbeat), else the one named ``MainThread``, else
    the one whose outermost frame is a module's top level, else the first."""
    for t in threads:
        if thread_id is not None and t.ident == thread_id:
            return t
    for t in threads:
        if t.name == "MainThread":
            return t
    for t in threads:
        py = [f for f in t.frames if f.python]
        if py and py[-1].func == "<module>":
            return t
    return threads[0] if threads else None


_LIBRARY = re.compile(r"[/\\](site-packages|dist-packages)[/\\]|[/\\]lib[/\\]python\d[\d.]*[/\\]|^<frozen ")
_OWN = re.compile(r"[/\\](torch_handle|handle_plugins|handle_cli)[/\\]")
_COLLECTIVE_FILES = re.compile(r"torch[/\\]distributed[/\\]distributed_c10d\.py$|deepspeed[/\\]comm[/\\]\w+\.py$")
_CALL = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
_KEYWORDS = {"if", "elif", "while", "for", "with", "return", "yield", "assert", "not", "and", "or", "in", "print",
             "lambda", "await", "del", "raise", "except"}
_WRAPPERS = {"wrapper", "log_wrapper", "inner", "wrapped", "decorated", "_fn"}
"""Decorators' inner functions (``c10d_logger``, ``deepspeed.comm.timed_op``): never the collective's name."""


def is_user_frame(frame: Frame) -> bool:
    """The run's own code (torch_handle, its plugins, a user's script), not a library or the standard library."""
    return frame.python and (bool(_OWN.search(frame.file)) or not _LIBRARY.search(frame.file))


def call_on_line(source: str) -> str:
    """The first call on a source line: ``time.sleep`` for ``time.sleep(self.hang_s)  # ...``; ``""`` without."""
    for m in _CALL.finditer(source.split("#", 1)[0]):
        if m.group(1) not in _KEYWORDS:
            return m.group(1)
    return ""


def waiting_point(frames: list[Frame], source: Callable[[Frame], str] = Frame.source) -> tuple[str, Frame | None]:
    """Where a thread waits: ``(call, frame)``.

    ``frame`` is the innermost frame of the run's own code (:func:`is_user_frame`; the innermost Python frame when
    there is none). ``call`` is what it waits in: the collective when a ``torch.distributed`` (or
    ``deepspeed.comm``) API is on the stack -- its outermost such frame, i.e. the call the run's code made
    (``all_reduce``, ``barrier``, ``all_gather_object``); else, when the run's own frame is the innermost Python
    frame, the first call on its source line (a C function such as ``time.sleep`` leaves no Python frame of its
    own); else the function that the run's code called (``backward``). ``("?", None)`` without Python frames.
    """
    py = [f for f in frames if f.python]
    if not py:
        return "?", None
    own = next((i for i, f in enumerate(py) if is_user_frame(f)), None)
    where = py[own] if own is not None else py[0]
    collectives = [i for i, f in enumerate(py) if _COLLECTIVE_FILES.search(f.file) and (own is None or i < own)
                   and f.func.rsplit(".", 1)[-1] not in _WRAPPERS]  # py-spy: qualified "timed_op.<locals>.log_wrapper"
    if collectives:
        return py[max(collectives)].func, where
    if own == 0 or own is None:
        return (call_on_line(source(where)) or where.func), where
    return py[own - 1].func, where


def describe(rank: int, frames: list[Frame], source: Callable[[Frame], str] = Frame.source) -> str:
    """``rank 1 in time.sleep (trainer.py:240 train_step)``; ``rank 1: no Python frames`` without."""
    call, where = waiting_point(frames, source)
    if where is None:
        return f"rank {rank}: no Python frames"
    return f"rank {rank} in {call} ({where.short} {where.func})"


# ---------------------------------------------------------------------------------------------------------------
# stacks: taking them
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RankStacks:
    """One rank's dump: where it came from and its threads."""

    beat: RankBeat
    source: str = ""
    """``py-spy`` | ``faulthandler`` | ``""`` (no dump)."""
    threads: list[ThreadStack] = field(default_factory=list)
    raw: str = ""
    error: str = ""

    @property
    def main(self) -> ThreadStack | None:
        return main_thread(self.threads, self.beat.thread_id)

    @property
    def summary(self) -> str:
        if self.main is None:
            return f"rank {self.beat.rank}: no stacks ({self.error or 'empty dump'})"
        return describe(self.beat.rank, self.main.frames)

    def to_json(self) -> dict[str, Any]:
        main = self.main
        call, where = waiting_point(main.frames) if main else ("?", None)
        return {"rank": self.beat.rank, "pid": self.beat.pid, "host": self.beat.host, "step": self.beat.step,
                "phase": self.beat.phase, "source": self.source, "call": call if where else None,
                "where": f"{where.short} {where.func}" if where else None, "summary": self.summary,
                "error": self.error or None}


def py_spy_path() -> str | None:
    """``py-spy`` on PATH, unless ``HANDLE_PY_SPY=0``."""
    if os.environ.get(PY_SPY_ENV, "").strip() == "0":
        return None
    return shutil.which("py-spy")


def _py_spy_dumps(beats: list[RankBeat], exe: str, timeout_s: float) -> dict[int, tuple[str, str]]:
    """rank -> (JSON text, error) from ``py-spy dump --pid P --json --native`` (again without ``--native`` where
    that failed), all ranks at once."""
    out: dict[int, tuple[str, str]] = {}
    for native in (True, False):
        todo = [b for b in beats if b.rank not in out or (out[b.rank][1] and native is False)]
        if not todo:
            break
        procs = {b.rank: subprocess.Popen([exe, "dump", "--pid", str(b.pid), "--json", *(["--native"] * native)],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for b in todo}
        for rank, p in procs.items():
            try:
                stdout, stderr = p.communicate(timeout=timeout_s)
                lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
                # the message, not the Rust backtrace that may follow it
                err = "" if p.returncode == 0 else next((ln for ln in lines if ln.lower().startswith("error")),
                                                        lines[0] if lines else f"exit code {p.returncode}")
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                stdout, err = "", f"no answer within {timeout_s:.0f} s"
            out[rank] = (stdout, err)
    return out


def _faulthandler_dumps(run_dir: Path, beats: list[RankBeat], timeout_s: float) -> dict[int, tuple[str, str]]:
    """rank -> (dump text, error): SIGUSR1 to every rank at once, then what each appended to its stacks file
    (complete once it stopped growing for 0.2 s)."""
    files = {b.rank: Path(run_dir) / (b.stacks or stack_file(Path("."), b.rank)) for b in beats}
    start = {}
    for rank, path in files.items():
        try:
            start[rank] = path.stat().st_size
        except OSError:
            start[rank] = 0
    out: dict[int, tuple[str, str]] = {}
    for b in beats:
        try:
            os.kill(b.pid, signal.SIGUSR1)
        except OSError as e:
            out[b.rank] = ("", f"cannot signal pid {b.pid}: {e.strerror or e}")
    last: dict[int, tuple[int, float]] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < len(beats) and time.monotonic() < deadline:
        time.sleep(0.05)
        for b in beats:
            if b.rank in out:
                continue
            try:
                size = files[b.rank].stat().st_size
            except OSError:
                continue
            if size <= start[b.rank]:
                continue
            prev = last.get(b.rank)
            if prev is None or prev[0] != size:
                last[b.rank] = (size, time.monotonic())
            elif time.monotonic() - prev[1] >= 0.2:
                out[b.rank] = (_read_from(files[b.rank], start[b.rank]), "")
    for b in beats:
        if b.rank not in out:
            text = _read_from(files[b.rank], start[b.rank])
            out[b.rank] = (text, "" if text.strip() else f"no answer to SIGUSR1 within {timeout_s:.0f} s")
    return out


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(4 * 1024 * 1024).decode("utf-8", "replace")
    except OSError:
        return ""


def collect_stacks(run_dir: Path, beats: list[RankBeat], *, timeout_s: float = 3.0,
                   py_spy: str | None = None) -> list[RankStacks]:
    """The stacks of every rank in ``beats`` (live local processes), by rank: ``py-spy`` where given and it
    worked, faulthandler (SIGUSR1) for the others."""
    beats = sorted(beats, key=lambda b: b.rank)
    result = {b.rank: RankStacks(b) for b in beats}
    spy_errors: dict[int, str] = {}
    if py_spy:
        for rank, (text, err) in _py_spy_dumps(beats, py_spy, timeout_s=max(timeout_s, 10.0)).items():
            if not err:
                try:
                    result[rank].threads = parse_py_spy_json(text)
                    result[rank].source, result[rank].raw = "py-spy", text
                    continue
                except ValueError as e:
                    err = str(e)
            spy_errors[rank] = f"py-spy failed: {err}"
    rest = [b for b in beats if not result[b.rank].source]
    for rank, (text, err) in _faulthandler_dumps(run_dir, rest, timeout_s).items():
        r = result[rank]
        r.raw, r.threads = text, parse_faulthandler(text)
        r.source = "faulthandler" if r.threads else ""
        r.error = "; ".join(e for e in (spy_errors.get(rank, ""), err) if e)
    return [result[b.rank] for b in beats]


def format_stacks(run_dir: Path, stacks: list[RankStacks], reason: str, *, remote: Iterable[RankBeat] = (),
                  extra: Iterable[str] = ()) -> str:
    """The text of a stacks file: a header (run, time, reason, one summary line per rank), then per rank its
    threads, main thread first, innermost frame first, each frame with its source line."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [f"handle stacks of {run_dir} at {now}", f"reason: {reason}", "",
             *(s.summary for s in stacks),
             *(f"rank {b.rank}: on host {b.host}, not this one (run `handle stacks` there)" for b in remote),
             *extra, ""]
    for s in stacks:
        b = s.beat
        lines.append(f"==== rank {b.rank} (local rank {b.local_rank}, node {b.node_rank}) · pid {b.pid} · "
                     f"host {b.host} · after step {b.step} · phase {b.phase} · {s.source or 'no dump'} ====")
        if s.error:
            lines.append(f"note: {s.error}")
        main = s.main
        ordered = ([main] if main else []) + [t for t in s.threads if t is not main]
        for t in ordered:
            label = "main thread" if t is main else f"thread {t.name}" if t.name else "thread"
            ident = f"0x{t.ident:x}" if t.ident is not None else "?"
            lines.append(f"{label} {ident} (most recent call first):")
            for f in t.frames:
                lines.append(f'  File "{f.file}", line {f.line}, in {f.func}' if f.line else
                             f"  {f.func} ({f.file})")
                if src := f.source():
                    lines.append(f"    {src}")
            lines.append("")
        if not s.threads and s.raw.strip():
            lines += ["raw dump:", s.raw.rstrip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def new_stacks_path(run_dir: Path) -> Path:
    """``logs/stacks-<UTC time>.txt``, with ``-1``, ``-2``... when one of that second exists."""
    logs = Path(run_dir) / "logs"
    base = f"{STACKS_PREFIX}{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"
    for i in range(1000):
        path = logs / (f"{base}.txt" if i == 0 else f"{base}-{i}.txt")
        if not path.exists():
            return path
    raise OSError(f"{logs}: too many stacks files named {base}")


@dataclass
class StacksReport:
    path: Path
    stacks: list[RankStacks]
    remote: list[RankBeat] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "ranks": [s.to_json() for s in self.stacks],
                "remote": [{"rank": b.rank, "host": b.host, "pid": b.pid} for b in self.remote]}


def take_stacks(run_dir: Path, beats: list[RankBeat], reason: str, *, remote: Iterable[RankBeat] = (),
                extra: Iterable[str] = (), timeout_s: float = 3.0) -> StacksReport:
    """Dump the stacks of ``beats`` (live local ranks) into a new ``logs/stacks-<time>.txt``.

    Raises:
        OSError: when the stacks file cannot be written.
    """
    stacks = collect_stacks(run_dir, beats, timeout_s=timeout_s, py_spy=py_spy_path())
    path = new_stacks_path(run_dir)
    remote = list(remote)
    text = format_stacks(Path(run_dir), stacks, reason, remote=remote, extra=extra)
    write_text_atomic(path, text)
    return StacksReport(path, stacks, remote)


# ---------------------------------------------------------------------------------------------------------------
# NCCL flight recorder, the hang event
# ---------------------------------------------------------------------------------------------------------------


def _torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch, from its metadata (no import); (0, 0) when unknown."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        m = re.match(r"(\d+)\.(\d+)", version("torch"))
    except PackageNotFoundError:
        return (0, 0)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


FR_NEW_NAMES = (2, 10)
"""From this torch on, the flight recorder's variables are ``TORCH_FR_BUFFER_SIZE`` and ``TORCH_FR_DUMP_TEMP_FILE``
(the ``TORCH_NCCL_*`` names still work there, with a deprecation warning in every rank's log; older versions
read only those)."""


def flight_recorder_env(run_dir: Path, environ: dict[str, str],
                        torch_version: tuple[int, int] | None = None) -> dict[str, str]:
    """The flight-recorder variables to add to the workers' environment: those the user did not set under either
    name. Read by ProcessGroupNCCL (torch >= 2.5): with gloo they cost a small ring buffer at most.

    - buffer size ``TORCH_FR_BUFFER_SIZE`` (``TORCH_NCCL_TRACE_BUFFER_SIZE`` before torch 2.10) = 2000 entries;
    - ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``: dump when a collective times out (``launch.timeout_s``);
    - dump file prefix ``TORCH_FR_DUMP_TEMP_FILE`` (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``): rank R's dump lands in
      ``RUN_DIR/logs/nccl_trace_rank_R`` (a pickle; ``torchfrtrace --prefix nccl_trace_rank_ RUN_DIR/logs``
      analyses them), not in PyTorch's default under /tmp or ~/.cache/torch;
    - ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``: each rank opens the FIFO ``logs/nccl_trace_rank_R.pipe``; writing to it
      asks for the same dump (:func:`trigger_flight_recorder`, on a hang).

    See PyTorch's "Flight Recorder for Debugging Stuck Jobs" tutorial and its ProcessGroupNCCL environment
    variables page.
    """
    new = (torch_version or _torch_version()) >= FR_NEW_NAMES
    prefix = str(Path(run_dir).resolve() / "logs" / FLIGHT_RECORDER_PREFIX)
    buffer_names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    file_names = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    wanted = {
        buffer_names if new else buffer_names[::-1]: str(FLIGHT_RECORDER_ENTRIES),
        ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
        file_names if new else file_names[::-1]: prefix,
        ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE",): prefix,
    }
    return {names[0]: value for names, value in wanted.items() if not any(n in environ for n in names)}


def trigger_flight_recorder(env: dict[str, str], ranks: Iterable[int], wait_s: float = 5.0) -> list[Path]:
    """Ask each rank's ProcessGroupNCCL for its flight-recorder dump through its pipe
    (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` + rank + ``.pipe``; only NCCL process groups create one) and wait up to
    ``wait_s`` for the dumps (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` + rank); returns the dump files that exist."""
    pipe_prefix = env.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
    dump_prefix = env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if not pipe_prefix or not dump_prefix:
        return []
    asked = []
    for rank in ranks:
        pipe = Path(f"{pipe_prefix}{rank}.pipe")
        try:
            if not stat.S_ISFIFO(pipe.stat().st_mode):
                continue
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, b"1\n")
            finally:
                os.close(fd)
            asked.append(Path(f"{dump_prefix}{rank}"))
        except OSError:  # no reader (the process group is gone) or no pipe: nothing to ask
            continue
    deadline = time.monotonic() + wait_s
    while asked and not all(p.exists() for p in asked) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in asked if p.exists()]


def append_event(path: Path, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event to an ``events.jsonl`` that rank 0's EventWriter may be writing at the same time.

    Safe beside that writer: the file is opened with ``O_APPEND`` and the line goes out in one ``write(2)``, so
    it lands whole after whatever line is complete; the EventWriter, too, writes each line in one call (a
    flushed line through a buffered file). Launcher events carry ``"seq": null`` and ``"source": "launcher"``:
    ``seq`` is rank 0's numbering, which only its writer knows; readers skip a missing seq (no gap is reported).
    """
    event = {"seq": None, "time": round(time.time(), 3), "kind": kind, "source": "launcher", **fields}
    data = (json.dumps(event, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return event


def hang_message(stall_s: float, timeout_s: float, summaries: list[str], stacks_path: str) -> str:
    """``hang: no rank advanced for 6 s (launch.hang_timeout_s = 5): rank 0 in all_reduce (...); rank 1 in
    time.sleep (...); stacks in logs/stacks-....txt``."""
    where = "; ".join(summaries) if summaries else "no stacks"
    return (f"hang: no rank advanced for {stall_s:.0f} s (launch.hang_timeout_s = {timeout_s:g}): {where}; "
            f"stacks in {stacks_path}")
