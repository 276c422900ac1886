"""What the dashboard reads, in plain Python (no Textual here): log tails, the run tailer, the run picker's rows.

The app's background thread calls :meth:`RunTailer.poll`, which reads what is new on disk (events, run.json,
rank logs) and returns one :class:`Batch`; the app applies the batch to its
:class:`~torch_handle.observe.state.RunState` (the fold shared with ``handle run``) on its own thread and redraws.
Everything that reaches the terminal goes through :func:`clean` first.
"""

from __future__ import annotations

import os
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from torch_handle.observe.fields import Kind, Status
from torch_handle.observe.tail import BadLine, EventReader, Tail, integer, number, tail_events
from torch_handle.rundir import ACTIVE, RUN_FILE, RunDirError, list_runs, read_run_info, read_run_status
from torch_handle.observe.telemetry import EVENTS_FILE
from torch_handle.common.run_layout import RunLayout
from torch_handle.common.text import clean, fmt_float, fmt_time


# ---------------------------------------------------------------------------------------------------------------
# logs
# ---------------------------------------------------------------------------------------------------------------

_ERROR_RE = re.compile(r"\bERROR\b|Traceback \(most recent call last\)|^[A-Za-z_][\w.]*(Error|Exception)\b")


def is_error_line(line: str) -> bool:
    return bool(_ERROR_RE.search(line))


class LogTail:
    """Incremental tail of one log file: new complete lines, cleaned; keeps the last ``keep`` lines.

    Starts ``initial_bytes`` before the end of the file; reads at most 4 MiB per poll, and a line longer than
    64 KiB without a newline is shown as it is (see :class:`~torch_handle.observe.tail.Tail`).
    """

    def __init__(self, path: Path, keep: int = 200, initial_bytes: int = 256 * 1024):
        self.path = Path(path)
        self.lines: deque[str] = deque(maxlen=keep)
        self.has_error = False
        self._tail = Tail(self.path, start_near_end=initial_bytes, max_read=4 * 1024 * 1024, max_line=64 * 1024)

    def poll(self) -> list[str]:
        out = []
        for r in self._tail.poll():
            line = clean(r.decode("utf-8", "replace"), 1000)
            if not line.strip():
                continue
            out.append(line)
            self.lines.append(line)
            if is_error_line(line):
                self.has_error = True
        return out


@dataclass
class LogLine:
    source: str  # "rank0", "rank1", "launcher"
    text: str
    error: bool


_RANK_LOG = re.compile(r"^rank(\d+)\.log$")


class LogWatcher:
    """Tails rank 0's log always, and every other rank's log (and the launcher's) once it shows an error."""

    BACKLOG = 40

    def __init__(self, logs_dir: Path):
        self.logs_dir = Path(logs_dir)
        self.tails: dict[str, LogTail] = {}
        self.shown: set[str] = set()
        self._last_scan = 0.0

    def _scan(self) -> None:
        try:
            names = os.listdir(self.logs_dir)
        except OSError:
            return
        for name in names:
            m = _RANK_LOG.match(name)
            source = f"rank{m.group(1)}" if m else ("launcher" if name == "launcher.log" else None)
            if source and source not in self.tails:
                self.tails[source] = LogTail(self.logs_dir / name)

    def poll(self, force_scan: bool = False) -> list[LogLine]:
        now = time.monotonic()
        if force_scan or now - self._last_scan > 1.0:
            self._last_scan = now
            self._scan()
        out: list[LogLine] = []
        for source in sorted(self.tails, key=_source_order):
            tail = self.tails[source]
            new = tail.poll()
            if source == "rank0" or source in self.shown:
                out.extend(LogLine(source, line, is_error_line(line)) for line in new)
            elif tail.has_error:
                self.shown.add(source)
                out.append(LogLine(source, f"── {source}.log: error; its last lines ──", True))
                out.extend(LogLine(source, line, is_error_line(line)) for line in list(tail.lines)[-self.BACKLOG:])
        return out


def _source_order(source: str) -> tuple[int, int]:
    if source.startswith("rank"):
        return (0, int(source[4:]))
    return (1, 0)


# ---------------------------------------------------------------------------------------------------------------
# the tailer (runs in the app's background thread)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """What one poll found; empty batches are not sent."""

    events: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] | None = None
    bad_lines: list[BadLine] = field(default_factory=list)
    logs: list[LogLine] = field(default_factory=list)
    polled_at: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.events or self.info is not None or self.bad_lines or self.logs)


class RunTailer:
    """Reads what is new in a run directory; plain Python, used from one thread at a time."""

    INFO_EVERY_S = 0.5

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.reader = EventReader(self.run_dir / EVENTS_FILE)
        self.logs = LogWatcher(self.run_dir / "logs")
        self._bad_seen = 0
        self._info_mtime: int | None = None
        self._info_checked = 0.0

    def poll(self) -> Batch:
        batch = Batch(polled_at=time.time())
        batch.events = self.reader.poll()
        bad = self.reader.bad_lines
        if len(bad) > self._bad_seen:
            batch.bad_lines = bad[self._bad_seen:]
            self._bad_seen = len(bad)
        now = time.monotonic()
        status_seen = any(e.get("kind") == Kind.STATUS for e in batch.events)
        if status_seen or self._info_mtime is None or now - self._info_checked > self.INFO_EVERY_S:
            self._info_checked = now
            batch.info = self._read_info()
        batch.logs = self.logs.poll(force_scan=status_seen)
        return batch

    def _read_info(self) -> dict[str, Any] | None:
        try:
            mtime = (self.run_dir / RUN_FILE).stat().st_mtime_ns
        except OSError:
            return None
        if mtime == self._info_mtime:
            return None
        try:
            info = read_run_info(self.run_dir)
        except RunDirError:
            return None  # caught mid-replace or unreadable: try again next time
        self._info_mtime = mtime
        return info if isinstance(info, dict) else None


# ---------------------------------------------------------------------------------------------------------------
# the run picker's rows
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RunRow:
    path: Path
    name: str
    status: str
    layout: str
    """The layout line (:class:`~torch_handle.common.run_layout.RunLayout`), or the strategy where the degrees are
    not known."""
    world_size: str
    steps: str
    last_loss: str
    started: str
    start_time: float


def run_row(run_dir: Path) -> RunRow:
    try:
        info = read_run_status(run_dir)  # "lost" for a run whose launcher is gone
        if not isinstance(info, dict):
            raise RunDirError("not an object")
    except RunDirError:
        info = {"status": Status.UNREADABLE}
    events = tail_events(Path(run_dir) / EVENTS_FILE)
    last_step = next((e for e in reversed(events) if e.get("kind") == Kind.STEP), None)
    newest = next((e for e in reversed(events) if e.get("kind") in (Kind.STEP, Kind.STATUS, Kind.HANG)), None)
    if info.get("status") in ACTIVE and newest is not None and newest.get("kind") == Kind.HANG:
        info = {**info, "status": Status.HUNG}  # the watchdog's hang, and nothing moved since
    done = integer(last_step.get("step")) if last_step else integer(info.get("step"))
    total = integer(info.get("steps"))
    loss = number(last_step.get("loss")) if last_step else None
    ws = integer(info.get("world_size"))
    start = number(info.get("start_time"))
    # run.json's record, else preset.toml's [parallel] or an old run's step events (what the header shows)
    layout = RunLayout.from_run(Path(run_dir), info, last_step.get("layout") if last_step else None)
    return RunRow(
        path=Path(run_dir),
        name=clean(Path(run_dir).name, 80),
        status=clean(info.get("status") or "?", 20),
        layout=layout.label() if layout.dp is not None else layout.strategy_text,
        world_size=str(ws) if ws is not None else "-",
        steps=f"{done if done is not None else 0}/{total if total is not None else '?'}",
        last_loss=fmt_float(loss),
        started=fmt_time(start) if start is not None else "-",
        start_time=start or 0.0,
    )


def run_rows(output_dirs: Iterable[Path]) -> list[RunRow]:
    """Rows for every run under the given directories, newest first."""
    seen: set[Path] = set()
    rows = []
    for d in output_dirs:
        for p in list_runs(Path(d)):
            key = p.resolve()
            if key in seen:
                continue
            seen.add(key)
            rows.append(run_row(p))
    rows.sort(key=lambda r: (r.start_time, r.name), reverse=True)
    return rows
