"""The ``hf`` model: a ``transformers`` causal LM wrapped in the contract of the project's ``DecoderLM``
(``torch_handle/model/transformer.py``).

Imported by the ``hf`` plugin's factory (torch at import, ``transformers`` inside :func:`build_hf`). The
contract the trainer, the strategies and ``handle estimate`` rely on:

- ``forward(input_ids (B, T)) -> logits`` float32 (B, T, V), position t predicting token t + 1 (not the
  transformers output object);
- ``blocks()`` and ``args.activation_checkpointing``: the ``BlockModel`` protocol
  (``torch_handle.model.parallelize``): the decoder layers in forward order, what FSDP2 shards one by one and
  activation checkpointing recomputes one by one; ``args`` replaced to switch checkpointing;
- ``flops_per_token(seq_len)``: training FLOPs per token for MFU (``torch_handle.model.flops``).

The state-dict keys are ``hf.`` + the transformers module's own keys (``hf.model.decoder.layers.0...`` for OPT),
so a checkpoint or ``model.safetensors`` loads back into the same preset's model, and into transformers with
``{k.removeprefix("hf."): v}``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import Tensor, nn

from torch_handle.model.flops import embedding_weights, matmul_params, training_flops_per_token

log = logging.getLogger("torch_handle")


@dataclasses.dataclass(frozen=True)
class HFArgs:
    """What the wrapper reports of its build (``model.args``); replacing it (``BlockModel.args``:
    ``parallelize.set_activation_checkpointing``) switches checkpointing."""

    architecture: str
    """transformers' ``model_type`` (``opt``, ``gpt2``, ``llama``, ...)."""
    vocab_size: int
    max_len: int
    activation_checkpointing: bool = False


def hf_config(options: Any, vocab_size: int, pad_id: int, max_len: int, local: dict | None = None) -> Any:
    """The transformers config object of ``options`` (``handle_plugins.hf.HFConfig``): the dims of the preset,
    or ``local``, the parsed ``config.json`` of ``config_path``.

    ``pad_id`` becomes ``pad_token_id``, the project's ``<bos>``/``<eos>`` ids ``bos_token_id``/``eos_token_id``
    (they matter to generation only). ``max_len`` sizes the position table (OPT, GPT-2) or the rotary range
    (Llama).
    """
    import transformers

    from torch_handle.api import SPECIAL_TOKENS

    tokens = {"pad_token_id": pad_id, "bos_token_id": SPECIAL_TOKENS.index("<bos>"),
              "eos_token_id": SPECIAL_TOKENS.index("<eos>")}
    if local is not None:
        config = transformers.AutoConfig.for_model(**local)
        config.vocab_size = vocab_size
        for key in ("max_position_embeddings", "n_positions"):
            if isinstance(getattr(config, key, None), int) and getattr(config, key) < max_len:
                setattr(config, key, max_len)
        for key, value in tokens.items():
            setattr(config, key, value)
        return config
    o = options
    if o.architecture == "opt":
        return transformers.OPTConfig(
            vocab_size=vocab_size, hidden_size=o.d_model, num_hidden_layers=o.n_layers, num_attention_heads=o.n_heads,
            ffn_dim=o.d_ff, max_position_embeddings=max_len, word_embed_proj_dim=o.d_model, dropout=o.dropout,
            attention_dropout=o.dropout, do_layer_norm_before=True, tie_word_embeddings=o.tie_embeddings, **tokens)
    if o.architecture == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab_size, n_embd=o.d_model, n_layer=o.n_layers, n_head=o.n_heads, n_inner=o.d_ff,
            n_positions=max_len, resid_pdrop=o.dropout, embd_pdrop=o.dropout, attn_pdrop=o.dropout,
            tie_word_embeddings=o.tie_embeddings, **tokens)
    if o.architecture == "llama":
        return transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=o.d_model, num_hidden_layers=o.n_layers, num_attention_heads=o.n_heads,
            num_key_value_heads=o.n_kv_heads or o.n_heads, intermediate_size=o.d_ff, max_position_embeddings=max_len,
            attention_dropout=o.dropout, tie_word_embeddings=o.tie_embeddings, **tokens)
    raise ValueError(f"unknown architecture {o.architecture!r}")  # HFConfig's Literal makes this unreachable


class HFCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` behind ``DecoderLM``'s interface (see the module docstring).

    Args:
        model: the transformers model (a ``PreTrainedModel`` with ``.config`` and ``.logits`` in its output).
        args: :class:`HFArgs`; its ``activation_checkpointing`` is applied now and on every reassignment.
    """

    def __init__(self, model: nn.Module, args: HFArgs) -> None:
        super().__init__()
        self.hf = model
        self._layers_name = _decoder_layers(model)
        """Dotted name (under ``hf``) of the decoder layers' ModuleList: a name, so that no module is registered
        twice (state-dict keys stay transformers' own)."""
        self.args = args

    @property
    def args(self) -> HFArgs:
        return self._args

    @args.setter
    def args(self, args: HFArgs) -> None:
        self._args = args
        _set_checkpointing(self.hf, args.activation_checkpointing)

    @property
    def config(self) -> Any:
        """The transformers config (``save_pretrained``-able)."""
        return self.hf.config

    def blocks(self) -> list[nn.Module]:
        """The decoder layers, in forward order (OPT ``model.decoder.layers``, GPT-2 ``transformer.h``, Llama
        ``model.layers``)."""
        return list(self.hf.get_submodule(self._layers_name))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """
        Args:
            input_ids: LongTensor (B, T), T <= max_len.
            attention_mask: optional (B, T), 1 for tokens and 0 for padding (the language-modelling datasets
                have no padding; without a mask the attention is purely causal).

        Returns:
            logits: float32 (B, T, V); position t predicts token t + 1.
        """
        out = self.hf(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=True)
        return out.logits.float()

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Trainable parameters, each shared tensor once; ``exclude_embeddings`` leaves out every embedding table
        (token and learned positions: they are indexed, not multiplied)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= sum(w.numel() for w in embedding_weights(self.hf))
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token, ``flops.training_flops_per_token`` (the formula of
        ``DecoderLM.flops_per_token``): N the parameters that take part in a matmul, all but the embedding tables
        (token and learned positions, which are indexed), plus the output projection even when it is the tied
        token table; L the decoder layers; attention width n_heads · head_dim (d_model for OPT, GPT-2 and Llama
        without an explicit head_dim).
        """
        c = self.hf.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        n_matmul = matmul_params(self.hf, self.hf.get_output_embeddings())
        return training_flops_per_token(n_matmul, len(self.blocks()), c.num_attention_heads * head_dim, seq_len)


def _decoder_layers(model: nn.Module) -> str:
    """The dotted name of the ``nn.ModuleList`` of decoder layers: the first (in module order) with
    ``config.num_hidden_layers`` entries, else the longest.

    Raises:
        ValueError: the model has no ``nn.ModuleList``.
    """
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of decoder layers (nn.ModuleList)")
    n = getattr(model.config, "num_hidden_layers", None)
    return next((name for name, m in lists if len(m) == n), max(lists, key=lambda item: len(item[1]))[0])


def _set_checkpointing(model: nn.Module, on: bool) -> None:
    """transformers' activation checkpointing, per decoder layer, non-reentrant (``activation_checkpointing_*``
    since transformers 5.x; ``gradient_checkpointing_*`` before)."""
    enabled = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    if on == enabled:
        return
    if on:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # pragma: no cover - older transformers
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:  # pragma: no cover - older transformers
        model.gradient_checkpointing_disable()


def build_hf(options: Any, vocab_size: int, pad_id: int, max_len: int, local: dict | None = None) -> HFCausalLM:
    """The ``hf`` model from ``options`` (``handle_plugins.hf.HFConfig``), in fp32: fresh weights, or the local
    ones with ``pretrained_path``; ``local`` is the parsed ``config.json`` of ``config_path``/``pretrained_path``
    (``handle_plugins.hf.read_local_config``).

    Initial weights come from torch's global RNG (transformers' ``_init_weights``), so the trainer's seed gives
    every rank the same model.

    Raises:
        ValueError: transformers cannot build a causal LM from the local config.
    """
    import transformers

    if options.pretrained_path:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            options.pretrained_path, local_files_only=True, dtype=torch.float32, attn_implementation=options.attention)
        if model.get_input_embeddings().weight.shape[0] != vocab_size:
            log.warning("hf: resizing the embedding of %s from %d to the data's vocabulary of %d tokens (the "
                        "project's tokenizer is not the checkpoint's: token embeddings start from other tokens)",
                        options.pretrained_path, model.get_input_embeddings().weight.shape[0], vocab_size)
            model.resize_token_embeddings(vocab_size)
        model.config.pad_token_id = pad_id
    else:
        config = hf_config(options, vocab_size, pad_id, max_len, local)
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=options.attention,
                                                                  dtype=torch.float32)
        except ValueError as e:
            raise ValueError(f"model.config_path: transformers has no causal LM for model_type "
                             f"{config.model_type!r}: {' '.join(str(e).split())[:300]}") from None
    model.config.use_cache = False
    args = HFArgs(architecture=model.config.model_type, vocab_size=vocab_size, max_len=max_len,
                  activation_checkpointing=options.activation_checkpointing)
    return HFCausalLM(model, args)
