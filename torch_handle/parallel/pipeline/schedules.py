"""The order in which one pipeline stage runs the forwards (F) and backwards (B) of a step's micro-batches.

A schedule here is a pure function ``(n_stages, stage, n_microbatches) -> [Action, ...]``: what this stage does,
in order. The executor (:mod:`torch_handle.parallel.pipeline.scratch`) receives before an F (the activation from the
stage before) and before a B (the gradient from the stage after), so the order alone decides the schedule.

- **GPipe** (Huang et al. 2019): all m forwards, then all m backwards. Simple; the first stage holds the
  activations of all m micro-batches at once.
- **1F1B** (Narayanan et al. 2019, PipeDream-Flush; Megatron-LM's ``forward_backward_pipelining_without_interleaving``):
  ``p - stage - 1`` warm-up forwards, then one forward and one backward in turn, then the remaining backwards. The
  same bubble as GPipe, but stage s holds at most ``p - s`` micro-batches of activations.

With p stages and m micro-batches, each F taking t_f and each B t_b on every stage and no communication cost, both
leave each stage idle for (p - 1)(t_f + t_b) of a step of (m + p - 1)(t_f + t_b): the bubble fraction
(p - 1) / (m + p - 1) (GPipe paper §2.3; Narayanan et al. 2021 §2.2). Interleaving v model chunks per rank
(Narayanan et al. 2021, §2.2) divides the bubble by v: (p - 1) / (v·m + p - 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from torch_handle.config.schema import PP_MULTI_STAGE, PP_V_SHAPED

ActionKind = Literal["F", "B"]


@dataclass(frozen=True)
class Action:
    """One unit of a stage's work: the forward (``"F"``) or backward (``"B"``) of micro-batch ``microbatch``."""

    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def gpipe(n_stages: int, stage: int, n_microbatches: int) -> list[Action]:
    """All forwards, then all backwards (in micro-batch order, as picotron's ``train_step_pipeline_afab``)."""
    return [Action("F", i) for i in range(n_microbatches)] + [Action("B", i) for i in range(n_microbatches)]


def one_f_one_b(n_stages: int, stage: int, n_microbatches: int) -> list[Action]:
    """Warm-up forwards, steady one-forward-one-backward, cool-down backwards (PipeDream-Flush)."""
    warmup = min(n_stages - stage - 1, n_microbatches)
    order = [Action("F", i) for i in range(warmup)]
    forwards, backwards = warmup, 0
    while forwards < n_microbatches:  # steady state: F(i) then B(i - warmup)
        order.append(Action("F", forwards))
        forwards += 1
        order.append(Action("B", backwards))
        backwards += 1
    order += [Action("B", i) for i in range(backwards, n_microbatches)]
    return order


SCRATCH_SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}
"""The schedules ``pp_impl = "scratch"`` runs, by their ``parallel.pp_schedule`` name."""

NATIVE_SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""``parallel.pp_schedule`` name -> class of ``torch.distributed.pipelining`` (``pp_impl = "native"``)."""



def stage_ranks(pp: int, v: int, schedule: str) -> list[int]:
    """The pipeline rank that runs each of the ``pp · v`` stages: round-robin (stage s on rank s mod pp, Megatron's
    interleaving), or a V for the V-shaped schedules (stages r and 2·pp - 1 - r on rank r)."""
    if schedule in PP_V_SHAPED:
        return [s if s < pp else 2 * pp - 1 - s for s in range(pp * v)]
    return [s % pp for s in range(pp * v)]


def theoretical_bubble(schedule: str, pp: int, n_microbatches: int, v: int = 1) -> float:
    """The idle fraction of each rank in a step, with equal F and B times and free communication:
    (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v·m + p - 1) for interleaved schedules. The zero-bubble
    schedules (Qi et al. 2023) split B into input- and weight-gradient parts to fill it: the same formula is
    their upper bound, reported as such."""
    chunks = v if schedule in PP_MULTI_STAGE else 1
    return (pp - 1) / (chunks * n_microbatches + pp - 1)
