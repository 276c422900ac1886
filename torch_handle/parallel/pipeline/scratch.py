"""GPipe and 1F1B by hand: one stage's share of a pipelined step, run in the order its schedule gives.

For a forward of micro-batch i a stage receives its input from the stage before (the first stage reads the batch),
runs its layers and sends the output on; the last stage computes the loss instead. For a backward it receives the
gradient of its output from the stage after (the last stage starts from its loss), back-propagates through its
layers and sends its input's gradient back. What the stage keeps between the two is the input and output of every
micro-batch in flight: activations held are what 1F1B saves over GPipe.

The loss of a micro-batch is scaled by the caller (``loss_fn``) so that the gradients accumulated over the m
micro-batches are those of the whole step's loss; nothing is rescaled afterwards.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from torch_handle.observe.activations import SavedTensorCounter
from torch_handle.observe.heartbeat import beat
from torch_handle.parallel.pipeline import data_parallel
from torch_handle.parallel.pipeline.p2p import StageLink
from torch_handle.parallel.pipeline.schedules import SCRATCH_SCHEDULES, Action
from torch_handle.parallel.pipeline.timeline import Timeline

LossFn = Callable[[torch.Tensor, int], torch.Tensor]
"""``loss_fn(output, microbatch) -> scalar``: the last stage's loss of micro-batch ``microbatch`` (already scaled)."""


class ScratchPipeline:
    """Runs one stage of a pipeline (``pp_impl = "scratch"``; one stage per rank).

    Args:
        module: this stage's layers: ``module(h, **inputs)`` with ``h`` None on the first stage; a DDP or FSDP2
            module syncs its gradients over its data-parallel ranks once a step (:mod:`.data_parallel`).
        link: the stage's sends and receives.
        n_stages: p.
        schedule: ``"gpipe"`` or ``"1f1b"`` (:data:`~torch_handle.parallel.pipeline.schedules.SCRATCH_SCHEDULES`).
        timeline: records each F and B.
        grad_sync: a strategy's own gradient sync (``scratch-ddp``), started in the stage's last backward and
            finished after the schedule.
    """

    def __init__(self, module: nn.Module, link: StageLink, n_stages: int, schedule: str, timeline: Timeline,
                 grad_sync: data_parallel.GradSync | None = None):
        self.module, self.link, self.n_stages, self.timeline = module, link, n_stages, timeline
        self.grad_sync = grad_sync or data_parallel.NoSync()
        self.stage = link.stage
        self.order_of: Callable[[int, int, int], list[Action]] = SCRATCH_SCHEDULES[schedule]
        self.is_first, self.is_last = self.stage == 0, self.stage == n_stages - 1
        self.saved_bytes: list[int] = []
        """Bytes autograd saved for each micro-batch's forward in the last step (counted when ``count_saved``)."""
        self.peak_saved_bytes = 0
        """The most saved bytes alive at once in the last step: micro-batches forwarded but not yet backwarded."""
        self.count_saved = False
        self._inputs: dict[int, torch.Tensor | None] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def step(self, inputs: list[dict[str, Any]], loss_fn: LossFn) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch (``inputs[i]``: micro-batch i's keyword arguments for the
        module, the same on every stage). Returns the last stage's detached losses (empty elsewhere); the
        parameters' ``.grad`` hold the step's gradients."""
        losses: list[torch.Tensor] = []
        self.saved_bytes, self.peak_saved_bytes = [0] * len(inputs), 0
        order = self.order_of(self.n_stages, self.stage, len(inputs))
        last = max(i for i, action in enumerate(order) if action.kind == "B")
        for i, action in enumerate(order):
            if action.kind == "F":
                with data_parallel.forward_context(self.module):
                    self._forward(action.microbatch, inputs[action.microbatch], loss_fn, losses)
            else:
                self._backward(action.microbatch, last=i == last)
        data_parallel.reduce_grads(self.module)
        self.grad_sync.finish()
        self.link.flush()
        return losses

    @torch.no_grad()
    def evaluate(self, inputs: list[dict[str, Any]], loss_fn: LossFn) -> list[torch.Tensor]:
        """Forwards only (no graph kept): the last stage's losses, empty elsewhere."""
        losses = []
        for i, kwargs in enumerate(inputs):
            h = None if self.is_first else self.link.recv_activation(i)
            out = self.module(h, **kwargs)
            if self.is_last:
                losses.append(loss_fn(out, i))
            else:
                self.link.send_activation(out, i)
        self.link.flush()
        return losses

    def _forward(self, i: int, kwargs: dict[str, Any], loss_fn: LossFn, losses: list[torch.Tensor]) -> None:
        h = None if self.is_first else self.link.recv_activation(i)
        beat(f"forward mb {i}")
        counter = SavedTensorCounter(self.module.parameters()) if self.count_saved else None
        with self.timeline.span("F", i, self.stage):
            if counter is not None:
                with counter:
                    out = self.module(h, **kwargs)
                self.saved_bytes[i] = counter.bytes
            else:
                out = self.module(h, **kwargs)
            if self.is_last:
                out = loss_fn(out, i)
                losses.append(out.detach())
        self._inputs[i], self._outputs[i] = h, out
        live = sum(self.saved_bytes[j] for j in self._outputs)
        self.peak_saved_bytes = max(self.peak_saved_bytes, live)
        if not self.is_last:
            self.link.send_activation(out, i)

    def _backward(self, i: int, last: bool) -> None:
        grad = None if self.is_last else self.link.recv_grad(i)
        out, h = self._outputs.pop(i), self._inputs.pop(i)
        beat(f"backward mb {i}")
        with self.timeline.span("B", i, self.stage):
            with self.grad_sync.backward(last):  # the data-parallel sync in the stage's last backward
                data_parallel.backward(self.module, out, grad, last)
        if not self.is_first:
            self.link.send_grad(h.grad, i)
