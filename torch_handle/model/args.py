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

ATTENTION_IMPLS: tuple[str, ...] = get_args(AttentionImpl)
ACTIVATIONS: tuple[str, ...] = get_args(Activation)
MLPS: tuple[str, ...] = get_args(MLP)
NORMS: tuple[str, ...] = get_args(Norm)
POSITIONS: tuple[str, ...] = get_args(Position)


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

    @property
    def d_k(self) -> int:
        """Channels per head: ``head_dim``, or d_model // n_heads when it is unset."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_heads``, or n_heads when it is unset."""
        return self.n_kv_heads or self.n_heads


DATASET_FIELDS: tuple[str, ...] = ("vocab_size", "max_len", "pad_id")
"""The ``TransformerArgs`` fields the dataset supplies (a model factory's arguments), not preset options."""
