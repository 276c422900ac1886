"""A built model's first weights and its adapters: ``model.init_from`` and ``[finetune]``, in the one order every
reader of a run uses (the trainer on every rank, ``handle generate`` / ``export`` through ``load_run``).

A full fine-tune reads ``init_from`` once, into a new run; a resumed run starts from its checkpoint. A LoRA run
reads it every time (checkpoints hold the adapters alone: the frozen base comes from ``init_from`` again, checked
against the hash the adapters were trained on), then wraps the targeted linears (:func:`apply_lora`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from torch_handle.finetune.lora import apply_lora


def prepare_model(model: nn.Module, preset: Any, *, new_run: bool, load_base: Callable[[nn.Module, str], str],
                  note: Callable[[str], None] = lambda line: None) -> list[str]:
    """Load ``preset.model``'s ``init_from`` into ``model`` where the run needs it, then apply
    ``preset.finetune``. ``load_base(model, directory) -> line`` reads a Hugging Face directory
    (:func:`torch_handle.checkpoint.hf_dir.load_into`). Each line for the run's log goes to ``note`` as it comes;
    returns them all.

    Raises:
        CheckpointError: ``init_from`` that does not fit the model (from ``load_base``).
        ValueError: ``finetune.target_modules`` that match no linear of the model.
    """
    notes = []
    finetune = preset.finetune
    init_from = getattr(preset.model.options, "init_from", None)
    if init_from and (new_run or finetune.method != "none"):
        notes.append(f"init_from: {load_base(model, init_from)}")
        note(notes[-1])
    if finetune.method == "lora":
        info = apply_lora(model, finetune.rank, finetune.alpha, finetune.dropout, finetune.target_modules)
        share = info["trainable"] / (info["trainable"] + info["frozen"])
        notes.append(f"LoRA rank {finetune.rank} on {info['adapted']} linears: {info['trainable']:,} trainable "
                     f"parameters ({share:.2%}), {info['frozen']:,} frozen (base sha256 {info['base_sha256'][:12]})")
        note(notes[-1])
    return notes
