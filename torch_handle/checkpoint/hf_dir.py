"""A Hugging Face model directory, the one ``save_pretrained`` writes and ``from_pretrained`` reads: written by
``handle export RUN --format hf OUT/`` (:mod:`torch_handle.infer.hf_export`), read by ``[model] init_from = "DIR"``.

What a directory holds (https://huggingface.co/docs/transformers/main_classes/model#transformers.PreTrainedModel)::

    config.json             the architecture: model_type, sizes, rope_theta, rms_norm_eps, token ids, dtype
    model.safetensors       the weights in Hugging Face's names (or model-0000i-of-0000n.safetensors shards
                            listed by model.safetensors.index.json, as large checkpoints come; read only)
    tokenizer.json          the tokenizer (``tokenizers``' own file)
    tokenizer_config.json   what ``AutoTokenizer`` needs beside it: the class and the special tokens

Every name and config key is :mod:`torch_handle.model.hf_names`'s; this module reads and writes files. Errors
are ``CheckpointError`` with one line naming the directory and the first problem. No ``transformers`` import:
exporting and importing need only ``safetensors`` and ``json``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from torch_handle.common.names import TOKENIZER_FILE
from torch_handle.checkpoint.resume import flat_keys
from torch_handle.checkpoint.vocab_rows import grow_vocab
from torch_handle.common.fsio import read_json_object, replace_problem, replacing_dir
from torch_handle.errors import CheckpointError
from torch_handle.model.args import DATASET_FIELDS, TransformerArgs
from torch_handle.model.hf_names import Inexpressible, from_hf_config, to_hf_config

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``config.json``'s ``torch_dtype`` names of the dtypes an export may write."""

_NOT_SHAPE = {"dropout", "activation_checkpointing", "attention", "fused_qkv", *DATASET_FIELDS,
              "capacity_factor", "router_aux_loss", "router_z_loss", "bias_update_rate"}
"""``TransformerArgs`` fields that do not shape the weights (how they are computed or trained, or the data's)."""


def read_config(directory: Path | str) -> dict[str, Any]:
    """``DIR/config.json`` as a dict.

    Raises:
        CheckpointError: no such directory, no config.json, or one that is not a JSON object.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such directory (expected a Hugging Face model directory with "
                              f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        return read_json_object(directory / CONFIG_FILE, CheckpointError)
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no {CONFIG_FILE} (not a Hugging Face model directory)") from None


def _shape_value(args: TransformerArgs, name: str) -> Any:
    """A field as the weights see it: unset n_kv_heads is n_heads, unset head_dim d_model / n_heads, unset
    d_ff_expert d_ff, and d_ff nothing when every layer is sparse (Mixtral's intermediate_size is an expert's)."""
    dense = any(not args.is_moe_layer(i) for i in range(args.n_layers))
    return {"n_kv_heads": args.kv_heads, "head_dim": args.d_k, "d_ff": args.d_ff if dense else None,
            "d_ff_expert": (args.d_ff_expert or args.d_ff) if args.n_experts else None}.get(name, getattr(args, name))


def _config_key(theirs: TransformerArgs, name: str, value: Any) -> str | None:
    """The ``config.json`` key that field ``name`` drives: the first key of ``to_hf_config`` that changes when
    ``theirs`` takes ``value`` for it (so the mapping stays hf_names' alone). None when no key changes or the
    changed model has no Hugging Face form."""
    try:
        before = flat_keys(to_hf_config(theirs))
        after = flat_keys(to_hf_config(dataclasses.replace(theirs, **{name: value})))
    except CheckpointError:
        return None
    return next((key for key in after if after[key] != before.get(key)), None)


_DERIVED = {"head_dim": ("d_model", "n_heads"), "n_kv_heads": ("n_heads",), "d_ff_expert": ("d_ff",)}
"""Fields that, left unset, follow others (head_dim = d_model / n_heads, ...): a mismatch of theirs is one of
those others', named once."""


def config_mismatches(args: TransformerArgs, directory: Path | str) -> list[str]:
    """One line for each option of ``args`` (the preset's ``[model]``) whose weights would not fit the model
    ``DIR/config.json`` describes (``model.n_kv_heads = 4 but DIR/config.json has num_key_value_heads = 2``), all of
    them, in field order (an unset field that follows a mismatched one, head_dim = d_model / n_heads, is not named
    again); or the one line naming every option no Hugging Face model has; empty when they fit. Options that do
    not shape the weights (dropout, the attention kernel, fused_qkv, activation checkpointing) may differ; the
    vocabulary is checked when the weights load (the run's tokenizer gives it).

    Raises:
        CheckpointError: an unreadable directory or config.json, or one that describes no model the decoder
            computes (another model_type, a RoPE scaling, ...).
    """
    directory = Path(directory)
    config = read_config(directory)
    where = directory / CONFIG_FILE
    try:
        to_hf_config(args)
    except Inexpressible as e:
        return [f"{e.text('model.')} (init_from loads Llama, Qwen 3, Qwen 3 MoE and Mixtral weights only)"]
    try:
        theirs = TransformerArgs(**from_hf_config(config))
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: not a Llama, Qwen 3, Qwen 3 MoE or Mixtral config ({type(e).__name__}: "
                              f"{e})") from None
    found: dict[str, str] = {}
    for field in dataclasses.fields(TransformerArgs):
        name = field.name
        if name in _NOT_SHAPE:
            continue
        mine, other = _shape_value(args, name), _shape_value(theirs, name)
        if mine == other or (name == "d_ff" and None in (mine, other)):  # no dense layer on one side: moot
            continue
        if getattr(args, name) is None and any(source in found for source in _DERIVED.get(name, ())):
            continue  # follows a mismatch named already
        key = _config_key(theirs, name, getattr(args, name)) or name
        value = flat_keys(config).get(key, other)
        shown = f"= {mine!r}" if getattr(args, name) is not None else f"is unset (so {mine!r})"
        found[name] = f"model.{name} {shown} but {where} has {key} = {value!r}"
    return list(found.values())


def config_mismatch(args: TransformerArgs, directory: Path | str) -> str | None:
    """:func:`config_mismatches` as one line (``; `` between them), or None when the weights fit."""
    return "; ".join(config_mismatches(args, directory)) or None


def read_weights(directory: Path | str) -> dict[str, Tensor]:
    """Every tensor of ``DIR/model.safetensors``, or of the shards ``model.safetensors.index.json`` lists.

    Raises:
        CheckpointError: no safetensors weights (``pytorch_model.bin`` is a pickle, not read), or unreadable ones.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    if (directory / WEIGHTS_FILE).is_file():
        files = [directory / WEIGHTS_FILE]
    elif (directory / WEIGHTS_INDEX).is_file():
        try:
            index = json.loads((directory / WEIGHTS_INDEX).read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{directory / WEIGHTS_INDEX}: unreadable ({type(e).__name__}: {e})") from None
        files = [directory / name for name in sorted(set(index.values()))]
    else:
        other = " (pytorch_model.bin is a pickle: save it with safe_serialization=True)" if (
            directory / "pytorch_model.bin").exists() else ""
        raise CheckpointError(f"{directory}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX}{other}")
    state: dict[str, Tensor] = {}
    for path in files:
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: cannot be read ({' '.join(str(e).split())})") from None
    return state


def load_into(model: torch.nn.Module, directory: Path | str) -> str:
    """Copy a Hugging Face directory's weights into ``model`` (a ``DecoderLM``, before any wrapping or sharding),
    cast to its dtype. Returns a line for the run's log. A model with more token rows than the base (a chat
    template's tokens added to its tokenizer) gets the new rows of
    :func:`torch_handle.checkpoint.vocab_rows.grow_vocab`.

    Raises:
        CheckpointError: a config that does not describe ``model.args`` (the first mismatch named), or weights
            with a missing, unexpected or misshapen tensor (the vocabulary, for one).
    """
    from torch_handle.model.hf_names import from_hf_state_dict

    directory = Path(directory)
    args: TransformerArgs = model.args
    mismatch = config_mismatch(args, directory)
    if mismatch is not None:
        raise CheckpointError(mismatch)
    family = read_config(directory)["model_type"]
    weights = read_weights(directory)
    grown = grow_vocab(weights, args.vocab_size)  # a chat template's tokens added to the base's tokenizer
    try:
        state = from_hf_state_dict(weights, args, family)
    except CheckpointError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    model.load_state_dict(state)
    rows = "" if grown is None else (f"; vocabulary {grown} -> {args.vocab_size}: rows {grown}-{args.vocab_size - 1} "
                                     f"mean-initialised as transformers' resize_token_embeddings")
    return f"weights from {directory} ({family}, {sum(p.numel() for p in model.parameters()):,} parameters){rows}"


def special_tokens(tokenizer_path: Path, names: Mapping[str, str]) -> dict[str, tuple[str, int]]:
    """``{"bos_token": ("<bos>", 1), ...}``: those of ``names`` (role -> token) that the tokenizer has."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    found = {role: (token, tokenizer.token_to_id(token)) for role, token in names.items()}
    return {role: (token, i) for role, (token, i) in found.items() if i is not None}


def write(out: Path | str, config: Mapping[str, Any], state: Mapping[str, Tensor], tokenizer_path: Path | None,
          specials: Mapping[str, tuple[str, int]], *, dtype: str, metadata: Mapping[str, str],
          force: bool = False, extra_files: Mapping[str, str] | None = None) -> list[str]:
    """Write a Hugging Face directory at ``out``: ``config`` (``to_hf_config``'s, completed here with the dtype,
    the special tokens' ids and a top-level ``rope_theta`` for transformers < 5), ``state`` (Hugging Face names)
    in ``dtype``, and the tokenizer. Everything is written into a temporary directory beside ``out`` and renamed
    into place, so ``out`` is either untouched or complete. Returns the files written.

    ``out`` may be missing or empty; a non-empty one is replaced only with ``force`` and only when it is a
    Hugging Face directory itself (it has a config.json): nothing else is ever deleted. ``extra_files`` (name ->
    text: a chat template, a generation config) are written beside them, in the same temporary directory.

    Raises:
        CheckpointError: ``out`` is a file, or non-empty without ``force``, or non-empty and not a model
            directory; a write that fails (disk full: the temporary directory is removed).
    """
    from safetensors.torch import save_file

    out = Path(out)
    check_out(out, force)
    config = dict(config)
    ids = {f"{role.removesuffix('_token')}_token_id": i for role, (_, i) in specials.items() if role != "unk_token"}
    config.update(ids, torch_dtype=dtype, dtype=dtype)
    rope = config.get("rope_parameters")
    if isinstance(rope, Mapping) and "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    try:
        with replacing_dir(out) as tmp:
            # safetensors stores each tensor on its own: no views of a shared buffer (the split fused Q/K/V)
            tensors = {k: v.detach().to(DTYPES[dtype]).contiguous().clone() for k, v in state.items()}
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", **metadata})
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            if tokenizer_path is not None:
                write_tokenizer(tmp, tokenizer_path, specials, config.get("max_position_embeddings"))
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text, encoding="utf-8")
            written = sorted(p.name for p in tmp.iterdir())
    except OSError as e:
        raise CheckpointError(f"{out}: cannot write the export ({type(e).__name__}: {e})") from None
    return written


def write_tokenizer(directory: Path, tokenizer_path: Path, specials: Mapping[str, tuple[str, int]],
                    model_max_length: int | None) -> list[str]:
    """Write the tokenizer ``AutoTokenizer.from_pretrained(directory)`` loads: ``tokenizer.json`` (a copy of
    ``tokenizer_path``) and ``tokenizer_config.json`` (the class and the special tokens' roles). Returns the files.

    Raises:
        OSError: a failed copy or write.
    """
    shutil.copyfile(tokenizer_path, Path(directory) / TOKENIZER_FILE)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
                        **{role: token for role, (token, _) in specials.items()}}
    (Path(directory) / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n",
                                                    encoding="utf-8")
    return [TOKENIZER_FILE, TOKENIZER_CONFIG]


def check_out(out: Path, force: bool) -> None:
    """Raises CheckpointError unless ``out`` may receive an export (see :func:`write`)."""
    problem = replace_problem(out, force, marker=CONFIG_FILE, kind="a Hugging Face model", what="the export")
    if problem:
        raise CheckpointError(problem)
