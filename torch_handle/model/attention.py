"""Step 2 of the model: multi-head scaled dot-product attention (Vaswani et al. 2017, §3.2).

* ``scaled_dot_product_attention_reference`` -- softmax(Q Kᵀ / √d_k) V written out, the twin of
  ``F.scaled_dot_product_attention``.
* ``MultiHeadAttention`` -- project Q/K/V, split into H heads, attend with one of the two kernels, merge, project.
* ``StackedLinear`` -- the fused Q/K/V projection: one Linear, any run of its parts computed by one call.

Masks are bool, True = may attend (SDPA's convention); padding masks are bool, True = pad
(``nn.MultiheadAttention``'s). Shape letters: B batch, T query length, S key length, C = d_model channels,
H heads, d_k = C // H channels per head.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_handle.model.args import ATTENTION_IMPLS, AttentionImpl, check_choice
from torch_handle.model.kernels import dropout
from torch_handle.model.kv_cache import AttentionCache
from torch_handle.parallel.tensor.random import tensor_parallel_rng


def _unmask_empty_rows(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Let rows that may attend to nothing attend to everything, and report which they were.

    A query whose keys are all masked (e.g. a left-padded position under a causal mask) would
    otherwise get softmax over all -inf = NaN, and the NaN would leak into gradients. Attending
    everywhere keeps the arithmetic finite; the caller then zeroes those rows' outputs so the
    result does not depend on the padding's contents.
    """
    empty_rows = ~mask.any(dim=-1, keepdim=True)  # (..., T, 1)
    return mask | empty_rows, empty_rows


def scaled_dot_product_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """softmax(Q Kᵀ / √d_k) V, written out (Vaswani et al. 2017, eq. 1).

    The explicit twin of ``torch.nn.functional.scaled_dot_product_attention``; kept for
    readability and as a correctness oracle for the fused kernel.

    Args:
        q: (B, H, T, d_k) float.
        k: (B, H, S, d_k), same dtype as q.
        v: (B, H, S, d_v), same dtype as q.
        mask: optional bool tensor broadcastable to (B, H, T, S); True = may attend (the same
            convention as ``F.scaled_dot_product_attention``).
        dropout_p: dropout on the attention weights; pass 0.0 at eval time.

    Returns:
        (B, H, T, d_v) in q's dtype. Query rows whose keys are all masked return zeros rather
        than NaN.
    """
    d_k = q.size(-1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  # (B, H, T, S)
    empty_rows = None
    if mask is not None:
        mask, empty_rows = _unmask_empty_rows(mask)
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # (B, H, T, S), each row sums to 1
    if dropout_p > 0.0:
        weights = dropout(weights, dropout_p)
    out = weights @ v  # (B, H, T, d_v)
    if empty_rows is not None:
        out = out.masked_fill(empty_rows, 0.0)
    return out


def _attention_mask(
    key_padding_mask: Tensor | None, causal: bool, T: int, S: int, device: torch.device, offset: int = 0
) -> Tensor | None:
    """Combine causal and key-padding masks into one bool mask, True = may attend.

    Returns None when nothing is masked, else a tensor broadcastable to (B, H, T, S). The causal
    mask is aligned top-left (query t sees keys 0..t), matching SDPA's ``is_causal``; with ``offset``
    (cached keys before the queries) query t sees keys 0..offset + t.
    """
    mask = None
    if causal:
        mask = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=offset)  # (T, S)
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
        mask = keep if mask is None else mask & keep  # (B, 1, T, S)
    return mask


def _attend_masked(kernel: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None,
                   causal: bool, offset: int, dropout_p: float) -> Tensor:
    """``kernel(q, k, v, mask, dropout_p)`` with the mask tensor of ``_attention_mask``: (B, H, T, d_k).

    Only padding can leave a query row with no key (causal always leaves key 0): such rows attend everywhere
    and their output is zeroed (``_unmask_empty_rows``)."""
    mask = _attention_mask(key_padding_mask, causal, q.shape[2], k.shape[2], q.device, offset)  # (B|1, 1, T, S)
    if key_padding_mask is None:
        return kernel(q, k, v, mask, dropout_p)
    mask, empty_rows = _unmask_empty_rows(mask)
    return kernel(q, k, v, mask, dropout_p).masked_fill(empty_rows, 0.0)


class StackedLinear(nn.Linear):
    """``n_parts`` projections of one width stacked in one Linear: weight [W_0; W_1; ...] (n_parts·out, in), bias
    likewise; the state dict is an ``nn.Linear``'s.

    ``forward(x)`` computes every part in one matmul: (B, L, in) -> (B, L, n_parts·out). ``forward(x, parts=
    slice(i, j))`` computes only parts i..j-1: (B, L, (j - i)·out), e.g. a cross-attention's Q of the decoder state
    and K, V of the encoder memory. Either is a call of this module, so a tensor-parallel version of it (which keeps
    a slice of every part: ``ColumnParallelLinear(parts=n_parts)``, DTensor's ``_StridedShard``) serves both; the
    parts are selected through a view (n_parts, out, in) of the weight, which both layouts support locally.
    """

    def __init__(self, in_features: int, out_features: int, n_parts: int, bias: bool = True) -> None:
        super().__init__(in_features, n_parts * out_features, bias=bias)
        self.n_parts = n_parts

    def forward(self, x: Tensor, parts: slice | None = None) -> Tensor:
        if parts is None:
            return super().forward(x)
        bias = None if self.bias is None else select_parts(self.bias, self.n_parts, parts)
        return F.linear(x, select_parts(self.weight, self.n_parts, parts), bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, n_parts={self.n_parts}"


def select_parts(stacked: Tensor, n_parts: int, parts: slice) -> Tensor:
    """Rows of ``parts`` from ``stacked``, ``n_parts`` equal blocks along dim 0 ((n_parts·n, ...) ->
    (len(parts)·n, ...)), as a view. Also a local operation on a DTensor split per block (``_StridedShard``)."""
    return stacked.unflatten(0, (n_parts, -1))[parts].flatten(0, 1)


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention (Vaswani et al. 2017, §3.2.2).

    Q, K and V are projected, split into H heads of width d_k = d_model / H, attended
    independently, concatenated, and projected back by ``out_proj``.

    Args:
        d_model: model width C.
        n_heads: number of heads H; must divide d_model.
        dropout: dropout on the attention weights (training only).
        fused_qkv: keep Q/K/V projections in one ``qkv_proj`` Linear(C, 3C) (a ``StackedLinear``) -- one
            matmul for self-attention, and for cross-attention one for Q and one for K, V -- instead of
            separate ``q_proj`` / ``k_proj`` / ``v_proj``. The fused weight is laid out [W_q; W_k; W_v], like
            ``nn.MultiheadAttention.in_proj_weight``.
        bias: whether the projections have biases.
        attention: the kernel, ``"sdpa"`` (``F.scaled_dot_product_attention``) or
            ``"reference"`` (``scaled_dot_product_attention_reference``). Both give the same
            result; the attribute ``self.attention`` may be changed at any time.

    Raises:
        ValueError: if d_model is not divisible by n_heads, or for an unknown ``attention``
        (when constructed or when ``self.attention`` is assigned).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        fused_qkv: bool = True,
        bias: bool = True,
        attention: AttentionImpl = "sdpa",
    ) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(
                f"d_model ({d_model}) must be divisible by n_heads ({n_heads}) "
                "so every head gets the same width"
            )
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.dropout = dropout
        self.fused_qkv = fused_qkv
        self.attention = attention  # validated by the setter below
        if fused_qkv:
            self.qkv_proj = StackedLinear(d_model, d_model, 3, bias=bias)
        else:
            self.q_proj = nn.Linear(d_model, d_model, bias=bias)
            self.k_proj = nn.Linear(d_model, d_model, bias=bias)
            self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.reset_parameters()

    @property
    def attention(self) -> AttentionImpl:
        """The kernel ``forward`` uses: ``"sdpa"`` or ``"reference"``."""
        return self._attention

    @attention.setter
    def attention(self, impl: AttentionImpl) -> None:
        # The one place the kernel is checked: at construction and at every switch.
        check_choice("attention", impl, ATTENTION_IMPLS)
        self._attention = impl

    def reset_parameters(self) -> None:
        """Xavier-uniform weights and zero biases, as in the original Transformer.

        The fused weight is initialised one (C, C) block at a time so fused and separate
        projections start from the same distribution.
        """
        if self.fused_qkv:
            projections = [self.qkv_proj, self.out_proj]
            weights = [*self.qkv_proj.weight.data.chunk(3, dim=0), self.out_proj.weight.data]
        else:
            projections = [self.q_proj, self.k_proj, self.v_proj, self.out_proj]
            weights = [proj.weight.data for proj in projections]
        for weight in weights:
            nn.init.xavier_uniform_(weight)  # chunks are views, so this writes into qkv_proj
        for proj in projections:
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)

    # ---- projections: (B, L, C) in, (B, H, L, d_k) out -------------------------------------------------------

    def _project_q(self, query: Tensor) -> Tensor:
        return self.qkv_proj(query, parts=slice(0, 1)) if self.fused_qkv else self.q_proj(query)

    def _project_qkv(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Input projections, each one module call; each result is (B, len, C)."""
        if not self.fused_qkv:
            return self.q_proj(query), self.k_proj(key), self.v_proj(value)
        if query is key and key is value:
            # Self-attention: one (C -> 3C) matmul instead of three.
            return self.qkv_proj(query).chunk(3, dim=-1)
        # Cross-attention: the inputs differ, so each projects through its parts of the fused weight.
        q = self._project_q(query)
        if key is value:
            # Encoder memory feeds both K and V: still one matmul for the pair.
            k, v = self.qkv_proj(key, parts=slice(1, 3)).chunk(2, dim=-1)
            return q, k, v
        return q, self.qkv_proj(key, parts=slice(1, 2)), self.qkv_proj(value, parts=slice(2, 3))

    def _split_heads(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        # (B, L, C) -> (B, H, L, d_k); under tensor parallelism C and H are this rank's share (C/tp, H/tp)
        return x.view(B, L, -1, self.d_k).transpose(1, 2)

    def _heads(self, query: Tensor, key: Tensor, value: Tensor, cache: AttentionCache | None
               ) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, T, d_k); k, v (B, H, S, d_k): the projections of key/value, or with a ``cache`` the cached
        ones (a static cache that is ready: projected once) or the cached followed by the new (self-attention)."""
        if cache is not None and cache.ready:
            return self._split_heads(self._project_q(query)), cache.k, cache.v
        q, k, v = (self._split_heads(t) for t in self._project_qkv(query, key, value))
        if cache is not None:
            k, v = cache.update(k, v)
        return q, k, v

    # ---- kernels: (B, H, T, d_k) q, (B, H, S, d_k) k and v in; (B, H, T, d_k) out -----------------------

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool,
                offset: int) -> Tensor:
        """Run the kernel ``self.attention`` names, in one of three ways:

        * the reference, with a mask tensor: ``"reference"``, and ``"sdpa"`` while training with dropout on CPU,
          where SDPA runs its math kernel (upcast to fp32 for bf16/fp16 inputs) and draws the mask with the slow
          ``bernoulli_``; the reference computes the same in the inputs' dtype with the fast CPU ``dropout``;
        * SDPA with ``is_causal`` and no mask tensor, which lets it pick its fastest (flash) kernel: nothing but
          a top-left causal mask to apply (the models pass no ``key_padding_mask`` for a batch without padding:
          ``transformer.padding_mask_of``);
        * SDPA with a mask tensor otherwise (padding, or a causal mask shifted by cached keys).
        """
        dropout_p = self.dropout if self.training else 0.0
        with tensor_parallel_rng(dropout_p > 0.0):  # under TP these are this rank's heads: masks of its own
            if self.attention == "reference" or (dropout_p > 0.0 and q.device.type == "cpu"):
                return _attend_masked(scaled_dot_product_attention_reference, q, k, v, key_padding_mask, causal,
                                      offset, dropout_p)
            if key_padding_mask is None and not (causal and offset):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
            return _attend_masked(F.scaled_dot_product_attention, q, k, v, key_padding_mask, causal, offset, dropout_p)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        cache: AttentionCache | None = None,
    ) -> Tensor:
        """Attend from ``query`` to ``key``/``value`` with the kernel ``self.attention``.

        Args:
            query: (B, T, C) float.
            key: (B, S, C); defaults to ``query`` (self-attention).
            value: (B, S, C); defaults to ``key``.
            key_padding_mask: optional bool (B, S), True = padding (ignored as a key), the same
                convention as ``nn.MultiheadAttention``.
            causal: if True, query t may only attend to keys 0..t (top-left aligned).
            cache: incremental decoding (eval): the keys/values of earlier calls (see ``AttentionCache``).
                For self-attention the keys are then the P cached plus the T new positions (S = P + T),
                key_padding_mask covers all S, and the causal mask is aligned bottom-right.

        Returns:
            (B, T, C) in query's dtype. A query row whose keys are all masked yields the output
            projection of a zero vector (i.e. the out_proj bias), never NaN.

        Raises:
            ValueError: for a key_padding_mask that is not bool (B, S).
        """
        key = query if key is None else key
        value = key if value is None else value
        q, k, v = self._heads(query, key, value, cache)  # (B, H, T, d_k), (B, H, S, d_k), (B, H, S, d_k)
        # from q, not query: under sequence parallelism query is this rank's 1/tp of the sequence, q all of it
        B, T, S = q.shape[0], q.shape[2], k.shape[2]
        if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool or key_padding_mask.shape != (B, S)):
            raise ValueError(f"key_padding_mask must be a bool tensor of shape {(B, S)}, got "
                             f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
        offset = S - T if cache is not None else 0  # with cached keys the queries are the last T of S positions
        if causal and offset and T == 1:
            causal = False  # one new query may see every cached key
        out = self._attend(q, k, v, key_padding_mask, causal, offset)  # (B, H, T, d_k)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, -1))  # heads concatenated: (B, T, H · d_k)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, dropout={self.dropout}, "
            f"fused_qkv={self.fused_qkv}, attention={self.attention!r}"
        )
