"""The contract of a parallel share: what one process holds of a model split by pipeline, context, tensor or expert
parallelism, and what the trainer asks of it.

A run has at most one share (:func:`torch_handle.train.shares.compose.build_shares` resolves it from the layout): the
:class:`~torch_handle.train.shares.pipeline.PipelineParallel` share with a pipeline, which composes the others;
else the :class:`~torch_handle.train.shares.context.ContextParallel` share (cp > 1, around the TP share); else the
:class:`~torch_handle.train.shares.tensor.TensorParallel` share (tp > 1) or the
:class:`~torch_handle.train.shares.expert.ExpertParallel` share (ep > 1). Each call goes to the pipeline's stages,
then to their sequence shards, then to their TP split, then to their experts (the order of :data:`COMPOSITION`).
The data-parallel strategy (DDP, FSDP2, ...) wraps what the share leaves it and steps it; the share then owns what
spans the split: the gradient norm and clipping over every part, the step's layout figures, and checkpoints and
final weights in the one-process form (the portable form: full tensors by name, so that any layout resumes them).

The trainer's calls, in a run's order::

    model = share.parallelize(model)       # build: split (same weights on every rank); the strategy wraps the result
    share.bind(strategy)                   # the strategy stops clipping; its state is saved and loaded here
    share.begin_step(); with share.micro_batch(): loss, n = share.loss(logits, labels, eps)   # each step
    grad_norm = share.before_step(max_norm); strategy.step(); share.step_stats(timeline=...)
    share.save(dir) / share.load_portable(dir) / share.full_state_dict()                     # checkpoints, export
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ContextManager, Protocol, Self, runtime_checkable

import torch
from torch import nn

from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.model.linear_cross_entropy import sequence_logps
from torch_handle.train.loss import chunked_loss_fn, loss_fn, token_losses

COMPOSITION = ("pipeline", "context", "tensor", "expert")
"""The order a composed share delegates in (tp × pp, pp × cp, cp × tp, pp × ep, dp × tp × pp): the pipeline's stages
(joined by name on rank 0, the tied embedding's gradients summed over the first and last stage), each stage's
sequence shards (inputs cut head-tail, the loss over the whole sequence's labels), each stage's TP split (partial
gradients summed, split tensors gathered), its experts (reduced over "edp", gathered over "ep"). A share holds the
later ones it composes, and is built with them in this order. Tensor and expert parallelism do not compose without
a pipeline (``handle validate`` refuses tp > 1 with ep > 1), nor context with expert parallelism."""

UNSPLIT_TP = SimpleNamespace(rank=0)
"""The TP "group" of a share whose model has no tensor parallelism (the ``tp`` argument of
:mod:`torch_handle.parallel.tensor.checkpoint`'s functions, with impl ``"scratch"`` and an empty plan): rank 0 of
one, nothing split."""


@runtime_checkable
class Checkpointer(Protocol):
    """What saves and loads a run's state: the strategy (``Strategy``), or the share bound to it when the model is
    split (every :class:`ParallelShare` is one). The trainer keeps it as ``trainer.checkpointer``."""

    def checkpoint_layout(self) -> dict[str, Any]:
        """What :meth:`save` writes, for ``layout.json`` (a share: ``format = "dcp"``, the portable form, the
        strategy and the share's degree and implementation)."""

    def loads_natively(self, layout: dict[str, Any]) -> bool:
        """Whether :meth:`load` reads a checkpoint of ``layout`` as it is (a share: never; every checkpoint
        reaches it through its portable form and :meth:`load_portable`)."""

    def save(self, ckpt_dir: Path) -> None:
        """Write the model and optimizer state (and the LR schedule) to ``ckpt_dir`` (a share: the one-process
        portable form); every rank calls it."""

    def load(self, ckpt_dir: Path) -> None:
        """Load a checkpoint :meth:`save` wrote (a share's: its portable form)."""

    def load_portable(self, portable: Path) -> None:
        """Load the portable form (any layout's): every rank keeps its slices of the full tensors."""

    def parameter_names(self) -> list[str]:
        """The one-process model's trainable parameter names in ``named_parameters()`` order (how a ``torch``
        checkpoint's numbered optimizer state maps to names)."""


@runtime_checkable
class ParallelShare(Checkpointer, Protocol):
    """One process's share of a split model, for the trainer (see the module)."""

    strategy: Any
    """The data-parallel strategy that steps the split model (set by :meth:`bind`)."""

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Split ``model`` (on its device, the same weights on every rank) into this rank's share; returns the
        module the strategy steps (``model`` itself, split in place, or a pipeline's shard of it)."""

    def bind(self, strategy: Any) -> ParallelShare:
        """Work with the ``strategy`` built over the split model: it stops clipping (:meth:`before_step` clips by
        the norm over every part) and its model's state is saved and loaded here. Returns self."""

    def begin_step(self) -> None:
        """Before a step's micro-batches (TP: start counting the step's traffic)."""

    def micro_batch(self) -> ContextManager:
        """Context of a micro-batch's forward, loss and backward (native TP: ``loss_parallel()``)."""

    def loss(self, logits: Any, labels: torch.Tensor, label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(token-mean loss, labelled tokens) of this share's logits (B, T, V or V/tp) and labels (B, T)."""

    def chunked_loss(self, hidden: Any, weight: Any, labels: torch.Tensor, label_smoothing: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`loss` of the logits ``hidden @ weight.T`` without making them (``training.loss_impl =
        "chunked"``): this share's final hidden states (B, T, C), its output layer's weight (V or V/tp, C), labels
        (B, T)."""

    def chunked_logps(self, hidden: Any, weight: Any, labels: torch.Tensor) -> torch.Tensor:
        """Each row's summed log-probability of its labels (B,) fp32, differentiable, from the logits ``hidden @
        weight.T`` without making them (``training.loss_impl = "chunked"`` of a preference objective), hidden,
        weight and labels as :meth:`chunked_loss` takes them; the same on every rank that computes it."""

    def token_losses(self, logits: Any, labels: torch.Tensor) -> torch.Tensor:
        """Each token's cross-entropy (B, T) fp32 (0 where ignored), differentiable, of this share's logits and
        labels as :meth:`loss` takes them, the same on every rank that computes it."""

    def before_step(self, max_norm: float) -> float:
        """After a step's last backward, before the strategy's optimizer step: finish the gradients (what the
        strategy does not reduce) and clip them all by the norm over every part of the model. Returns that norm
        before clipping. Collective."""

    def step_stats(self, timeline: bool = False) -> dict[str, Any]:
        """The step event's figures of this share (``layout``; TP traffic; the pipeline's bubble, with its spans
        when ``timeline``); on rank 0. Collective for a pipeline."""

    def full_state_dict(self, model: nn.Module | None = None) -> dict[str, torch.Tensor] | None:
        """The one-process state dict (names and shapes of the unsplit model) on rank 0, None elsewhere; a
        collective. ``model``: the split model (default: the strategy's)."""


class PortableShare:
    """What the shares have in common: the portable form is their checkpoint (no native load), the strategy's
    model keeps the one-process parameter names, and nothing to do around a micro-batch or before a step. A share
    overrides what it does differently."""

    strategy: Any = None

    def bind(self, strategy: Any) -> Self:
        """Keep ``strategy`` and stop its clipping (the share's ``before_step`` clips, by the norm over every part
        of the split model). Returns self; a share that holds others binds them as well."""
        self.strategy = strategy
        strategy.clips_gradients = False
        return self

    def begin_step(self) -> None:
        return None

    def micro_batch(self) -> ContextManager:
        return contextlib.nullcontext()

    def loss(self, logits: Any, labels: torch.Tensor, label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
        return loss_fn(logits, labels, label_smoothing)

    def chunked_loss(self, hidden: Any, weight: Any, labels: torch.Tensor, label_smoothing: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return chunked_loss_fn(hidden, weight, labels, label_smoothing)  # the output layer whole

    def chunked_logps(self, hidden: Any, weight: Any, labels: torch.Tensor) -> torch.Tensor:
        return sequence_logps(hidden, weight, labels, IGNORE_INDEX)  # the output layer whole

    def token_losses(self, logits: Any, labels: torch.Tensor) -> torch.Tensor:
        return token_losses(logits, labels)

    def loads_natively(self, layout: dict[str, Any]) -> bool:
        return False  # every checkpoint reaches a split model through its portable form (load_portable)

    def load(self, ckpt_dir: Path) -> None:
        self.load_portable(Path(ckpt_dir))  # its checkpoint is the portable form itself (format "dcp")

    def load_portable(self, portable: Path) -> None:
        raise NotImplementedError

    def parameter_names(self) -> list[str]:
        return self.strategy.parameter_names()
