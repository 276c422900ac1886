"""Where a training step's time goes: laps over the loop's phases, cheap enough to run on every step.

A step is a sequence of phases -- per micro-batch ``data`` (waiting for the next batch), ``forward``,
``backward``; then ``sync`` (the trainer's loss/stop all-reduce and its read-back) and ``optimizer`` (clip,
step, schedule). :class:`PhaseTimer` times them as consecutive *laps*: each phase ends where the next begins, so
the parts tile the step and add up to it (nothing falls between two phases). A phase that occurs once per
micro-batch accumulates over the micro-batches.

- CPU: ``time.perf_counter`` at every boundary (about 0.1 µs each).
- CUDA: a ``torch.cuda.Event`` recorded on the current stream at every boundary, read with ``elapsed_time``
  only by :meth:`PhaseTimer.read` (at log time, after the step's own ``torch.cuda.synchronize``): never a
  synchronize per phase. Events time the stream, so a phase lasts from when the GPU reached its start marker to
  when it reached its end marker: the kernels it launched plus any idle gap while the host prepared them.

Every phase is also a ``torch.profiler.record_function`` range named ``handle/<phase>`` (``sync`` is
``handle/comm``), visible in profiler traces; without an active profiler no range is opened (checking costs
well under a microsecond).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from torch_handle.observe.fields import STEP_PHASES

PHASES = tuple(STEP_PHASES)
"""The phases in the order a step runs them; each one's seconds go into the step event's field
``STEP_PHASES[phase]`` (:mod:`torch_handle.observe.fields`)."""
RANGE_NAMES = {"data": "handle/data", "forward": "handle/forward", "backward": "handle/backward",
               "sync": "handle/comm", "optimizer": "handle/optimizer"}
"""``record_function`` name of each phase (the profiler's view of the same boundaries)."""


class _Phase:
    """``with timer.phase(name):`` -- a profiler range plus a lap at the exit (a class: cheaper than a
    generator-based context manager)."""

    __slots__ = ("timer", "name", "range")

    def __init__(self, timer: "PhaseTimer", name: str):
        self.timer, self.name, self.range = timer, name, None

    def __enter__(self) -> "_Phase":
        # ``_profiler_enabled`` (a C++ flag: true while a torch.profiler is recording, Kineto on-demand included)
        # skips the range's dispatcher round trip, ~14 us, when nobody would see it
        if self.timer.ranges and torch.autograd._profiler_enabled():
            self.range = torch.autograd.profiler.record_function(RANGE_NAMES[self.name])
            self.range.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.range is not None:
            self.range.__exit__(*exc)
            self.range = None
        self.timer.lap(self.name)


class PhaseTimer:
    """Laps of one step over :data:`PHASES`; ``begin()`` at the step's start, ``with phase(name):`` around each
    phase, ``read()`` once the step has ended.

    Args:
        device: where the step runs (CUDA: events, else ``perf_counter``).
        enabled: time the phases (False: :meth:`read` returns ``{}`` and laps cost one attribute test).
        ranges: open a ``record_function`` range per phase (for profiler traces).
    """

    def __init__(self, device: torch.device | str = "cpu", *, enabled: bool = True, ranges: bool = True):
        self.cuda = torch.device(device).type == "cuda"
        self.enabled, self.ranges = enabled, ranges
        self._pool: list[Any] = []  # CUDA events, reused step after step
        self._marks: list[tuple[Any, Any]] = []  # (phase that ends here or {phase: share}, time or event)
        self._n = 0

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        if self._n == len(self._pool):
            self._pool.append(torch.cuda.Event(enable_timing=True))
        event = self._pool[self._n]
        self._n += 1
        event.record()  # on the current stream: no synchronisation
        return event

    def begin(self) -> None:
        """Start a step (forgets the previous one's laps)."""
        if not self.enabled:
            return
        self._n = 0
        self._marks = [("", self._mark())]

    def lap(self, name: str) -> None:
        """End phase ``name`` now (the time since the previous boundary is added to it)."""
        if self.enabled:
            self._marks.append((name, self._mark()))

    def lap_shared(self, weights: dict[str, float]) -> None:
        """End a stretch in which several phases interleaved (a pipeline schedule's forwards and backwards): its
        time is shared among ``weights``' phases in proportion (e.g. the seconds each measured itself)."""
        if self.enabled:
            self._marks.append((dict(weights), self._mark()))

    def phase(self, name: str) -> _Phase:
        """Context manager: a ``handle/<phase>`` profiler range, and a lap of ``name`` at its exit."""
        return _Phase(self, name)

    def read(self) -> dict[str, float]:
        """Seconds per phase of the step just timed (each phase summed over its micro-batches), in the order of
        :data:`PHASES`; ``{}`` when disabled. On CUDA, call it after the step's kernels have finished (the trainer
        synchronises once at the end of the step) -- ``elapsed_time`` of unfinished events raises."""
        if not self.enabled or len(self._marks) < 2:
            return {}
        out = dict.fromkeys(PHASES, 0.0)
        prev = self._marks[0][1]
        for name, mark in self._marks[1:]:
            dt = prev.elapsed_time(mark) / 1000.0 if self.cuda else mark - prev
            shares = name if isinstance(name, dict) else {name: 1.0}
            total = sum(shares.values()) or 1.0
            for phase, weight in shares.items():
                out[phase] = out.get(phase, 0.0) + dt * weight / total
            prev = mark
        return out
