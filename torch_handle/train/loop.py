"""Who runs a step's micro-batches: the trainer's gradient accumulation, or a loop a strategy brings (a pipeline).

A :class:`MicroBatchLoop` runs the forward, loss and backward of every micro-batch of one optimizer step and adds
the step's summed loss and token count into ``stats`` (``[loss · tokens, tokens, ...]``: the trainer all-reduces
it once). The trainer does everything around it: the step's timer and TP traffic, the sync, the optimizer step,
the event. :class:`GradientAccumulation` is the loop of every data-parallel strategy, micro-batch after micro-batch;
:class:`~torch_handle.train.shares.pipeline.PipelineParallel` schedules them over the stages of a pipeline.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Protocol

import torch

from torch_handle.model.parallelize import checkpointed_blocks
from torch_handle.observe.heartbeat import beat


def plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (native TP's loss) as a plain tensor; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class MicroBatchLoop(Protocol):
    activation_saved_bytes: int | None
    """Bytes autograd saved for this rank's first micro-batch (measured once per process; None before), for the memory
    telemetry's ``activation_saved_bytes``."""

    def run(self, trainer: Any, batches: Iterator[dict[str, torch.Tensor]], stats: torch.Tensor) -> None:
        """Forward, loss and backward of the step's ``training.grad_accum`` micro-batches from ``batches``; adds
        Σ loss · tokens to ``stats[0]`` and the tokens to ``stats[1]`` (each once per model replica)."""


def activation_counter(model: torch.nn.Module) -> Any:
    """Counts the distinct storages autograd saves during one micro-batch's forward of ``model`` (parameters and
    buffers left out; with activation checkpointing the blocks' inputs instead): ``activation_saved_bytes`` in the
    memory telemetry, as ``handle estimate`` names its prediction."""
    from torch_handle.observe.activations import SavedTensorCounter

    return SavedTensorCounter([*model.parameters(), *model.buffers()], checkpointed_blocks(model))


class GradientAccumulation:
    """One micro-batch after another: forward and loss under the strategy's autocast, backward, with the
    strategy's gradient sync on the last one only (``accumulating(sync=...)``)."""

    def __init__(self) -> None:
        self.activation_saved_bytes: int | None = None

    def run(self, trainer: Any, batches: Iterator[dict[str, torch.Tensor]], stats: torch.Tensor) -> None:
        t, timer, strategy = trainer.training, trainer.timer, trainer.strategy
        for i in range(t.grad_accum):
            beat("train_step", trainer.step)
            with timer.phase("data"):
                batch = next(batches)
                if trainer.test_delay_s:
                    time.sleep(trainer.test_delay_s)  # HANDLE_TEST_DELAY_RANK: a slow input pipeline, for tests
            with strategy.accumulating(sync=i == t.grad_accum - 1), trainer.micro_batch():
                with timer.phase("forward"):
                    if i == 0 and self.activation_saved_bytes is None:  # once per process: what autograd saves
                        with activation_counter(strategy.unwrapped()) as counter:
                            loss, n = trainer.forward_loss(batch)
                        self.activation_saved_bytes = counter.bytes
                    else:
                        loss, n = trainer.forward_loss(batch)
                    once = float(trainer.ctx.tp_rank == 0)  # a replica's TP ranks hold the same loss: count it once
                    stats[0] += plain(loss).detach().double() * n * once
                    stats[1] += n * once
                with timer.phase("backward"):
                    weight = getattr(trainer, "loss_weight", None)  # the global batch's mean (Trainer._loss_weight)
                    strategy.backward(loss if weight is None else loss * (n * weight))
