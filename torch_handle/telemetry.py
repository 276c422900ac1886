"""Telemetry: rank 0 appends JSON events to ``events.jsonl``; readers tail it.

Why a file: it is durable (nothing is lost when the dashboard closes), lets any reader attach to a run at any
time and replay its history, needs no open port, and works on the shared filesystems of clusters.

Schema (one JSON object per line; every event has ``seq`` (int, increasing, never reused across restarts),
``time`` (unix seconds) and ``kind``):

- ``status``: ``status`` (running|finished|failed|stopped|restarting), optional ``message``, ``world_size``,
  ``strategy``, ``zero_stage``, ``steps`` (total), ``restart`` (count).
- ``step``: ``step``, ``loss`` (null when not finite; then ``skipped`` is true with ``on_nan = "skip"``), ``lr``, ``grad_norm``, ``tokens_per_s`` (global), ``step_time_s``, ``tokens``
  (global tokens in this step), and every ``log_every`` steps ``memory``: a list with one object per rank:
  ``rank``, ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``, ``rss_bytes`` and on CUDA
  ``cuda_allocated_bytes``, ``cuda_max_allocated_bytes``, ``cuda_reserved_bytes``.
- ``eval``: ``step``, ``val_loss``.
- ``checkpoint``: ``step``, ``path``.
- ``log``: ``level``, ``message``.

This module imports neither torch nor any UI library.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

EVENTS_FILE = "events.jsonl"


def last_seq(path: Path) -> int:
    """The highest ``seq`` in an events file (-1 when there is none); reads only the file's tail."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["seq"])
        except (ValueError, KeyError, TypeError):
            continue
    return -1


class EventWriter:
    """Appends events from a background thread, so a slow filesystem never blocks the training step.

    Each event is written as one line and flushed; ``close()`` drains the queue. ``seq`` continues from the
    last event already in the file, so restarts and resumes never reuse a number.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._seq = last_seq(self.path) + 1
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._file = open(self.path, "a", encoding="utf-8")
        self._thread = threading.Thread(target=self._drain, name="handle-events", daemon=True)
        self._thread.start()

    def emit(self, kind: str, **fields: Any) -> None:
        # strict JSON has no NaN/Infinity: a non-finite figure (a diverged loss) is written as null
        fields = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in fields.items()}
        event = {"seq": self._seq, "time": round(time.time(), 3), "kind": kind, **fields}
        self._seq += 1
        self._queue.put(event)

    def _drain(self) -> None:
        while (event := self._queue.get()) is not None:
            self._file.write(json.dumps(event, separators=(",", ":"), allow_nan=False) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10)
        self._file.close()


class NullEventWriter:
    """What non-zero ranks get: the loop calls ``emit`` without asking which rank it is on."""

    def emit(self, kind: str, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class BadLine:
    """A line of ``events.jsonl`` that is not a JSON object (reported, never fatal)."""

    line_no: int
    text: str
    error: str


class EventReader:
    """Incremental reader of an ``events.jsonl`` that may still be growing.

    ``poll()`` returns the complete new events since the previous call; a partial last line (a writer caught
    mid-write) is kept until its newline arrives. Lines that are not JSON objects are collected in
    ``bad_lines`` instead of raising. A file that shrinks (replaced) is read again from the start.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._offset = 0
        self._partial = b""
        self._line_no = 0
        self.bad_lines: list[BadLine] = []

    def poll(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:  # truncated or replaced: start over
            self._offset, self._partial, self._line_no = 0, b"", 0
        if size == self._offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read(size - self._offset)
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # b"" when the chunk ended with a newline
        events = []
        for raw in lines:
            self._line_no += 1
            if not raw.strip():
                continue
            try:
                event = json.loads(raw)
                if not isinstance(event, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                self.bad_lines.append(BadLine(self._line_no, raw.decode("utf-8", "replace")[:200], str(e)))
                continue
            events.append(event)
        return events

    def follow(self, interval_s: float = 0.1, stop: Any = None) -> Iterator[list[dict[str, Any]]]:
        """Yield batches of new events until ``stop()`` returns true (polls every ``interval_s``)."""
        while stop is None or not stop():
            events = self.poll()
            if events:
                yield events
            else:
                time.sleep(interval_s)


def read_events(path: Path) -> list[dict[str, Any]]:
    """All complete events of a file."""
    return EventReader(path).poll()


def _number(value: Any, default: float | None = None) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


@dataclass
class RunSummary:
    """What a run's events add up to (used by the progress line, the final summary and the dashboard)."""

    steps_total: int | None = None
    step: int = 0
    loss: float | None = None
    first_val_loss: float | None = None
    val_loss: float | None = None
    lr: float | None = None
    tokens_per_s: list[float] = field(default_factory=list)
    step_time_s: list[float] = field(default_factory=list)
    status: str = "running"
    message: str = ""
    peak_memory: dict[int, dict[str, int]] = field(default_factory=dict)
    """rank -> the largest value seen of each memory figure."""
    start_time: float | None = None
    last_time: float | None = None

    def update(self, event: dict[str, Any]) -> None:
        """Fold one event in; fields of the wrong type are ignored (a reader must survive any file)."""
        kind = event.get("kind")
        t = _number(event.get("time"))
        if t is not None:
            self.start_time = t if self.start_time is None else self.start_time
            self.last_time = t
        if kind == "status":
            if isinstance(event.get("status"), str):
                self.status = event["status"]
            self.message = str(event.get("message") or "")
            if isinstance(event.get("steps"), int):
                self.steps_total = event["steps"]
        elif kind == "step":
            if isinstance(event.get("step"), int):
                self.step = event["step"]
            self.loss = _number(event.get("loss"), self.loss)
            self.lr = _number(event.get("lr"), self.lr)
            for key, series in (("tokens_per_s", self.tokens_per_s), ("step_time_s", self.step_time_s)):
                if (value := _number(event.get(key))) is not None:
                    series.append(value)
            memory = event.get("memory")
            for mem in memory if isinstance(memory, list) else []:
                if not isinstance(mem, dict) or not isinstance(mem.get("rank", 0), int):
                    continue
                peak = self.peak_memory.setdefault(mem.get("rank", 0), {})
                for k, v in mem.items():
                    if k != "rank" and (v := _number(v)) is not None:
                        peak[k] = max(peak.get(k, 0), int(v))
        elif kind == "eval":
            val = _number(event.get("val_loss"))
            if val is not None:
                self.first_val_loss = val if self.first_val_loss is None else self.first_val_loss
                self.val_loss = val

    @property
    def mean_tokens_per_s(self) -> float | None:
        # the first steps include warm-up (allocation, DeepSpeed's first bucket setup): leave them out
        xs = self.tokens_per_s[2:] or self.tokens_per_s
        return sum(xs) / len(xs) if xs else None

    def eta_s(self) -> float | None:
        if not self.steps_total or not self.step_time_s:
            return None
        recent = self.step_time_s[-20:]
        return max(0, self.steps_total - self.step) * sum(recent) / len(recent)
