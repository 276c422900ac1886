"""``TransformerArgs``: every size and switch of the Transformer, with its defaults, in one dataclass.

The role of nanoGPT's ``GPTConfig``. It is also the one source of the ``transformer`` plugin's ``[model]``
options (``plugins/transformer.py`` builds its options dataclass from these fields), so this module imports no
torch: reading a preset must stay instant. (No ``from __future__ import annotations`` either: the plugin copies
these fields' types, which must be types, not strings.)
"""

from dataclasses import KW_ONLY, dataclass
from typing import Literal, get_args

from torch_handle.config.schema import param

ModelKind = Literal["decoder", "encoder-decoder"]
AttentionImpl = Literal["sdpa", "reference"]
Activation = Literal["relu", "gelu"]
MLP = Literal["relu", "gelu", "swiglu"]
Norm = Literal["layernorm", "rmsnorm"]
Position = Literal["sinusoidal", "rope"]
Router = Literal["softmax", "sigmoid"]
Balance = Literal["aux_loss", "aux_free"]

ATTENTION_IMPLS: tuple[str, ...] = get_args(AttentionImpl)
ACTIVATIONS: tuple[str, ...] = get_args(Activation)
MLPS: tuple[str, ...] = get_args(MLP)
NORMS: tuple[str, ...] = get_args(Norm)
POSITIONS: tuple[str, ...] = get_args(Position)
ROUTERS: tuple[str, ...] = get_args(Router)
BALANCES: tuple[str, ...] = get_args(Balance)


def check_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    """Raises ValueError naming the valid choices when ``value`` is not one of them."""
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(map(repr, valid))}")


@dataclass(frozen=True)
class TransformerArgs:
    """Everything that shapes a ``DecoderLM`` or ``EncoderDecoder``. Frozen: it describes how the model was built;
    switch the attention kernel of a built model with ``model.attention = ...``.

    The defaults are a post-LN GELU stack; the original Transformer (Vaswani et al. 2017) is ``mlp="relu"``, a
    GPT-2-style pre-LN stack ``norm_first=True``, and a Llama-style decoder (Touvron et al. 2023) ``norm="rmsnorm",
    position="rope", mlp="swiglu", n_kv_heads < n_heads, bias=False, scale_embeddings=False, norm_first=True``
    (``presets/llama.toml``). The ranges (``param``) are what a preset is checked against; nothing is checked here:
    each building block checks its own arguments when the model is constructed.
    """

    vocab_size: int
    """V: size of the (shared) token vocabulary (the dataset's)."""
    d_model: int = param(128, ge=8)
    """C: width of the residual stream."""
    n_heads: int = param(4, ge=1)
    """H: query heads; must divide d_model unless head_dim is given."""
    n_layers: int = param(2, ge=1)
    """Layers per stack (the encoder-decoder has two stacks, 2·n_layers layers in all)."""
    d_ff: int = param(512, ge=1)
    """Hidden width of the position-wise feed-forward network."""
    _: KW_ONLY
    dropout: float = param(0.1, ge=0.0, le=0.9, frozen_on_resume=False)
    """Dropout on embeddings, attention weights, FFN hidden units and residual branches."""
    mlp: MLP = "gelu"
    """Feed-forward network: ``"relu"`` / ``"gelu"``, two matrices with that nonlinearity between them (Vaswani et al.
    2017); ``"swiglu"``, three: down(SiLU(gate x) · up x) (Shazeer 2020), as in Llama. (Before SwiGLU this option
    was called ``activation``; presets may still say ``activation = "relu"``.)"""
    norm: Norm = "layernorm"
    """``"layernorm"`` (Ba et al. 2016) or ``"rmsnorm"`` (Zhang & Sennrich 2019: no mean, no bias), everywhere."""
    norm_eps: float = param(1e-5, gt=0.0)
    """Epsilon of every norm (LayerNorm's variance, RMSNorm's mean square)."""
    norm_first: bool = False
    """False: post-LN as in Vaswani et al. 2017; True: pre-LN (Xiong et al. 2020), steadier when deep."""
    position: Position = "sinusoidal"
    """``"sinusoidal"``: a fixed table added to the embeddings (Vaswani et al. 2017); ``"rope"``: queries and keys
    rotated by their position inside attention (Su et al. 2021, RoFormer; Llama's rotate-half layout)."""
    rope_theta: float = param(10000.0, gt=1.0)
    """RoPE's base: pair i of a head turns by position · theta^(-2i/head_dim) radians (Llama 3 uses 500000)."""
    n_kv_heads: int | None = param(None, ge=1)
    """Key/value heads, shared by n_heads / n_kv_heads query heads each (grouped-query attention, Ainslie et al.
    2023); 1 = multi-query attention (Shazeer 2019); unset = n_heads (multi-head attention). Must divide n_heads."""
    head_dim: int | None = param(None, ge=1)
    """d_k: channels per head; unset = d_model / n_heads (Qwen 3 sets it independently of d_model)."""
    qk_norm: bool = False
    """RMSNorm over each head's query and key before RoPE (Qwen 3; Dehghani et al. 2023 for the idea)."""
    bias: bool = True
    """Biases in the attention and feed-forward linears and the LayerNorms (Llama and Qwen have none)."""
    scale_embeddings: bool = True
    """Multiply token embeddings by √d_model (Vaswani et al. 2017, §3.4); Llama, Qwen and GPT-2 do not."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection (Press & Wolf 2017)."""
    max_len: int = 1024
    """Longest sequence accepted (the sinusoidal table's size; RoPE has no table: its limit only; the dataset's)."""
    pad_id: int | None = None
    """Token id masked out as a key (the dataset's); None disables padding masks."""
    activation_checkpointing: bool = param(False, frozen_on_resume=False)
    """Recompute each block's activations in backward while training (torch.utils.checkpoint,
    use_reentrant=False)."""
    attention: AttentionImpl = param("sdpa", frozen_on_resume=False)
    """Initial attention kernel: sdpa = torch's fused scaled_dot_product_attention; reference = explicit
    softmax(QK^T/sqrt(d_k))V."""
    fused_qkv: bool = True
    """One projection for Q, K, V, (d_model -> (H + 2·H_kv)·d_k), instead of three (see ``MultiHeadAttention``)."""
    # -- mixture of experts (model/router.py, model/moe.py): every option below is unused while n_experts = 0 --------
    n_experts: int = param(0, ge=0)
    """E: routed experts in each MoE layer's feed-forward network (``MoEFeedForward``); 0 = a dense model."""
    top_k: int = param(2, ge=1)
    """k: experts each token is routed to (Shazeer et al. 2017; Mixtral and Qwen 3 MoE: 2 and 8); at most E."""
    moe_every: int = param(1, ge=1)
    """Layer i (from 0) is an MoE layer when (i + 1) % moe_every == 0 (``decoder_sparse_step`` in transformers);
    1 = every layer, 2 = every second (GShard, Switch)."""
    n_shared_experts: int = param(0, ge=0)
    """Experts every token passes through besides its k routed ones, as one FFN of n_shared_experts · d_ff_expert
    hidden units (DeepSeekMoE, Dai et al. 2024; DeepSeek-V3)."""
    d_ff_expert: int | None = param(None, ge=1)
    """Hidden width of each expert (``moe_intermediate_size`` in transformers); unset = d_ff."""
    capacity_factor: float | None = param(None, gt=0.0, frozen_on_resume=False)
    """Unset: dropless, every routed token is computed. Else each expert takes at most ceil(capacity_factor · N ·
    top_k / E) of a batch's N tokens, in batch order; the rest are dropped (they keep their residual and the shared
    expert) and counted (Switch Transformer, Fedus et al. 2021, §2.2)."""
    router: Router = "softmax"
    """Router scores: ``"softmax"`` over the experts (Switch, Mixtral, Qwen 3 MoE) or ``"sigmoid"`` per expert
    (DeepSeek-V3); computed in fp32."""
    norm_topk_prob: bool = True
    """Divide each token's k selected scores by their sum, so its weights add to 1 (Mixtral, Qwen3-30B-A3B,
    DeepSeek-V3); false: the raw scores (Switch)."""
    balance: Balance = "aux_loss"
    """How the load is balanced: ``"aux_loss"``, router_aux_loss · the Switch loss E·Σᵢ fᵢ·Pᵢ (Fedus et al. 2021);
    ``"aux_free"``, a per-expert bias added to the scores for the selection only, moved by bias_update_rate after
    each optimizer step against the load's error (Wang et al. 2024; DeepSeek-V3): the Switch loss is then measured
    only, never added."""
    router_aux_loss: float = param(0.01, ge=0.0, frozen_on_resume=False)
    """Coefficient of the load-balancing loss (Switch: 0.01; Qwen 3 MoE's ``router_aux_loss_coef``, whose loss is
    top_k times this one's, 0.001)."""
    router_z_loss: float = param(0.0, ge=0.0, frozen_on_resume=False)
    """Coefficient of the router z-loss, the mean squared log-sum-exp of the router logits (ST-MoE, Zoph et al.
    2022, who use 0.001); 0 = off."""
    bias_update_rate: float = param(0.001, gt=0.0, frozen_on_resume=False)
    """γ of ``balance = "aux_free"``: each step every expert bias moves by ±γ (DeepSeek-V3: 0.001)."""

    @property
    def d_k(self) -> int:
        """Channels per head: ``head_dim``, or d_model // n_heads when it is unset."""
        return self.head_dim or self.d_model // self.n_heads

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` of a stack (from 0) has a mixture-of-experts feed-forward network."""
        return self.n_experts > 0 and (i + 1) % self.moe_every == 0

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_heads``, or n_heads when it is unset."""
        return self.n_kv_heads or self.n_heads


DATASET_FIELDS: tuple[str, ...] = ("vocab_size", "max_len", "pad_id")
"""The ``TransformerArgs`` fields the dataset supplies (a model factory's arguments), not preset options."""
