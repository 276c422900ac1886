"""Step 2 of the model: multi-head scaled dot-product attention (Vaswani et al. 2017, §3.2), and what later
decoders changed in it: fewer key/value heads (grouped-query attention), rotary positions, q/k normalisation.

* ``scaled_dot_product_attention_reference`` -- softmax(Q Kᵀ / √d_k) V written out, the twin of
  ``F.scaled_dot_product_attention``; ``repeat_kv`` -- the key/value heads repeated for their query heads.
* ``MultiHeadAttention`` -- project Q/K/V, split into heads, (normalise and rotate q and k,) attend with one of the
  two kernels, merge, project.
* ``StackedLinear`` -- the fused Q/K/V projection: one Linear, any run of its parts computed by one call.

Grouped-query attention (Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from
Multi-Head Checkpoints"): H query heads share H_kv key/value heads, each K/V head serving a group of H / H_kv
consecutive query heads (H_kv = 1 is multi-query attention, Shazeer 2019; H_kv = H is multi-head attention). The
K and V projections shrink by H / H_kv and so does the key/value cache of generation, which is what bounds batch
size and context at inference.

Masks are bool, True = may attend (SDPA's convention); padding masks are bool, True = pad
(``nn.MultiheadAttention``'s). Shape letters: B batch, T query length, S key length, C = d_model channels,
H query heads, H_kv key/value heads, d_k channels per head (C // H unless ``head_dim`` is given).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_handle.model.args import ATTENTION_IMPLS, AttentionImpl, check_choice
from torch_handle.model.kernels import causal_attention, dropout, sdpa_fast_path_cpu
from torch_handle.model.kv_cache import AttentionCache
from torch_handle.model.norms import RMSNorm
from torch_handle.model.rope import RotaryEmbedding
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


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Each key/value head repeated for the ``n_rep`` query heads of its group: (B, H_kv, S, d) -> (B, H_kv·n_rep,
    S, d), query head h reading K/V head h // n_rep (``transformers``' ``repeat_kv``; SDPA's ``enable_gqa``)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def scaled_dot_product_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """softmax(Q Kᵀ / √d_k) V, written out (Vaswani et al. 2017, eq. 1).

    The explicit twin of ``torch.nn.functional.scaled_dot_product_attention`` (with ``enable_gqa`` when k and v
    have fewer heads than q); kept for readability and as a correctness oracle for the fused kernel.

    Args:
        q: (B, H, T, d_k) float.
        k: (B, H_kv, S, d_k), same dtype as q; H_kv divides H (grouped-query attention: ``repeat_kv``).
        v: (B, H_kv, S, d_v), same dtype as q.
        mask: optional bool tensor broadcastable to (B, H, T, S); True = may attend (the same
            convention as ``F.scaled_dot_product_attention``).
        dropout_p: dropout on the attention weights; pass 0.0 at eval time.

    Returns:
        (B, H, T, d_v) in q's dtype. Query rows whose keys are all masked return zeros rather
        than NaN.
    """
    d_k = q.size(-1)
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, S, d_k): every query head its group's K/V
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
    key_padding_mask: Tensor | None, causal: bool, T: int, S: int, device: torch.device, offset: int = 0,
    attn_mask: Tensor | None = None,
) -> Tensor | None:
    """Combine causal (or a given ``attn_mask``) and key-padding masks into one bool mask, True = may attend.

    Returns None when nothing is masked, else a tensor broadcastable to (B, H, T, S). The causal
    mask is aligned top-left (query t sees keys 0..t), matching SDPA's ``is_causal``; with ``offset``
    (cached keys before the queries) query t sees keys 0..offset + t. ``attn_mask`` (bool (B, 1, T, S), e.g. the
    block-causal mask of packed documents) replaces the causal mask: it already holds what may be attended.
    """
    mask = attn_mask
    if causal and mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=offset)  # (T, S)
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
        mask = keep if mask is None else mask & keep  # (B, 1, T, S)
    return mask


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0,
         is_causal: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention`` with the reference's signature and its grouped-query handling: k and v
    may have H_kv heads (``enable_gqa``: no copies of K and V are made). q (B, H, T, d_k) -> (B, H, T, d_v).

    Causal bf16 self-attention on CPU up to ``kernels.EXPLICIT_ATTENTION_MAX_LEN`` tokens takes
    ``kernels.causal_attention`` instead (the same arithmetic; torch's CPU flash backward is the slower there)."""
    if sdpa_fast_path_cpu(q, k, is_causal, mask is not None, dropout_p):
        return causal_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                          enable_gqa=k.shape[1] != q.shape[1])


def _attend_masked(kernel: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None,
                   causal: bool, offset: int, dropout_p: float, attn_mask: Tensor | None = None) -> Tensor:
    """``kernel(q, k, v, mask, dropout_p)`` with the mask tensor of ``_attention_mask``: (B, H, T, d_k).

    Only padding can leave a query row with no key (causal always leaves key 0, a document mask the query's own
    position): such rows attend everywhere and their output is zeroed (``_unmask_empty_rows``)."""
    mask = _attention_mask(key_padding_mask, causal, q.shape[2], k.shape[2], q.device, offset,
                           attn_mask)  # (B|1, 1, T, S)
    if key_padding_mask is None:
        return kernel(q, k, v, mask, dropout_p)
    mask, empty_rows = _unmask_empty_rows(mask)
    return kernel(q, k, v, mask, dropout_p).masked_fill(empty_rows, 0.0)


class StackedLinear(nn.Linear):
    """Projections stacked in one Linear: weight [W_0; W_1; ...] (sum(part_features), in), bias likewise; the state
    dict is an ``nn.Linear``'s. Fused Q/K/V: parts (H·d_k, H_kv·d_k, H_kv·d_k), equal without grouped-query attention.

    ``forward(x)`` computes every part in one matmul: (B, L, in) -> (B, L, sum(part_features)). ``forward(x, parts=
    slice(i, j))`` computes only parts i..j-1, e.g. a cross-attention's Q of the decoder state and K, V of the
    encoder memory. Either is a call of this module, so a tensor-parallel version of it (which keeps a slice of every
    part: ``ColumnParallelLinear(parts=n_parts)``, DTensor's ``_StridedShard``) serves both; equal parts are
    selected through a view (n_parts, out, in) of the weight, which both layouts support locally.
    """

    def __init__(self, in_features: int, part_features: Sequence[int], bias: bool = True) -> None:
        super().__init__(in_features, sum(part_features), bias=bias)
        self.part_features = tuple(part_features)

    @property
    def n_parts(self) -> int:
        return len(self.part_features)

    def forward(self, x: Tensor, parts: slice | None = None) -> Tensor:
        if parts is None:
            return super().forward(x)
        bias = None if self.bias is None else select_parts(self.bias, self.part_features, parts)
        return F.linear(x, select_parts(self.weight, self.part_features, parts), bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, part_features={self.part_features}"


def select_parts(stacked: Tensor, part_features: Sequence[int], parts: slice) -> Tensor:
    """Rows of ``parts`` from ``stacked``, blocks of ``part_features`` rows along dim 0, as a view: ((sum, ...) ->
    (the selected blocks' rows, ...)). For equal blocks also a local operation on a DTensor split per block
    (``_StridedShard``)."""
    if len(set(part_features)) == 1:
        return stacked.unflatten(0, (len(part_features), -1))[parts].flatten(0, 1)
    start, stop, _ = parts.indices(len(part_features))
    offset = sum(part_features[:start])
    return stacked.narrow(0, offset, sum(part_features[start:stop]))


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention (Vaswani et al. 2017, §3.2.2), with grouped-query attention (Ainslie
    et al. 2023), rotary positions (Su et al. 2021) and q/k normalisation (Qwen 3) as options.

    Q is projected to H heads of width d_k, K and V to H_kv heads; with ``qk_norm`` each head's q and k is
    RMS-normalised, with ``rope_theta`` q and k are rotated by their positions (``rope.py``); each query head
    attends with the K/V head of its group, the heads are concatenated, and ``out_proj`` maps H·d_k back to C.

    Args:
        d_model: model width C.
        n_heads: number of query heads H; must divide d_model unless ``head_dim`` is given.
        dropout: dropout on the attention weights (training only).
        fused_qkv: keep Q/K/V projections in one ``qkv_proj`` Linear(C, (H + 2·H_kv)·d_k) (a ``StackedLinear``) --
            one matmul for self-attention, and for cross-attention one for Q and one for K, V -- instead of
            separate ``q_proj`` / ``k_proj`` / ``v_proj``. The fused weight is laid out [W_q; W_k; W_v], like
            ``nn.MultiheadAttention.in_proj_weight``.
        bias: whether the projections have biases.
        attention: the kernel, ``"sdpa"`` (``F.scaled_dot_product_attention``) or
            ``"reference"`` (``scaled_dot_product_attention_reference``). Both give the same
            result; the attribute ``self.attention`` may be changed at any time.
        n_kv_heads: H_kv, key/value heads; must divide n_heads. None: n_heads (multi-head attention).
        head_dim: d_k; None: d_model // n_heads.
        rope_theta: rotate q and k by their positions with this base (``rope.RotaryEmbedding``); None: no rotary
            positions (the model adds a position table instead, or there are none: cross-attention).
        qk_norm: an RMSNorm of width d_k on every query and key head (``q_norm``, ``k_norm``), before RoPE.
        norm_eps: the q/k norms' epsilon.

    Raises:
        ValueError: if d_model is not divisible by n_heads (without head_dim), n_kv_heads does not divide
        n_heads, an odd d_k with RoPE, or for an unknown ``attention`` (when constructed or when
        ``self.attention`` is assigned).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        fused_qkv: bool = True,
        bias: bool = True,
        attention: AttentionImpl = "sdpa",
        *,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        rope_theta: float | None = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if head_dim is None and d_model % n_heads != 0:
            raise ValueError(
                f"d_model ({d_model}) must be divisible by n_heads ({n_heads}) "
                "so every head gets the same width (or give head_dim)"
            )
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads}): each key/value head "
                             f"serves an equal group of query heads")
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.d_k = head_dim or d_model // n_heads
        self.dropout = dropout
        self.fused_qkv = fused_qkv
        self.attention = attention  # validated by the setter below
        q_features, kv_features = n_heads * self.d_k, n_kv_heads * self.d_k
        if fused_qkv:
            self.qkv_proj = StackedLinear(d_model, (q_features, kv_features, kv_features), bias=bias)
        else:
            self.q_proj = nn.Linear(d_model, q_features, bias=bias)
            self.k_proj = nn.Linear(d_model, kv_features, bias=bias)
            self.v_proj = nn.Linear(d_model, kv_features, bias=bias)
        self.out_proj = nn.Linear(q_features, d_model, bias=bias)
        self.q_norm = RMSNorm(self.d_k, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.d_k, norm_eps) if qk_norm else None
        self.rope = RotaryEmbedding(self.d_k, rope_theta) if rope_theta is not None else None
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
        """Xavier-uniform weights and zero biases, as in the original Transformer (the q/k norms' gains: ones).

        The fused weight is initialised one block (W_q, W_k, W_v) at a time so fused and separate
        projections start from the same distribution.
        """
        if self.fused_qkv:
            projections = [self.qkv_proj, self.out_proj]
            weights = [*self.qkv_proj.weight.data.split(self.qkv_proj.part_features, dim=0), self.out_proj.weight.data]
        else:
            projections = [self.q_proj, self.k_proj, self.v_proj, self.out_proj]
            weights = [proj.weight.data for proj in projections]
        for weight in weights:
            nn.init.xavier_uniform_(weight)  # blocks are views, so this writes into qkv_proj
        for proj in projections:
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)

    # ---- projections: (B, L, C) in, (B, H or H_kv, L, d_k) out ----------------------------------------------

    def _project_q(self, query: Tensor) -> Tensor:
        return self.qkv_proj(query, parts=slice(0, 1)) if self.fused_qkv else self.q_proj(query)

    def _split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, L, (H + 2·H_kv)·d_k) -> q (B, L, H·d_k), k and v (B, L, H_kv·d_k). Sized from the width, not from
        the weight: under tensor parallelism the fused projection is this rank's share of each part."""
        unit = qkv.shape[-1] // (self.n_heads + 2 * self.n_kv_heads)
        return qkv.split([self.n_heads * unit, self.n_kv_heads * unit, self.n_kv_heads * unit], dim=-1)

    def _project_qkv(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Input projections, each one module call: q (B, T, H·d_k), k and v (B, S, H_kv·d_k)."""
        if not self.fused_qkv:
            return self.q_proj(query), self.k_proj(key), self.v_proj(value)
        if query is key and key is value:
            # Self-attention: one matmul instead of three.
            return self._split_qkv(self.qkv_proj(query))
        # Cross-attention: the inputs differ, so each projects through its parts of the fused weight.
        q = self._project_q(query)
        if key is value:
            # Encoder memory feeds both K and V: still one matmul for the pair.
            k, v = self.qkv_proj(key, parts=slice(1, 3)).chunk(2, dim=-1)
            return q, k, v
        return q, self.qkv_proj(key, parts=slice(1, 2)), self.qkv_proj(value, parts=slice(2, 3))

    def _split_heads(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        # (B, L, heads·d_k) -> (B, heads, L, d_k); under tensor parallelism this rank's share of the heads
        return x.view(B, L, -1, self.d_k).transpose(1, 2)

    def _position(self, x: Tensor, norm: RMSNorm | None, offset: int, positions: Tensor | None = None,
                  table: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """q or k (B, heads, L, d_k) of positions offset .. offset + L - 1 (or ``positions`` (B, L)): RMS-normalised
        per head (``qk_norm``), then rotated (RoPE, from the model's ``table`` when given); as it is without
        either."""
        if norm is not None:
            x = norm(x)
        return x if self.rope is None else self.rope(x, offset, positions, table)

    def _heads(self, query: Tensor, key: Tensor, value: Tensor, cache: AttentionCache | None,
               positions: Tensor | None = None, table: tuple[Tensor, Tensor] | None = None
               ) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, T, d_k); k, v (B, H_kv, S, d_k): the projections of key/value, or with a ``cache`` the cached
        ones (a static cache that is ready: projected once) or the cached followed by the new (self-attention).
        Cached keys are stored normalised and rotated: a key's rotation depends on its own position only.
        ``positions`` (B, T): each token's position for RoPE (packed documents), instead of 0 .. T - 1; ``table``:
        the model's RoPE (cos, sin) rows (``rope.rope_table``)."""
        offset = 0 if cache is None or cache.static else cache.length  # positions before these queries
        if cache is not None and cache.ready:
            q = self._position(self._split_heads(self._project_q(query)), self.q_norm, offset, table=table)
            return q, cache.k, cache.v
        q, k, v = (self._split_heads(t) for t in self._project_qkv(query, key, value))
        q = self._position(q, self.q_norm, offset, positions, table)
        k = self._position(k, self.k_norm, offset, positions, table)
        if cache is not None:
            k, v = cache.update(k, v)
        return q, k, v

    # ---- kernels: (B, H, T, d_k) q, (B, H_kv, S, d_k) k and v in; (B, H, T, d_k) out ------------------------

    context_parallel: Callable[[Tensor, Tensor, Tensor, bool], Tensor] | None = None
    """Context parallelism's attention, installed by its share (``torch_handle.train.shares.context``): called
    as ``context_parallel(q, k, v, causal)`` in place of the kernel, with q (B, H, T/cp, d_k) and k, v (B, H_kv,
    T/cp, d_k) this rank's tokens; it knows their positions and documents (the model's ``attn_mask``, built from
    the local tokens alone, is not used). None: the kernel below."""

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool,
                offset: int, attn_mask: Tensor | None = None) -> Tensor:
        """Run the kernel ``self.attention`` names, in one of three ways:

        * the reference, with a mask tensor: ``"reference"``, and ``"sdpa"`` while training with dropout on CPU,
          where SDPA runs its math kernel (upcast to fp32 for bf16/fp16 inputs) and draws the mask with the slow
          ``bernoulli_``; the reference computes the same in the inputs' dtype with the fast CPU ``dropout``;
        * SDPA with ``is_causal`` and no mask tensor, which lets it pick its fastest (flash) kernel: nothing but
          a top-left causal mask to apply (the models pass no ``key_padding_mask`` for a batch without padding:
          ``transformer.padding_mask_of``);
        * SDPA with a mask tensor otherwise (padding, a causal mask shifted by cached keys, or ``attn_mask``: the
          block-causal mask of packed documents).
        """
        if self.context_parallel is not None:  # this rank's share of the sequence against every cp rank's keys
            return self.context_parallel(q, k, v, causal or attn_mask is not None)
        dropout_p = self.dropout if self.training else 0.0
        with tensor_parallel_rng(dropout_p > 0.0):  # under TP these are this rank's heads: masks of its own
            if self.attention == "reference" or (dropout_p > 0.0 and q.device.type == "cpu"):
                return _attend_masked(scaled_dot_product_attention_reference, q, k, v, key_padding_mask, causal,
                                      offset, dropout_p, attn_mask)
            if key_padding_mask is None and attn_mask is None and not (causal and offset):
                return sdpa(q, k, v, dropout_p=dropout_p, is_causal=causal)
            return _attend_masked(sdpa, q, k, v, key_padding_mask, causal, offset, dropout_p, attn_mask)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        cache: AttentionCache | None = None,
        attn_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        rope_table: tuple[Tensor, Tensor] | None = None,
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
                key_padding_mask covers all S, the causal mask is aligned bottom-right, and RoPE rotates the
                new queries and keys as positions P .. P + T - 1.
            attn_mask: optional bool (B, 1, T, S), True = may attend, built once per batch by the model (the
                block-causal mask of packed documents: ``transformer.document_mask_of``); it replaces the causal
                mask (``causal`` is then ignored) and forces a mask tensor into the kernel.
            position_ids: optional LongTensor (B, T): each query's and key's position for RoPE (self-attention;
                restarting at 0 at each packed document) instead of 0 .. T - 1.
            rope_table: the model's RoPE (cos, sin), each float32 (max_len, d_k) (``rope.rope_table``): the rows of
                these positions are sliced from it; None computes the angles here (a module used on its own).

        Returns:
            (B, T, C) in query's dtype. A query row whose keys are all masked yields the output
            projection of a zero vector (i.e. the out_proj bias), never NaN.

        Raises:
            ValueError: for a key_padding_mask that is not bool (B, S), or an attn_mask that is not bool (B|1, 1,
                T, S).
        """
        key = query if key is None else key
        value = key if value is None else value
        # (B, H, T, d_k), (B, H_kv, S, d_k), (B, H_kv, S, d_k)
        q, k, v = self._heads(query, key, value, cache, position_ids, rope_table)
        # from q, not query: under sequence parallelism query is this rank's 1/tp of the sequence, q all of it
        B, T, S = q.shape[0], q.shape[2], k.shape[2]
        if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool or key_padding_mask.shape != (B, S)):
            raise ValueError(f"key_padding_mask must be a bool tensor of shape {(B, S)}, got "
                             f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
        if attn_mask is not None and (attn_mask.dtype != torch.bool or attn_mask.dim() != 4
                                      or attn_mask.shape[0] not in (1, B) or attn_mask.shape[1:] != (1, T, S)):
            raise ValueError(f"attn_mask must be a bool tensor of shape {(B, 1, T, S)}, got "
                             f"{attn_mask.dtype} {tuple(attn_mask.shape)}")
        offset = S - T if cache is not None else 0  # with cached keys the queries are the last T of S positions
        if causal and offset and T == 1:
            causal = False  # one new query may see every cached key
        out = self._attend(q, k, v, key_padding_mask, causal, offset, attn_mask)  # (B, H, T, d_k)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, -1))  # heads concatenated: (B, T, H · d_k)

    def extra_repr(self) -> str:
        kv = f", n_kv_heads={self.n_kv_heads}" if self.n_kv_heads != self.n_heads else ""
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}{kv}, d_k={self.d_k}, dropout={self.dropout}, "
            f"fused_qkv={self.fused_qkv}, attention={self.attention!r}"
        )
