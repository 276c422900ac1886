"""A context-parallel rank whose shard holds no labelled token (a packed conversation's prompt, cut T/cp tokens at a
time; a pipeline micro-batch of one sample makes it likely) adds 0 to the micro-batch's loss and 0 to every gradient.
Each loss kernel's mean over no labels is NaN, as ``F.cross_entropy``'s, and its backward given a zero gradient is
zero, not 0/0; the cp share weighs the shard's mean by its 0 tokens without letting the NaN through. Before, the
pp 2 × cp 2 SFT run of tests/test_objectives_split.py stopped on a NaN loss at step 5."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.model.kernels import cross_entropy
from torch_handle.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from torch_handle.train.loss import chunked_loss_fn
from torch_handle.train.shares.context import ContextParallel

ONE_RANK = SimpleNamespace(rank=0, size=1, all_reduce=lambda x, op=None: x)  # a TP "group" of one


def _local_loss(kernel: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    """(mean, labelled tokens) of one rank's shard: hidden (B, T/cp, C), weight (V, C), labels (B, T/cp)."""
    if kernel == "chunked":
        return chunked_loss_fn(hidden, weight, labels, 0.1)
    logits = hidden @ weight.T  # (B, T/cp, V)
    if kernel == "vocab_parallel":
        return vocab_parallel_cross_entropy(logits, labels, ONE_RANK, 0.1)
    flat, targets = logits.flatten(0, 1), labels.flatten()
    n = (targets != IGNORE_INDEX).sum()
    if kernel == "torch":
        return F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, label_smoothing=0.1), n
    return cross_entropy(flat, targets, 0.1, IGNORE_INDEX), n  # the CPU's chunked kernel


@pytest.mark.parametrize("kernel", ["cpu", "torch", "chunked", "vocab_parallel"])
def test_a_shard_without_labels_adds_zero_loss_and_zero_gradient(kernel):
    torch.manual_seed(0)
    hidden = torch.randn(2, 4, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    whole = torch.full((2, 8), IGNORE_INDEX)
    whole[0, 6:] = 3  # the sequence's labelled tokens lie on the other rank
    local = whole[:, :4]  # this rank's shard: none
    mean, n_local = _local_loss(kernel, hidden, weight, local)
    assert int(n_local) == 0 and torch.isnan(mean)  # like F.cross_entropy over no labels
    loss, count = ContextParallel._whole_sequence(SimpleNamespace(cp=2), mean, n_local, whole)
    loss.backward()
    assert loss.item() == 0.0 and count.item() == 1.0  # n / cp: the sequence's 2 tokens over 2 ranks
    assert torch.equal(hidden.grad, torch.zeros_like(hidden)) and torch.equal(weight.grad, torch.zeros_like(weight))
