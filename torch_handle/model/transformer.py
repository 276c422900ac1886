"""A from-scratch Transformer, written to be read top to bottom.

Building blocks, then two models that share them and one set of arguments:

* ``SinusoidalPositionalEncoding`` -- fixed sin/cos position table (Vaswani et al. 2017, §3.5).
* ``MultiHeadAttention``           -- scaled dot-product attention over H heads (Vaswani et al. 2017, §3.2).
* ``PositionwiseFeedForward``      -- two linear layers with a nonlinearity in between (§3.3).
* ``EncoderLayer`` / ``DecoderLayer`` -- attention + FFN sub-layers, each wrapped in a residual
  connection and LayerNorm, either post-LN (the original paper) or pre-LN (Xiong et al. 2020,
  "On Layer Normalization in the Transformer Architecture").
* ``TransformerArgs`` -- every size and switch of a model, in one dataclass (like nanoGPT's ``GPTConfig``).
* ``DecoderLM``      -- GPT-style decoder-only language model.
* ``EncoderDecoder`` -- the original encoder-decoder Transformer with a shared vocabulary.

Both models declare their repeated layers with ``blocks()``: each block is checkpointed on its own
(``activation_checkpointing``) and is the unit a sharding wrapper such as FSDP2 gathers and frees.
The attention kernel (``"sdpa"`` or ``"reference"``) is an attribute of ``MultiHeadAttention``, checked
in one place (its setter); ``model.attention = "reference"`` switches every attention module at once.

Shape letters used throughout: B batch, T query/target length, S key/source length,
C = d_model channels, H heads, d_k = C // H channels per head, V vocabulary size.

Only ``torch`` and the standard library are imported, so this file can be lifted out on its own.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import KW_ONLY, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "ACTIVATIONS",
    "ATTENTION_IMPLS",
    "MODEL_KINDS",
    "AttentionCache",
    "DecoderLM",
    "DecoderLayer",
    "EncoderDecoder",
    "EncoderLayer",
    "KVCache",
    "LayerCache",
    "MultiHeadAttention",
    "PositionwiseFeedForward",
    "SinusoidalPositionalEncoding",
    "TransformerArgs",
    "build_transformer",
    "scaled_dot_product_attention_reference",
]

AttentionImpl = Literal["sdpa", "reference"]
Activation = Literal["relu", "gelu"]

ATTENTION_IMPLS: tuple[str, ...] = ("sdpa", "reference")
ACTIVATIONS: tuple[str, ...] = ("relu", "gelu")


# --------------------------------------------------------------------------------------------
# Profiler ranges
# --------------------------------------------------------------------------------------------

def _range(name: str) -> contextlib.AbstractContextManager:
    """A ``torch.profiler.record_function(name)`` range while a profiler records, else a no-op context.

    The model's ranges show its structure in a trace: ``decoder.layer<i>`` / ``encoder.layer<i>`` around each
    block's forward, and ``attention`` / ``cross_attention`` / ``feed_forward`` inside it (these also mark the
    recomputation in backward under activation checkpointing). ``torch.autograd._profiler_enabled()`` (a C++
    flag, true while any ``torch.profiler`` records) guards them: an unguarded range costs 6-14 µs even with no
    profiler (measured on 2 shared CPU cores: +6.9% on a forward + backward of the 2-layer d_model=64 test
    model); guarded, 0.1 µs more than a plain no-op context (+0.2%, within noise).
    """
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _check_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(map(repr, valid))}")


# --------------------------------------------------------------------------------------------
# Dropout
# --------------------------------------------------------------------------------------------

_DROP_LEVELS = 1 << 16  # the CPU mask compares 16-bit random integers with a threshold


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Inverted dropout (Srivastava et al. 2014): zero each element with probability p, scale the rest by 1/(1-p).

    Same contract as ``F.dropout(x, p, training)``; on CUDA (or for p outside (0, 1)) it *is* ``F.dropout``. On
    CPU, ``F.dropout`` draws its mask with ``bernoulli_``, whose CPU kernel (on non-Intel CPUs, without MKL's
    generator) costs ~5 ns per element: ~20-28% of a bf16 step of the P1 model (d_model 256, 4 layers, seq 128,
    micro-batch 8; measured with torch.profiler on 2 AMD EPYC cores, torch 2.13). Here the mask comes from 64-bit
    draws of torch's global generator split into four 16-bit integers (``torch.randint`` over the full int64
    range, viewed as int16; ~0.7 ns per element), kept where the integer is at or above a threshold:

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


# --------------------------------------------------------------------------------------------
# Positional encoding
# --------------------------------------------------------------------------------------------


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sinusoidal position table (Vaswani et al. 2017, §3.5)::

        PE[pos, 2i]   = sin(pos / 10000^(2i / d_model))
        PE[pos, 2i+1] = cos(pos / 10000^(2i / d_model))

    The table is a persistent buffer: it is saved in the ``state_dict`` and follows the module
    through ``.to(device)`` / ``.to(dtype)``, but it is not a parameter, so no optimizer sees it.

    Args:
        d_model: embedding width C.
        max_len: longest sequence the table covers.

    Shape:
        forward(x): x is (B, T, C) float; returns (B, T, C) in x's dtype.

    Raises:
        ValueError: if T > max_len.
    """

    pe: Tensor

    def __init__(self, d_model: int, max_len: int = 5000) -> None:
        super().__init__()
        self.d_model = d_model
        self.max_len = max_len
        # Computed in float64 so large positions keep their precision before the float32 cast.
        position = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (max_len, 1)
        div_term = torch.exp(
            torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model)
        )  # (ceil(C/2),)
        pe = torch.zeros(max_len, d_model, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term[: d_model // 2])  # odd C has one fewer cos column
        self.register_buffer("pe", pe.to(torch.float32), persistent=True)  # (max_len, C)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """x (B, T, C) -> x + PE[offset : offset + T]; ``offset`` is the number of positions before x (the
        length of a key/value cache when decoding incrementally)."""
        T = x.shape[1]
        if offset + T > self.max_len:
            raise ValueError(f"sequence length {offset + T} exceeds positional-encoding max_len {self.max_len}")
        return x + self.pe[offset:offset + T].to(x.dtype)  # (T, C) broadcasts over B

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}"


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


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


class AttentionCache:
    """What one ``MultiHeadAttention`` keeps between incremental decoding steps: its keys and values.

    Self-attention (``static=False``): each call appends the new positions' keys/values, so a step feeds only
    the new token. Cross-attention (``static=True``): the keys/values of the encoder memory are projected on
    the first call and reused afterwards (the memory passed later is ignored).

    Attributes:
        k, v: (B, H, S, d_k) or None before the first call.
    """

    def __init__(self, static: bool = False) -> None:
        self.static = static
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (LongTensor (B',), repeats allowed: beam search)."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


class LayerCache:
    """A ``DecoderLayer``'s caches: ``self_attn`` (appending) and ``cross_attn`` (static, encoder-decoder)."""

    def __init__(self) -> None:
        self.self_attn = AttentionCache()
        self.cross_attn = AttentionCache(static=True)


class KVCache:
    """Key/value cache for incremental decoding (eval only): one ``LayerCache`` per decoder layer, the
    target padding mask of the positions seen so far, and their number (``length``: the position offset
    of the next tokens). Pass the same object to successive ``DecoderLM.forward`` / ``EncoderDecoder.decode``
    calls, feeding only the new tokens; the logits equal those of recomputing the whole prefix.

    Args:
        n_layers: decoder layers of the model (``KVCache.for_model(model)`` counts them).
    """

    def __init__(self, n_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(n_layers)]
        self.padding_mask: Tensor | None = None  # bool (B, length), True = pad
        self.length = 0

    @classmethod
    def for_model(cls, model: nn.Module) -> KVCache:
        return cls(len(model.layers) if hasattr(model, "layers") else len(model.decoder_layers))

    def extend_padding(self, mask: Tensor | None) -> Tensor | None:
        """Append the new tokens' padding mask (B, T) and return the whole (B, length + T) one."""
        if mask is not None:
            self.padding_mask = mask if self.padding_mask is None else torch.cat([self.padding_mask, mask], 1)
        return self.padding_mask

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (LongTensor (B',)) of every cached tensor (beam search, finished rows)."""
        for layer in self.layers:
            layer.self_attn.reorder(index)
            layer.cross_attn.reorder(index)
        if self.padding_mask is not None:
            self.padding_mask = self.padding_mask.index_select(0, index)


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention (Vaswani et al. 2017, §3.2.2).

    Q, K and V are projected, split into H heads of width d_k = d_model / H, attended
    independently, concatenated, and projected back by ``out_proj``.

    Args:
        d_model: model width C.
        n_heads: number of heads H; must divide d_model.
        dropout: dropout on the attention weights (training only).
        fused_qkv: keep Q/K/V projections in one ``qkv_proj`` Linear(C, 3C) -- one matmul for
            self-attention -- instead of separate ``q_proj`` / ``k_proj`` / ``v_proj``. The fused
            weight is laid out [W_q; W_k; W_v], like ``nn.MultiheadAttention.in_proj_weight``.
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
            self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
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
        _check_choice("attention", impl, ATTENTION_IMPLS)
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

    def _project_qkv(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Input projections; each result is (B, len, C)."""
        if not self.fused_qkv:
            return self.q_proj(query), self.k_proj(key), self.v_proj(value)
        if query is key and key is value:
            # Self-attention: one (C -> 3C) matmul instead of three.
            return self.qkv_proj(query).chunk(3, dim=-1)
        # Cross-attention: the inputs differ, so slice the fused weight [W_q; W_k; W_v] by rows.
        C = self.d_model
        weight, bias = self.qkv_proj.weight, self.qkv_proj.bias  # (3C, C), (3C,)

        def project(x: Tensor, rows: slice) -> Tensor:
            return F.linear(x, weight[rows], None if bias is None else bias[rows])

        q = project(query, slice(0, C))
        if key is value:
            # Encoder memory feeds both K and V: still one matmul for the pair.
            k, v = project(key, slice(C, 3 * C)).chunk(2, dim=-1)
        else:
            k, v = project(key, slice(C, 2 * C)), project(value, slice(2 * C, 3 * C))
        return q, k, v

    def _attend_cached(self, query: Tensor, key: Tensor, value: Tensor,
                       cache: AttentionCache) -> tuple[Tensor, Tensor, Tensor]:
        """Projections with a cache: q (B, H, T, d_k) of the new queries; k, v (B, H, S, d_k): for a static
        (cross-attention) cache the memory's, projected once; otherwise the cached ones followed by the new."""
        B, H, d_k = query.shape[0], self.n_heads, self.d_k

        def heads(x: Tensor) -> Tensor:  # (B, L, C) -> (B, H, L, d_k)
            return x.view(B, x.shape[1], H, d_k).transpose(1, 2)

        if cache.static and cache.k is not None:
            C = self.d_model
            q = (self.q_proj(query) if not self.fused_qkv else
                 F.linear(query, self.qkv_proj.weight[:C], None if self.qkv_proj.bias is None
                          else self.qkv_proj.bias[:C]))
            return heads(q), cache.k, cache.v
        q, k, v = (heads(t) for t in self._project_qkv(query, key, value))
        if not cache.static and cache.k is not None:
            k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
        cache.k, cache.v = k, v
        return q, k, v

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
        impl = self.attention

        B, T, C = query.shape
        S = key.shape[1]
        H, d_k = self.n_heads, self.d_k
        if cache is not None:
            q, k, v = self._attend_cached(query, key, value, cache)  # (B, H, T, d_k), (B, H, S', d_k) x2
            S = k.shape[2]
        if key_padding_mask is not None and (
            key_padding_mask.dtype != torch.bool or key_padding_mask.shape != (B, S)
        ):
            raise ValueError(
                f"key_padding_mask must be a bool tensor of shape {(B, S)}, got "
                f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
            )

        if cache is None:
            q, k, v = self._project_qkv(query, key, value)  # (B, T, C), (B, S, C), (B, S, C)
            q = q.view(B, T, H, d_k).transpose(1, 2)  # (B, H, T, d_k)
            k = k.view(B, S, H, d_k).transpose(1, 2)  # (B, H, S, d_k)
            v = v.view(B, S, H, d_k).transpose(1, 2)  # (B, H, S, d_k)
        offset = S - T if cache is not None else 0  # with cached keys the queries are the last T of S positions
        if causal and offset and T == 1:
            causal = False  # one new query may see every cached key

        dropout_p = self.dropout if self.training else 0.0
        # On CPU, SDPA with dropout runs its math kernel (upcast to fp32 for bf16/fp16 inputs) and draws the mask
        # with the slow bernoulli_; the reference computes the same with the fast CPU ``dropout`` (see there), in
        # the inputs' dtype: bf16 matmuls (fp32 accumulation, AMX) and a softmax that accumulates in fp32 take
        # 4.4 ms against 9.3 ms for the upcast version (fwd + bwd, B=8, H=4, T=128, d_k=64, 1 thread).
        cpu_dropout = dropout_p > 0.0 and query.device.type == "cpu"
        if impl == "sdpa" and key_padding_mask is None and not cpu_dropout and not (causal and offset):
            # No mask tensor needed: is_causal lets SDPA pick its fastest (flash) kernel.
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
        else:
            mask = _attention_mask(key_padding_mask, causal, T, S, query.device, offset)  # (B|1, 1, T, S) | None
            empty_rows = None
            if key_padding_mask is not None:
                # Only padding can empty a row (causal always leaves key 0); see _unmask_empty_rows.
                mask, empty_rows = _unmask_empty_rows(mask)
            if impl == "sdpa" and cpu_dropout:
                out = scaled_dot_product_attention_reference(q, k, v, mask, dropout_p)
            elif impl == "sdpa":
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
            else:
                out = scaled_dot_product_attention_reference(q, k, v, mask, dropout_p)
            if empty_rows is not None:
                out = out.masked_fill(empty_rows, 0.0)
        # out: (B, H, T, d_k)
        out = out.transpose(1, 2).reshape(B, T, C)  # (B, T, H * d_k): heads concatenated
        return self.out_proj(out)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, dropout={self.dropout}, "
            f"fused_qkv={self.fused_qkv}, attention={self.attention!r}"
        )


# --------------------------------------------------------------------------------------------
# Feed-forward and layers
# --------------------------------------------------------------------------------------------


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = W2 · dropout(act(W1 x + b1)) + b2, applied to every position independently
    (Vaswani et al. 2017, §3.3).

    Args:
        d_model: model width C.
        d_ff: hidden width (4C in most models).
        dropout: dropout on the hidden activations.
        activation: ``"relu"`` (the paper) or ``"gelu"`` (exact erf form, as in
            ``nn.TransformerEncoderLayer``).

    Shape:
        (B, T, C) -> (B, T, C).

    Raises:
        ValueError: for an unknown activation.
    """

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, activation: Activation = "relu") -> None:
        super().__init__()
        _check_choice("activation", activation, ACTIVATIONS)
        self.activation = activation
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.dropout = Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for linear in (self.linear1, self.linear2):
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        act = F.relu if self.activation == "relu" else F.gelu
        return self.linear2(self.dropout(act(self.linear1(x))))  # (B, T, d_ff) inside


class EncoderLayer(nn.Module):
    """Self-attention + feed-forward, each a residual sub-layer with LayerNorm.

    ``norm_first=False`` is the original post-LN layer, x = LN(x + sublayer(x))
    (Vaswani et al. 2017, §3.1); ``norm_first=True`` is pre-LN, x = x + sublayer(LN(x)), which
    trains stably without learning-rate warm-up (Xiong et al. 2020). Computes the same function
    as ``nn.TransformerEncoderLayer(batch_first=True)`` with the same settings.

    Args:
        d_model, n_heads, d_ff: widths; n_heads must divide d_model.
        dropout: used on attention weights, FFN hidden units and both residual branches.
        activation: ``"relu"`` or ``"gelu"``.
        norm_first: pre-LN if True, post-LN if False.
        attention: attention kernel (``"sdpa"`` / ``"reference"``), kept by ``self_attn``.
        fused_qkv: see ``MultiHeadAttention``.
        layer_norm_eps: LayerNorm epsilon.

    Shape:
        forward(x (B, T, C), key_padding_mask bool (B, T) True = pad) -> (B, T, C).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.0,
        activation: Activation = "relu",
        norm_first: bool = False,
        attention: AttentionImpl = "sdpa",
        fused_qkv: bool = True,
        layer_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout, fused_qkv=fused_qkv, attention=attention)
        self.ff = PositionwiseFeedForward(d_model, d_ff, dropout, activation)
        self.self_attn_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.ff_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout = Dropout(dropout)  # residual dropout, reused: it holds no state

    def forward(self, x: Tensor, *, key_padding_mask: Tensor | None = None) -> Tensor:
        def self_attn(h: Tensor) -> Tensor:
            with _range("attention"):
                return self.dropout(self.self_attn(h, h, h, key_padding_mask=key_padding_mask))

        def ff(h: Tensor) -> Tensor:
            with _range("feed_forward"):
                return self.dropout(self.ff(h))

        if self.norm_first:
            x = x + self_attn(self.self_attn_norm(x))
            x = x + ff(self.ff_norm(x))
        else:
            x = self.self_attn_norm(x + self_attn(x))
            x = self.ff_norm(x + ff(x))
        return x  # (B, T, C)


class DecoderLayer(nn.Module):
    """Causal self-attention, optional cross-attention to encoder memory, then feed-forward.

    Residual + LayerNorm wiring as in ``EncoderLayer`` (post-LN: Vaswani et al. 2017; pre-LN:
    Xiong et al. 2020). With ``cross_attention=True`` this computes the same function as
    ``nn.TransformerDecoderLayer(batch_first=True)`` given a causal ``tgt_mask``; with
    ``cross_attention=False`` it is a GPT-style decoder block.

    Args:
        d_model, n_heads, d_ff, dropout, activation, norm_first, attention, fused_qkv,
        layer_norm_eps: as for ``EncoderLayer``.
        cross_attention: add a cross-attention sub-layer over encoder memory.

    Shape:
        forward(x (B, T, C), memory (B, S, C) | None) -> (B, T, C).

    Raises:
        ValueError (from forward): memory missing when the layer has cross-attention, or given
        when it has none.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.0,
        activation: Activation = "relu",
        norm_first: bool = False,
        cross_attention: bool = True,
        attention: AttentionImpl = "sdpa",
        fused_qkv: bool = True,
        layer_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout, fused_qkv=fused_qkv, attention=attention)
        self.self_attn_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.cross_attn: MultiHeadAttention | None = None
        self.cross_attn_norm: nn.LayerNorm | None = None
        if cross_attention:
            self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout, fused_qkv=fused_qkv, attention=attention)
            self.cross_attn_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.ff = PositionwiseFeedForward(d_model, d_ff, dropout, activation)
        self.ff_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout = Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        causal: bool = True,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """
        Args:
            x: (B, T, C) target-side hidden states.
            memory: (B, S, C) encoder output; required iff the layer has cross-attention.
            key_padding_mask: bool (B, T), True = padded target position (with ``cache``: (B, P + T), the
                P cached positions first).
            memory_key_padding_mask: bool (B, S), True = padded source position.
            causal: mask future target positions (leave True except for experiments).
            cache: incremental decoding (eval): the keys/values of the P positions decoded before x.

        Returns:
            (B, T, C).
        """
        if (memory is None) != (self.cross_attn is None):
            raise ValueError(
                "memory must be given exactly when the DecoderLayer has cross-attention "
                f"(cross_attention={self.cross_attn is not None}, memory given={memory is not None})"
            )

        def self_attn(h: Tensor) -> Tensor:
            with _range("attention"):
                return self.dropout(self.self_attn(h, h, h, key_padding_mask=key_padding_mask, causal=causal,
                                                   cache=None if cache is None else cache.self_attn))

        def cross_attn(h: Tensor) -> Tensor:
            with _range("cross_attention"):
                return self.dropout(self.cross_attn(h, memory, memory, key_padding_mask=memory_key_padding_mask,
                                                    cache=None if cache is None else cache.cross_attn))

        def ff(h: Tensor) -> Tensor:
            with _range("feed_forward"):
                return self.dropout(self.ff(h))

        if self.norm_first:
            x = x + self_attn(self.self_attn_norm(x))
            if self.cross_attn is not None:
                x = x + cross_attn(self.cross_attn_norm(x))
            x = x + ff(self.ff_norm(x))
        else:
            x = self.self_attn_norm(x + self_attn(x))
            if self.cross_attn is not None:
                x = self.cross_attn_norm(x + cross_attn(x))
            x = self.ff_norm(x + ff(x))
        return x  # (B, T, C)


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerArgs:
    """Everything that shapes a ``DecoderLM`` or ``EncoderDecoder``, in one place (the role of
    nanoGPT's ``GPTConfig``). Frozen: it describes how the model was built; switch the attention
    kernel of a built model with ``model.attention = ...``.

    The defaults describe a pre-LN GELU stack (GPT-2 style); the original Transformer
    (Vaswani et al. 2017) is ``activation="relu", norm_first=False``. Nothing is checked here:
    each building block checks its own arguments when the model is constructed.
    """

    vocab_size: int
    """V: size of the (shared) token vocabulary."""
    d_model: int
    """C: width of the residual stream."""
    n_heads: int
    """H: attention heads; must divide d_model."""
    n_layers: int
    """Layers per stack (the encoder-decoder has two stacks, 2·n_layers layers in all)."""
    d_ff: int
    """Hidden width of the position-wise feed-forward network."""
    _: KW_ONLY
    dropout: float = 0.1
    """Embedding, attention-weight, FFN and residual dropout."""
    activation: Activation = "gelu"
    """Feed-forward nonlinearity: ``"relu"`` or ``"gelu"``."""
    norm_first: bool = True
    """Pre-LN (True; Xiong et al. 2020) or post-LN (False; Vaswani et al. 2017)."""
    tie_embeddings: bool = True
    """Share the embedding matrix with the output projection (Press & Wolf 2017)."""
    max_len: int = 1024
    """Longest sequence accepted (positional-table size)."""
    pad_id: int | None = None
    """Token id masked out as a key; None disables padding masks."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward while training."""
    attention: AttentionImpl = "sdpa"
    """Initial attention kernel, ``"sdpa"`` or ``"reference"``."""
    fused_qkv: bool = True
    """One Q/K/V projection per attention module (see ``MultiHeadAttention``)."""


class _TransformerModel(nn.Module):
    """What DecoderLM and EncoderDecoder share: token embedding + positional encoding on the
    way in, optional tied output projection on the way out, the block list (``blocks``) with
    per-block activation checkpointing, the attention switch, init and accounting.

    ``self.args`` is the ``TransformerArgs`` the model was built from.
    """

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.d_model)
        self.pos_encoding = SinusoidalPositionalEncoding(args.d_model, args.max_len)
        self.embed_dropout = Dropout(args.dropout)

    def _layer_kwargs(self) -> dict:
        """The ``TransformerArgs`` every ``EncoderLayer`` / ``DecoderLayer`` takes."""
        a = self.args
        return {"dropout": a.dropout, "activation": a.activation, "norm_first": a.norm_first, "attention": a.attention,
                    "fused_qkv": a.fused_qkv}

    def blocks(self) -> list[nn.Module]:
        """The repeated Transformer layers, in forward order.

        Each is run through ``_run_block`` (so it is checkpointed on its own when
        ``args.activation_checkpointing`` is set), and a sharding wrapper may make each its own unit
        (the ``fsdp`` strategy calls ``fully_shard`` on every block, then on the whole model).
        """
        raise NotImplementedError

    @property
    def n_layers_total(self) -> int:
        """Number of Transformer layers (encoder + decoder): ``len(self.blocks())``."""
        return len(self.blocks())

    @property
    def attention(self) -> AttentionImpl:
        """Attention kernel of the model's ``MultiHeadAttention`` modules, ``"sdpa"`` or ``"reference"``.

        Assigning it switches every attention module at once (each checks the name: an unknown one
        raises ValueError before anything changed).
        """
        return next(m for m in self.modules() if isinstance(m, MultiHeadAttention)).attention

    @attention.setter
    def attention(self, impl: AttentionImpl) -> None:
        for module in self.modules():
            if isinstance(module, MultiHeadAttention):
                module.attention = impl

    def _make_lm_head(self) -> nn.Linear:
        """Output projection C -> V; subclasses create it after their layers so the module
        tree reads in data-flow order."""
        lm_head = nn.Linear(self.args.d_model, self.args.vocab_size, bias=False)
        if self.args.tie_embeddings:
            # Press & Wolf 2017; Vaswani et al. 2017 §3.4: one matrix for input and output.
            lm_head.weight = self.embed.weight
        return lm_head

    def _reset_parameters(self) -> None:
        """Embedding (and untied output) weights ~ N(0, d_model^-0.5).

        With the √d_model input scaling this gives unit-variance token embeddings, and with a
        tied head it keeps initial logits O(1). The layers initialise themselves (Xavier).
        Only torch's global RNG is used, so the same seed builds the same model.
        """
        std = self.args.d_model**-0.5
        nn.init.normal_(self.embed.weight, mean=0.0, std=std)
        if not self.args.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=std)

    def _embed(self, ids: Tensor, offset: int = 0) -> Tensor:
        """(B, T) token ids -> (B, T, C): scaled embedding + position (from ``offset``), then dropout (§3.4)."""
        x = self.embed(ids) * math.sqrt(self.args.d_model)  # (B, T, C)
        return self.embed_dropout(self.pos_encoding(x, offset) if offset else self.pos_encoding(x))

    def _padding_mask(self, ids: Tensor) -> Tensor | None:
        """bool (B, T), True where ids == pad_id; None when the model has no pad_id."""
        return None if self.args.pad_id is None else ids == self.args.pad_id

    def _run_block(self, name: str, block: nn.Module, *args, **kwargs) -> Tensor:
        """Call ``block`` (one of ``blocks()``) inside the profiler range ``name`` (e.g. ``"decoder.layer3"``;
        see ``_range``); with activation checkpointing on (and training), store only its input and
        recompute its activations in the backward pass -- trades ~1 extra forward for O(n_layers) less
        activation memory (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost")."""
        with _range(name):
            if self.args.activation_checkpointing and self.training:
                return checkpoint(block, *args, use_reentrant=False, **kwargs)
            return block(*args, **kwargs)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of trainable parameters, each shared tensor counted once.

        Args:
            exclude_embeddings: leave out the token-embedding table (the positional table is a
                buffer and never counted). With tied embeddings this also removes the output
                projection, since it is the same tensor -- Kaplan et al. 2020's
                "non-embedding parameters".
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() de-duplicates tied weights
        if exclude_embeddings:
            n -= self.embed.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token, PaLM appendix B (Chowdhery et al. 2022),
        after Kaplan et al. 2020::

            6 N + 12 · L · d_model · seq_len

        6N covers the matmuls with the weights (2 FLOPs per multiply-add, ×3 for forward plus
        the backward's two matmuls); the second term covers the attention scores QKᵀ and the
        weighted sum with V over a context of ``seq_len`` keys in each of L layers.

        N counts the parameters that take part in a matmul: every parameter except the input
        embedding table, which is only indexed. With tied embeddings that table *is* the output
        projection, so it counts once -- N == ``num_params()``. L is ``n_layers_total``. For
        the encoder-decoder, "per token" means per target token with source and target both
        ``seq_len`` long; the cross-attention score term is not included (a small undercount).
        """
        n_matmul = self.num_params(exclude_embeddings=True)
        if self.args.tie_embeddings:
            n_matmul += self.lm_head.weight.numel()
        return 6.0 * n_matmul + 12.0 * self.n_layers_total * self.args.d_model * seq_len


class DecoderLM(_TransformerModel):
    """Decoder-only (GPT-style) causal language model.

    ids -> embed·√C + PE -> dropout -> n_layers × DecoderLayer(causal, no cross-attention)
    -> final LayerNorm (pre-LN only; Xiong et al. 2020) -> lm_head -> logits.

    Args:
        args: sizes and switches (``TransformerArgs``).

    Raises:
        ValueError: d_model % n_heads != 0, unknown activation/attention; from forward,
        sequences longer than max_len.
    """

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__(args)
        sizes = (args.d_model, args.n_heads, args.d_ff)
        self.layers = nn.ModuleList(
            DecoderLayer(*sizes, cross_attention=False, **self._layer_kwargs()) for _ in range(args.n_layers)
        )
        # Pre-LN leaves the residual stream un-normalised, so normalise once before the head.
        self.final_norm = nn.LayerNorm(args.d_model) if args.norm_first else nn.Identity()
        self.lm_head = self._make_lm_head()
        self._reset_parameters()

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, input_ids: Tensor, *, cache: KVCache | None = None) -> Tensor:
        """
        Args:
            input_ids: LongTensor (B, T) with T <= max_len (with ``cache``: cache.length + T <= max_len).
            cache: incremental decoding (eval): ``KVCache.for_model(model)``, then the same object on every
                call, each feeding only the tokens after those already seen (positions continue from
                ``cache.length``). None (training): the whole sequence, as always.

        Returns:
            logits: (B, T, V) in the head's compute dtype (float32, or bf16/fp16 under autocast or a 16-bit
                model: the loss upcasts chunk by chunk); position t predicts token t + 1.
        """
        padding_mask = self._padding_mask(input_ids)  # (B, T) or None
        if cache is None:
            x = self._embed(input_ids)  # (B, T, C)
            for i, layer in enumerate(self.layers):
                x = self._run_block(f"decoder.layer{i}", layer, x, key_padding_mask=padding_mask)
        else:
            x = self._embed(input_ids, cache.length)  # (B, T, C)
            padding_mask = cache.extend_padding(padding_mask)  # (B, P + T) or None
            for i, layer in enumerate(self.layers):
                x = self._run_block(f"decoder.layer{i}", layer, x, key_padding_mask=padding_mask,
                                    cache=cache.layers[i])
            cache.length += input_ids.shape[1]
        x = self.final_norm(x)
        # (B, T, V). No .float(): under autocast the head's output is already rounded to bf16, so an fp32 copy
        # adds no precision, only a B·T·V pass (7 % of a bf16 P1 micro-batch on CPU); the loss upcasts per chunk.
        return self.lm_head(x)


class EncoderDecoder(_TransformerModel):
    """The original encoder-decoder Transformer (Vaswani et al. 2017, fig. 1), with one
    vocabulary shared by source and target (one embedding, also the output projection when
    tied, §3.4).

    Encoder: n_layers × EncoderLayer over the source, with a source padding mask.
    Decoder: n_layers × DecoderLayer (causal self-attention with target padding mask,
    cross-attention to the encoder output with the source padding mask, FFN).
    Pre-LN models add a final LayerNorm to each stack.

    Args:
        args: as for ``DecoderLM``; ``args.n_layers`` is per stack (2·n_layers layers in all).
        The paper's model is ``activation="relu", norm_first=False``.

    Raises:
        ValueError: as for ``DecoderLM``.
    """

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__(args)
        sizes = (args.d_model, args.n_heads, args.d_ff)
        self.encoder_layers = nn.ModuleList(EncoderLayer(*sizes, **self._layer_kwargs()) for _ in range(args.n_layers))
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(*sizes, cross_attention=True, **self._layer_kwargs()) for _ in range(args.n_layers)
        )
        self.encoder_norm = nn.LayerNorm(args.d_model) if args.norm_first else nn.Identity()
        self.decoder_norm = nn.LayerNorm(args.d_model) if args.norm_first else nn.Identity()
        self.lm_head = self._make_lm_head()
        self._reset_parameters()

    def blocks(self) -> list[nn.Module]:
        return [*self.encoder_layers, *self.decoder_layers]

    def encode(self, src_ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """src_ids LongTensor (B, S) -> (memory (B, S, C), source padding mask bool (B, S) or None)."""
        src_padding_mask = self._padding_mask(src_ids)  # (B, S) or None
        x = self._embed(src_ids)  # (B, S, C)
        for i, layer in enumerate(self.encoder_layers):
            x = self._run_block(f"encoder.layer{i}", layer, x, key_padding_mask=src_padding_mask)
        return self.encoder_norm(x), src_padding_mask

    def decode(self, tgt_ids: Tensor, memory: Tensor, src_padding_mask: Tensor | None = None, *,
               cache: KVCache | None = None) -> Tensor:
        """tgt_ids LongTensor (B, T), memory (B, S, C) -> logits (B, T, V) in the head's compute dtype (as in
        ``DecoderLM.forward``).

        ``cache`` (eval): incremental decoding as in ``DecoderLM.forward``; the cross-attention keys/values
        of ``memory`` are projected on the first call and reused (after ``cache.reorder`` too)."""
        tgt_padding_mask = self._padding_mask(tgt_ids)  # (B, T) or None
        offset = 0 if cache is None else cache.length
        x = self._embed(tgt_ids, offset)  # (B, T, C)
        if cache is not None:
            tgt_padding_mask = cache.extend_padding(tgt_padding_mask)  # (B, P + T) or None
            cache.length += tgt_ids.shape[1]
        for i, layer in enumerate(self.decoder_layers):
            kwargs = {} if cache is None else {"cache": cache.layers[i]}
            x = self._run_block(f"decoder.layer{i}", layer, x, memory, key_padding_mask=tgt_padding_mask,
                                memory_key_padding_mask=src_padding_mask, **kwargs)
        x = self.decoder_norm(x)
        return self.lm_head(x)  # (B, T, V)

    def forward(self, src_ids: Tensor, tgt_ids: Tensor) -> Tensor:
        """
        Args:
            src_ids: LongTensor (B, S), S <= max_len.
            tgt_ids: LongTensor (B, T), T <= max_len (teacher-forced decoder input).

        Returns:
            logits: float32 (B, T, V); position t predicts target token t + 1.
        """
        memory, src_padding_mask = self.encode(src_ids)  # (B, S, C)
        return self.decode(tgt_ids, memory, src_padding_mask)


MODEL_KINDS: dict[str, type[_TransformerModel]] = {
    "decoder": DecoderLM,
    "encoder-decoder": EncoderDecoder,
}


def build_transformer(args: TransformerArgs, kind: str = "decoder") -> DecoderLM | EncoderDecoder:
    """Build the model ``kind`` names from ``args``.

    Args:
        args: sizes and switches (``TransformerArgs``).
        kind: ``"decoder"`` (``DecoderLM``) or ``"encoder-decoder"`` (``EncoderDecoder``).

    Raises:
        ValueError: for an unknown kind (the message lists the valid ones), plus anything the
        model's constructor raises.
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {', '.join(map(repr, MODEL_KINDS))}")
    return MODEL_KINDS[kind](args)
