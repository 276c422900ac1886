"""New token rows for a base's embedding and output projection, as transformers' ``resize_token_embeddings(n,
mean_resizing=True)`` initialises them: what :func:`torch_handle.checkpoint.hf_dir.load_into` appends when a model
has more token rows than the base it loads (a chat template's tokens added to the base's tokenizer by ``handle data
prepare --chat``; :mod:`torch_handle.finetune.vocab` says how they train and export).

Each new row is drawn from N(μ, 10⁻⁹·Σ), μ and Σ the mean and covariance of the base's rows, or is μ itself when
10⁻⁹·Σ is not positive definite (more columns than rows). That is transformers'
``PreTrainedModel._init_added_embeddings_weights_with_mean`` (``modeling_utils.py``; Hewitt 2021, "Initializing
New Word Embeddings for Pretrained Language Models", https://nlp.stanford.edu/~johnhew/vocab-expansion.html: the
new tokens start with a probability no larger than the average token's, so the base's predictions barely move),
the embedding's rows first and the output's second from one generator, but seeded (:data:`GROW_SEED`), so every
load of the base (each rank, a resume, ``handle export``) grows the same rows: a LoRA run's base hash holds.

Shapes: weight (V, C) -> (V + k, C); V the base's rows, k the tokens added, C = d_model.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
from torch import Tensor

GROW_SEED = 0
"""Seed of the generator that draws the new rows (transformers draws from the global one)."""
VOCAB_KEYS = ("model.embed_tokens.weight", "lm_head.weight")
"""The Hugging Face tensors with a row per token, in the order transformers resizes them."""
EPSILON = 1e-9
"""transformers' scale of the covariance of the new rows."""


def mean_rows(weight: Tensor, added: int, generator: torch.Generator) -> Tensor:
    """``added`` new rows for ``weight`` (V, C): ``μ + L·ε`` with ``L`` the Cholesky factor of ``10⁻⁹·Σ`` and ``ε``
    standard normal (``MultivariateNormal(μ, 10⁻⁹·Σ).sample``, drawn from ``generator``), or ``μ`` repeated when
    ``10⁻⁹·Σ`` is not positive definite; computed in float32, returned as (added, C) in ``weight``'s dtype.
    Σ = (W - μ)ᵀ(W - μ) / V, as transformers computes it (a biased covariance)."""
    w = weight.detach().to(torch.float32)
    mean = w.mean(dim=0)  # (C,)
    centered = w - mean
    covariance = EPSILON * (centered.T @ centered / w.shape[0])  # (C, C)
    scale_tril, info = torch.linalg.cholesky_ex(covariance)
    if int(info) == 0 and bool(torch.isfinite(scale_tril).all()):
        eps = torch.randn(added, w.shape[1], generator=generator)  # (added, C)
        rows = mean + eps @ scale_tril.T
    else:
        rows = mean.expand(added, -1)
    return rows.to(weight.dtype)


def grow_vocab(state: MutableMapping[str, Tensor], rows: int) -> int | None:
    """Grow the :data:`VOCAB_KEYS` tensors of ``state`` (a Hugging Face state dict; a tied model has no
    ``lm_head.weight``) to ``rows`` rows with :func:`mean_rows`, in place. Returns the base's rows, or None when
    nothing grew (the base has ``rows`` or more: a larger base is the loader's error to report)."""
    base = state.get(VOCAB_KEYS[0])
    if base is None or base.shape[0] >= rows:
        return None
    generator = torch.Generator().manual_seed(GROW_SEED)
    old = base.shape[0]
    for key in VOCAB_KEYS:
        weight = state.get(key)
        if weight is not None and weight.shape[0] == old:
            state[key] = torch.cat([weight, mean_rows(weight, rows - old, generator)])
    return old

