"""``handle export`` of a LoRA run (``[finetune] method = "lora"``): its adapters in peft's format, or with
``--merge`` the adapted model as a plain Hugging Face model.

The run's ``model.safetensors`` (or a checkpoint's model state) holds the adapters alone, gathered by rank 0
from whatever layout trained them (DDP, FSDP2, ZeRO-2/3: the strategies' ``full_state_dict``); the base comes from
``model.init_from``, checked against the hash the adapters carry (:func:`torch_handle.infer.generate.load_run`).
So a merge is *gather, then merge*: adapters gathered at the end of the run, folded into the base here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch_handle.errors import CheckpointError
from torch_handle.finetune import peft_format
from torch_handle.infer.generate import TOKENIZER_FILE, OpenedRun
from torch_handle.infer.hf_export import ROLES, chat_files, check_exportable, export_hf


def finetune_method(run: OpenedRun | Path | str) -> str:
    """The run's ``finetune.method`` (``"none"`` for a run from before the table); ``run``: opened already, or its
    directory. Raises as :func:`check_exportable`."""
    run = run if isinstance(run, OpenedRun) else OpenedRun(run)
    check_exportable(run.run_dir, run.preset)
    return run.preset.finetune.method


def export_adapters(run_dir: Path | str, out: Path | str, *, checkpoint: int | None = None,
                    force: bool = False, run: OpenedRun | None = None) -> dict[str, Any]:
    """Write a LoRA run's adapters to ``out`` as peft's ``save_pretrained`` does (``adapter_config.json``,
    ``adapter_model.safetensors``; :mod:`torch_handle.finetune.peft_format`) with the run's tokenizer beside them
    (``tokenizer.json``, ``tokenizer_config.json``: ``AutoTokenizer.from_pretrained(out)`` loads it) and, for a
    run fine-tuned on conversations, its ``chat_template.jinja`` (``apply_chat_template`` renders what it trained
    on) and a ``generation_config.json`` listing its end-of-turn ids, as the Hugging Face export writes them
    (:func:`~torch_handle.infer.hf_export.chat_files`);
    ``base_model_name_or_path`` is the run's ``model.init_from`` relative to ``out`` (``../llama``), so the two
    directories move together. ``run``: ``run_dir`` opened already (:class:`~torch_handle.infer.generate.OpenedRun`).

    Returns:
        ``{"directory", "format": "peft", "base", "base_dir", "r", "lora_alpha", "target_modules", "params",
        "step", "files"}`` (``base``: as stored, relative to ``out``; ``base_dir``: the same directory from here;
        ``params``: the adapters' parameters).

    Raises:
        RunDirError, PresetError, CheckpointError: as :func:`torch_handle.infer.hf_export.export_hf`; a changed
            base (its hash differs from the adapters'). Nothing is written on any of them.
    """
    from torch_handle.checkpoint import hf_dir

    run_dir, out = Path(run_dir), Path(out)
    loaded = (run or OpenedRun(run_dir, checkpoint)).load()
    init_from = getattr(loaded.preset.model.options, "init_from", None)
    base = os.path.relpath(Path(init_from).resolve(), out.resolve()) if init_from else None
    state = peft_format.peft_state_dict(loaded.model, loaded.model.args)
    config = peft_format.adapter_config(loaded.model, loaded.model.args, dropout=loaded.preset.finetune.dropout,
                                        base=base)
    tokenizer = run_dir / TOKENIZER_FILE
    specials = hf_dir.special_tokens(tokenizer, ROLES)
    chat = chat_files(run_dir, loaded.tokenizer)

    def beside(tmp: Path) -> list[str]:  # what AutoTokenizer and GenerationConfig read from the adapter directory
        for name, text in chat.items():
            (tmp / name).write_text(text, encoding="utf-8")
        return [*hf_dir.write_tokenizer(tmp, tokenizer, specials, loaded.model.args.max_len), *chat]

    files = peft_format.write_adapter(
        out, state, config, force=force, metadata={"source": str(run_dir.resolve()), "weights": loaded.weights.name},
        extra=beside)
    return {"directory": str(out), "format": "peft", "base": base,
            "base_dir": os.path.normpath(out / base) if base else None, "r": config["r"],
            "lora_alpha": config["lora_alpha"], "target_modules": config["target_modules"],
            "params": sum(t.numel() for t in state.values()), "step": checkpoint, "files": files}


def export_run(run_dir: Path | str, out: Path | str, *, checkpoint: int | None = None, dtype: str = "float32",
               force: bool = False, merge: bool = False) -> dict[str, Any]:
    """``handle export``: a LoRA run's adapters (peft's format), or with ``merge`` its merged model; any other run
    as a Hugging Face model (:func:`export_hf`).

    Raises:
        CheckpointError: ``merge`` for a run without adapters; as :func:`export_hf` and :func:`export_adapters`.
    """
    run_dir = Path(run_dir)
    run = OpenedRun(run_dir, checkpoint)  # preset, tokenizer and weights read once for the whole export
    method = finetune_method(run)
    if merge and method == "none":
        raise CheckpointError(f"{run_dir}: --merge folds LoRA adapters into their base, and this run has none "
                              f"(finetune.method = 'none'): export it without --merge")
    if method != "none" and not merge:
        return export_adapters(run_dir, out, checkpoint=checkpoint, force=force, run=run)
    return export_hf(run_dir, out, checkpoint=checkpoint, dtype=dtype, force=force, merge=merge, run=run)
