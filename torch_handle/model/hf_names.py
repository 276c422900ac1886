"""The one place that knows Hugging Face's names: parameters and configs of ``transformers``' Llama, Qwen 3, Qwen 3
MoE and Mixtral against this project's ``DecoderLM`` and ``TransformerArgs``, both ways.

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

A mixture-of-experts decoder (``n_experts > 0``, ``MoEFeedForward``) exports as ``Qwen3MoeForCausalLM`` with q/k
norms (``moe_every`` is its ``decoder_sparse_step``: the same rule, layer i sparse when (i + 1) % step == 0) and as
``MixtralForCausalLM`` without (every layer sparse, top-k weights renormalised). Its layers' FFN, expert j of E
being slice j of the stacked (E, F, C) / (E, C, F) tensors, in the on-disk names ``save_pretrained`` writes and
every transformers version loads (``MIXTRAL``: ``block_sparse_moe`` for ``mlp``, w1 / w3 / w2 for gate / up / down)::

    layers.i.ff.gate.weight               model.layers.i.mlp.gate.weight                          (E, C)
    layers.i.ff.experts.gate_proj[j]      model.layers.i.mlp.experts.j.gate_proj.weight           (F, C)
    layers.i.ff.experts.up_proj[j]        model.layers.i.mlp.experts.j.up_proj.weight             (F, C)
    layers.i.ff.experts.down_proj[j]      model.layers.i.mlp.experts.j.down_proj.weight           (C, F)

transformers 5 holds the experts fused in memory (``experts.gate_up_proj`` (E, 2F, C) = [gate; up] per expert,
``experts.down_proj`` (E, C, F)) and converts on load and save; :func:`fuse_experts` gives that form, and
:func:`from_hf_state_dict` reads either. Options neither class has -- shared experts, sigmoid scores, the
auxiliary-loss-free expert bias -- are refused by name.

Configs are plain dicts (``config.json``'s keys; ``transformers.AutoConfig.for_model(**d)`` builds one), and no
``transformers`` import happens here: the export, ``init_from`` and the tests bring their own. Options the Hugging
Face class does not have raise :class:`Inexpressible`, one line naming every one with the value it needs (against
the family fewest changes away, :func:`closest_family`); a missing or unexpected key or a shape raises
``CheckpointError`` with one line naming the first one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from torch_handle.errors import CheckpointError
from torch_handle.model.args import TransformerArgs

FAMILIES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                             "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
"""``model_type`` -> the causal-LM class of ``transformers`` (``config.json``'s ``architectures``)."""
MOE_FAMILIES = ("qwen3_moe", "mixtral")
_QK_NORM = ("qwen3", "qwen3_moe")
_EXPERTS = {"qwen3_moe": ("mlp", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
            "mixtral": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})}
"""Per MoE family: the on-disk name of a layer's sparse block, and of each expert matrix."""
_EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")

_SHARED = {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "norm_first": True, "scale_embeddings": False}
"""The options every mapped family needs, with the value it needs."""
_ROTARY_KEY = "rotary_emb.inv_freq"
"""A buffer older Llama checkpoints carry and newer ones recompute: skipped on the way in."""


def hf_family(args: TransformerArgs) -> str:
    """The ``model_type`` that computes ``args``' model: ``"qwen3"`` with q/k norms, else ``"llama"``; with experts
    ``"qwen3_moe"`` with q/k norms, else ``"mixtral"``."""
    if args.n_experts:
        return "qwen3_moe" if args.qk_norm else "mixtral"
    return "qwen3" if args.qk_norm else "llama"


Problem = tuple[str, Any, str, str]
"""One option a family cannot express: ``(key, the value args has, what the family needs, a note)``, e.g.
``("position", "sinusoidal", "= 'rope'", "")``."""


class Inexpressible(CheckpointError):
    """Every option of a ``TransformerArgs`` that the Hugging Face class ``architecture`` cannot express, with the
    value each needs, in one line (:meth:`text`): ``MixtralForCausalLM needs model.position = 'rope' (not
    'sinusoidal'); model.scale_embeddings = False (not True)``. ``problems``: :data:`Problem` s, in field order."""

    def __init__(self, architecture: str, problems: list[Problem], prefix: str = ""):
        self.architecture, self.problems = architecture, list(problems)
        super().__init__(self.text(prefix))

    def text(self, prefix: str = "") -> str:
        """The line, each key after ``prefix`` (``"model."``: as a preset names it)."""
        return f"{self.architecture} needs " + "; ".join(f"{prefix}{key} {need} (not {have!r}){note}"
                                                         for key, have, need, note in self.problems)


def hf_problems(args: TransformerArgs, family: str) -> list[Problem]:
    """Every option of ``args`` that ``family``'s class cannot express, with the value it needs (empty: it can)."""
    if family not in FAMILIES:
        raise CheckpointError(f"unknown Hugging Face family {family!r}; expected one of {', '.join(FAMILIES)}")
    needs: dict[str, object] = {**_SHARED, "qk_norm": family in _QK_NORM}
    if family != "llama":
        needs["bias"] = False
    if family in MOE_FAMILIES:  # the expert bias moves the choice of experts: neither router has one
        needs.update(router="softmax", n_shared_experts=0, balance="aux_loss")
        if family == "mixtral":
            needs.update(moe_every=1, norm_topk_prob=True)
    else:
        needs["n_experts"] = 0
    found: list[Problem] = []
    for key, value in needs.items():
        if getattr(args, key) != value:
            hint = (" (with qk_norm = True it exports as Qwen3MoeForCausalLM)"
                    if family == "mixtral" and key in ("moe_every", "norm_topk_prob") else "")
            found.append((key, getattr(args, key), f"= {value!r}", hint))
    if family == "llama" and args.d_model % args.n_heads:
        found.append(("d_model", args.d_model, f"divisible by n_heads = {args.n_heads}", ""))
    return found


def closest_family(args: TransformerArgs) -> str:
    """The family ``args`` is fewest options away from: :func:`hf_family` when it expresses ``args`` or no other
    one of the same kind (dense: llama, qwen3; experts: qwen3_moe, mixtral) needs fewer changes."""
    first = hf_family(args)
    kinds = MOE_FAMILIES if args.n_experts else ("llama", "qwen3")
    return min([first, *(f for f in kinds if f != first)], key=lambda f: len(hf_problems(args, f)))


def _check_args(args: TransformerArgs, family: str | None) -> str:
    """``family`` (None: :func:`closest_family`), or raises :class:`Inexpressible` naming every option of ``args``
    that it cannot express."""
    family = family or closest_family(args)
    problems = hf_problems(args, family)
    if problems:
        raise Inexpressible(FAMILIES[family], problems)
    return family


def to_hf_config(args: TransformerArgs, family: str | None = None) -> dict[str, Any]:
    """``config.json`` of the Hugging Face model that computes ``args``' decoder (``family``: ``"llama"`` or
    ``"qwen3"``, ``"qwen3_moe"``, ``"mixtral"``; None: ``hf_family(args)``). ``dropout`` is not carried (Llama's only
    dropout is on the attention weights; a model is exported for use): ``attention_dropout`` is 0. Of an MoE's
    training options, ``router_aux_loss`` becomes ``router_aux_loss_coef`` = router_aux_loss · L_moe / k, the
    coefficient that gives transformers' loss (k times this project's per layer, averaged over the L_moe sparse
    layers rather than summed) the same weight; ``capacity_factor``, ``router_z_loss`` are not carried: the
    classes compute every routed token (dropless) and have no z-loss.

    Raises:
        Inexpressible: options the family (None: the closest one) cannot express, every one (``LlamaForCausalLM
            needs position = 'rope' (not 'sinusoidal'); scale_embeddings = False (not True)``).
    """
    family = _check_args(args, family)
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
    elif family in _QK_NORM:
        config["use_sliding_window"] = False
    if family in MOE_FAMILIES:
        d_ff_expert = args.d_ff_expert or args.d_ff
        n_sparse = sum(args.is_moe_layer(i) for i in range(args.n_layers))
        config["num_experts_per_tok"] = args.top_k
        if family == "qwen3_moe":
            config.update(num_experts=args.n_experts, moe_intermediate_size=d_ff_expert,
                          decoder_sparse_step=args.moe_every, mlp_only_layers=[], norm_topk_prob=args.norm_topk_prob)
        else:  # every layer sparse: intermediate_size is an expert's
            config.update(num_local_experts=args.n_experts, intermediate_size=d_ff_expert, sliding_window=None,
                          router_jitter_noise=0.0)
        # after the keys that shape the model: hf_dir names the first key an option changes
        config.update(output_router_logits=False, router_aux_loss_coef=args.router_aux_loss * n_sparse / args.top_k)
    return config


def _rope_theta(config: Mapping[str, Any]) -> float:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise CheckpointError(f"rope_type {kind!r}: only the default RoPE maps (rope_theta, no scaling)")
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def from_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerArgs`` keyword arguments of the decoder that computes a Llama, Qwen 3, Qwen 3 MoE or Mixtral
    ``config.json`` (a dict, or ``config.to_dict()``): sizes, switches, the experts, ``vocab_size``, ``max_len`` and
    ``pad_id``. ``dropout`` is 0 (set it for fine-tuning); ``n_kv_heads``, ``head_dim`` and ``d_ff_expert`` are left
    unset where they are n_heads, d_model / n_heads and d_ff.

    Raises:
        CheckpointError: another ``model_type``, ``hidden_act`` other than silu, a RoPE scaling, a sliding window,
            Qwen 3 MoE's ``mlp_only_layers`` (only ``decoder_sparse_step`` maps, to ``moe_every``).
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
    if config.get("sliding_window") and family == "mixtral":
        raise CheckpointError(f"sliding_window = {config['sliding_window']}: sliding-window attention does not map")
    if family == "qwen3_moe" and config.get("mlp_only_layers"):
        raise CheckpointError(f"mlp_only_layers = {list(config['mlp_only_layers'])}: only decoder_sparse_step maps "
                              f"(to model.moe_every)")
    return {**_dense_kwargs(config, family, d_model, n_heads, head_dim, n_kv_heads, bias),
            **(_moe_kwargs(config, family) if family in MOE_FAMILIES else {})}


def _dense_kwargs(config: Mapping[str, Any], family: str, d_model: int, n_heads: int, head_dim: int,
                  n_kv_heads: int, bias: bool) -> dict[str, Any]:
    return {
        "vocab_size": int(config["vocab_size"]), "d_model": d_model, "n_heads": n_heads,
        "n_layers": int(config["num_hidden_layers"]), "d_ff": int(config["intermediate_size"]),
        "n_kv_heads": None if n_kv_heads == n_heads else n_kv_heads,
        "head_dim": None if head_dim * n_heads == d_model and d_model % n_heads == 0 else int(head_dim),
        "dropout": 0.0, **_SHARED, "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(config), "qk_norm": family in _QK_NORM, "bias": bias,
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "max_len": int(config.get("max_position_embeddings", 2048)), "pad_id": config.get("pad_token_id"),
    }


def _moe_kwargs(config: Mapping[str, Any], family: str) -> dict[str, Any]:
    """The expert options of a Qwen 3 MoE or Mixtral config (none for a Qwen 3 MoE config without experts)."""
    qwen = family == "qwen3_moe"
    # transformers 5 writes Qwen 3 MoE's num_experts as num_local_experts (its attribute_map), 4.x as num_experts
    n_experts = int(config.get("num_experts", config.get("num_local_experts")) or 0)
    if not n_experts:
        return {}
    d_ff = int(config["intermediate_size"])
    d_ff_expert = int(config["moe_intermediate_size"]) if qwen else d_ff
    top_k, step = int(config.get("num_experts_per_tok", 2)), int(config.get("decoder_sparse_step", 1)) if qwen else 1
    n_sparse = sum((i + 1) % step == 0 for i in range(int(config["num_hidden_layers"])))
    return {"n_experts": n_experts, "top_k": top_k, "moe_every": step,
            "d_ff_expert": None if d_ff_expert == d_ff else d_ff_expert,
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)) if qwen else True,
            "router_aux_loss": float(config.get("router_aux_loss_coef", 0.001)) * top_k / max(n_sparse, 1)}


def hf_names(args: TransformerArgs) -> dict[str, str]:
    """Project parameter name -> Hugging Face name, every parameter of ``args``' decoder with separate Q/K/V
    projections (with ``fused_qkv`` the project's ``qkv_proj`` stacks the three ``q/k/v_proj`` entries) and one
    entry per expert, ``layers.i.ff.experts.gate_proj.j`` for slice j of the stacked ``layers.i.ff.experts.gate_proj``
    (:func:`_expert_names`), the tied output projection left out (it is the embedding)."""
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
        if args.is_moe_layer(i):
            block, matrices = _EXPERTS[hf_family(args)]
            names[f"{ours}.ff.gate.weight"] = f"{theirs}.{block}.gate.weight"
            for p in _EXPERT_MATRICES:
                names.update({f"{ours}.ff.experts.{p}.{j}": f"{theirs}.{block}.experts.{j}.{matrices[p]}.weight"
                              for j in range(args.n_experts)})
            continue
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
    F = args.d_ff_expert or args.d_ff
    expert = {"gate_proj": (F, C), "up_proj": (F, C), "down_proj": (C, F), "w1": (F, C), "w3": (F, C), "w2": (C, F)}
    shapes = {}
    for name in hf_names(args).values():
        parts = name.split(".")
        if ".experts." in name:
            shapes[name] = expert[parts[-2]]
        elif parts[-2] == "gate":  # an MoE layer's router
            shapes[name] = (args.n_experts, C)
        elif parts[-2] in out_features:
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


def _expert_names(args: TransformerArgs) -> list[tuple[str, list[str]]]:
    """(stacked name, [its E per-expert names]) for every expert matrix of ``args``' decoder."""
    return [(f"layers.{i}.ff.experts.{p}", [f"layers.{i}.ff.experts.{p}.{j}" for j in range(args.n_experts)])
            for i in range(args.n_layers) if args.is_moe_layer(i) for p in _EXPERT_MATRICES]


def to_hf_state_dict(state: Mapping[str, Tensor], args: TransformerArgs, family: str | None = None
                     ) -> dict[str, Tensor]:
    """The Hugging Face state dict of a ``DecoderLM(args)`` state dict (``model.state_dict()``): tensors renamed,
    the fused Q/K/V split and the stacked experts cut into one tensor per expert (views, no copies), the tied
    ``lm_head.weight`` left out as ``save_pretrained`` does.

    Raises:
        CheckpointError: ``args`` the family cannot express, or a missing, unexpected or misshapen key of
            ``state`` (named).
    """
    _check_args(args, family)
    state = {k: v for k, v in state.items() if not (args.tie_embeddings and k == "lm_head.weight")}
    if args.fused_qkv:
        sizes = [args.n_heads * args.d_k, args.kv_heads * args.d_k, args.kv_heads * args.d_k]
        for fused, names in _qkv_names(args):
            if fused in state:
                if state[fused].shape[0] != sum(sizes):
                    raise CheckpointError(f"DecoderLM state dict: {fused} has {state[fused].shape[0]} rows, "
                                          f"expected {sum(sizes)} (H + 2·H_kv heads of {args.d_k})")
                state.update(zip(names, state.pop(fused).split(sizes)))
    for stacked, names in _expert_names(args):
        if stacked in state:
            if state[stacked].dim() != 3 or state[stacked].shape[0] != args.n_experts:
                raise CheckpointError(f"DecoderLM state dict: {stacked} has shape {tuple(state[stacked].shape)}, "
                                      f"expected {args.n_experts} experts stacked on dim 0")
            state.update(zip(names, state.pop(stacked).unbind(0)))
    names = hf_names(args)
    shapes = _expected_shapes(args)
    _check_state(state, {ours: shapes[theirs] for ours, theirs in names.items()}, "DecoderLM state dict")
    return {names[k]: v for k, v in state.items()}


def fuse_experts(state: Mapping[str, Tensor], args: TransformerArgs) -> dict[str, Tensor]:
    """A Hugging Face state dict (:func:`to_hf_state_dict`'s, on-disk names) as ``transformers`` ≥ 5 holds it in
    memory (``model.state_dict()``, ``load_state_dict``): each sparse block under ``mlp``, its experts fused,
    ``experts.gate_up_proj`` (E, 2F, C) = [gate_j; up_j] stacked over j and ``experts.down_proj`` (E, C, F)
    (``conversion_mapping.py``'s ``MergeModulelist`` and ``Concatenate``). Other tensors pass unchanged."""
    block, matrices = _EXPERTS[hf_family(args)] if args.n_experts else ("mlp", {})
    out = dict(state)
    for i in range(args.n_layers):
        if not args.is_moe_layer(i):
            continue
        theirs = f"model.layers.{i}.{block}"
        mats = {p: torch.stack([out.pop(f"{theirs}.experts.{j}.{matrices[p]}.weight") for j in range(args.n_experts)])
                for p in _EXPERT_MATRICES}
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([mats["gate_proj"], mats["up_proj"]], dim=1)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = mats["down_proj"]
        out[f"model.layers.{i}.mlp.gate.weight"] = out.pop(f"{theirs}.gate.weight")
    return out


def _unfuse_experts(state: dict[str, Tensor], args: TransformerArgs) -> dict[str, Tensor]:
    """The inverse of :func:`fuse_experts` for the layers ``state`` holds fused (a ``save_pretrained(...,
    save_original_format=False)`` directory); a state dict in on-disk names passes unchanged."""
    block, matrices = _EXPERTS[hf_family(args)] if args.n_experts else ("mlp", {})
    for i in range(args.n_layers):
        fused = f"model.layers.{i}.mlp.experts.gate_up_proj"
        if not args.is_moe_layer(i) or fused not in state:
            continue
        theirs = f"model.layers.{i}.{block}"
        gate, up = state.pop(fused).chunk(2, dim=1)
        mats = {"gate_proj": gate, "up_proj": up, "down_proj": state.pop(f"model.layers.{i}.mlp.experts.down_proj")}
        for p, stacked in mats.items():
            state.update({f"{theirs}.experts.{j}.{matrices[p]}.weight": t for j, t in enumerate(stacked.unbind(0))})
        if f"model.layers.{i}.mlp.gate.weight" in state:
            state[f"{theirs}.gate.weight"] = state.pop(f"model.layers.{i}.mlp.gate.weight")
    return state


def from_hf_state_dict(state: Mapping[str, Tensor], args: TransformerArgs, family: str | None = None
                       ) -> dict[str, Tensor]:
    """A ``DecoderLM(args)`` state dict (``load_state_dict``-ready, strict) from a Llama, Qwen 3, Qwen 3 MoE or
    Mixtral one (experts one tensor each, as on disk, or fused, as transformers 5 holds them): renamed, Q/K/V
    stacked when ``args.fused_qkv``, the experts stacked, ``lm_head.weight`` the embedding when tied (given or not),
    RoPE's ``inv_freq`` buffers skipped.

    Raises:
        CheckpointError: ``args`` the family cannot express, or a missing, unexpected or misshapen key of
            ``state`` (named).
    """
    _check_args(args, family)
    state = {k: v for k, v in state.items() if not k.endswith(_ROTARY_KEY)}
    if args.tie_embeddings:
        state.pop("lm_head.weight", None)
    state = _unfuse_experts(state, args)
    _check_state(state, _expected_shapes(args), "Hugging Face state dict")
    ours = {name: state[theirs] for name, theirs in hf_names(args).items()}
    if args.fused_qkv:
        for fused, names in _qkv_names(args):
            ours[fused] = torch.cat([ours.pop(n) for n in names])
    for stacked, names in _expert_names(args):
        ours[stacked] = torch.stack([ours.pop(n) for n in names])
    if args.tie_embeddings:
        ours["lm_head.weight"] = ours["embed.weight"]
    return ours
