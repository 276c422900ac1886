"""A built model's first weights and its adapters: ``model.init_from`` and ``[finetune]``, in the one order every
reader of a run uses (the trainer on every rank, ``handle generate`` / ``export`` through ``load_run``).

A full fine-tune reads ``init_from`` once, into a new run; a resumed run starts from its checkpoint. A LoRA run
reads it every time (checkpoints hold the adapters alone: the frozen base comes from ``init_from`` again, checked
against the hash the adapters were trained on), then wraps the targeted linears (:func:`apply_lora`). A QLoRA run
then stores its frozen base linears in NF4 (:func:`quantize_base`), rebuilt the same way on every load. A base
whose vocabulary a chat template grew (:mod:`torch_handle.finetune.vocab`) gets its new rows when it loads, and a
LoRA run on it trains the embedding and output projection whole beside the adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torch_handle.finetune.lora import apply_lora
from torch_handle.finetune.nf4 import quantize_linears
from torch_handle.finetune.vocab import TRAINED_MODULES, grown_vocab

QLORA_SKIP = ("lm_head", "*.lora_A.*", "*.lora_B.*")
"""Linears QLoRA leaves in the compute precision: the output projection (transformers' bitsandbytes integration
keeps it so; a tied one is the embedding table anyway) and the adapters themselves."""


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
    if finetune.method in ("lora", "qlora"):
        quantize = quantize_base if finetune.method == "qlora" else None
        grown = grown_vocab(init_from, model.args.vocab_size) if hasattr(model, "args") else False
        info = apply_lora(model, finetune.rank, finetune.alpha, finetune.dropout, finetune.target_modules,
                          quantize=quantize, modules_to_save=TRAINED_MODULES if grown else ())
        share = info["trainable"] / (info["trainable"] + info["frozen"])
        name, stored = ("QLoRA", " (linears in NF4)") if quantize else ("LoRA", "")
        saved = f" and {' and '.join(TRAINED_MODULES)} whole (the vocabulary grew)" if grown else ""
        notes.append(f"{name} rank {finetune.rank} on {info['adapted']} linears{saved}: {info['trainable']:,} "
                     f"trainable parameters ({share:.2%}), {info['frozen']:,} frozen{stored} (base sha256 "
                     f"{info['base_sha256'][:12]})")
        note(notes[-1])
    return notes


def nf4_digest(model: nn.Module, local_shard: Callable[[torch.Tensor], torch.Tensor]) -> tuple[str, int] | None:
    """(SHA-256 hex, bytes) of this rank's part of ``model``'s NF4 base: every ``weight_nf4``, as ``local_shard``
    (the strategy's :meth:`~torch_handle.train.strategy.Strategy.local_shard`) gives this rank's bytes of it, in
    registration order; None without NF4 linears. Taken before the first step and after the last, it proves the
    frozen base bitwise unchanged by training (the trainer records both in run.json, ``nf4_sha256``, and the bytes,
    ``nf4_bytes``)."""
    import hashlib

    from torch_handle.finetune.nf4 import nf4_storage

    storage = nf4_storage(model)
    if not storage:
        return None
    digest, nbytes = hashlib.sha256(), 0
    for t in storage:
        local = local_shard(t).detach().cpu().contiguous()
        digest.update(local.numpy().tobytes())
        nbytes += local.numel() * local.element_size()
    return digest.hexdigest(), nbytes


def quantize_base(model: nn.Module) -> list[str]:
    """QLoRA's frozen base (Dettmers et al. 2023, §3): every linear of the blocks, adapted or not, becomes an
    ``NF4Linear`` (4.127 bits a weight, double-quantised), as the paper quantises every linear layer of the base;
    the embeddings, the norms, the output projection (:data:`QLORA_SKIP`) and the adapters stay in the compute
    precision. Returns the names quantised.

    On one CPU thread, whatever the run's thread count: the double quantisation's mean is a float32 reduction whose
    last bit depends on the thread count (docs/qlora.md), and a resume or ``handle export`` rebuilds these bytes
    from the hash-checked base rather than reading them from a checkpoint. Same bytes for the same base, torch
    build and CPU (the model is still on the CPU here: the trainer moves it to its device afterwards).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return quantize_linears(model, skip=QLORA_SKIP)
    finally:
        torch.set_num_threads(threads)
