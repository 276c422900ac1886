"""What a training process does differently when ``parallel.tp > 1``: the mesh, the split model, the loss over a
split vocabulary, the gradient norm over split gradients, and the TP traffic in the step event.

The trainer calls :class:`TensorParallel` at five points (build, loss, backward, before the optimizer step, step
event); everything else (the data-parallel strategy, the loop, checkpoints of the replicated state) is unchanged.
Ranks are laid out dp × tp with TP fastest (:mod:`torch_handle.parallel.mesh`): the TP ranks of one replica read
the same micro-batches, so the data samplers use the data-parallel rank and size.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ContextManager

import torch
from torch import nn

from torch_handle.checkpoint.convert import load_schedule, read_portable, write_portable
from torch_handle.config.schema import ParallelConfig
from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.model.parallelize import parallelize_tensor, tensor_parallel_plan
from torch_handle.parallel.tensor.checkpoint import full_model_state, full_optimizer_state, load_full_state
from torch_handle.model.linear_cross_entropy_tp import (vocab_parallel_linear_cross_entropy,
                                                        vocab_parallel_sequence_logps)
from torch_handle.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_token_losses
from torch_handle.parallel.tensor.layers import all_reduce_grads
from torch_handle.parallel.tensor.plan import partial_grad
from torch_handle.train.grad_norm import clip_, local, mesh_grad_norm
from torch_handle.train.shares.contract import PortableShare
from torch_handle.train.strategy import DistContext


class TensorParallel(PortableShare):
    """One process's share of tensor parallelism (``parallel.tp > 1``), for the trainer.

    ``impl`` ``"scratch"``: the hand-written layers; the model returns this rank's vocabulary slice of the logits
    and the loss is :func:`vocab_parallel_cross_entropy`. ``"native"``: DTensor; the model returns a DTensor of
    logits sharded over the vocabulary, and forward, loss and backward of a micro-batch run under
    ``loss_parallel()`` (:meth:`micro_batch`)."""

    def __init__(self, parallel: ParallelConfig, ctx: DistContext) -> None:
        self.impl, self.sequence_parallel = parallel.tp_impl, parallel.sequence_parallel
        self.ctx, self.tp = ctx, ctx.tp_group
        self.plan: dict[str, Any] = {}
        self.strategy: Any = None  # the data-parallel strategy that steps the split model (set by the trainer)

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Split ``model`` (same weights on every rank) over this rank's TP group, in place."""
        self.plan = tensor_parallel_plan(model)
        target = self.tp if self.impl == "scratch" else self.ctx.mesh["tp"]
        return parallelize_tensor(model, self.impl, target, sequence_parallel=self.sequence_parallel)

    # -- checkpoints: the one-process state, in the portable form (any strategy or world size resumes it) ---------
    def _target(self) -> Any:
        return self.tp if self.impl == "scratch" else self.ctx.mesh["tp"]

    def full_state_dict(self, model: nn.Module | None = None) -> dict[str, torch.Tensor] | None:
        """The one-process state dict (names and values of the unsplit model) on rank 0, None elsewhere; a
        collective over the TP group. ``model``: the split model (default: the strategy's)."""
        model = model if model is not None else self.strategy.unwrapped()
        state = full_model_state(model, self.impl, self.plan, self._target())
        return state if self.ctx.is_main else None

    def checkpoint_layout(self) -> dict[str, Any]:
        """A TP checkpoint is the portable form itself (DCP, full tensors by name: ``format = "dcp"``), so that
        ``single``, ``ddp`` or ``fsdp`` on any world size resume it, and it records the layout that wrote it."""
        return {"format": "dcp", "strategy": self.strategy.name, "tp": self.tp.size, "tp_impl": self.impl}

    def save(self, ckpt_dir: Path) -> None:
        """Gather the full model and optimizer state to rank 0 and write it as the portable form (with the LR
        schedule); every rank calls it. A GradScaler's state (fp16) is not kept: it starts afresh on resume."""
        model, optimizer = self.strategy.unwrapped(), self.strategy.optimizer
        weights = full_model_state(model, self.impl, self.plan, self._target())
        state = full_optimizer_state(model, optimizer, self.impl, self.plan, self._target())
        if self.ctx.is_main:
            write_portable(Path(ckpt_dir), weights, state, self.strategy.scheduler.state_dict())

    def load_portable(self, portable: Path) -> None:
        """Every rank reads the full portable form and keeps its slices (no communication); then the LR schedule."""
        weights, state, scheduler = read_portable(Path(portable))
        load_full_state(self.strategy.unwrapped(), self.strategy.optimizer, weights, state, self.impl, self.plan,
                        self._target())
        load_schedule(self.strategy.optimizer, self.strategy.scheduler, scheduler)

    def micro_batch(self) -> ContextManager:
        """Context of one micro-batch's forward, loss and backward: ``loss_parallel()`` for the native path."""
        if self.impl == "native":
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def loss(self, logits: Any, labels: torch.Tensor, label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(token-mean loss, labelled tokens) of vocabulary-split logits (B, T, V/tp), replicated on the TP ranks.
        The trainer passes it through ``AuxLossScale.probe``, as ``loss_fn``'s: an MoE layer's attached balancing
        losses (:mod:`torch_handle.model.aux_loss`) read the factor it was scaled by."""
        if self.impl == "scratch":
            return vocab_parallel_cross_entropy(logits, labels, self.tp, label_smoothing)
        import torch.nn.functional as F

        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               label_smoothing=label_smoothing)
        return loss, (labels != IGNORE_INDEX).sum()

    def chunked_loss(self, hidden: Any, weight: Any, labels: torch.Tensor, label_smoothing: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``training.loss_impl = "chunked"``: :meth:`loss` of the logits ``hidden @ weight.T`` without them, each
        rank its vocabulary rows of a chunk of tokens at a time (:func:`vocab_parallel_linear_cross_entropy`).
        hidden (B, T, C), or this rank's (B, T/tp, C) under sequence parallelism; weight the split output layer's
        (V/tp, C), or its ``Shard(0)`` DTensor (native); labels (B, T). The same loss and gradients as
        :meth:`loss` of the output layer's logits (fp32: within 1e-6, tests/test_tp_primitives.py)."""
        loss = vocab_parallel_linear_cross_entropy(hidden, weight, labels, self.tp, label_smoothing, IGNORE_INDEX,
                                                   sequence_parallel=self.sequence_parallel)
        return loss, (labels != IGNORE_INDEX).sum()

    def chunked_logps(self, hidden: Any, weight: Any, labels: torch.Tensor) -> torch.Tensor:
        """A preference objective's per-row summed log-probabilities (B,) fp32 with ``training.loss_impl =
        "chunked"``: minus the row sums of :meth:`token_losses` of the logits ``hidden @ weight.T`` without them,
        each rank its vocabulary rows of a chunk of tokens at a time (:func:`vocab_parallel_sequence_logps`);
        hidden, weight and labels as :meth:`chunked_loss` takes them. Within 1e-6 of the full path in fp32
        (tests/test_tp_primitives.py)."""
        return vocab_parallel_sequence_logps(hidden, weight, labels, self.tp, IGNORE_INDEX,
                                             sequence_parallel=self.sequence_parallel)

    def token_losses(self, logits: Any, labels: torch.Tensor) -> torch.Tensor:
        """Each token's cross-entropy (B, T) fp32 of vocabulary-split logits (B, T, V/tp), 0 where ignored,
        replicated on the TP ranks and differentiable: :func:`vocab_parallel_token_losses`, or native
        ``F.cross_entropy(reduction="none")`` under ``loss_parallel()`` (torch 2.13: a replicated DTensor on the
        one-dimensional TP mesh), as a plain tensor."""
        if self.impl == "scratch":
            return vocab_parallel_token_losses(logits, labels, self.tp)
        import torch.nn.functional as F

        token = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="none")
        return token.to_local().view_as(labels)

    def begin_step(self) -> None:
        """Start counting this step's TP traffic (evaluation's forwards are not the step's)."""
        self.tp.stats.reset()

    def before_step(self, max_norm: float) -> float:
        """After the last backward of a step, before the strategy's optimizer step: sum the partial gradients over
        the TP group (:meth:`sync_partial_grads`), then clip every gradient by the norm over the whole model (each split
        gradient's square summed over the TP group, each replicated one counted once). Returns that norm, before
        clipping; the strategy's own clip then finds nothing above ``max_norm``."""
        named = [(n, p) for n, p in self.strategy.unwrapped().named_parameters() if p.grad is not None]
        self.sync_partial_grads(named)
        norm = mesh_grad_norm(named, self.ctx.mesh, self.plan)
        clip_((p for _, p in named), norm, max_norm)
        return norm

    def sync_partial_grads(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """Sum over the TP group, in one all-reduce, the gradients of replicated parameters that are partial sums
        (:func:`~torch_handle.parallel.tensor.plan.partial_grad`): under sequence parallelism the norms' and the
        row-parallel biases' (hand-written path; DTensor sums its own), and the per-head q/k norms' (both paths).
        Part of :meth:`before_step`; by name, since FSDP's parameters are new tensors."""
        sp = self.impl == "scratch" and self.sequence_parallel
        all_reduce_grads([local(p.grad) for n, p in named if partial_grad(n, self.plan, sp)], self.tp)

    def step_stats(self, timeline: bool = False) -> dict[str, Any]:
        """The layout, and for the hand-written path this step's TP collectives: ``tp_comm_calls``,
        ``tp_comm_bytes`` (full-tensor bytes) and ``tp_comm_s`` (seconds this rank spent in them)."""
        out: dict[str, Any] = {"layout": self.ctx.layout.describe()}
        if self.impl == "scratch":
            s = self.tp.stats
            out.update(tp_comm_calls=s.calls, tp_comm_bytes=s.bytes, tp_comm_s=s.wait_s)
        return out
