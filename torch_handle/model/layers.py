"""Step 3 of the model: the position-wise feed-forward network and the layers that wrap attention and FFN in
residual connections with LayerNorm (Vaswani et al. 2017, §3.1 and §3.3).

* ``PositionwiseFeedForward`` -- two linear layers with a nonlinearity in between.
* ``EncoderLayer`` / ``DecoderLayer`` -- attention + FFN sub-layers, each x + sublayer(LN(x)) (pre-LN; Xiong et al.
  2020, "On Layer Normalization in the Transformer Architecture") or LN(x + sublayer(x)) (post-LN, the paper).

A layer is one of the model's blocks: the unit of activation checkpointing and of FSDP sharding
(``parallelize.py``). Shape letters: B batch, T target length, S source length, C = d_model channels.
"""

from __future__ import annotations

from typing import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from torch_handle.model.args import ACTIVATIONS, Activation, AttentionImpl, check_choice
from torch_handle.model.attention import MultiHeadAttention
from torch_handle.model.kernels import Dropout
from torch_handle.model.kv_cache import LayerCache
from torch_handle.model.profiling import record_range
from torch_handle.parallel.tensor.random import tensor_parallel_rng


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
        check_choice("activation", activation, ACTIVATIONS)
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
        h = act(self.linear1(x))  # (B, T, d_ff); under TP this rank's d_ff/tp units, masks of its own
        with tensor_parallel_rng(self.training and self.dropout.p > 0):
            h = self.dropout(h)
        return self.linear2(h)


class _ResidualLayer(nn.Module):
    """What ``EncoderLayer`` and ``DecoderLayer`` share: the self-attention sub-layer they start with and the
    residual wiring of every sub-layer. Subclasses add their other modules after ``self_attn`` (the order of the
    state dict) and set ``dropout``, the residual dropout (one module reused: it holds no state)."""

    dropout: Dropout

    def __init__(self, d_model: int, n_heads: int, dropout: float, norm_first: bool, attention: AttentionImpl,
                 fused_qkv: bool) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout, fused_qkv=fused_qkv, attention=attention)

    def _residual(self, x: Tensor, norm: nn.LayerNorm, name: str, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        """One residual sub-layer: x + dropout(sublayer(norm(x))) pre-LN, norm(x + dropout(sublayer(x))) post-LN.
        The sub-layer and its dropout run inside the profiler range ``name``. (B, T, C) -> (B, T, C)."""

        def branch(h: Tensor) -> Tensor:
            with record_range(name):
                return self.dropout(sublayer(h))

        return x + branch(norm(x)) if self.norm_first else norm(x + branch(x))


class EncoderLayer(_ResidualLayer):
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

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.0, activation: Activation = "relu",
                 norm_first: bool = False, attention: AttentionImpl = "sdpa", fused_qkv: bool = True,
                 layer_norm_eps: float = 1e-5) -> None:
        super().__init__(d_model, n_heads, dropout, norm_first, attention, fused_qkv)
        self.ff = PositionwiseFeedForward(d_model, d_ff, dropout, activation)
        self.self_attn_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.ff_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor, *, key_padding_mask: Tensor | None = None) -> Tensor:
        x = self._residual(x, self.self_attn_norm, "attention",
                           lambda h: self.self_attn(h, h, h, key_padding_mask=key_padding_mask))
        return self._residual(x, self.ff_norm, "feed_forward", self.ff)  # (B, T, C)


class DecoderLayer(_ResidualLayer):
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

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.0, activation: Activation = "relu",
                 norm_first: bool = False, cross_attention: bool = True, attention: AttentionImpl = "sdpa",
                 fused_qkv: bool = True, layer_norm_eps: float = 1e-5) -> None:
        super().__init__(d_model, n_heads, dropout, norm_first, attention, fused_qkv)
        self.self_attn_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.cross_attn: MultiHeadAttention | None = None
        self.cross_attn_norm: nn.LayerNorm | None = None
        if cross_attention:
            self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout, fused_qkv=fused_qkv, attention=attention)
            self.cross_attn_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.ff = PositionwiseFeedForward(d_model, d_ff, dropout, activation)
        self.ff_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor, memory: Tensor | None = None, *, key_padding_mask: Tensor | None = None,
                memory_key_padding_mask: Tensor | None = None, causal: bool = True, cache: LayerCache | None = None
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
        self_cache, cross_cache = (None, None) if cache is None else (cache.self_attn, cache.cross_attn)
        x = self._residual(x, self.self_attn_norm, "attention",
                           lambda h: self.self_attn(h, h, h, key_padding_mask=key_padding_mask, causal=causal,
                                                    cache=self_cache))
        if self.cross_attn is not None:
            x = self._residual(x, self.cross_attn_norm, "cross_attention",
                               lambda h: self.cross_attn(h, memory, memory, key_padding_mask=memory_key_padding_mask,
                                                         cache=cross_cache))
        return self._residual(x, self.ff_norm, "feed_forward", self.ff)  # (B, T, C)
