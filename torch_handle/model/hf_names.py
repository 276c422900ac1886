"""The one place that knows Hugging Face's names: parameters and configs of ``transformers``' Llama and Qwen 3
against this project's ``DecoderLM`` and ``TransformerArgs``, both ways.

A ``DecoderLM`` with ``norm="rmsnorm", position="rope", mlp="swiglu", norm_first=True, scale_embeddings=False``
computes what ``LlamaForCausalLM`` computes (with ``qk_norm=True``, ``Qwen3ForCausalLM``): RoPE uses the same
rotate-half pairing (``rope.py``), the norms the same fp32 order (``norms.py``), so the weights map 1:1 by name,
except the fused Q/K/V projection, which is the three of them stacked ([W_q; W_k; W_v], rows H·d_k, H_kv·d_k,
H_kv·d_k). The table (layer i; ``.bias`` beside each linear's ``.weight`` when ``bias``)::

    embed.weight                          model.embed_tokens.weight
    layers.i.self_attn_norm.weight        model.layers.i.input_layernorm.weight
    layers.i.self_attn.{q,k,v}_proj       model.layers.i.self_attn.{q,k,v}_proj    (fused: self_attn.qkv_proj)
    layers.i.self_attn.out_proj           model.layers.i.self_attn.o_proj
    layers.i.self_attn.{q,k}_norm.weight  model.layers.i.self_attn.{q,k}_norm.weight      (qk_norm: Qwen 3)
    layers.i.ff_norm.weight               model.layers.i.post_attention_layernorm.weight
    layers.i.ff.{gate,up,down}_proj       model.layers.i.mlp.{gate,up,down}_proj
    final_norm.weight                     model.norm.weight
    lm_head.weight                        lm_head.weight                (untied; tied: the embedding's)

Configs are plain dicts (``config.json``'s keys; ``transformers.AutoConfig.for_model(**d)`` builds one), and no
``transformers`` import happens here: the export, ``init_from`` and the tests bring their own. Every mismatch --
an option the Hugging Face model does not have, a missing or unexpected key, a shape -- raises
``CheckpointError`` with one line naming the first one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from torch_handle.errors import CheckpointError
from torch_handle.model.args import TransformerArgs

FAMILIES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
"""``model_type`` -> the causal-LM class of ``transformers`` (``config.json``'s ``architectures``)."""

_SHARED = {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "norm_first": True, "scale_embeddings": False}
"""The options every mapped family needs, with the value it needs."""
_ROTARY_KEY = "rotary_emb.inv_freq"
"""A buffer older Llama checkpoints carry and newer ones recompute: skipped on the way in."""


def hf_family(args: TransformerArgs) -> str:
    """The ``model_type`` that computes ``args``' model: ``"qwen3"`` with q/k norms, else ``"llama"``."""
    return "qwen3" if args.qk_norm else "llama"


def _check_args(args: TransformerArgs, family: str) -> None:
    """Raises CheckpointError naming the first option of ``args`` that ``family`` cannot express."""
    if family not in FAMILIES:
        raise CheckpointError(f"unknown Hugging Face family {family!r}; expected one of {', '.join(FAMILIES)}")
    name = FAMILIES[family]
    needs = {**_SHARED, "qk_norm": family == "qwen3"}
    if family == "qwen3":
        needs["bias"] = False
    for key, value in needs.items():
        if getattr(args, key) != value:
            raise CheckpointError(f"{key} = {getattr(args, key)!r}: {name} needs {key} = {value!r}")
    if family == "llama" and args.d_model % args.n_heads:
        raise CheckpointError(f"d_model = {args.d_model}: {name} needs it divisible by n_heads = {args.n_heads}")


def to_hf_config(args: TransformerArgs, family: str | None = None) -> dict[str, Any]:
    """``config.json`` of the Hugging Face model that computes ``args``' decoder (``family``: ``"llama"`` or
    ``"qwen3"``; None: ``hf_family(args)``). ``dropout`` is not carried (Llama's only dropout is on the attention
    weights; a model is exported for use): ``attention_dropout`` is 0.

    Raises:
        CheckpointError: an option the family cannot express (``position = 'sinusoidal': LlamaForCausalLM needs
            position = 'rope'``).
    """
    family = family or hf_family(args)
    _check_args(args, family)
    config = {
        "model_type": family, "architectures": [FAMILIES[family]], "vocab_size": args.vocab_size,
        "hidden_size": args.d_model, "intermediate_size": args.d_ff, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.d_k,
        "hidden_act": "silu", "max_position_embeddings": args.max_len, "rms_norm_eps": args.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "attention_bias": args.bias, "attention_dropout": 0.0, "tie_word_embeddings": args.tie_embeddings,
        "pad_token_id": args.pad_id,
    }
    if family == "llama":
        config["mlp_bias"] = args.bias
    else:
        config["use_sliding_window"] = False
    return config


def _rope_theta(config: Mapping[str, Any]) -> float:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise CheckpointError(f"rope_type {kind!r}: only the default RoPE maps (rope_theta, no scaling)")
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def from_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerArgs`` keyword arguments of the decoder that computes a Llama or Qwen 3 ``config.json`` (a dict,
    or ``config.to_dict()``): sizes, switches, ``vocab_size``, ``max_len`` and ``pad_id``. ``dropout`` is 0 (set
    it for fine-tuning); ``n_kv_heads`` and ``head_dim`` are left unset where they are n_heads and d_model / n_heads.

    Raises:
        CheckpointError: another ``model_type``, ``hidden_act`` other than silu, a RoPE scaling, a sliding window.
    """
    family = config.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"model_type {family!r}: expected one of {', '.join(map(repr, FAMILIES))}")
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {config['hidden_act']!r}: only SwiGLU (silu) maps")
    if config.get("use_sliding_window"):
        raise CheckpointError("use_sliding_window = true: sliding-window attention does not map")
    d_model, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or d_model // n_heads
    n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    bias = bool(config.get("attention_bias", False))
    if family == "llama" and bool(config.get("mlp_bias", False)) != bias:
        raise CheckpointError(f"attention_bias = {bias} but mlp_bias = {not bias}: one bias option covers both")
    return {
        "vocab_size": int(config["vocab_size"]), "d_model": d_model, "n_heads": n_heads,
        "n_layers": int(config["num_hidden_layers"]), "d_ff": int(config["intermediate_size"]),
        "n_kv_heads": None if n_kv_heads == n_heads else n_kv_heads,
        "head_dim": None if head_dim * n_heads == d_model and d_model % n_heads == 0 else int(head_dim),
        "dropout": 0.0, **_SHARED, "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(config), "qk_norm": family == "qwen3", "bias": bias,
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "max_len": int(config.get("max_position_embeddings", 2048)), "pad_id": config.get("pad_token_id"),
    }


def hf_names(args: TransformerArgs) -> dict[str, str]:
    """Project parameter name -> Hugging Face name, every parameter of ``args``' decoder with separate Q/K/V
    projections (with ``fused_qkv`` the project's ``qkv_proj`` stacks the three ``q/k/v_proj`` entries), the
    tied output projection left out (it is the embedding)."""
    linear = ("weight", "bias") if args.bias else ("weight",)
    names = {"embed.weight": "model.embed_tokens.weight"}
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        names[f"{ours}.self_attn_norm.weight"] = f"{theirs}.input_layernorm.weight"
        for p in ("q", "k", "v"):
            names.update({f"{ours}.self_attn.{p}_proj.{t}": f"{theirs}.self_attn.{p}_proj.{t}" for t in linear})
        names.update({f"{ours}.self_attn.out_proj.{t}": f"{theirs}.self_attn.o_proj.{t}" for t in linear})
        if args.qk_norm:
            names.update({f"{ours}.self_attn.{p}_norm.weight": f"{theirs}.self_attn.{p}_norm.weight" for p in "qk"})
        names[f"{ours}.ff_norm.weight"] = f"{theirs}.post_attention_layernorm.weight"
        for p in ("gate", "up", "down"):
            names.update({f"{ours}.ff.{p}_proj.{t}": f"{theirs}.mlp.{p}_proj.{t}" for t in linear})
    names["final_norm.weight"] = "model.norm.weight"
    if not args.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def _expected_shapes(args: TransformerArgs) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape, for every name of ``hf_names(args)``."""
    C, q, kv, d_k = args.d_model, args.n_heads * args.d_k, args.kv_heads * args.d_k, args.d_k
    out_features = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": C, "gate_proj": args.d_ff, "up_proj": args.d_ff,
                    "down_proj": C}
    in_features = {"o_proj": q, "down_proj": args.d_ff}
    shapes = {}
    for name in hf_names(args).values():
        parts = name.split(".")
        if parts[-2] in out_features:
            rows = out_features[parts[-2]]
            shapes[name] = (rows, in_features.get(parts[-2], C)) if parts[-1] == "weight" else (rows,)
        elif parts[-2] in ("q_norm", "k_norm"):
            shapes[name] = (d_k,)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            shapes[name] = (args.vocab_size, C)
        else:  # the d_model norms
            shapes[name] = (C,)
    return shapes


def _check_state(state: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...]], what: str) -> None:
    """Raises CheckpointError naming the first missing key, unexpected key or wrong shape of ``state``."""
    for name, shape in shapes.items():
        if name not in state:
            raise CheckpointError(f"{what}: missing {name}")
        if tuple(state[name].shape) != shape:
            raise CheckpointError(f"{what}: {name} has shape {tuple(state[name].shape)}, expected {shape}")
    for name in state:
        if name not in shapes:
            raise CheckpointError(f"{what}: unexpected {name}")


def _qkv_names(args: TransformerArgs) -> list[tuple[str, list[str]]]:
    """(fused name, [its q, k, v names]) for every fused projection parameter of ``args``' decoder."""
    kinds = ("weight", "bias") if args.bias else ("weight",)
    return [(f"layers.{i}.self_attn.qkv_proj.{t}", [f"layers.{i}.self_attn.{p}_proj.{t}" for p in "qkv"])
            for i in range(args.n_layers) for t in kinds]


def to_hf_state_dict(state: Mapping[str, Tensor], args: TransformerArgs, family: str | None = None
                     ) -> dict[str, Tensor]:
    """The Hugging Face state dict of a ``DecoderLM(args)`` state dict (``model.state_dict()``): tensors renamed,
    the fused Q/K/V split (views, no copies), the tied ``lm_head.weight`` left out as ``save_pretrained`` does.

    Raises:
        CheckpointError: ``args`` the family cannot express, or a missing, unexpected or misshapen key of
            ``state`` (named).
    """
    _check_args(args, family or hf_family(args))
    state = {k: v for k, v in state.items() if not (args.tie_embeddings and k == "lm_head.weight")}
    if args.fused_qkv:
        sizes = [args.n_heads * args.d_k, args.kv_heads * args.d_k, args.kv_heads * args.d_k]
        for fused, names in _qkv_names(args):
            if fused in state:
                if state[fused].shape[0] != sum(sizes):
                    raise CheckpointError(f"DecoderLM state dict: {fused} has {state[fused].shape[0]} rows, "
                                          f"expected {sum(sizes)} (H + 2·H_kv heads of {args.d_k})")
                state.update(zip(names, state.pop(fused).split(sizes)))
    names = hf_names(args)
    shapes = _expected_shapes(args)
    _check_state(state, {ours: shapes[theirs] for ours, theirs in names.items()}, "DecoderLM state dict")
    return {names[k]: v for k, v in state.items()}


def from_hf_state_dict(state: Mapping[str, Tensor], args: TransformerArgs, family: str | None = None
                       ) -> dict[str, Tensor]:
    """A ``DecoderLM(args)`` state dict (``load_state_dict``-ready, strict) from a Llama or Qwen 3 one: renamed,
    Q/K/V stacked when ``args.fused_qkv``, ``lm_head.weight`` the embedding when tied (given or not), RoPE's
    ``inv_freq`` buffers skipped.

    Raises:
        CheckpointError: ``args`` the family cannot express, or a missing, unexpected or misshapen key of
            ``state`` (named).
    """
    _check_args(args, family or hf_family(args))
    state = {k: v for k, v in state.items() if not k.endswith(_ROTARY_KEY)}
    if args.tie_embeddings:
        state.pop("lm_head.weight", None)
    _check_state(state, _expected_shapes(args), "Hugging Face state dict")
    ours = {name: state[theirs] for name, theirs in hf_names(args).items()}
    if args.fused_qkv:
        for fused, names in _qkv_names(args):
            ours[fused] = torch.cat([ours.pop(n) for n in names])
    if args.tie_embeddings:
        ours["lm_head.weight"] = ours["embed.weight"]
    return ours
