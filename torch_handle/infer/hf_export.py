"""``handle export RUN --format hf OUT/``: a decoder run as a Hugging Face model directory that
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)`` load.

The weights are the run's final ``model.safetensors`` (which rank 0 gathered from whatever layout the run had:
DDP, ZeRO, FSDP2, tensor or pipeline parallel) or, with ``checkpoint=STEP``, a checkpoint's (as
:func:`torch_handle.infer.generate.load_run` reads them); names and config keys are
:mod:`torch_handle.model.hf_names`'s, files :mod:`torch_handle.checkpoint.hf_dir`'s. A run whose model no Hugging
Face class computes (post-LN, sinusoidal positions, LayerNorm, GELU, scaled embeddings, an encoder-decoder, the
``hf`` plugin's models, which are ``transformers`` models already) is refused before anything is read or written,
in one line naming every option that differs and the value each needs (:func:`export_problems`, which ``handle
validate --target hf`` also runs before training).
"""

from __future__ import annotations

import json

from pathlib import Path
from typing import Any

import torch

from torch_handle.checkpoint import hf_dir
from torch_handle.data.datasets import PAD_ID, SPECIAL_TOKENS
from torch_handle.errors import CheckpointError, PresetError, RunDirError
from torch_handle.finetune.lora import merge_lora
from torch_handle.infer.generate import TOKENIZER_FILE, OpenedRun
from torch_handle.model.hf_names import Inexpressible, Problem, to_hf_config, to_hf_state_dict
from torch_handle.rundir import PRESET_FILE

FORMATS = ("hf",)
ROLES: dict[str, str] = dict(zip(("pad_token", "bos_token", "eos_token", "unk_token"), SPECIAL_TOKENS))
"""``tokenizer_config.json``'s role -> the project tokenizer's special token (``data/datasets.py``)."""


HF_PLUGIN = ("only the from-scratch 'transformer' maps; the 'hf' plugin's models are transformers models "
             "already")


def export_problems(preset: Any) -> tuple[str | None, list[Problem]]:
    """Whether a run of ``preset`` (a loaded :class:`~torch_handle.config.schema.Preset`) exports to a Hugging Face
    class, from its ``[model]`` alone (the model is sized on the meta device: no memory): ``(architecture, [])``,
    or ``(architecture, problems)``: every option that class cannot express, keyed as the preset names it
    (``("model.position", "sinusoidal", "= 'rope'", "")``). The class is the one fewest options away
    (:func:`torch_handle.model.hf_names.closest_family`); None, with the one problem ``model.name``, for another
    model plugin. Used by ``handle export`` and ``handle validate --target hf``."""
    from torch_handle.model.hf_names import FAMILIES, closest_family, hf_problems
    from torch_handle.registry import get_registry

    model = preset.model
    if model.name != "transformer":
        return None, [("model.name", model.name, "= 'transformer'", f" ({HF_PLUGIN})")]
    kind = getattr(model.options, "kind", "decoder")
    with torch.device("meta"):  # the model's TransformerArgs, as the plugin builds them; no memory
        args = get_registry().get("model", model.name).factory(model.options, len(SPECIAL_TOKENS), PAD_ID, 8).args
    family = closest_family(args)
    problems: list[Problem] = [("model.kind", kind, "= 'decoder'", "")] if kind != "decoder" else []
    problems += [(f"model.{key}", have, need, note) for key, have, need, note in hf_problems(args, family)]
    return FAMILIES[family], problems


def export_preset_errors(preset: Any) -> list[PresetError]:
    """:func:`export_problems` as preset problems, one per option, keyed as the preset names it (``model.position:
    'sinusoidal': MixtralForCausalLM needs 'rope'``): ``handle validate --target hf``'s check."""
    architecture, problems = export_problems(preset)
    return [PresetError(f"{have!r}: {architecture or 'handle export --format hf'} needs {need.removeprefix('= ')}"
                        f"{note}", key=key) for key, have, need, note in problems]


def check_exportable(run_dir: Path, preset: Any = None) -> str:
    """The Hugging Face architecture a run's model exports as (``LlamaForCausalLM``), from its preset alone
    (``preset``: the run's, already read).

    Raises:
        RunDirError: not a run directory.
        PresetError: its preset no longer loads.
        CheckpointError: a model no Hugging Face causal LM computes: every option that differs and the value each
            needs, in one line (``RUN: cannot export to Hugging Face format: MixtralForCausalLM needs
            model.position = 'rope' (not 'sinusoidal'); model.scale_embeddings = False (not True)``).
    """
    from torch_handle.config.loader import load_preset

    if preset is None and not (run_dir / PRESET_FILE).is_file():
        raise RunDirError(f"{run_dir}: not a run directory (no {PRESET_FILE})")
    architecture, problems = export_problems(preset or load_preset(run_dir / PRESET_FILE))
    where = f"{run_dir}: cannot export to Hugging Face format"
    if architecture is None:
        raise CheckpointError(f"{where}: model.name = {problems[0][1]!r} ({HF_PLUGIN})")
    if problems:
        raise CheckpointError(f"{where}: {Inexpressible(architecture, problems)}")
    return architecture


def chat_files(run_dir: Path, tokenizer: Any) -> dict[str, str]:
    """A run fine-tuned on conversations: its ``chat_template.jinja`` (which transformers' ``apply_chat_template``
    reads from a model directory) and a ``generation_config.json`` whose ``eos_token_id`` lists every end-of-turn id,
    so that ``generate`` stops where ``handle generate --chat`` stops. Empty for other runs."""
    from torch_handle.data.chat.template import TEMPLATE_FILE
    from torch_handle.infer.chat import end_of_turn_ids, run_template

    if not (run_dir / TEMPLATE_FILE).is_file():
        return {}
    template = run_template(run_dir)
    generation = {"eos_token_id": sorted(end_of_turn_ids(tokenizer, template))}
    return {TEMPLATE_FILE: template.source, "generation_config.json": json.dumps(generation, indent=2) + "\n"}


def export_hf(run_dir: Path | str, out: Path | str, *, checkpoint: int | None = None, dtype: str = "float32",
              force: bool = False, merge: bool = False, run: OpenedRun | None = None) -> dict[str, Any]:
    """Write run ``run_dir``'s decoder as a Hugging Face model directory ``out``.

    Args:
        run_dir: a finished decoder run (or, with ``checkpoint``, one with that checkpoint).
        out: a new or empty directory; a Hugging Face model directory with ``force``.
        checkpoint: a step of ``checkpoints/`` (single, ddp, scratch-ddp, fsdp, pipeline runs), None: the final
            ``model.safetensors``.
        dtype: ``float32``, ``bfloat16`` or ``float16``: the weights' dtype in ``out``.
        force: replace ``out`` when it is a Hugging Face model directory already.
        merge: a LoRA run's adapters folded into its base (W + (α/r)·B·A; ``finetune.lora.merge_lora``): the
            adapted model as a plain one (``torch_handle.infer.adapter_export`` decides when).
        run: ``run_dir`` opened already (its preset, tokenizer and weights read once for the whole export).

    Returns:
        ``{"directory", "format", "architecture", "model_type", "params", "dtype", "weights", "step", "files"}``
        (``params``: parameters, a tied embedding counted once).

    Raises:
        RunDirError, PresetError: not a run directory, or its preset no longer loads.
        CheckpointError: a model no Hugging Face class computes, missing or unreadable weights, an ``out`` that
            may not be written. Nothing is written on any of them.
    """
    run_dir, out = Path(run_dir), Path(out)
    if dtype not in hf_dir.DTYPES:
        raise CheckpointError(f"dtype {dtype!r}: expected one of {', '.join(hf_dir.DTYPES)}")
    hf_dir.check_out(out, force)
    run = run or OpenedRun(run_dir, checkpoint)
    check_exportable(run_dir, run.preset)
    loaded = run.load()
    if merge:
        merge_lora(loaded.model)
    args = loaded.model.args
    config = to_hf_config(args)
    state = to_hf_state_dict(loaded.model.state_dict(), args)
    specials = hf_dir.special_tokens(run_dir / TOKENIZER_FILE, ROLES)
    step = run.step
    weights = str(loaded.weights.relative_to(run_dir))
    files = hf_dir.write(out, config, state, run_dir / TOKENIZER_FILE, specials, dtype=dtype, force=force,
                         metadata={"source": str(run_dir.resolve()), "weights": weights, "step": str(step)},
                         extra_files=chat_files(run_dir, loaded.tokenizer))
    return {"directory": str(out), "format": "hf", "architecture": config["architectures"][0],
            "model_type": config["model_type"], "params": loaded.model.num_params(), "dtype": dtype,
            "weights": weights, "step": step, "files": files}
