"""When each forward and backward of a step ran on each pipeline rank, and what that makes of the bubble.

Every rank records its own spans: compute (``F``, ``B``, and ``W`` for the weight-gradient half of a zero-bubble
backward) and communication waits (``recv``: blocked waiting for an activation or a gradient), in seconds from the
start of the step's schedule on that rank. Clocks are ``time.perf_counter`` on CPU (about 0.1 µs a read) and CUDA
events on GPU, read once per step after the trainer's synchronise (never a synchronise per micro-batch).

:func:`summarize` turns every rank's spans into the step's figures: per rank ``busy_s`` (compute), ``wait_s``
(blocked in a receive) and ``idle_s`` (the rest of the step's window), and the measured bubble
1 - Σ busy / (p · window) next to the theory of :func:`~torch_handle.parallel.pipeline.schedules.theoretical_bubble`.
The window is the longest rank's span from its own start to its last action; starts are aligned by the collective
that ends the previous step (every rank leaves it together, within its latency).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from torch_handle.parallel.pipeline.schedules import theoretical_bubble

COMPUTE = ("F", "B", "W")
Span = tuple[str, int, int, float, float]
"""(kind, micro-batch, stage, start_s, end_s): ``kind`` one of F, B, W or recv; seconds from the step's start."""


class _Open:
    __slots__ = ("timeline", "kind", "microbatch", "stage", "start")

    def __init__(self, timeline: "Timeline", kind: str, microbatch: int, stage: int):
        self.timeline, self.kind, self.microbatch, self.stage = timeline, kind, microbatch, stage

    def __enter__(self) -> None:
        self.start = self.timeline._mark()

    def __exit__(self, *exc: Any) -> None:
        self.timeline._raw.append((self.kind, self.microbatch, self.stage, self.start, self.timeline._mark()))


class Timeline:
    """One rank's spans of one step: ``begin()``, then ``with span(kind, microbatch, stage):`` around each action,
    ``spans()`` after the step (after ``torch.cuda.synchronize`` on GPU).

    Args:
        device: CUDA: events on the current stream; else ``perf_counter``.
        enabled: False: no marks are taken and :meth:`spans` returns [].
    """

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = True):
        self.cuda = torch.device(device).type == "cuda"
        self.enabled = enabled
        self._raw: list[tuple[str, int, int, Any, Any]] = []
        self._origin: Any = None

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        """Start a step: forget the previous one's spans."""
        self._raw = []
        self._origin = self._mark() if self.enabled else None

    def span(self, kind: str, microbatch: int, stage: int) -> Any:
        """Context manager recording one span (a no-op when disabled)."""
        if not self.enabled:
            import contextlib

            return contextlib.nullcontext()
        return _Open(self, kind, microbatch, stage)

    def spans(self) -> list[Span]:
        """This step's spans in seconds from :meth:`begin`, in the order they ended."""
        if not self.enabled or self._origin is None:
            return []
        if self.cuda:
            o = self._origin
            return [(k, i, s, o.elapsed_time(a) / 1e3, o.elapsed_time(b) / 1e3) for k, i, s, a, b in self._raw]
        o = self._origin
        return [(k, i, s, a - o, b - o) for k, i, s, a, b in self._raw]


def summarize(per_rank: list[list[Span]], schedule: str, pp: int, n_microbatches: int, v: int = 1, *,
              timeline: bool = False) -> dict[str, Any]:
    """The ``pipeline`` field of a step event from every pipeline rank's spans (index = pipeline rank).

    Returns ``{"schedule", "pp", "v", "microbatches", "window_s", "bubble", "bubble_theory", "ranks": [{"busy_s",
    "wait_s", "idle_s"}, ...]}`` plus ``"timeline"`` (every span, ``[rank, kind, microbatch, stage, start_s,
    end_s]``, rounded to microseconds) when ``timeline`` is set."""
    window = max((end for spans in per_rank for *_, end in spans), default=0.0)
    ranks = []
    for spans in per_rank:
        busy = sum(end - start for kind, _, _, start, end in spans if kind in COMPUTE)
        wait = sum(end - start for kind, _, _, start, end in spans if kind not in COMPUTE)
        ranks.append({"busy_s": busy, "wait_s": wait, "idle_s": max(0.0, window - busy - wait)})
    measured = 1.0 - sum(r["busy_s"] for r in ranks) / (len(ranks) * window) if window > 0 else float("nan")
    out: dict[str, Any] = {"schedule": schedule, "pp": pp, "v": v, "microbatches": n_microbatches,
                           "window_s": window, "bubble": measured,
                           "bubble_theory": theoretical_bubble(schedule, pp, n_microbatches, v), "ranks": ranks}
    if timeline:
        out["timeline"] = [[r, kind, i, s, round(a, 6), round(b, 6)]
                           for r, spans in enumerate(per_rank) for kind, i, s, a, b in spans]
    return out
