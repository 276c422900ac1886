"""A row's summed log-probability of its labels, the quantity the preference losses compare: from a strategy's
model (:func:`sequence_logps`) or from logits already computed (:func:`row_logps`, a pipeline's last stage). Used by
the policy (:mod:`~torch_handle.train.objectives.pairs`) and by the reference copy
(:mod:`~torch_handle.train.objectives.reference`) alike."""

from __future__ import annotations

from typing import Any

import torch

from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.model.linear_cross_entropy import sequence_logps as chunked_sequence_logps
from torch_handle.train.loss import token_losses


def sequence_logps(strategy: Any, input_ids: torch.Tensor, labels: torch.Tensor, loss_impl: str,
                   share: Any = None) -> torch.Tensor:
    """Σ_t log π(labels_t | input_ids_≤t) over each row's labels other than ``IGNORE_INDEX``: input_ids, labels
    (N, T) -> (N,) fp32, differentiable. The forward of ``strategy.model`` under ``strategy.autocast()``, as
    :func:`~torch_handle.train.loss.micro_batch_loss` runs it: ``"chunked"`` from the hidden states a chunk of
    tokens at a time (:func:`~torch_handle.model.linear_cross_entropy.sequence_logps`, or ``share.chunked_logps``
    of a model split over tensor-parallel ranks: each rank its vocabulary rows), else from the logits (N, T, V) in
    fp32 (:func:`row_logps`; ``share``: a split model, whose logits are vocabulary-split)."""
    model = strategy.unwrapped()
    checked = getattr(model, "checked_inputs", None) if share is None else None  # a split model checks its own
    inputs = {"input_ids": input_ids} if checked is None else checked(input_ids=input_ids)
    with strategy.autocast():
        if loss_impl == "chunked":
            hidden = strategy.model(**inputs, return_hidden=True)  # (N, T, C); (N, T/tp, C) under sp
            if share is not None:
                return share.chunked_logps(hidden, model.lm_head.weight, labels)
            return chunked_sequence_logps(hidden, model.lm_head.weight, labels, IGNORE_INDEX)
        logits = strategy.model(**inputs)  # (N, T, V)
    return row_logps(logits, labels, share)


def row_logps(logits: Any, labels: torch.Tensor, share: Any = None) -> torch.Tensor:
    """Each row's summed log-probability of its labels: logits (N, T, V), or this rank's vocabulary slice
    (N, T, V/tp) with ``share`` (:meth:`~torch_handle.train.shares.contract.ParallelShare.token_losses`: the
    vocabulary-parallel cross-entropy per token), labels (N, T) -> (N,) fp32, differentiable."""
    token = token_losses(logits, labels) if share is None else share.token_losses(logits, labels)  # (N, T)
    return -token.sum(1)
