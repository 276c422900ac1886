"""Reading files that may still be growing: :class:`Tail` (the complete new lines of any file: events, logs),
:class:`EventReader` (those lines as events), :func:`tail_events` (only the end of a file), and :func:`number` /
:func:`integer` (a field's value, or None). A reader survives any file: bad lines and fields of the wrong type
are skipped and reported, never raised. Standard library only.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def number(x: Any) -> float | None:
    """A finite float, or None (bools, strings, NaN, inf and missing values all give None)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def integer(x: Any) -> int | None:
    """:func:`number` as an int (truncated), or None."""
    v = number(x)
    return int(v) if v is not None else None


class Tail:
    """Incremental reader of the complete lines appended to a file that may still be growing.

    ``poll()`` returns the lines (bytes, without the newline) completed since the previous call. A partial last
    line (a writer caught mid-write) is kept until its newline arrives, unless it grows past ``max_line`` bytes
    (a runaway line): then it is returned as it is. A file that shrinks or is replaced (another inode) is read
    again from its start. With ``start_near_end`` (bytes), the first poll starts that far before the end and
    skips the line it lands in, unless it lands on a line's start. ``max_read`` caps the bytes read per poll
    (None: everything new). A missing or unreadable file gives no lines, never an error.
    """

    def __init__(self, path: Path, *, start_near_end: int | None = None, max_read: int | None = None,
                 max_line: int = 16 * 1024 * 1024):
        self.path = Path(path)
        self.start_near_end = start_near_end
        self.max_read = max_read
        self.max_line = max_line
        self.line_no = 0
        """Lines returned since the (last) start of the file, blank ones included."""
        self._offset: int | None = None
        self._inode: tuple[int, int] | None = None
        self._partial = b""
        self._skip_to_newline = False

    def _restart(self, offset: int, skip: bool) -> None:
        self._offset, self._partial, self._skip_to_newline, self.line_no = offset, b"", skip, 0

    def poll(self) -> list[bytes]:
        try:
            st = os.stat(self.path)
        except OSError:
            return []
        inode, size = (st.st_dev, st.st_ino), st.st_size
        if self._offset is None:
            near = self.start_near_end
            if near is not None and size > near:
                # one byte early: when that byte is a newline, the line at ``size - near`` is complete
                self._restart(size - near - 1, skip=True)
            else:
                self._restart(0, skip=False)
        elif size < self._offset or inode != self._inode:  # truncated or replaced: start over
            self._restart(0, skip=False)
        self._inode = inode
        assert self._offset is not None
        if size == self._offset:
            return []
        n = size - self._offset if self.max_read is None else min(size - self._offset, self.max_read)
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(n)
        except OSError:
            return []
        self._offset += len(chunk)
        if self._skip_to_newline:
            cut = chunk.find(b"\n")
            if cut < 0:
                return []
            chunk, self._skip_to_newline = chunk[cut + 1:], False
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # b"" when the chunk ended with a newline
        if len(self._partial) > self.max_line:
            lines.append(self._partial)
            self._partial = b""
        self.line_no += len(lines)
        return lines


@dataclass
class BadLine:
    """A line of ``events.jsonl`` that is not a JSON object (reported, never fatal)."""

    line_no: int
    text: str
    error: str


class EventReader:
    """Incremental reader of an ``events.jsonl`` that may still be growing (a :class:`Tail` from the start).

    ``poll()`` returns the complete new events since the previous call. Lines that are not JSON objects are
    collected in ``bad_lines`` (line numbers from 1) instead of raising.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._tail = Tail(self.path)
        self.bad_lines: list[BadLine] = []

    def poll(self) -> list[dict[str, Any]]:
        lines = self._tail.poll()
        events = []
        for line_no, raw in enumerate(lines, self._tail.line_no - len(lines) + 1):
            if not raw.strip():
                continue
            try:
                event = json.loads(raw)
                if not isinstance(event, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                self.bad_lines.append(BadLine(line_no, raw.decode("utf-8", "replace")[:200], str(e)))
                continue
            events.append(event)
        return events


def read_tail(path: Path, nbytes: int = 65536) -> list[bytes]:
    """The lines in the last ``nbytes`` of a file, without the first one when it is cut (the last one is
    included even without its newline); ``[]`` when the file is missing or unreadable."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - nbytes)
            f.seek(max(0, start - 1))
            data = f.read()
    except OSError:
        return []
    if start > 0:
        data = data.partition(b"\n")[2]  # the byte before ``start`` tells whether the first line is whole
    lines = data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    return lines


def tail_events(path: Path, nbytes: int = 65536) -> list[dict[str, Any]]:
    """The events (JSON objects) in the last ``nbytes`` of an events file, oldest first; other lines skipped."""
    out = []
    for line in read_tail(path, nbytes):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            out.append(event)
    return out
