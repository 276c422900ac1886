"""Telemetry, the writer side: rank 0 appends JSON events to ``events.jsonl`` and hands each one to the sinks.

Why a file: it is durable (nothing is lost when the dashboard closes), lets any reader attach to a run at any
time and replay its history, needs no open port, and works on the shared filesystems of clusters. The events'
vocabulary is :mod:`torch_handle.observe.fields` (their meaning: docs/run-directory.md), their readers
:mod:`torch_handle.observe.tail` and :mod:`torch_handle.observe.state`; another process (the launcher's ``hang``
event) appends with :func:`append_event`.

Sinks send the same events elsewhere (TensorBoard, a metrics service): plugins register them with the
``handle_register_sinks`` hook, ``register(name, factory, description="")``, ``factory(run_dir: Path, preset) ->
Sink | None``. The JSONL file stays the record every run has: the writer's thread writes each event to it first,
then gives it to every sink. A sink that raises (in its factory, ``emit`` or ``close``) is disabled with one
``log`` event at level ``warning`` in ``events.jsonl``; it never stops training or changes the exit code.

This module imports neither torch nor any UI library.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from torch_handle.observe.fields import Kind, Level
from torch_handle.observe.tail import tail_events

EVENTS_FILE = "events.jsonl"

log = logging.getLogger("torch_handle")


def last_seq(path: Path) -> int:
    """The last numbered ``seq`` in an events file (-1 when there is none). Reads the file's tail, and a wider
    one while the tail holds only events without a number (the launcher's ``hang`` events carry ``seq: null``)."""
    nbytes = 1 << 16
    try:
        size = Path(path).stat().st_size
    except OSError:
        return -1
    while True:
        for event in reversed(tail_events(path, nbytes)):
            try:
                return int(event["seq"])
            except (ValueError, KeyError, TypeError):
                continue
        if nbytes >= size:
            return -1
        nbytes *= 4


class Sink:
    """Where rank 0's events go besides ``events.jsonl``; subclassing is optional (any object with these two
    methods is a sink).

    ``emit(event)`` gets every event of the run from the moment the sink is opened (after the trainer built
    data, model and strategy): the dict written to ``events.jsonl`` (``seq``, ``time``, ``kind`` and the kind's
    fields, non-finite numbers as None; see :mod:`torch_handle.observe.fields`), to be treated as read-only. It
    runs on the writer's background thread, never on the training step's, so a slow sink delays the file's later
    lines, not training. ``close()`` is called once, after the last event. Either may raise: the sink is then disabled
    (one warning in ``events.jsonl``), and the run goes on.
    """

    def emit(self, event: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


SinkFactory = Callable[[Path, Any], Any]
"""``factory(run_dir, preset) -> Sink | None`` (None: this sink has nothing to do for this run)."""


def _describe(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:500] if text else type(e).__name__


class EventWriter:
    """Appends events from a background thread, so a slow filesystem never blocks the training step.

    Each event is written as one line and flushed, then given to every sink; ``close()`` drains the queue and
    closes the sinks. ``seq`` continues from the last event already in the file, so restarts and resumes never
    reuse a number.
    """

    def __init__(self, path: Path, sinks: Mapping[str, Sink] | None = None):
        self.path = Path(path)
        self._seq = last_seq(self.path) + 1
        self._lock = threading.Lock()  # seq order is queue order, also for the warnings of the writer's thread
        self._sinks: dict[str, Sink] = dict(sinks or {})
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._file = open(self.path, "a", encoding="utf-8")
        self._thread = threading.Thread(target=self._drain, name="handle-events", daemon=True)
        self._thread.start()

    def emit(self, kind: str, **fields: Any) -> None:
        # strict JSON has no NaN/Infinity: a non-finite figure (a diverged loss) is written as null
        fields = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in fields.items()}
        with self._lock:
            event = {"seq": self._seq, "time": round(time.time(), 3), "kind": kind, **fields}
            self._seq += 1
            self._queue.put(event)

    def open_sinks(self, factories: Mapping[str, SinkFactory], run_dir: Path, preset: Any) -> None:
        """Call each sink factory as ``factory(run_dir, preset)`` and send the following events to the sinks
        they return; a factory that raises gets its one warning (KeyboardInterrupt alone propagates)."""
        for name, factory in factories.items():
            try:
                sink = factory(Path(run_dir), preset)
            except BaseException as e:  # noqa: BLE001 - a sink never ends the run (SystemExit included)
                if isinstance(e, KeyboardInterrupt):
                    raise
                self._warn_disabled(name, e, "its factory")
                continue
            if sink is not None:
                with self._lock:
                    self._sinks[name] = sink

    def _warn_disabled(self, name: str, error: BaseException, where: str) -> None:
        message = f"sink {name!r} disabled: {_describe(error)} (in {where})"
        log.warning("%s", message)
        self.emit(Kind.LOG, level=Level.WARNING, message=message)

    def _write(self, event: dict[str, Any]) -> None:
        self._file.write(json.dumps(event, separators=(",", ":"), allow_nan=False) + "\n")
        self._file.flush()

    def _drain(self) -> None:
        closing = False
        while True:
            if not closing:
                event = self._queue.get()
            else:  # after the end marker: what is left (a sink's warning), then stop
                try:
                    event = self._queue.get_nowait()
                except queue.Empty:
                    break
            if event is None:
                closing = True
                continue
            self._write(event)  # the file first: it is the record
            self._fan_out(event)
        with self._lock:
            sinks, self._sinks = list(self._sinks.items()), {}
        for name, sink in sinks:
            try:
                sink.close()
            except BaseException as e:  # noqa: BLE001
                self._warn_disabled(name, e, "close")
        while True:  # the warnings of close(): the file only, the sinks are closed
            try:
                event = self._queue.get_nowait()
            except queue.Empty:
                break
            if event is not None:
                self._write(event)

    def _fan_out(self, event: dict[str, Any]) -> None:
        with self._lock:
            sinks = list(self._sinks.items())
        for name, sink in sinks:
            try:
                sink.emit(event)
            except BaseException as e:  # noqa: BLE001 - SystemExit too: this thread must go on writing the file
                with self._lock:
                    self._sinks.pop(name, None)
                try:
                    sink.close()  # release what it holds; it already has its warning
                except BaseException:  # noqa: BLE001
                    pass
                self._warn_disabled(name, e, "emit")

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10)
        self._file.close()


class NullEventWriter:
    """What non-zero ranks get: the loop calls ``emit`` without asking which rank it is on."""

    def emit(self, kind: str, **fields: Any) -> None:
        pass

    def open_sinks(self, factories: Mapping[str, SinkFactory], run_dir: Path, preset: Any) -> None:
        pass

    def close(self) -> None:
        pass


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
