"""CPU kernels beside the model: dropout and cross-entropy, same values as torch's, faster on CPU.

* ``dropout`` / ``Dropout`` -- inverted dropout whose CPU mask comes from 16-bit integers instead of
  ``bernoulli_``; ``F.dropout`` elsewhere.
* ``cross_entropy`` -- token-mean cross-entropy (with label smoothing); on CPU ``ChunkedCrossEntropy``, which
  upcasts the logits a chunk of rows at a time while they are in cache; ``F.cross_entropy`` elsewhere.

How much they save is measured in the performance docs, with the command, not here. Only ``torch`` is imported.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_DROP_LEVELS = 1 << 16  # the CPU mask compares 16-bit random integers with a threshold


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Inverted dropout (Srivastava et al. 2014): zero each element with probability p, scale the rest by 1/(1-p).

    Same contract as ``F.dropout(x, p, training)``; on CUDA (or for p outside (0, 1)) it *is* ``F.dropout``. On
    CPU, ``F.dropout`` draws its mask with ``bernoulli_``, whose CPU kernel (on non-Intel CPUs, without MKL's
    generator) is slow enough to be a large part of a small model's step. Here the mask comes from 64-bit draws of
    torch's global generator split into four 16-bit integers (``torch.randint`` over the full int64 range, viewed
    as int16), kept where the integer is at or above a threshold:

        keep = u >= round(p · 2^16) - 2^15,   u uniform on [-2^15, 2^15)
        out  = x · keep · 2^16 / (2^16 - round(p · 2^16))

    so the drop probability is p rounded to a multiple of 2^-16 (|Δp| ≤ 7.6e-6; 0.1 → 0.1000061) and the scale
    is the exact inverse of the keep probability (E[out] = x). The scaled mask is built in x's dtype, as
    ``F.dropout`` builds its noise (in bf16 both round 1/(1-p) to bf16), and is what autograd saves for backward.
    Only the global torch generator is used, so checkpointing its state (``torch.get_rng_state``) still gives
    exact resume; the masks differ from ``F.dropout``'s for the same seed.

    Args:
        x: any shape, floating point.
        p: drop probability in [0, 1].
        training: identity when False.

    Returns:
        Tensor of x's shape and dtype.
    """
    if not training or p <= 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, training)
    n = x.numel()
    bits = torch.randint(-(1 << 63), (1 << 63) - 1, ((n + 3) // 4,), dtype=torch.int64, device=x.device)
    cut = round(p * _DROP_LEVELS)
    keep = torch.empty_like(x, memory_format=torch.contiguous_format)  # 1.0 = keep, 0.0 = drop, in x's dtype
    torch.ge(bits.view(torch.int16)[:n].view(x.shape), cut - _DROP_LEVELS // 2, out=keep)  # no bool temporary
    return x * keep.mul_(_DROP_LEVELS / (_DROP_LEVELS - cut))  # scaled mask, saved by autograd for backward


class Dropout(nn.Dropout):
    """``nn.Dropout`` computed by ``dropout`` above (same ``p``, ``inplace`` ignored, no state)."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Token-mean cross-entropy computed ``rows`` rows at a time, each chunk in fp32 while it is in cache.

    ``F.cross_entropy`` on CPU keeps the (N, V) fp32 log-softmax for backward, builds a zero-filled (N, V) gradient
    for ``nll_loss_backward`` and reads both again in ``_log_softmax_backward_data``: ~5 passes over N·V floats.
    Here forward keeps only the input, and backward recomputes each chunk's softmax and writes the gradient once:
    (softmax(x) - q) · g / n_valid, with q the target distribution. Same values up to floating-point order
    (tests/unit/test_fast_path.py, tests/unit/test_label_smoothing.py).

    With label smoothing ``eps`` (Szegedy et al. 2016 §7; Vaswani et al. 2017 §5.4 use eps = 0.1) the target is
    q = (1 - eps) · onehot(label) + eps / V, as ``F.cross_entropy(label_smoothing=eps)``: each row's loss is
    (1 - eps) · (-log p_label) + eps · mean_j(-log p_j).

    forward(logits (N, V) float, labels (N,) long, rows int, eps float in [0, 1), ignore_index int, mean bool) ->
    scalar fp32 mean over labels != ignore_index (NaN when none, like ``F.cross_entropy``); ``mean=False``: each
    row's loss (N,) fp32, 0 where ignored (``reduction="none"``: :func:`token_cross_entropy`).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, rows: int, eps: float = 0.0, ignore_index: int = -100,
                mean: bool = True) -> Tensor:
        valid = labels != ignore_index  # (N,)
        safe = torch.where(valid, labels, 0)[:, None]  # (N, 1): ignored rows point at class 0, then weigh 0
        nll = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)  # (N,)
        for s in range(0, logits.shape[0], rows):
            log_p = torch.log_softmax(logits[s:s + rows].float(), dim=-1)  # (rows, V) fp32
            nll[s:s + rows] = log_p.gather(1, safe[s:s + rows]).squeeze(1).neg_()
            if eps:  # (1 - eps) · nll + eps · mean_j(-log p_j), in the same pass over the chunk
                nll[s:s + rows].mul_(1.0 - eps).sub_(log_p.mean(dim=-1), alpha=eps)
        n = valid.sum()
        ctx.save_for_backward(logits, safe, valid, n)
        ctx.rows, ctx.eps, ctx.mean = rows, eps, mean
        nll.masked_fill_(~valid, 0.0)
        return nll.sum() / n if mean else nll

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, safe, valid, n = ctx.saved_tensors
        eps = ctx.eps
        uniform = eps / logits.shape[-1]
        # n clamped: with every label ignored the forward is NaN (as F.cross_entropy's) but the gradient 0, not
        # 0/0 (what a caller that weighs that NaN by its 0 tokens, a cp shard with no labels, backpropagates)
        weight = (valid * (grad / n.clamp(min=1) if ctx.mean else grad)).float()[:, None]  # (N, 1): d loss / d row loss
        out = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.rows):
            x, idx = logits[s:s + ctx.rows], safe[s:s + ctx.rows]
            p = out[s:s + ctx.rows] if x.dtype == torch.float32 else torch.empty_like(x, dtype=torch.float32)
            torch.softmax(x.float(), dim=-1, out=p)  # (rows, V) fp32, written in place when logits are fp32
            if eps:
                p.sub_(uniform)
            p.scatter_add_(1, idx, torch.full_like(idx, eps - 1.0, dtype=p.dtype)).mul_(weight[s:s + ctx.rows])
            if p.data_ptr() != out[s:s + ctx.rows].data_ptr():
                out[s:s + ctx.rows] = p
        return out, None, None, None, None, None


CE_CHUNK_ELEMENTS = 1 << 18
"""Logit elements per chunk of ``ChunkedCrossEntropy`` (1 MiB of fp32: 64 rows of a 4096 vocabulary)."""


def _fp32_cross_entropy(logits: Tensor, labels: Tensor, label_smoothing: float, ignore_index: int) -> Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, label_smoothing=label_smoothing)


@functools.cache
def _compiled_cross_entropy():
    """:func:`_fp32_cross_entropy` under ``torch.compile``, built on first use (not at import: ``torch.compile``
    imports Dynamo)."""
    return torch.compile(_fp32_cross_entropy)


def cross_entropy(logits: Tensor, labels: Tensor, label_smoothing: float = 0.0, ignore_index: int = -100, *,
                  compiled: bool = False) -> Tensor:
    """Token-mean cross-entropy in fp32, exactly ``F.cross_entropy(logits.float(), labels, ignore_index=...,
    label_smoothing=...)``.

    Args:
        logits: (N, V) float, any floating dtype.
        labels: (N,) long; ``ignore_index`` entries are left out of the mean.
        label_smoothing: eps in [0, 1): the target puts 1 - eps on the label and eps spread evenly over the
            vocabulary (Szegedy et al. 2016; Vaswani et al. 2017, eps = 0.1); 0 is plain cross-entropy.

        compiled: ``F.cross_entropy`` under ``torch.compile`` (``training.compile``): Inductor fuses the upcast,
            log-softmax and gather into one pass forward and one backward, which beats ``ChunkedCrossEntropy``
            eagerly (``benchmarks/vs_litgpt.py``; docs/performance.md).

    Returns:
        Scalar fp32; NaN when every label is ignored. On CPU computed by ``ChunkedCrossEntropy`` (the same values,
        chunk by chunk in cache) unless ``compiled``.
    """
    if compiled:
        return _compiled_cross_entropy()(logits, labels, float(label_smoothing), ignore_index)
    if logits.device.type == "cpu":
        rows = max(1, CE_CHUNK_ELEMENTS // logits.shape[-1])
        return ChunkedCrossEntropy.apply(logits, labels, rows, float(label_smoothing), ignore_index)
    return _fp32_cross_entropy(logits, labels, float(label_smoothing), ignore_index)


def token_cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Each row's cross-entropy in fp32, exactly ``F.cross_entropy(logits.float(), labels, ignore_index=...,
    reduction="none")``: logits (N, V) float, labels (N,) long -> (N,) fp32, 0 where ignored. On CPU computed by
    ``ChunkedCrossEntropy`` (``mean=False``), which keeps only the logits for backward: ``F.cross_entropy`` keeps
    the (N, V) fp32 log-softmax too and builds a zero-filled (N, V) gradient in backward, one logits-sized buffer
    more at a DPO step's peak than the token-mean loss of the same rows (benchmarks/preference.py)."""
    if logits.device.type == "cpu":
        rows = max(1, CE_CHUNK_ELEMENTS // logits.shape[-1])
        return ChunkedCrossEntropy.apply(logits, labels, rows, 0.0, ignore_index, False)
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="none")


EXPLICIT_ATTENTION_MAX_LEN = 128
"""The longest sequence for which :func:`sdpa_fast_path_cpu` takes :func:`causal_attention` over torch's CPU flash
kernel (bf16): ``benchmarks/attention_cpu.py`` measured it 1.29-1.76x faster (forward + backward) at T = 128 and
0.64-1.05x at T = 256 (1,024 tokens a batch; docs/performance.md)."""


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal softmax(Q Kᵀ / √d_k) V composed of two matmuls and one softmax, with FlashAttention's arithmetic:
    scores and softmax in fp32, the weights rounded to v's dtype for the product with V (Dao et al. 2022; torch's
    CPU flash kernel does the same), so its outputs and gradients match ``F.scaled_dot_product_attention(q, k, v,
    is_causal=True, enable_gqa=...)`` to the kernel's own rounding (tests/unit/test_decoder_pieces.py).

    Why: torch's CPU flash kernel runs its bf16 backward at about a quarter of its forward's speed at short
    sequences (10.6 against 2.5 ms a layer for presets/llama.toml's shape), where these few large matmuls and one
    fused softmax take less; it materialises B·H·T² fp32 scores, and from T = 256 on flash is the faster, so only
    sequences up to ``EXPLICIT_ATTENTION_MAX_LEN`` take it (docs/performance.md).

    Args:
        q: (B, H, T, d_k); k, v: (B, H_kv, T, d_k) and (B, H_kv, T, d_v), H_kv dividing H (grouped-query
            attention: each group of H / H_kv query heads reads its K/V head, nothing copied).

    Returns:
        (B, H, T, d_v) in v's dtype; autocast is off inside (the fp32 scores must stay fp32).
    """
    H, T, d_k = q.shape[1:]
    with torch.autocast(q.device.type, enabled=False):
        q = q.unflatten(1, (k.shape[1], H // k.shape[1]))  # (B, H_kv, H / H_kv, T, d_k)
        scores = q.float() @ k.float()[:, :, None].transpose(-2, -1) * d_k**-0.5  # (B, H_kv, H / H_kv, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # (T, T): key s <= query t
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1).to(v.dtype)
        return (weights @ v[:, :, None]).flatten(1, 2)  # (B, H, T, d_v)


def sdpa_fast_path_cpu(q: Tensor, k: Tensor, is_causal: bool, has_mask: bool, dropout_p: float) -> bool:
    """Whether ``attention.sdpa`` should take :func:`causal_attention` instead of torch's kernel: bf16 on CPU, causal
    self-attention with no mask tensor and no dropout, T <= ``EXPLICIT_ATTENTION_MAX_LEN``."""
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and is_causal and not has_mask
            and dropout_p == 0.0 and q.shape[2] == k.shape[2] <= EXPLICIT_ATTENTION_MAX_LEN)
