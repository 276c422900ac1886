"""Model plugin ``transformer``: the project's from-scratch Transformer (``torch_handle.model.transformer``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from torch_handle.api import InvalidValue, hookimpl, param


@dataclass
class TransformerConfig:
    """``[model]`` options of the ``transformer`` plugin: ``kind`` picks the class, every other field is the
    ``torch_handle.model.transformer.TransformerArgs`` field of the same name (``build`` passes them on by name)."""

    kind: Literal["decoder", "encoder-decoder"] = "decoder"
    """decoder = decoder-only language model; encoder-decoder = translation (Vaswani et al. 2017)."""
    d_model: int = param(128, ge=8)
    """Width of the residual stream."""
    n_heads: int = param(4, ge=1)
    """Attention heads; must divide d_model."""
    n_layers: int = param(2, ge=1)
    """Layers (for encoder-decoder: in the encoder and in the decoder each)."""
    d_ff: int = param(512, ge=1)
    """Hidden width of the position-wise feed-forward network."""
    dropout: float = param(0.1, ge=0.0, le=0.9, frozen_on_resume=False)
    """Dropout on embeddings, attention weights and residual branches."""
    activation: Literal["relu", "gelu"] = "gelu"
    """Feed-forward activation."""
    norm_first: bool = False
    """False: post-LN as in Vaswani et al. 2017; true: pre-LN (Xiong et al. 2020), steadier when deep."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection (Press & Wolf 2017)."""
    activation_checkpointing: bool = param(False, frozen_on_resume=False)
    """Recompute each layer's activations in backward (torch.utils.checkpoint, use_reentrant=False)."""
    attention: Literal["sdpa", "reference"] = param("sdpa", frozen_on_resume=False)
    """sdpa = torch's fused scaled_dot_product_attention; reference = explicit softmax(QK^T/sqrt(d_k))V."""
    fused_qkv: bool = True
    """One (d_model, 3*d_model) projection for Q, K, V instead of three."""

    def check(self) -> None:
        if self.d_model % self.n_heads:
            raise InvalidValue("n_heads", f"{self.n_heads} does not divide d_model={self.d_model}")


def check_preset(options: TransformerConfig, preset) -> None:
    data_kind = getattr(preset.data.options, "task", None)
    wanted = {"lm": "decoder", "translation": "encoder-decoder"}.get(data_kind)
    if wanted and options.kind != wanted:
        raise InvalidValue("kind", f"{options.kind!r} cannot train on data {preset.data.name!r} "
                                   f"({data_kind}); use kind = {wanted!r}")


def build(options: TransformerConfig, vocab_size: int, pad_id: int, max_len: int):
    """``factory(options, vocab_size, pad_id, max_len) -> nn.Module``: every option but ``kind`` is the
    ``TransformerArgs`` field of the same name; the dataset supplies vocab_size, pad_id and max_len."""
    from torch_handle.model.transformer import TransformerArgs, build_transformer

    shared = {f.name: getattr(options, f.name) for f in fields(options) if f.name != "kind"}
    args = TransformerArgs(vocab_size=vocab_size, pad_id=pad_id, max_len=max_len, **shared)
    return build_transformer(args, kind=options.kind)


@hookimpl
def handle_register_models(register):
    register("transformer", TransformerConfig, build, "from-scratch Transformer (decoder-only or encoder-decoder)",
             check_preset)
