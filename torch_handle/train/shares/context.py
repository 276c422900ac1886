"""What a training process does differently when ``parallel.cp > 1``: each micro-batch's sequences split over the cp
ranks, the model's attention run by a context-parallel algorithm, the loss over the whole sequence's labels, and the
load balance in the step event (docs/context-parallel.md).

The cp ranks of a replica read the same samples (the samplers use the data-parallel rank and size,
:mod:`torch_handle.parallel.mesh`). Each micro-batch reaches the model whole, and a forward pre-hook cuts it:

* the whole sequence's positions (``position_ids``, or 0 .. T - 1) and documents (``position_ids`` restarting at 0,
  :func:`~torch_handle.parallel.context.sharding.document_ids_of`) are computed first, then the head-tail order
  (per document) of :func:`~torch_handle.parallel.context.sharding.shard_order`, and the input ids and positions
  are sharded by it: RoPE rotates each token by its true position;
* every ``MultiHeadAttention`` calls :meth:`ContextParallel.attend` in place of its kernel (its
  ``context_parallel`` hook), which runs ring, all-gather or Ulysses attention on this rank's q, k, v with the
  local tokens' positions and documents, so the causal and document masks are the whole sequence's;
* the labels, already shifted on the whole sequence by the data, are sharded by the same order in :meth:`loss`.

The loss of a micro-batch is this rank's sum over the labelled tokens of the whole sequence: each rank returns
``cp · local_sum / n`` (n: the sequence's labelled tokens) with ``n / cp`` as its count, so that the strategy's
average over the dp × cp ranks is each replica's token mean (Megatron-LM and torchtitan divide by the global count
the same way), and the trainer's sums over ranks are the step's loss · tokens and tokens. Packed conversations
(``sft``) weight each micro-batch by the global batch's trained tokens (:func:`~torch_handle.train.loss
.global_mean_weight`) over the dp × cp ranks the strategy averages the gradients over, so the gradient is the one
process's mean over the trained tokens (their labels ``IGNORE_INDEX`` outside the answers, sharded like the others).

A preference loss (``dpo``) needs each row's whole log-probability: :meth:`token_losses` gathers the per-token
losses of the cp ranks with autograd, every rank computes the same pair losses, and the backward sums the ranks'
gradients of each token's loss into the rank that holds it (cp times the token's term, which the strategy's mean
over dp × cp divides back); the reference (adapters off, or the precomputed table, written by the cp rank 0 of each
replica) goes the same way, and the objective counts its pairs and metrics once per cp group.

The model is not split: the data-parallel strategy (DDP, FSDP2 or DeepSpeed ZeRO) holds it over the dp × cp ranks,
reduces the gradients over all of them (and FSDP2 and ZeRO shard over them, torchtitan's ``dp_shard_cp``), clips
and checkpoints it as it would without cp (DeepSpeed clips inside its step; its norm reaches the step event through
:meth:`ContextParallel.step_stats`); its checkpoint is already a whole model's, so a cp 2 run resumes at cp 1 (or
under another strategy) through the strategy's own load or the portable form.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ContextManager

import torch
from torch import Tensor, nn

from torch_handle.config.context_parallel import chosen_cp_impl
from torch_handle.config.schema import ParallelConfig
from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.observe.fields import CP_COMM_S
from torch_handle.parallel.context.blocks import Tokens
from torch_handle.parallel.context.comms import STATS, gather_sequence
from torch_handle.parallel.context.sharding import attention_pairs, document_ids_of, imbalance, shard, shard_order
from torch_handle.train.loop import plain
from torch_handle.train.loss import chunked_loss_fn, loss_fn, token_losses
from torch_handle.train.shares.contract import PortableShare


def _attention_function(impl: str) -> Any:
    """The attention ``impl`` names (:mod:`torch_handle.parallel.context`): hand-written, or ``native`` (torch's
    FlexAttention context parallel, CUDA only: :mod:`torch_handle.config.context_parallel` refuses it elsewhere)."""
    if impl == "ring":
        from torch_handle.parallel.context.ring import ring_attention

        return ring_attention
    if impl == "allgather":
        from torch_handle.parallel.context.allgather import allgather_attention

        return allgather_attention
    if impl == "ulysses":
        from torch_handle.parallel.context.ulysses import ulysses_attention

        return ulysses_attention
    if impl == "native":
        from torch_handle.parallel.context.native import native_attention

        return native_attention
    raise ValueError(f"parallel.cp_impl = {impl!r} does not run in handle run (valid: ring, allgather, ulysses, "
                     f"native)")


class ContextParallel(PortableShare):
    """One process's share of context parallelism (``parallel.cp > 1``), for the trainer (see the module).

    Args:
        parallel: ``[parallel]`` (``cp``, ``cp_impl``).
        ctx: the rank's ``DistContext`` with the layout and ``cp_mesh`` (:func:`~torch_handle.parallel.mesh
            .attach_layout`).
        document_mask: ``data.document_mask`` (what ``cp_impl = "auto"`` picks by).
        inner: the :class:`~torch_handle.train.shares.tensor.TensorParallel` share when tp > 1 (hand-written or
            DTensor): it splits the model first (each rank attends its heads of its tokens), and the loss over a
            split vocabulary (in its micro-batch context: DTensor's ``loss_parallel()``), the norm over split
            gradients, the step's TP traffic and the checkpoints are its own.

    Raises:
        ValueError: a ``cp_impl`` other than ring, allgather, ulysses, native."""

    def __init__(self, parallel: ParallelConfig, ctx: Any, document_mask: bool = False, inner: Any = None) -> None:
        self.impl = chosen_cp_impl(parallel.cp_impl, document_mask)
        self.function = _attention_function(self.impl)
        self.ctx, self.cp, self.rank = ctx, ctx.layout.cp, ctx.cp_rank
        self.group = ctx.cp_mesh["cp"].get_group()
        self.strategy: Any = None
        self.inner = inner
        self._engine: Any = None
        self.tokens: Tokens | None = None
        """The local tokens' positions and documents (B, T/cp) of the micro-batch in the model now."""
        self.order: Tensor | None = None
        """That micro-batch's permutation (B, T): rank r holds ``order[:, r·T/cp : (r+1)·T/cp]``."""
        self.documents: Tensor | None = None
        """Its whole sequence's documents (B, T), None for one document per row."""

    # -- build ----------------------------------------------------------------------------------------------------
    def parallelize(self, model: nn.Module) -> nn.Module:
        """Hook ``model`` (split over tp first by the inner share, in place): its inputs are sharded before its
        forward and every ``MultiHeadAttention`` attends through :meth:`attend`.

        Raises:
            ValueError: the model has no ``MultiHeadAttention``, or one with attention dropout."""
        if self.inner is not None:
            model = self.inner.parallelize(model)
        self.hook_attention(model)
        model.register_forward_pre_hook(self._shard_inputs, with_kwargs=True)
        return model

    def hook_attention(self, model: nn.Module) -> None:
        """Make every ``MultiHeadAttention`` of ``model`` attend through :meth:`attend` (a pipeline's share calls it
        on the whole model before its split, then hooks each stage with :meth:`shard_stage_inputs`).

        Raises:
            ValueError: the model has no ``MultiHeadAttention``, or one with attention dropout."""
        from torch_handle.model.attention import MultiHeadAttention

        layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
        if not layers:
            raise ValueError(f"parallel.cp > 1: {type(model).__name__} has no MultiHeadAttention to split")
        for layer in layers:
            if layer.dropout > 0:
                raise ValueError(f"parallel.cp > 1: attention dropout {layer.dropout} is not applied by the "
                                 f"context-parallel attentions (set model.dropout = 0)")
            layer.context_parallel = self.attend

    def bind(self, strategy: Any) -> ContextParallel:
        """Work with ``strategy``: it clips in :meth:`before_step`, whose norm the trainer reports. Returns self."""
        super().bind(strategy)
        self._engine = getattr(strategy, "engine", None)  # DeepSpeed: ZeRO's partitioned gradients are its own
        if self.inner is not None:
            self.inner.bind(strategy)
        return self

    # -- each micro-batch ----------------------------------------------------------------------------------------
    def _shard_inputs(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """The model's forward pre-hook: the whole micro-batch's ``input_ids`` (B, T) and ``position_ids`` (B, T) or
        None in, this rank's (B, T/cp) of both out (positions always: RoPE needs the true ones)."""
        if args:  # input_ids given by position
            kwargs = {**kwargs, "input_ids": args[0]}
        return args[1:], self.shard_stage_inputs(module, (), kwargs)[1]

    def shard_stage_inputs(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]
                           ) -> tuple[tuple, dict[str, Any]]:
        """A pipeline stage's forward pre-hook (``DecoderStage.forward(h, *, input_ids, position_ids)``): its
        keyword ``input_ids`` and ``position_ids`` of the whole micro-batch (B, T) in, this rank's (B, T/cp) out,
        ``args`` (the previous stage's output, already this rank's tokens) untouched. Every stage recomputes the
        micro-batch's order from its positions, so the last stage's :meth:`loss` shards the labels by it."""
        input_ids, position_ids = kwargs["input_ids"], kwargs.get("position_ids")
        B, T = input_ids.shape
        self.documents = None if position_ids is None else document_ids_of(position_ids)
        positions = torch.arange(T, device=input_ids.device).expand(B, T) if position_ids is None else position_ids
        self.order = shard_order(B, T, self.cp, self.documents)
        local_documents = None if self.documents is None else shard(self.documents, self.order, self.cp, self.rank)
        self.tokens = Tokens(shard(positions, self.order, self.cp, self.rank), local_documents)
        return args, {**kwargs, "input_ids": shard(input_ids, self.order, self.cp, self.rank),
                      "position_ids": self.tokens.positions}

    def attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
        """A layer's attention of this rank's q (B, H, T/cp, d_k) to the keys k, v (B, H_kv, T/cp, d_k) of every cp
        rank, by ``cp_impl``: (B, H, T/cp, d_k)."""
        tokens = self.tokens
        return self.function(q, k, v, tokens.positions, self.group, document_ids=tokens.documents, causal=causal)

    def loss(self, logits: Any, labels: Tensor, label_smoothing: float) -> tuple[Tensor, Tensor]:
        """(cp · local sum / n, n / cp) of this rank's logits (B, T/cp, V) and the whole micro-batch's labels
        (B, T), sharded here by the micro-batch's order; n: the labelled tokens of the whole micro-batch (see the
        module). Summed over the cp ranks, loss · count is the micro-batch's loss sum and count its tokens."""
        local = shard(labels, self.order, self.cp, self.rank)  # (B, T/cp)
        split = self.inner.loss if self.inner is not None else loss_fn  # a vocabulary split over tp: its own
        return self._whole_sequence(*split(logits, local, label_smoothing), labels)

    def _whole_sequence(self, mean: Tensor, n_local: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """(cp · local sum / n, n / cp) from this rank's token mean ``mean`` over its ``n_local`` labelled tokens
        and the whole micro-batch's ``labels`` (B, T) (n: their labelled tokens; see the module)."""
        n = (labels != IGNORE_INDEX).sum()
        mean = plain(mean)  # DTensor TP's loss, replicated: a plain tensor (differentiable)
        # a shard with no labelled token (a packed conversation's prompt, cut T/cp at a time) sums to 0: its mean is
        # NaN, as F.cross_entropy's over no labels, and its gradient 0
        local_sum = torch.where(n_local > 0, mean * n_local, torch.zeros_like(mean))
        return local_sum * self.cp / n.clamp(min=1), n / self.cp

    def chunked_loss(self, hidden: Any, weight: Any, labels: Tensor, label_smoothing: float
                     ) -> tuple[Tensor, Tensor]:
        """:meth:`loss` without the logits (``training.loss_impl = "chunked"``): this rank's final hidden states
        (B, T/cp, C), the output weight (V, or V/tp with its TP share, C), the whole micro-batch's labels (B, T),
        sharded here; the chunked loss of the local tokens (the TP share's where there is one), scaled as
        :meth:`loss` scales its mean."""
        local = shard(labels, self.order, self.cp, self.rank)  # (B, T/cp)
        split = self.inner.chunked_loss if self.inner is not None else chunked_loss_fn
        return self._whole_sequence(*split(hidden, weight, local, label_smoothing), labels)

    def chunked_logps(self, hidden: Any, weight: Any, labels: Tensor) -> Tensor:
        """Each row's summed log-probability (B,) fp32 of the whole sequence without the logits: this rank's tokens'
        sums (the chunked per-sequence log-probabilities of its hidden states (B, T/cp, C) and labels, sharded
        here), gathered over the cp group with autograd and summed, so every rank holds whole rows and the gradient
        returns to each rank's tokens as :meth:`token_losses`' does."""
        local = shard(labels, self.order, self.cp, self.rank)  # (B, T/cp)
        split = self.inner.chunked_logps if self.inner is not None else super().chunked_logps
        partial = split(hidden, weight, local)  # (B,): this rank's tokens
        return gather_sequence(partial[:, None], 1, self.group).sum(dim=1)

    def token_losses(self, logits: Any, labels: Tensor) -> Tensor:
        """Each token's cross-entropy (B, T) fp32 of the whole sequence, in its own order (0 where ignored), from
        this rank's logits (B, T/cp, V or V/tp) and the whole micro-batch's labels (B, T): this rank's tokens' losses
        gathered over the cp group, differentiable (:func:`~torch_handle.parallel.context.comms.gather_sequence`),
        so every rank sums whole rows (a preference loss's log-probabilities) and the gradient of each token's loss
        flows back to the rank that holds it (see the module)."""
        from torch_handle.parallel.context.sharding import unshard

        local = shard(labels, self.order, self.cp, self.rank)  # (B, T/cp)
        split = self.inner.token_losses if self.inner is not None else token_losses
        return unshard(gather_sequence(split(logits, local), 1, self.group), self.order)

    def before_step(self, max_norm: float) -> float:
        """Clip by the strategy's own norm (DDP: the replicated gradients'; FSDP2: over its shards), then leave the
        step to it. Returns the norm before clipping (``max_norm`` is the strategy's ``training.grad_clip``); NaN
        for DeepSpeed, whose engine reduces and clips inside its step (:meth:`step_stats` reports its norm)."""
        if self._engine is not None:
            return float("nan")
        if self.inner is not None:
            return self.inner.before_step(max_norm)
        return float(self.strategy.clip_grad_norm())

    def step_stats(self, timeline: bool = False) -> dict[str, Any]:
        """The layout, ``cp_impl``, this step's CP communication (``cp_comm_calls``, ``cp_comm_bytes`` sent,
        ``cp_comm_s`` blocked: :class:`~torch_handle.parallel.context.comms.CommStats`; evaluation's forwards are not
        the step's) and ``cp_imbalance``: max ÷ mean over the cp ranks of the unmasked query-key pairs of the step's
        last micro-batch (:func:`~torch_handle.parallel.context.sharding.imbalance`; 1.0 is perfect balance)."""
        out: dict[str, Any] = {**(self.inner.step_stats(timeline) if self.inner is not None else {}),
                               "layout": self.ctx.layout.describe(), "cp_impl": self.impl,
                               "cp_comm_calls": STATS.calls, "cp_comm_bytes": STATS.bytes, CP_COMM_S: STATS.wait_s}
        if self._engine is not None:  # the norm the engine measured in the step that just ran
            norm = self._engine.get_global_grad_norm()
            out["grad_norm"] = float(norm) if norm is not None else float("nan")
        if self.order is not None:
            out["cp_imbalance"] = round(imbalance(attention_pairs(self.order, self.cp, self.documents)), 4)
        return out

    # -- checkpoints and export: the TP share's (the portable form), else the strategy's (a whole model) ----------
    @property
    def _holder(self) -> Any:
        return self.inner if self.inner is not None else self.strategy

    def micro_batch(self) -> ContextManager:
        """The TP share's context of a micro-batch (DTensor TP: ``loss_parallel()``), none without one."""
        return self.inner.micro_batch() if self.inner is not None else contextlib.nullcontext()

    def begin_step(self) -> None:
        """Start counting this step's CP traffic (and TP's)."""
        STATS.reset()
        if self.inner is not None:
            self.inner.begin_step()

    def checkpoint_layout(self) -> dict[str, Any]:
        return {**self._holder.checkpoint_layout(), "cp": self.cp, "cp_impl": self.impl}

    def loads_natively(self, layout: dict[str, Any]) -> bool:
        return self._holder.loads_natively(layout)

    def save(self, ckpt_dir: Path) -> None:
        self._holder.save(ckpt_dir)

    def load(self, ckpt_dir: Path) -> None:
        self._holder.load(ckpt_dir)

    def load_portable(self, portable: Path) -> None:
        self._holder.load_portable(portable)

    def full_state_dict(self, model: nn.Module | None = None) -> dict[str, Tensor] | None:
        return self.inner.full_state_dict(model) if self.inner is not None else self.strategy.full_state_dict()
