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

ATTENTION_IMPLS: tuple[str, ...] = get_args(AttentionImpl)
ACTIVATIONS: tuple[str, ...] = get_args(Activation)


def check_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    """Raises ValueError naming the valid choices when ``value`` is not one of them."""
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(map(repr, valid))}")


@dataclass(frozen=True)
class TransformerArgs:
    """Everything that shapes a ``DecoderLM`` or ``EncoderDecoder``. Frozen: it describes how the model was built;
    switch the attention kernel of a built model with ``model.attention = ...``.

    The defaults are a post-LN GELU stack; the original Transformer (Vaswani et al. 2017) is
    ``activation="relu"``, a GPT-2-style pre-LN stack ``norm_first=True``. The ranges (``param``) are what a preset
    is checked against; nothing is checked here: each building block checks its own arguments when the model is
    constructed.
    """

    vocab_size: int
    """V: size of the (shared) token vocabulary (the dataset's)."""
    d_model: int = param(128, ge=8)
    """C: width of the residual stream."""
    n_heads: int = param(4, ge=1)
    """H: attention heads; must divide d_model."""
    n_layers: int = param(2, ge=1)
    """Layers per stack (the encoder-decoder has two stacks, 2·n_layers layers in all)."""
    d_ff: int = param(512, ge=1)
    """Hidden width of the position-wise feed-forward network."""
    _: KW_ONLY
    dropout: float = param(0.1, ge=0.0, le=0.9, frozen_on_resume=False)
    """Dropout on embeddings, attention weights, FFN hidden units and residual branches."""
    activation: Activation = "gelu"
    """Feed-forward nonlinearity: ``"relu"`` or ``"gelu"``."""
    norm_first: bool = False
    """False: post-LN as in Vaswani et al. 2017; True: pre-LN (Xiong et al. 2020), steadier when deep."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection (Press & Wolf 2017)."""
    max_len: int = 1024
    """Longest sequence accepted (positional-table size; the dataset's)."""
    pad_id: int | None = None
    """Token id masked out as a key (the dataset's); None disables padding masks."""
    activation_checkpointing: bool = param(False, frozen_on_resume=False)
    """Recompute each block's activations in backward while training (torch.utils.checkpoint,
    use_reentrant=False)."""
    attention: AttentionImpl = param("sdpa", frozen_on_resume=False)
    """Initial attention kernel: sdpa = torch's fused scaled_dot_product_attention; reference = explicit
    softmax(QK^T/sqrt(d_k))V."""
    fused_qkv: bool = True
    """One (d_model, 3·d_model) projection for Q, K, V instead of three (see ``MultiHeadAttention``)."""


DATASET_FIELDS: tuple[str, ...] = ("vocab_size", "max_len", "pad_id")
"""The ``TransformerArgs`` fields the dataset supplies (a model factory's arguments), not preset options."""
