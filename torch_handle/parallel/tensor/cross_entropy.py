"""Cross-entropy over a vocabulary split across the TP group: the (tokens, V) logits are never gathered.

Each rank holds the logits of its V/tp vocabulary rows (the output of a column-parallel LM head). Softmax needs
three numbers per token that span the whole vocabulary, and each is one all-reduce of a (tokens,) vector instead of
an all-gather of (tokens, V/tp) logits (Megatron-LM ``tensor_parallel/cross_entropy.py``; Shoeybi et al. 2019 §3):

    m      = max_j x_j                (all-reduce MAX)
    z      = sum_j exp(x_j - m)       (all-reduce SUM, together with the next two)
    x_y    = x_label - m              (only the rank that holds the label contributes; the others add 0)
    mean_x = sum_j (x_j - m) / V      (label smoothing only)

    loss   = (1 - eps) (log z - x_y) + eps (log z - mean_x)

which is ``F.cross_entropy(label_smoothing=eps)`` (Szegedy et al. 2016 §7). The gradient with respect to this rank's
logits is local: softmax_j - (1 - eps) onehot_j - eps / V, for j in this rank's rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from torch_handle.parallel.tensor.mappings import TPGroup

IGNORE_INDEX = -100
"""Label of a position that has no target (padding), as in ``F.cross_entropy``."""


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, tp: TPGroup, eps: float, per_token: bool = False) -> Tensor:
        x = logits.float()  # (N, V/tp)
        n_local = x.shape[-1]
        vocab = n_local * tp.size
        start = tp.rank * n_local
        valid = labels != IGNORE_INDEX  # (N,)
        local = labels - start
        mine = valid & (local >= 0) & (local < n_local)  # this rank holds the label's logit

        m = x.max(dim=-1).values  # (N,)
        m = tp.all_reduce(m, op=dist.ReduceOp.MAX)
        x = x - m[:, None]
        exp = x.exp()
        sums = torch.stack([exp.sum(dim=-1),  # z
                            torch.where(mine, x.gather(1, local.clamp(0, n_local - 1)[:, None]).squeeze(1), 0.0),
                            x.sum(dim=-1) if eps else torch.zeros_like(m)], dim=1)  # (N, 3)
        sums = tp.all_reduce(sums)
        log_z = sums[:, 0].log()
        row = (1.0 - eps) * (log_z - sums[:, 1]) + eps * (log_z - sums[:, 2] / vocab)  # (N,)
        n = valid.sum()
        ctx.save_for_backward(exp.div_(sums[:, :1]), local, mine, valid, n)  # softmax (N, V/tp)
        ctx.eps, ctx.vocab, ctx.dtype, ctx.per_token = eps, vocab, logits.dtype, per_token
        row = row.masked_fill(~valid, 0.0)
        return row if per_token else row.sum() / n

    @staticmethod
    def backward(ctx, grad: Tensor):
        softmax, local, mine, valid, n = ctx.saved_tensors
        g = softmax
        if ctx.eps:
            g = g - ctx.eps / ctx.vocab
        rows = mine.nonzero().squeeze(1)
        g[rows, local[rows]] -= 1.0 - ctx.eps
        g = g * (valid * (grad if ctx.per_token else grad / n.clamp(min=1))).float()[:, None]  # 0 when none counts
        return g.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, tp: TPGroup,
                                 label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
    """Token-mean cross-entropy of vocabulary-parallel logits, in fp32.

    logits (B, T, V/tp) or (N, V/tp): this rank's vocabulary rows [rank·V/tp, (rank+1)·V/tp); labels (B, T) or
    (N,) long over the whole vocabulary, IGNORE_INDEX where there is no target. Returns (scalar loss, scalar count
    of labelled tokens), the loss replicated on every TP rank. Communication: two all-reduces of (N,) and (N, 3)
    fp32 per call, forward only; backward sends nothing.
    """
    flat, targets = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    return (_VocabParallelCrossEntropy.apply(flat, targets, tp, float(label_smoothing)),
            (targets != IGNORE_INDEX).sum())


def vocab_parallel_token_losses(logits: Tensor, labels: Tensor, tp: TPGroup) -> Tensor:
    """Each token's cross-entropy (``F.cross_entropy(reduction="none")``) of vocabulary-parallel logits, in fp32:
    logits (B, T, V/tp) and labels (B, T) as :func:`vocab_parallel_cross_entropy` takes them -> (B, T), 0 where the
    label is ``IGNORE_INDEX``, replicated on every TP rank and differentiable (a preference loss sums a row's). The
    same two all-reduces per call."""
    flat, targets = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    return _VocabParallelCrossEntropy.apply(flat, targets, tp, 0.0, True).view(labels.shape)
