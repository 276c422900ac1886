"""The training loss: token-mean cross-entropy over the whole vocabulary (the tensor-parallel loss over a split
vocabulary is :func:`torch_handle.parallel.tensor.cross_entropy.vocab_parallel_cross_entropy`)."""

from __future__ import annotations

import torch

from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.model.aux_loss import probe_loss_scale
from torch_handle.model.kernels import cross_entropy


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0, *, compiled: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-mean cross-entropy in fp32. logits (B, T, V), labels (B, T) -> (scalar loss, tokens counted as a
    scalar tensor on the same device: counting must not force a host sync).

    ``label_smoothing`` eps in [0, 1): the target puts 1 - eps on the label and eps spread evenly over the
    vocabulary (Szegedy et al. 2016; Vaswani et al. 2017, eps = 0.1), exactly ``F.cross_entropy``'s
    ``label_smoothing``; 0 is plain cross-entropy. The trainer passes ``training.label_smoothing`` for training
    steps only: validation loss stays plain cross-entropy.

    Computed by ``torch_handle.model.kernels.cross_entropy`` (chunk by chunk in cache on CPU; ``compiled``: under
    ``torch.compile``, as ``training.compile`` asks). The loss passes
    through ``probe_loss_scale``, an identity whose backward tells the model's auxiliary losses (a mixture of
    experts' balancing losses, ``torch_handle.model.aux_loss``) the factor this loss was scaled by."""
    n_tokens = (labels != IGNORE_INDEX).sum()
    flat, targets = logits.flatten(0, 1), labels.flatten()  # (B·T, V), (B·T,)
    return probe_loss_scale(cross_entropy(flat, targets, label_smoothing, IGNORE_INDEX, compiled=compiled)), n_tokens
