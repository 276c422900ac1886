"""The native pipeline: this rank's stages as ``torch.distributed.pipelining.PipelineStage`` s, timed, and the
schedule class ``parallel.pp_schedule`` names (torch docs, "Pipeline Parallelism"; torchtitan's
``pipeline_parallel.py`` builds the same).

:class:`TimedStage` records when each forward (``F``), full or input-gradient backward (``B``) and weight-gradient
backward (``W``, zero-bubble schedules) ran, and names the receive a stage is about to wait in as its heartbeat
phase. torch's schedules wait for their receives inside the schedule, where a stage cannot observe the wait, so
on this path the bubble counts those waits as idle (``wait_s`` is 0).
"""

from __future__ import annotations

from typing import Any

from torch.distributed import pipelining
from torch.distributed.pipelining import PipelineStage

from torch_handle.observe.activations import SavedTensorCounter
from torch_handle.observe.heartbeat import beat
from torch_handle.parallel.pipeline import data_parallel
from torch_handle.parallel.pipeline.schedules import NATIVE_SCHEDULES
from torch_handle.parallel.pipeline.timeline import Timeline
from torch_handle.train.routing import uncounted


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that records its actions on ``timeline`` (and, when ``count_saved`` is set, the bytes
    autograd saves for each micro-batch's forward and the most alive at once)."""

    def __init__(self, *args: Any, timeline: Timeline, grad_sync: data_parallel.GradSync | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.timeline, self.grad_sync = timeline, grad_sync or data_parallel.NoSync()
        self.count_saved = False
        self.inferring = False
        self.saved_bytes: dict[int, int] = {}
        self.peak_saved_bytes = 0

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        """torch 2.13 infers the stage's shapes with a real forward outside ``no_sync``, which arms a DDP
        submodule's reducer for the next backward (the first micro-batch's) as well as the last: run it under
        ``no_sync``, as the schedule's forwards are; and on uninitialised tensors, so an MoE layer's routing in it is
        not counted (``torch_handle.train.routing.uncounted``)."""
        with data_parallel.forward_context(self.submod), uncounted(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        """torch 2.13 infers the backward's shapes by calling the schedule's ``loss_fn`` on that forward's outputs
        (the last stage): ``inferring`` tells the loss it is not a micro-batch's (its metrics are not counted)."""
        self.inferring = True
        try:
            return super()._prepare_backward_infra(*args, **kwargs)
        finally:
            self.inferring = False

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        if not self.is_first:
            beat(f"recv activation mb {fwd_chunk_id} from stage {self.stage_index - 1}")
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        if not self.is_last:
            beat(f"recv gradient mb {bwd_chunk_id} from stage {self.stage_index + 1}")
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        beat(f"forward mb {fwd_chunk_id} stage {self.stage_index}")
        with self.timeline.span("F", fwd_chunk_id, self.stage_index):
            if not (self.count_saved and self.has_backward):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            with SavedTensorCounter(self.submod.parameters()) as counter:
                out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self.saved_bytes[fwd_chunk_id] = counter.bytes
        live = sum(self.saved_bytes.get(i, 0) for i in self.fwd_cache)
        self.peak_saved_bytes = max(self.peak_saved_bytes, live)
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        beat(f"backward mb {bwd_chunk_id} stage {self.stage_index}")
        with self.timeline.span("B", bwd_chunk_id, self.stage_index), \
                self.grad_sync.backward(kwargs.get("last_backward", False)):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self.timeline.span("W", bwd_chunk_id, self.stage_index), \
                self.grad_sync.backward(kwargs.get("last_backward", False)):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)


class NativeEngine:
    """This rank's :class:`TimedStage` s and their schedule, with the scratch engine's interface for the
    activation figures (``count_saved``, ``saved_bytes``, ``peak_saved_bytes``)."""

    def __init__(self, stages: list[TimedStage], schedule: Any):
        self.stages, self.schedule = stages, schedule

    @property
    def count_saved(self) -> bool:
        return self.stages[0].count_saved

    @count_saved.setter
    def count_saved(self, value: bool) -> None:
        for stage in self.stages:
            stage.count_saved = value
            stage.saved_bytes, stage.peak_saved_bytes = {}, 0

    @property
    def saved_bytes(self) -> list[int]:
        first = self.stages[0].saved_bytes
        return [first.get(i, 0) for i in range(len(first))]

    @property
    def peak_saved_bytes(self) -> int:
        return sum(stage.peak_saved_bytes for stage in self.stages)

    def step(self, **kwargs: Any) -> Any:
        out = self.schedule.step(**kwargs)
        self.stages[0].grad_sync.finish()
        return out

    def eval(self, **kwargs: Any) -> Any:
        return self.schedule.eval(**kwargs)


def native_schedule(pp: Any) -> NativeEngine:
    """The :class:`NativeEngine` of :class:`~torch_handle.train.shares.pipeline.PipelineParallel` ``pp`` (its
    stages built, its group set)."""
    stages = [TimedStage(module, index, pp.n_stages, pp.ctx.device, group=pp.group, timeline=pp.timeline,
                         grad_sync=pp.grad_sync) for module, index in zip(pp.stages, pp.my_stages)]
    cls = getattr(pipelining.schedules, NATIVE_SCHEDULES[pp.schedule_name])
    single = pp.schedule_name in ("gpipe", "1f1b")
    schedule = cls(stages[0] if single else stages, n_microbatches=pp.m, loss_fn=pp.native_loss, scale_grads=False)
    return NativeEngine(stages, schedule)
