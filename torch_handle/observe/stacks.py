"""The Python stacks of a run's live workers: taking them, reading them, and naming where each rank waits.

:func:`take_stacks` dumps every given rank's stacks (``py-spy dump --native`` when ``py-spy`` is on PATH, for
native frames too, else SIGUSR1 and the file each worker's faulthandler writes: :mod:`torch_handle.observe.heartbeat`)
into ``logs/stacks-<UTC time>.txt``; :func:`waiting_point` and :func:`describe` name where a rank waits (``rank 0
in all_reduce (trainer.py:262 train_step)``). Used by ``handle stacks`` (:func:`stacks_of_run`) and by the
launcher when the ranks hang (:mod:`torch_handle.launch.hang`). Standard library only.
"""

from __future__ import annotations

import json
import linecache
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

from torch_handle.common.fsio import write_text_atomic
from torch_handle.observe.heartbeat import HEARTBEATS_DIR, RankBeat, live_beats, stack_file

STACKS_PREFIX = "stacks-"
PY_SPY_ENV = "HANDLE_PY_SPY"
"""``0`` keeps the stack dumps on faulthandler even when ``py-spy`` is on PATH."""


# ---------------------------------------------------------------------------------------------------------------
# parsing and summarising
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
# taking them
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
