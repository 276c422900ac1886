"""LoRA adapters handed on in peft's format: the directory ``PeftModel.from_pretrained(base, DIR)`` loads onto the
``transformers`` export of the base (``handle export --format hf``), as peft's ``save_pretrained`` writes it::

    adapter_config.json         peft_type LORA, r, lora_alpha, lora_dropout, target_modules (Hugging Face names),
                                base_model_name_or_path (the run's model.init_from, relative to this
                                directory where both are local), task_type CAUSAL_LM
    adapter_model.safetensors   base_model.model.<Hugging Face module path>.lora_A.weight  (r, in_features)
                                base_model.model.<Hugging Face module path>.lora_B.weight  (out_features, r)
    base_model.model.model.embed_tokens.weight   (V, C) and base_model.model.lm_head.weight (tied: the same
                                tensor, peft's ensure_weight_tying): only when a chat template's tokens grew the
                                base's vocabulary (peft's modules_to_save; load on
                                ``base.resize_token_embeddings(V)``: :mod:`torch_handle.finetune.vocab`)
    tokenizer.json              the run's tokenizer, as the base's export has it (``AutoTokenizer`` loads the
    tokenizer_config.json       directory), written by the caller (``extra``)

The keys are peft's (``utils/save_and_load.py``: ``get_peft_model_state_dict`` drops the adapter name
``default``) over the module paths of :func:`torch_handle.model.hf_names.hf_names`. A fused Q/K/V projection's
per-part adapters become the separate ``q_proj`` / ``k_proj`` / ``v_proj`` adapters peft puts on Llama's
separate projections: the same update, since the fused weight is the three stacked.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from torch_handle.common.fsio import replace_problem, replacing_dir
from torch_handle.errors import CheckpointError
from torch_handle.finetune.lora import DEFAULT_ADAPTER, adapter_modules
from torch_handle.finetune.vocab import TRAINED_MODULES
from torch_handle.model.args import TransformerArgs
from torch_handle.model.hf_names import hf_names

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
"""peft's prefix of every saved key: the ``PeftModel``'s ``base_model`` (a ``LoraModel``) and its ``model``."""


def _linear_name(module_name: str, part: str) -> str:
    """The unfused linear an adapter belongs to: ``layers.0.self_attn.qkv_proj`` + ``q_proj`` ->
    ``layers.0.self_attn.q_proj``."""
    return module_name if part == DEFAULT_ADAPTER else f"{module_name.rpartition('.')[0]}.{part}"


def peft_state_dict(model: nn.Module, args: TransformerArgs) -> dict[str, Tensor]:
    """Every adapter of ``model`` (a ``DecoderLM(args)`` after ``apply_lora``) under peft's key names.

    Raises:
        CheckpointError: an adapted linear that has no Hugging Face name (e.g. the paper's FFN).
    """
    names = hf_names(args)
    state: dict[str, Tensor] = {}
    for module_name, module in adapter_modules(model).items():
        for part in module.parts:
            ours = _linear_name(module_name, part) + ".weight"
            if ours not in names:
                raise CheckpointError(f"{ours}: no Hugging Face name (peft's format covers Llama-shaped decoders)")
            theirs = PREFIX + names[ours].removesuffix(".weight")
            state[f"{theirs}.lora_A.weight"] = module.lora_A[part].weight.detach()
            state[f"{theirs}.lora_B.weight"] = module.lora_B[part].weight.detach()
    for ours in saved_modules(model, args):  # a grown vocabulary's embedding and output rows, trained whole
        state[PREFIX + names[ours]] = model.get_parameter(ours).detach()
        if args.tie_embeddings:  # peft's ensure_weight_tying loads the tied lm_head from its own key
            state[PREFIX + "lm_head.weight"] = state[PREFIX + names[ours]]
    return state


def saved_modules(model: nn.Module, args: TransformerArgs) -> list[str]:
    """The weights (this model's names) of the modules a LoRA run trains whole, peft's ``modules_to_save``: the
    embedding and, untied, the output projection of a base whose vocabulary grew
    (:mod:`torch_handle.finetune.vocab`); empty otherwise."""
    return [f"{m}.weight" for m in TRAINED_MODULES if not (m == "lm_head" and args.tie_embeddings)
            and hasattr(model, m) and getattr(model, m).weight.requires_grad]


def adapter_config(model: nn.Module, args: TransformerArgs, *, dropout: float, base: str | None) -> dict[str, Any]:
    """``adapter_config.json`` of ``model``'s adapters (peft's ``LoraConfig`` fields that shape the load)."""
    modules = adapter_modules(model)
    first = next(iter(modules.values()))
    names = hf_names(args)
    targets = sorted({names[_linear_name(n, part) + ".weight"].split(".")[-2]
                      for n, m in modules.items() for part in m.parts})
    saved = [names[w].split(".")[-2] for w in saved_modules(model, args)] or None  # embed_tokens, lm_head
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.rank, "lora_alpha": first.alpha,
            "lora_dropout": dropout, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": saved, "use_rslora": False,
            "use_dora": False, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
            "base_model_name_or_path": base, "revision": None,
            "ensure_weight_tying": bool(saved) and args.tie_embeddings}


def write_adapter(out: Path | str, state: dict[str, Tensor], config: dict[str, Any], *, force: bool = False,
                  metadata: dict[str, str] | None = None,
                  extra: Callable[[Path], list[str]] | None = None) -> list[str]:
    """Write ``out/adapter_config.json`` and ``out/adapter_model.safetensors`` (fp32), and whatever ``extra`` writes
    into the directory it is given (the tokenizer files), into a temporary directory renamed into place: ``out`` is
    untouched or complete. A non-empty ``out`` is replaced only with ``force`` and only when it is an adapter
    directory itself. Returns the files written.

    Raises:
        CheckpointError: ``out`` is a file, non-empty (without ``force``, or not an adapter directory), or the
            write failed.
    """
    from safetensors.torch import save_file

    out = Path(out)
    problem = replace_problem(out, force, marker=CONFIG_FILE, kind="an adapter", what="the adapters")
    if problem:
        raise CheckpointError(problem)
    try:
        with replacing_dir(out) as tmp:
            tensors = {k: v.detach().float().contiguous().clone() for k, v in state.items()}
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", **(metadata or {})})
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            written = [CONFIG_FILE, WEIGHTS_FILE, *(extra(tmp) if extra is not None else ())]
    except OSError as e:
        raise CheckpointError(f"{out}: cannot write the adapters ({type(e).__name__}: {e})") from None
    return written
