"""The output layer and the cross-entropy over a vocabulary split across the TP group, a chunk of tokens at a time:
neither the whole (tokens x V) logits nor this rank's (tokens x V/tp) slice of them exists at once.

Two known algorithms composed:

* Megatron-LM's vocabulary-parallel cross-entropy (``megatron/core/tensor_parallel/cross_entropy.py``; Shoeybi et
  al. 2019 §3), as :mod:`torch_handle.parallel.tensor.cross_entropy` computes it from this rank's logits: per token
  three numbers span the vocabulary, each an all-reduce of a (rows,) vector,

      m   = max_j z_j                       (all-reduce MAX)
      s   = sum_j exp(z_j - m)              (all-reduce SUM, with the next two in one (rows, 3) tensor)
      z_y = z_label - m                     (only the rank that holds the label adds it)
      z_m = sum_j (z_j - m) / V             (label smoothing only)
      loss = (1 - eps)(log s - z_y) + eps(log s - z_m)

* Liger Kernel's fused linear cross-entropy (``liger_kernel/ops/fused_linear_cross_entropy.py``), as
  :mod:`torch_handle.model.linear_cross_entropy` computes it on one process: each chunk's logits are projected,
  reduced to the loss and turned into the chunk's gradients in the forward pass, then dropped.

So per chunk of ``rows`` tokens a rank projects its (rows, V/tp) logits with its local output-weight rows, makes
the three small all-reduces, and computes the gradient of its logits locally (softmax_j - (1 - eps) onehot_j -
eps/V, for its j). The local weight's gradient gᵀ·h needs no communication; the hidden states' gradient g·W_local
is this rank's partial sum, summed over the group by the caller's entry into the TP region (:func:`copy_to_tp`'s
all-reduce, or sequence parallelism's reduce-scatter, :func:`gather_from_sp`), exactly as for the column-parallel
output layer it replaces. Communication: 2 all-reduces per chunk of (rows,) and (rows, 3) fp32 forward, one (N, C)
all-reduce (or reduce-scatter) of the hidden states' gradient backward, where the full path sends the same
(N, C) gradient and the same two all-reduces of (N,) and (N, 3) once.

The per-sequence summed log-probabilities a preference loss needs (:func:`vocab_parallel_sequence_logps`) take the
same per-chunk softmax over the group (:class:`VocabSlice`) inside the one-process ``ChunkedSequenceLogProbs``,
which saves one log-sum-exp per token and recomputes each chunk's slice of the logits in backward.

Shape letters: N tokens (B·T), C d_model, V vocabulary, V/tp this rank's rows of it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from torch_handle.model.linear_cross_entropy import (ChunkedLinearCrossEntropy, WholeVocab, _Weight, cast_whole,
                                                     chunk_rows, compute_dtype, sequence_logps, weight_rows)
from torch_handle.parallel.tensor.mappings import TPGroup, copy_to_tp, gather_from_sp


class VocabSlice(WholeVocab):
    """This rank's rows [start, start + V_r) of a vocabulary split over the TP group ``tp``, as the chunked losses
    read it: which labels' logits it holds, and each chunk's softmax over the whole vocabulary from its slice with
    two all-reduces of (r,) and (r, 3) fp32 (Megatron-LM's vocabulary-parallel cross-entropy)."""

    def __init__(self, tp: TPGroup, start: int) -> None:
        self.tp, self.start = tp, start

    def owned(self, labels: Tensor, valid: Tensor, n_local: int) -> tuple[Tensor, Tensor]:
        local = labels - self.start
        mine = valid & (local >= 0) & (local < n_local)  # (N,): this rank holds the label's logit
        return torch.where(mine, local, 0)[:, None], mine

    def exp_sums_(self, z: Tensor, idx: Tensor, mine: Tensor, smoothing: bool = False
                  ) -> tuple[Tensor, Tensor, Tensor]:
        """(exp(z - m) written into z (r, V_r), m (r,), sums (r, 3) over the group: [Σ_j exp(z_j - m), z_y - m,
        Σ_j (z_j - m) where ``smoothing`` else 0]): z (r, V_r) fp32 this rank's logits of a chunk, m each row's max
        over the group (one all-reduce MAX, then one SUM)."""
        top = self.tp.all_reduce(z.amax(dim=-1), op=dist.ReduceOp.MAX)  # (r,)
        z.sub_(top[:, None])
        z_label = torch.where(mine, z.gather(1, idx).squeeze(1), 0.0)  # (r,)
        z_sum = z.sum(dim=-1) if smoothing else torch.zeros_like(top)  # (r,)
        p = z.exp_()  # (r, V_r), in place of the logits
        return p, top, self.tp.all_reduce(torch.stack([p.sum(dim=-1), z_label, z_sum], dim=1))

    def lse_logp(self, z: Tensor, idx: Tensor, mine: Tensor) -> tuple[Tensor, Tensor]:
        _, top, sums = self.exp_sums_(z, idx, mine)
        log_s = sums[:, 0].log()
        return top + log_s, sums[:, 1] - log_s  # as vocab_parallel_token_losses: log s - (z_y - m)


class VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """Token-mean cross-entropy of the logits ``hidden @ weight.T`` whose vocabulary rows are split over the TP
    group, ``rows`` tokens at a time, the gradients computed in forward (as ``ChunkedLinearCrossEntropy``).

    forward(hidden (N, C) the same on every TP rank, weight (V_r, C) this rank's rows [start, start + V_r) of the
    vocab V, labels (N,) long over the whole vocabulary, tp TPGroup, vocab int, start int, eps float in [0, 1),
    ignore_index int, rows int, dtype
    torch.dtype, need_hidden bool, need_weight bool) -> scalar fp32 loss, the same on every TP rank (NaN when every
    label is ignored). Backward returns this rank's partial d hidden (N, C) (the caller sums it over the group) and
    the local weight's gradient (V/tp, C); it runs once (a second backward raises RuntimeError)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, tp: TPGroup, vocab: int, start: int, eps: float,
                ignore_index: int, rows: int, dtype: torch.dtype, need_hidden: bool, need_weight: bool) -> Tensor:
        h = hidden.to(dtype)  # (N, C)
        n_rows, n_local = h.shape[0], weight.shape[0]
        w = _Weight(weight, dtype, cast_whole(n_rows, weight, dtype), weight_rows(n_local, weight.shape[1], h.device))
        valid = labels != ignore_index  # (N,)
        vocab_slice = VocabSlice(tp, start)
        idx, mine = vocab_slice.owned(labels, valid, n_local)  # (N, 1), (N,)
        n = valid.sum()
        row_weight = valid / n  # (N,) fp32: d loss / d row loss
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(hidden) if need_hidden else None  # (N, C): this rank's partial sum
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_weight else None
        for s in range(0, n_rows, rows):
            h_c, idx_c, mine_c = h[s:s + rows], idx[s:s + rows], mine[s:s + rows]
            p, _, sums = vocab_slice.exp_sums_(w.logits(h_c), idx_c, mine_c, bool(eps))  # (r, V/tp), (r, 3)
            log_s = sums[:, 0].log()
            row = (1.0 - eps) * (log_s - sums[:, 1]) + eps * (log_s - sums[:, 2] / vocab)  # (r,)
            total += row.masked_fill_(~valid[s:s + rows], 0.0).sum()
            if grad_h is None and grad_w is None:
                continue
            p.div_(sums[:, :1])  # softmax over this rank's rows
            if eps:
                p.sub_(eps / vocab)
            p.scatter_add_(1, idx_c, torch.where(mine_c, eps - 1.0, 0.0)[:, None])
            g = p.mul_(row_weight[s:s + rows, None]).to(dtype)  # (r, V/tp): d loss / d z
            del p
            w.grads(g, h_c, None if grad_h is None else grad_h[s:s + rows], grad_w)
            del g
        ctx.grads = [grad_h, grad_w]
        ctx.weight_dtype = weight.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad: Tensor):
        # the gradients were computed in forward: scaled by ``grad`` and handed over once, as the one-process
        # function's; None more, for ``tp``, ``vocab`` and ``start``
        return (*ChunkedLinearCrossEntropy.backward(ctx, grad), None, None, None)


def _local_inputs(hidden: Any, weight: Any, tp: TPGroup, sequence_parallel: bool
                  ) -> tuple[Tensor, Tensor, int, int]:
    """(hidden, weight rows, V, the first row's index): the hidden states (..., C) replicated and entering the TP
    region, and this rank's weight rows, as plain tensors. A plain ``hidden`` (both implementations: native TP's
    final norm hands back local tensors) enters as the column-parallel output layer's input enters:
    :func:`copy_to_tp`, or :func:`gather_from_sp` of a sequence shard, whose backward sums the ranks' partial
    gradients. A DTensor ``hidden`` is made replicated and local, its gradient handed back as a ``Partial`` sum that
    DTensor reduces. A DTensor ``weight`` (native: ``Shard(0)`` over the vocabulary rows, ``torch.chunk``'s split:
    ceil(V/tp) rows a rank, the last ranks fewer where tp does not divide V) gives its local rows; its gradient goes
    back as the same shard."""
    if hasattr(hidden, "to_local"):
        from torch.distributed.tensor import Partial, Replicate

        placements = [Replicate()] * hidden.device_mesh.ndim
        hidden = hidden.redistribute(placements=placements).to_local(grad_placements=[Partial()] * len(placements))
    else:
        hidden = gather_from_sp(hidden, tp) if sequence_parallel else copy_to_tp(hidden, tp)
    if hasattr(weight, "to_local"):
        vocab = weight.shape[0]
        return hidden, weight.to_local(), vocab, min(vocab, tp.rank * -(-vocab // tp.size))
    return hidden, weight, weight.shape[0] * tp.size, tp.rank * weight.shape[0]


def vocab_parallel_linear_cross_entropy(hidden: Any, weight: Any, labels: Tensor, tp: TPGroup,
                                        label_smoothing: float = 0.0, ignore_index: int = -100, *,
                                        sequence_parallel: bool = False, rows: int | None = None) -> Tensor:
    """Token-mean cross-entropy in fp32 of the vocabulary-parallel logits ``hidden @ weight.T`` without them:
    exactly :func:`~torch_handle.parallel.tensor.cross_entropy.vocab_parallel_cross_entropy` of the column-parallel
    output layer's logits, a chunk of tokens at a time (:class:`VocabParallelLinearCrossEntropy`).

    Args:
        hidden: (B, T, C) the final hidden states, the same on every TP rank; with ``sequence_parallel`` this
            rank's (B, T/tp, C) sequence shard, gathered here as the output layer gathers it (``_local_inputs``).
        weight: (V/tp, C) this rank's output-weight rows (tp divides V), or the (V, C) DTensor sharded over rows
            (``Shard(0)``, any V).
        labels: (B, T) long over the whole vocabulary; ``ignore_index`` entries are left out of the mean.
        tp: the TP group (its counters record the collectives).
        label_smoothing: eps in [0, 1).
        rows: tokens per chunk (default ``chunk_rows`` of N over V/tp).

    Returns:
        Scalar fp32, the same on every TP rank; NaN when every label is ignored.

    Raises:
        ValueError: ``labels``' shape is not the (gathered) hidden states' leading shape, or the widths differ.
    """
    hidden, weight, vocab, start = _local_inputs(hidden, weight, tp, sequence_parallel)
    if labels.shape != hidden.shape[:-1] or weight.shape[-1] != hidden.shape[-1]:
        raise ValueError(f"vocab_parallel_linear_cross_entropy: hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)} and labels {tuple(labels.shape)} do not fit ((..., C), (V/tp, C), "
                         f"(...))")
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)  # (N, C), (N,)
    grad = torch.is_grad_enabled()
    rows = rows or chunk_rows(flat.shape[0], weight.shape[0], flat.device)
    return VocabParallelLinearCrossEntropy.apply(flat, weight, targets, tp, vocab, start, float(label_smoothing),
                                                 ignore_index, rows, compute_dtype(hidden), grad and flat.requires_grad,
                                                 grad and weight.requires_grad)


def vocab_parallel_sequence_logps(hidden: Any, weight: Any, labels: Tensor, tp: TPGroup, ignore_index: int = -100,
                                  *, sequence_parallel: bool = False, rows: int | None = None) -> Tensor:
    """Per-sequence summed log-probabilities of the vocabulary-parallel logits ``hidden @ weight.T`` without them:
    exactly the row sums of minus :func:`~torch_handle.parallel.tensor.cross_entropy.vocab_parallel_token_losses`
    of the column-parallel output layer's logits (a preference loss's policy and reference log-likelihoods under
    tensor parallelism), a chunk of tokens at a time: ``ChunkedSequenceLogProbs``
    (:mod:`torch_handle.model.linear_cross_entropy`) over this rank's :class:`VocabSlice` (forward: two all-reduces
    per chunk; backward recomputes each chunk's slice of the logits from the saved per-token log-sum-exp, with no
    communication but the hidden states' gradient's, as the token-mean loss).

    Args:
        hidden: (B, T, C) the final hidden states, the same on every TP rank; with ``sequence_parallel`` this
            rank's (B, T/tp, C) sequence shard (``_local_inputs``, as :func:`vocab_parallel_linear_cross_entropy`).
        weight: (V/tp, C) this rank's output-weight rows, or the (V, C) ``Shard(0)`` DTensor (native TP, any V).
        labels: (B, T) long over the whole vocabulary; ``ignore_index`` entries are left out of the sums.
        tp: the TP group.
        rows: tokens per chunk (default ``chunk_rows`` of B·T over V/tp).

    Returns:
        (B,) fp32, the same on every TP rank, differentiable in ``hidden`` (this rank's partial gradient, summed
        over the group by the entry into the TP region) and ``weight`` (its local rows); 0 for a sequence with no
        counted token.

    Raises:
        ValueError: ``labels`` is not (B, T) of the (gathered) hidden states, or the widths differ
            (:func:`~torch_handle.model.linear_cross_entropy.sequence_logps`).
    """
    hidden, weight, _, start = _local_inputs(hidden, weight, tp, sequence_parallel)
    return sequence_logps(hidden, weight, labels, ignore_index, rows=rows, vocab=VocabSlice(tp, start))
