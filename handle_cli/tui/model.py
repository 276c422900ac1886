"""What the dashboard shows, in plain Python (no Textual here): run state, log tails, run rows, the tailer.

The app's background thread calls :meth:`RunTailer.poll`, which reads what is new on disk (events, run.json,
rank logs) and returns one :class:`Batch`; the app applies the batch to :class:`RunState` on its own thread and
redraws. Everything that reaches the terminal goes through :func:`clean` first.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from torch_handle.rundir import RUN_FILE, RunDirError, list_runs, read_run_info
from torch_handle.telemetry import EVENTS_FILE, BadLine, EventReader
from torch_handle.text import clean, fmt_float, fmt_time, strategy_label

FINAL_STATUSES = ("finished", "failed", "stopped")
RESTART_STATUSES = ("restarting", "restarted")

def _num(x: Any) -> float | None:
    """A finite float, or None (bools, strings, NaN, inf and missing values all give None)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _int(x: Any) -> int | None:
    v = _num(x)
    return int(v) if v is not None else None


# ---------------------------------------------------------------------------------------------------------------
# run state
# ---------------------------------------------------------------------------------------------------------------

MEMORY_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes", "rss_bytes",
               "cuda_allocated_bytes", "cuda_max_allocated_bytes", "cuda_reserved_bytes")


@dataclass
class Notice:
    """A line for the log panel that comes from the events, not from a log file."""

    level: str  # info | warning | error
    text: str


@dataclass
class RunState:
    """Everything the main screen shows about one run, built by applying events in order."""

    run_dir: Path
    info: dict[str, Any] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    lr: list[float | None] = field(default_factory=list)
    tokens_per_s: list[float | None] = field(default_factory=list)
    step_time_s: list[float | None] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float | None] = field(default_factory=list)
    grad_norm: float | None = None
    memory: dict[int, dict[str, int]] = field(default_factory=dict)
    """rank -> the latest memory figures."""
    peak_memory: dict[int, dict[str, int]] = field(default_factory=dict)
    event_status: str | None = None
    event_message: str = ""
    event_steps_total: int | None = None
    event_world_size: int | None = None
    event_strategy: str | None = None
    event_zero_stage: Any = None
    restarts_seen: int = 0
    first_time: float | None = None
    last_time: float | None = None
    n_events: int = 0
    last_seq: int | None = None
    seq_gaps: int = 0
    """Times ``seq`` jumped forward (events missing from the file); 0 for a complete history."""
    bad_lines: list[BadLine] = field(default_factory=list)
    last_checkpoint: str | None = None

    # -- applying --------------------------------------------------------------------------------------------

    def apply(self, events: Iterable[dict[str, Any]]) -> list[Notice]:
        """Apply events in order; returns the notices they produce (log events, restarts, failures)."""
        notices: list[Notice] = []
        for event in events:
            try:
                self._apply_one(event, notices)
            except Exception as e:  # noqa: BLE001 - a malformed event is reported, never fatal
                notices.append(Notice("warning", f"event seq {clean(event.get('seq'), 20)} skipped: "
                                                 f"{type(e).__name__}: {clean(e, 200)}"))
        return notices

    def _apply_one(self, event: dict[str, Any], notices: list[Notice]) -> None:
        self.n_events += 1
        seq = _int(event.get("seq"))
        if seq is not None:
            if self.last_seq is not None and seq > self.last_seq + 1:
                self.seq_gaps += 1
                notices.append(Notice("warning", f"events {self.last_seq + 1}..{seq - 1} are missing from the file"))
            self.last_seq = seq
        kind = event.get("kind")
        t = _num(event.get("time"))
        if t is not None:
            self.first_time = t if self.first_time is None else self.first_time
            self.last_time = t
        if kind == "step":
            step = _int(event.get("step"))
            if step is None:
                return
            if self.steps and step <= self.steps[-1]:
                self._truncate(step)  # a restart resumed from an earlier checkpoint: the new attempt wins
            self.steps.append(step)
            self.loss.append(_num(event.get("loss")))
            self.lr.append(_num(event.get("lr")))
            self.tokens_per_s.append(_num(event.get("tokens_per_s")))
            self.step_time_s.append(_num(event.get("step_time_s")))
            self.grad_norm = _num(event.get("grad_norm"))
            memory = event.get("memory")
            if isinstance(memory, list):
                for mem in memory:
                    if not isinstance(mem, dict):
                        continue
                    rank = _int(mem.get("rank"))
                    if rank is None:
                        continue
                    latest = {k: int(v) for k in MEMORY_KEYS if (v := _num(mem.get(k))) is not None}
                    self.memory[rank] = latest
                    peak = self.peak_memory.setdefault(rank, {})
                    for k, v in latest.items():
                        peak[k] = max(peak.get(k, 0), v)
        elif kind == "eval":
            step = _int(event.get("step"))
            if step is None:
                return
            while self.val_steps and self.val_steps[-1] >= step:
                self.val_steps.pop()
                self.val_loss.pop()
            self.val_steps.append(step)
            self.val_loss.append(_num(event.get("val_loss")))
        elif kind == "status":
            status = clean(event.get("status") or "", 40)
            message = clean(event.get("message") or "", 500)
            if status in RESTART_STATUSES:
                self.restarts_seen += 1
                notices.append(Notice("warning", f"restarting: {message or 'a worker failed'}"))
            elif status == "running" and self.event_status in RESTART_STATUSES:
                notices.append(Notice("info", f"restart {self.restarts_seen}: workers running again"))
            elif status == "failed":
                notices.append(Notice("error", f"run failed: {message}" if message else "run failed"))
            elif status == "stopped":
                notices.append(Notice("warning", f"run stopped{': ' + message if message else ''}"))
            elif status == "finished":
                notices.append(Notice("info", "run finished"))
            restart = _int(event.get("restart"))
            if restart is not None:
                self.restarts_seen = max(self.restarts_seen, restart)
            self.event_status = status or self.event_status
            self.event_message = message
            if (steps := _int(event.get("steps"))) is not None:
                self.event_steps_total = steps
            if (ws := _int(event.get("world_size"))) is not None:
                self.event_world_size = ws
            if event.get("strategy"):
                self.event_strategy = clean(event["strategy"], 40)
                self.event_zero_stage = event.get("zero_stage")
        elif kind == "log":
            level = clean(event.get("level") or "info", 10).lower()
            notices.append(Notice(level if level in ("warning", "error") else "info",
                                  clean(event.get("message") or "", 1000)))
        elif kind == "checkpoint":
            self.last_checkpoint = clean(event.get("path") or "", 200)

    def _truncate(self, step: int) -> None:
        keep = 0
        while keep < len(self.steps) and self.steps[keep] < step:
            keep += 1
        for series in (self.steps, self.loss, self.lr, self.tokens_per_s, self.step_time_s):
            del series[keep:]
        while self.val_steps and self.val_steps[-1] >= step:
            self.val_steps.pop()
            self.val_loss.pop()

    # -- derived ---------------------------------------------------------------------------------------------

    @property
    def status(self) -> str:
        """running | finished | failed | stopped | restarting | starting.

        run.json has the last word once it is final (the launcher records failures no worker could report);
        otherwise the newest status event. (A final event status while run.json says running is a resumed run
        whose workers have not reported yet: it shows as that final status until they do.)
        """
        info_status = self.info.get("status")
        if info_status in FINAL_STATUSES:
            return info_status
        if self.event_status:
            return "restarting" if self.event_status in RESTART_STATUSES else self.event_status
        return info_status if isinstance(info_status, str) and info_status else "starting"

    @property
    def message(self) -> str:
        if self.info.get("status") in FINAL_STATUSES and self.info.get("message"):
            return clean(self.info["message"], 500)
        return self.event_message

    @property
    def step(self) -> int:
        return self.steps[-1] if self.steps else _int(self.info.get("step")) or 0

    @property
    def steps_total(self) -> int | None:
        return self.event_steps_total or _int(self.info.get("steps"))

    @property
    def world_size(self) -> int | None:
        return self.event_world_size or _int(self.info.get("world_size"))

    @property
    def strategy(self) -> str:
        if self.event_strategy:
            return strategy_label(self.event_strategy, self.event_zero_stage)
        return strategy_label(self.info.get("strategy"), self.info.get("zero_stage"))

    @property
    def restarts(self) -> int:
        return max(self.restarts_seen, _int(self.info.get("restarts")) or 0)

    @property
    def name(self) -> str:
        return clean(self.info.get("name") or self.run_dir.name, 80)

    @property
    def preset(self) -> str:
        preset = self.info.get("preset")
        return clean(Path(str(preset)).stem if preset else self.name, 80)

    @property
    def last_loss(self) -> float | None:
        return next((x for x in reversed(self.loss) if x is not None), None)

    @property
    def last_val_loss(self) -> float | None:
        return next((x for x in reversed(self.val_loss) if x is not None), None)

    def last(self, series: list[float | None]) -> float | None:
        return next((x for x in reversed(series) if x is not None), None)

    def elapsed_s(self) -> float | None:
        """From the run's start to its end, or to the newest event while it runs (event times, not the clock)."""
        start = _num(self.info.get("start_time"))
        if start is None:
            start = self.first_time
        if start is None:
            return None
        end = _num(self.info.get("end_time")) if self.status in FINAL_STATUSES else None
        if end is None:
            end = self.last_time
        return None if end is None else max(0.0, end - start)

    def eta_s(self) -> float | None:
        if self.status not in ("running", "restarting") or not self.steps_total:
            return None
        recent = [x for x in self.step_time_s[-20:] if x is not None]
        if not recent:
            return None
        return max(0, self.steps_total - self.step) * sum(recent) / len(recent)


# ---------------------------------------------------------------------------------------------------------------
# logs
# ---------------------------------------------------------------------------------------------------------------

_ERROR_RE = re.compile(r"\bERROR\b|Traceback \(most recent call last\)|^[A-Za-z_][\w.]*(Error|Exception)\b")


def is_error_line(line: str) -> bool:
    return bool(_ERROR_RE.search(line))


class LogTail:
    """Incremental tail of one log file: new complete lines, cleaned; keeps the last ``keep`` lines."""

    def __init__(self, path: Path, keep: int = 200, initial_bytes: int = 256 * 1024):
        self.path = Path(path)
        self.lines: deque[str] = deque(maxlen=keep)
        self.has_error = False
        self._offset: int | None = None
        self._partial = b""
        self._initial_bytes = initial_bytes

    def poll(self) -> list[str]:
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        skip_first = False
        if self._offset is None:
            self._offset = max(0, size - self._initial_bytes)
            skip_first = self._offset > 0  # started mid-line
        elif size < self._offset:  # truncated or replaced
            self._offset, self._partial = 0, b""
        if size == self._offset:
            return []
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(min(size - self._offset, 4 * 1024 * 1024))
        except OSError:
            return []
        self._offset += len(chunk)
        raw = (self._partial + chunk).split(b"\n")
        self._partial = raw.pop()
        if skip_first and raw:
            raw.pop(0)
        if len(self._partial) > 64 * 1024:  # a runaway line without newline: show what there is
            raw.append(self._partial)
            self._partial = b""
        out = []
        for r in raw:
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
        status_seen = any(e.get("kind") == "status" for e in batch.events)
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
    strategy: str
    world_size: str
    steps: str
    last_loss: str
    started: str
    start_time: float


def _tail_events(path: Path, nbytes: int = 65536) -> list[dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - nbytes))
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict):
            out.append(e)
    return out


def run_row(run_dir: Path) -> RunRow:
    try:
        info = read_run_info(run_dir)
        if not isinstance(info, dict):
            raise RunDirError("not an object")
    except RunDirError:
        info = {"status": "unreadable"}
    events = _tail_events(Path(run_dir) / EVENTS_FILE)
    last_step = next((e for e in reversed(events) if e.get("kind") == "step"), None)
    done = _int(last_step.get("step")) if last_step else _int(info.get("step"))
    total = _int(info.get("steps"))
    loss = _num(last_step.get("loss")) if last_step else None
    ws = _int(info.get("world_size"))
    start = _num(info.get("start_time"))
    return RunRow(
        path=Path(run_dir),
        name=clean(Path(run_dir).name, 80),
        status=clean(info.get("status") or "?", 20),
        strategy=strategy_label(info.get("strategy"), info.get("zero_stage")),
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
