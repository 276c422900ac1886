"""Step 3 of the model: the layers that wrap attention and the feed-forward network (``feed_forward.py``) in
residual connections with a norm (``norms.py``: LayerNorm or RMSNorm) (Vaswani et al. 2017, §3.1 and §3.3).

* ``EncoderLayer`` / ``DecoderLayer`` -- attention + FFN sub-layers, each x + sublayer(LN(x)) (pre-LN; Xiong et al.
  2020, "On Layer Normalization in the Transformer Architecture") or LN(x + sublayer(x)) (post-LN, the paper).

A layer is one of the model's blocks: the unit of activation checkpointing and of FSDP sharding
(``parallelize.py``). Shape letters: B batch, T target length, S source length, C = d_model channels.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from torch_handle.model.args import MLP, AttentionImpl, Norm
from torch_handle.model.attention import MultiHeadAttention
from torch_handle.model.feed_forward import build_feed_forward
from torch_handle.model.kernels import Dropout
from torch_handle.model.kv_cache import LayerCache
from torch_handle.model.norms import build_norm
from torch_handle.model.profiling import record_range


class _ResidualLayer(nn.Module):
    """What ``EncoderLayer`` and ``DecoderLayer`` share: the self-attention sub-layer they start with, how they build
    norms and the feed-forward network, and the residual wiring of every sub-layer. Subclasses add their other
    modules after ``self_attn`` (the order of the state dict) and set ``dropout``, the residual dropout (one module
    reused: it holds no state).

    ``norm``, ``norm_eps``, ``mlp`` and ``bias`` choose the norms and the FFN; ``n_kv_heads``, ``head_dim``,
    ``rope_theta`` and ``qk_norm`` go to the attention modules (``MultiHeadAttention``; a cross-attention gets no
    RoPE: its keys are another sequence's positions); ``feed_forward``, when given, builds the FFN instead (a
    mixture of experts, ``moe.py``)."""

    dropout: Dropout

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, norm_first: bool,
                 attention: AttentionImpl, fused_qkv: bool, norm_eps: float, mlp: MLP, norm: Norm, bias: bool,
                 n_kv_heads: int | None, head_dim: int | None, rope_theta: float | None, qk_norm: bool,
                 feed_forward: Callable[[], nn.Module] | None) -> None:
        super().__init__()
        self.norm_first = norm_first
        self._attention_args = {"d_model": d_model, "n_heads": n_heads, "dropout": dropout, "fused_qkv": fused_qkv,
                                "bias": bias, "attention": attention, "n_kv_heads": n_kv_heads,
                                "head_dim": head_dim, "qk_norm": qk_norm, "norm_eps": norm_eps}
        self._norm_args = (norm, d_model, norm_eps, bias)
        self._ff_args = (mlp, d_model, d_ff, dropout, bias)
        self._feed_forward = feed_forward
        self.self_attn = self._make_attention(rope_theta)

    def _make_attention(self, rope_theta: float | None) -> MultiHeadAttention:
        return MultiHeadAttention(**self._attention_args, rope_theta=rope_theta)

    def _make_norm(self) -> nn.Module:
        return build_norm(*self._norm_args)

    def _make_feed_forward(self) -> nn.Module:
        """The dense FFN ``build_feed_forward`` makes, or what the ``feed_forward`` factory builds (an MoE layer's
        ``MoEFeedForward``)."""
        return self._feed_forward() if self._feed_forward is not None else build_feed_forward(*self._ff_args)

    def _residual(self, x: Tensor, norm: nn.Module, name: str, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        """One residual sub-layer: x + dropout(sublayer(norm(x))) pre-LN, norm(x + dropout(sublayer(x))) post-LN.
        The sub-layer and its dropout run inside the profiler range ``name``. (B, T, C) -> (B, T, C)."""

        def branch(h: Tensor) -> Tensor:
            with record_range(name):
                return self.dropout(sublayer(h))

        return x + branch(norm(x)) if self.norm_first else norm(x + branch(x))


class EncoderLayer(_ResidualLayer):
    """Self-attention + feed-forward, each a residual sub-layer with a norm (LayerNorm or RMSNorm).

    ``norm_first=False`` is the original post-LN layer, x = LN(x + sublayer(x))
    (Vaswani et al. 2017, §3.1); ``norm_first=True`` is pre-LN, x = x + sublayer(LN(x)), which
    trains stably without learning-rate warm-up (Xiong et al. 2020). Computes the same function
    as ``nn.TransformerEncoderLayer(batch_first=True)`` with the same settings.

    Args:
        d_model, n_heads, d_ff: widths; n_heads must divide d_model unless head_dim is given.
        dropout: used on attention weights, FFN hidden units and both residual branches.
        mlp: the feed-forward network, ``"relu"``, ``"gelu"`` or ``"swiglu"`` (``build_feed_forward``).
        norm_first: pre-LN if True, post-LN if False.
        attention: attention kernel (``"sdpa"`` / ``"reference"``), kept by ``self_attn``.
        fused_qkv: see ``MultiHeadAttention``.
        norm_eps: epsilon of every norm (the q/k norms' too).
        norm: ``"layernorm"`` or ``"rmsnorm"`` (``build_norm``).
        bias: biases in the linears and LayerNorms.
        n_kv_heads, head_dim, rope_theta, qk_norm: see ``MultiHeadAttention``.
        feed_forward: builds the FFN in place of ``build_feed_forward`` (an MoE layer: ``MoEFeedForward``).

    Shape:
        forward(x (B, T, C), key_padding_mask bool (B, T) True = pad, rope_table (cos, sin) | None) -> (B, T, C).
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.0, mlp: MLP = "relu",
                 norm_first: bool = False, attention: AttentionImpl = "sdpa", fused_qkv: bool = True,
                 norm_eps: float = 1e-5, *, norm: Norm = "layernorm", bias: bool = True, n_kv_heads: int | None = None,
                 head_dim: int | None = None, rope_theta: float | None = None, qk_norm: bool = False,
                 feed_forward: Callable[[], nn.Module] | None = None) -> None:
        super().__init__(d_model, n_heads, d_ff, dropout, norm_first, attention, fused_qkv, norm_eps, mlp, norm, bias,
                         n_kv_heads, head_dim, rope_theta, qk_norm, feed_forward)
        self.ff = self._make_feed_forward()
        self.self_attn_norm = self._make_norm()
        self.ff_norm = self._make_norm()
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor, *, key_padding_mask: Tensor | None = None,
                rope_table: tuple[Tensor, Tensor] | None = None) -> Tensor:
        x = self._residual(x, self.self_attn_norm, "attention",
                           lambda h: self.self_attn(h, h, h, key_padding_mask=key_padding_mask, rope_table=rope_table))
        return self._residual(x, self.ff_norm, "feed_forward", self.ff)  # (B, T, C)


class DecoderLayer(_ResidualLayer):
    """Causal self-attention, optional cross-attention to encoder memory, then feed-forward.

    Residual + norm wiring as in ``EncoderLayer`` (post-LN: Vaswani et al. 2017; pre-LN:
    Xiong et al. 2020). With ``cross_attention=True`` this computes the same function as
    ``nn.TransformerDecoderLayer(batch_first=True)`` given a causal ``tgt_mask``; with
    ``cross_attention=False`` it is a GPT-style decoder block.

    Args:
        d_model, n_heads, d_ff, dropout, mlp, norm_first, attention, fused_qkv, norm_eps, norm, bias, n_kv_heads,
        head_dim, qk_norm, feed_forward: as for ``EncoderLayer``.
        cross_attention: add a cross-attention sub-layer over encoder memory.
        rope_theta: RoPE in the self-attention (a cross-attention never rotates: see ``_ResidualLayer``).

    Shape:
        forward(x (B, T, C), memory (B, S, C) | None, attn_mask bool (B, 1, T, T) | None, position_ids (B, T) |
        None) -> (B, T, C).

    Raises:
        ValueError (from forward): memory missing when the layer has cross-attention, or given
        when it has none.
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.0, mlp: MLP = "relu",
                 norm_first: bool = False, cross_attention: bool = True, attention: AttentionImpl = "sdpa",
                 fused_qkv: bool = True, norm_eps: float = 1e-5, *, norm: Norm = "layernorm", bias: bool = True,
                 n_kv_heads: int | None = None, head_dim: int | None = None, rope_theta: float | None = None,
                 qk_norm: bool = False, feed_forward: Callable[[], nn.Module] | None = None) -> None:
        super().__init__(d_model, n_heads, d_ff, dropout, norm_first, attention, fused_qkv, norm_eps, mlp, norm, bias,
                         n_kv_heads, head_dim, rope_theta, qk_norm, feed_forward)
        self.self_attn_norm = self._make_norm()
        self.cross_attn: MultiHeadAttention | None = None
        self.cross_attn_norm: nn.Module | None = None
        if cross_attention:
            self.cross_attn = self._make_attention(rope_theta=None)
            self.cross_attn_norm = self._make_norm()
        self.ff = self._make_feed_forward()
        self.ff_norm = self._make_norm()
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor, memory: Tensor | None = None, *, key_padding_mask: Tensor | None = None,
                memory_key_padding_mask: Tensor | None = None, causal: bool = True, cache: LayerCache | None = None,
                attn_mask: Tensor | None = None, position_ids: Tensor | None = None,
                rope_table: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """
        Args:
            x: (B, T, C) target-side hidden states.
            memory: (B, S, C) encoder output; required iff the layer has cross-attention.
            key_padding_mask: bool (B, T), True = padded target position (with ``cache``: (B, P + T), the
                P cached positions first).
            memory_key_padding_mask: bool (B, S), True = padded source position.
            causal: mask future target positions (leave True except for experiments).
            cache: incremental decoding (eval): the keys/values of the P positions decoded before x.
            attn_mask: bool (B, 1, T, T), True = may attend: the block-causal mask of packed documents, built once
                per batch by the model outside the blocks (``transformer.document_mask_of``); replaces the causal
                mask of the self-attention.
            position_ids: LongTensor (B, T), each token's position in its document (the self-attention's RoPE).
            rope_table: the model's RoPE (cos, sin) of every position (``rope.rope_table``), for the
                self-attention; None: the attention computes its angles.

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
                                                    cache=self_cache, attn_mask=attn_mask,
                                                    position_ids=position_ids, rope_table=rope_table))
        if self.cross_attn is not None:
            x = self._residual(x, self.cross_attn_norm, "cross_attention",
                               lambda h: self.cross_attn(h, memory, memory, key_padding_mask=memory_key_padding_mask,
                                                         cache=cross_cache))
        return self._residual(x, self.ff_norm, "feed_forward", self.ff)  # (B, T, C)
