"""When a node's ranks hang: the launcher's decision, and NCCL's flight recorder.

:class:`HangWatchdog`: when no local rank's heartbeat ``progress`` (:mod:`torch_handle.observe.heartbeat`) has
changed for ``launch.hang_timeout_s`` seconds, the launcher takes every local rank's stacks
(:func:`torch_handle.observe.stacks.take_stacks`), asks the flight recorder for its dump, and appends a ``hang``
event (:func:`hang_message`) to ``events.jsonl``. It fires once per stall and again only after some rank advanced.

NCCL's flight recorder (:func:`flight_recorder_env`): the launcher sets its environment variables for the workers
unless the user set them, so a collective timeout (``launch.timeout_s``) dumps each rank's recent collectives to
``RUN_DIR/logs/nccl_trace_rank_<R>``, and a hang asks for the same dump through the per-rank pipe
``logs/nccl_trace_rank_<R>.pipe`` (:func:`trigger_flight_recorder`).

Standard library only: no torch.
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from torch_handle.observe.heartbeat import RankBeat

FLIGHT_RECORDER_ENTRIES = 2000
"""``TORCH_NCCL_TRACE_BUFFER_SIZE``: collectives kept per rank in the ring buffer (PyTorch's recommended value)."""
FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"


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


def hang_message(stall_s: float, timeout_s: float, summaries: list[str], stacks_path: str) -> str:
    """``hang: no rank advanced for 6 s (launch.hang_timeout_s = 5): rank 0 in all_reduce (...); rank 1 in
    time.sleep (...); stacks in logs/stacks-....txt``."""
    where = "; ".join(summaries) if summaries else "no stacks"
    return (f"hang: no rank advanced for {stall_s:.0f} s (launch.hang_timeout_s = {timeout_s:g}): {where}; "
            f"stacks in {stacks_path}")
