"""``handle export RUN --format hf OUT/``: a decoder run as a Hugging Face model directory that
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)`` load.

The weights are the run's final ``model.safetensors`` (which rank 0 gathered from whatever layout the run had:
DDP, ZeRO, FSDP2, tensor or pipeline parallel) or, with ``checkpoint=STEP``, a checkpoint's (as
:func:`torch_handle.infer.generate.load_run` reads them); names and config keys are
:mod:`torch_handle.model.hf_names`'s, files :mod:`torch_handle.checkpoint.hf_dir`'s. A run whose model no Hugging
Face class computes (post-LN, sinusoidal positions, LayerNorm, GELU, scaled embeddings, an encoder-decoder, the
``hf`` plugin's models, which are ``transformers`` models already) is refused before anything is read or written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torch_handle.checkpoint import hf_dir
from torch_handle.data.datasets import PAD_ID, SPECIAL_TOKENS
from torch_handle.errors import CheckpointError, RunDirError
from torch_handle.finetune.lora import merge_lora
from torch_handle.infer.generate import TOKENIZER_FILE, load_run
from torch_handle.model.hf_names import to_hf_config, to_hf_state_dict
from torch_handle.rundir import PRESET_FILE

FORMATS = ("hf",)
ROLES: dict[str, str] = dict(zip(("pad_token", "bos_token", "eos_token", "unk_token"), SPECIAL_TOKENS))
"""``tokenizer_config.json``'s role -> the project tokenizer's special token (``data/datasets.py``)."""


def check_exportable(run_dir: Path) -> str:
    """The Hugging Face architecture a run's model exports as (``LlamaForCausalLM``), from its preset alone.

    Raises:
        RunDirError: not a run directory.
        PresetError: its preset no longer loads.
        CheckpointError: a model no Hugging Face causal LM computes: the first option that differs and the value
            it needs (``model.norm = 'layernorm': LlamaForCausalLM needs norm = 'rmsnorm'``).
    """
    from torch_handle.config.loader import load_preset
    from torch_handle.registry import get_registry

    if not (run_dir / PRESET_FILE).is_file():
        raise RunDirError(f"{run_dir}: not a run directory (no {PRESET_FILE})")
    preset = load_preset(run_dir / PRESET_FILE)
    model = preset.model
    where = f"{run_dir}: cannot export to Hugging Face format"
    if model.name != "transformer":
        raise CheckpointError(f"{where}: model.name = {model.name!r} (only the from-scratch 'transformer' maps; the "
                              f"'hf' plugin's models are transformers models already)")
    if getattr(model.options, "kind", "decoder") != "decoder":
        raise CheckpointError(f"{where}: model.kind = {model.options.kind!r}: LlamaForCausalLM needs kind = "
                              f"'decoder'")
    with torch.device("meta"):  # the model's TransformerArgs, as the plugin builds them; no memory
        args = get_registry().get("model", model.name).factory(model.options, len(SPECIAL_TOKENS), PAD_ID, 8).args
    try:
        return to_hf_config(args)["architectures"][0]
    except CheckpointError as e:
        raise CheckpointError(f"{where}: model.{e}") from None


def _step(weights: Path, checkpoint: int | None) -> int | None:
    if checkpoint is not None:
        return checkpoint
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        step = (f.metadata() or {}).get("step")
    return int(step) if step and step.isdigit() else None


def export_hf(run_dir: Path | str, out: Path | str, *, checkpoint: int | None = None, dtype: str = "float32",
              force: bool = False, merge: bool = False) -> dict[str, Any]:
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
    check_exportable(run_dir)
    loaded = load_run(run_dir, checkpoint)
    if merge:
        merge_lora(loaded.model)
    args = loaded.model.args
    config = to_hf_config(args)
    state = to_hf_state_dict(loaded.model.state_dict(), args)
    specials = hf_dir.special_tokens(run_dir / TOKENIZER_FILE, ROLES)
    step = _step(loaded.weights, checkpoint)
    weights = str(loaded.weights.relative_to(run_dir))
    files = hf_dir.write(out, config, state, run_dir / TOKENIZER_FILE, specials, dtype=dtype, force=force,
                         metadata={"source": str(run_dir.resolve()), "weights": weights, "step": str(step)})
    return {"directory": str(out), "format": "hf", "architecture": config["architectures"][0],
            "model_type": config["model_type"], "params": loaded.model.num_params(), "dtype": dtype,
            "weights": weights, "step": step, "files": files}
