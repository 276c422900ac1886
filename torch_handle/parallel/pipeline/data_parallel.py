"""A pipeline stage's gradients synchronised over its data-parallel ranks once a step, not once a micro-batch.

A stage wrapped by DDP or sharded by FSDP2 runs many forwards and backwards per step (one per micro-batch, in the
schedule's order), where gradient accumulation runs them in pairs; the sync must happen once, after the stage's
last backward (picotron's PR #5 fixed exactly this: a data-parallel all-reduce per micro-batch). This is what
torch's ``PipelineStage`` does for its submodule (``forward_maybe_with_nosync``, ``backward_maybe_with_nosync``,
``perform_reduce_grad`` in ``torch/distributed/pipelining/stage.py``), written out for the hand-written schedules:

- DDP: every forward and every backward but the last under ``no_sync()``; before the last backward the reducer is
  armed (``prepare_for_backward``), so its hooks all-reduce the accumulated gradients bucket by bucket, overlapped
  with that backward.
- FSDP2: every backward with gradient sync off (unsharded gradients accumulate; the weights stay gathered), then,
  after the last, each parameter group's post-backward: one reduce-scatter per unit of the step's sum.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class GradSync(Protocol):
    """A strategy's own gradient sync under a pipeline (one that is not a DDP or FSDP2 module: ``scratch-ddp``'s
    hooks), from ``Strategy.pipeline_grad_sync()``: ``backward(last)`` is the context of each of a stage's
    backwards (the sync may start only when ``last``), ``finish()`` runs once after the schedule."""

    def backward(self, last: bool) -> ContextManager: ...

    def finish(self) -> None: ...


class NoSync:
    """The :class:`GradSync` of a strategy without one of its own."""

    def backward(self, last: bool) -> ContextManager:
        return contextlib.nullcontext()

    def finish(self) -> None:
        pass


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def forward_context(module: nn.Module) -> ContextManager:
    """Context of a stage's forward: DDP's ``no_sync`` (the reducer is armed before the last backward instead)."""
    return module.no_sync() if isinstance(module, DistributedDataParallel) else contextlib.nullcontext()


def backward(module: nn.Module, output: torch.Tensor, grad: torch.Tensor | None, last: bool) -> None:
    """``torch.autograd.backward(output, grad)`` through ``module``'s stage, with its data-parallel gradient sync on
    ``last`` (the stage's last backward of the step) only."""
    if isinstance(module, DistributedDataParallel):
        if last:
            from torch.nn.parallel.distributed import _find_tensors

            module.reducer.prepare_for_backward(list(_find_tensors(output)))
            torch.autograd.backward(output, grad_tensors=grad)
        else:
            with module.no_sync():
                torch.autograd.backward(output, grad_tensors=grad)
        return
    if _is_fsdp(module):
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)
    torch.autograd.backward(output, grad_tensors=grad)


def reduce_grads(module: nn.Module) -> None:
    """After a stage's last backward: FSDP2's post-backward for every unit of ``module`` (reduce-scatter of the
    accumulated gradients, then reshard), as ``PipelineStage.perform_reduce_grad``; nothing for other modules (DDP
    reduced during the last backward)."""
    if not _is_fsdp(module):
        return
    from torch.distributed.fsdp import fully_shard

    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state: Any = fully_shard.state(module)
    for unit in state._state_ctx.all_states:
        for group in unit._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
