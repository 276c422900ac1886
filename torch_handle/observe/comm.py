"""Communication per parallel dimension: the ``comm`` field of a step event, ``{"dp": s, "tp": s, "pp": s}``, read
from what the event already carries (rank 0's figures, seconds of the step):

- ``dp``: the strategy's gradient-communication wait not hidden behind backward, ``comm_s`` (the hand-written
  strategies report it; torch DDP and FSDP do not, and then ``dp`` is left out rather than shown as 0);
- ``tp``: the step's tensor-parallel collectives, ``tp_comm_s`` (``tp_impl = "scratch"``; native DTensor TP
  reports none);
- ``pp``: rank 0's blocked receives in the pipeline schedule, ``pipeline.ranks[0].wait_s``
  (:func:`torch_handle.parallel.pipeline.timeline.summarize`; ``pp_impl = "scratch"``: torch's schedules wait
  inside the schedule, where a stage cannot observe it, and report 0, so ``pipeline.impl = "native"`` gives none);
- ``cp``: rank 0's seconds blocked in the context-parallel attention's communication, ``cp_comm_s`` (a collective's
  call, a ring pass's wait after the compute it overlapped: :mod:`torch_handle.parallel.context.comms`). Not one
  of :data:`DIMENSIONS` (the degrees ``handle bench scaling`` varies): it follows them.

Only the dimensions of degree > 1 in the event's ``layout`` appear. Standard library only.
"""

from __future__ import annotations

from typing import Any

from torch_handle.observe.fields import COMM, COMM_S, CP_COMM_S, TP_COMM_S
from torch_handle.observe.tail import integer, number

DIMENSIONS = ("dp", "tp", "pp")


def _pipeline_wait(pipeline: Any) -> Any:
    if not isinstance(pipeline, dict) or pipeline.get("impl") == "native":
        return None
    ranks = pipeline.get("ranks")
    first = ranks[0] if isinstance(ranks, list) and ranks else None
    return first.get("wait_s") if isinstance(first, dict) else None


def comm_fields(record: dict[str, Any]) -> dict[str, Any]:
    """``{"comm": {"dp": s, "tp": s, "pp": s}}`` for the step record ``record`` (a step event under
    construction or read back), with each dimension whose degree in ``record["layout"]`` is above 1 and whose
    seconds the record carries (finite, >= 0); ``{}`` when no dimension qualifies or there is no layout. Never
    raises on a malformed record."""
    layout = record.get("layout")
    if not isinstance(layout, dict):
        return {}
    seconds = {"dp": record.get(COMM_S), "tp": record.get(TP_COMM_S), "pp": _pipeline_wait(record.get("pipeline")),
               "cp": record.get(CP_COMM_S)}
    wide = [dim for dim in (*DIMENSIONS, "cp") if (integer(layout.get(dim)) or 1) > 1]
    out = {dim: value for dim in wide if (value := number(seconds[dim])) is not None and value >= 0}
    return {COMM: out} if out else {}


def read_comm(value: Any) -> dict[str, float] | None:
    """A step event's ``comm`` as ``{dimension: seconds}`` in the order dp, tp, pp, then any other name (a later
    dimension needs no new code); entries that are not finite non-negative numbers left out. None when nothing
    is left."""
    if not isinstance(value, dict):
        return None
    others = sorted(k for k in value if isinstance(k, str) and k not in DIMENSIONS)
    names = [d for d in DIMENSIONS if d in value] + others
    out = {name: s for name in names if (s := number(value[name])) is not None and s >= 0}
    return out or None
