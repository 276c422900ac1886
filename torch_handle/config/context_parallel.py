"""``parallel.cp``: the layouts context parallelism runs, what ``cp_impl = "auto"`` picks, and every problem of a
preset with cp > 1 (one line each, before anything starts; :data:`torch_handle.config.layout.LAYOUT_CHECKS` runs
:func:`context_parallel_problems`).

Context parallelism splits each sequence over cp ranks (docs/context-parallel.md). In this version it composes
with data parallelism -- DDP, FSDP2, DeepSpeed ZeRO or the hand-written scratch-ddp and scratch-fsdp, which reduce
(and shard) over dp × cp, torchtitan's ``dp_shard_cp`` -- tensor parallelism (either ``tp_impl``, with or without
sequence parallelism; DTensor's under FSDP2, its loss under ``loss_parallel``) and pipelines (both
``pp_impl``: each stage on its T/cp tokens), under the ``lm``, ``sft`` and ``dpo`` objectives (full training or
LoRA), for the from-scratch decoder. What it refuses, and
why:

* ``seq_len`` not divisible by 2 × cp × tp: head-tail balancing cuts every sequence into 2 × cp chunks;
* ``ulysses`` with heads (or key/value heads) not divisible by cp × tp: each rank takes whole heads;
* cp × tp × pp not dividing the world size (the rest is dp);
* ``native`` (torch's FlexAttention context parallel, :mod:`torch_handle.parallel.context.native`) without CUDA:
  FlexAttention has no CPU backward in torch 2.13, and SDPA's context parallel is CUDA-only (pytorch#147793); the
  hand-written ``ring``, ``allgather``, ``ulysses`` run everywhere. On a CUDA machine ``native`` is accepted, but
  ``auto`` keeps to the hand-written ones: native has not been measured on a GPU here;
* torch's zero-bubble schedules
  (their split backward gives wrong gradients through the cp attentions: ZBV's norm 7% off at step 1);
* ep > 1, an encoder-decoder, another model plugin, dpo's ``reference = "copy"`` (the copy's attention is not split),
  another strategy, ``training.compile`` and attention dropout: not supported with cp yet (each named in its line).

Standard library only (``torch.cuda`` is asked only when ``native`` is named).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch_handle.common.run_layout import chosen_cp_impl
from torch_handle.config.loss_impl import SPLIT_BACKWARD_SCHEDULES
from torch_handle.errors import PresetError

__all__ = ["IMPLS", "STRATEGIES", "chosen_cp_impl", "context_parallel_problems"]

IMPLS = ("ring", "allgather", "ulysses")
"""The hand-written context-parallel attentions (``torch_handle/parallel/context/``): what ``auto`` and ``handle
plan`` choose among. ``native`` (torch's, CUDA only) runs when named."""

STRATEGIES = ("ddp", "fsdp", "deepspeed", "scratch-ddp", "scratch-fsdp")
"""The data-parallel strategies that run with cp > 1: their gradients are reduced (and FSDP2's, ZeRO's and
scratch-fsdp's parameters, gradients or optimizer states sharded) over the dp × cp ranks (the default process group,
or the mesh's "dp" of a (pp, tp) coordinate), averaged over that many, and their clipping measures the whole model's
norm. Which of them a split (tp, pp) takes is the strategy plugin's own check (scratch-ddp: pp; scratch-fsdp:
neither)."""


def _native_problem() -> str | None:
    """Why ``native`` cannot train here (one line), or None on a CUDA machine."""
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        cuda = False
    if cuda:
        return None
    return ("\"native\" needs CUDA, and this machine has none: FlexAttention has no CPU backward in torch 2.13 and "
            "SDPA's context parallel is CUDA-only (valid: ring, allgather, ulysses, or auto)")


def context_parallel_problems(preset: Any, registry: Any = None) -> Iterator[PresetError]:
    """Every problem of ``preset``'s layout with ``parallel.cp > 1`` (none with cp = 1), one per line, each naming
    its key and what is valid (the module's list)."""
    par, model, data = preset.parallel, preset.model.options, preset.data.options
    cp = par.cp
    if cp == 1:
        return
    world, split = preset.world_size, cp * par.tp * par.pp
    if world % split:
        valid = ", ".join(str(d) for d in range(1, world + 1) if world % (d * par.tp * par.pp) == 0)
        yield PresetError(f"cp x tp x pp = {cp} x {par.tp} x {par.pp} does not divide the world size {world} "
                          f"(launch.nproc_per_node x launch.nnodes); dp is the rest (valid cp: {valid})",
                          key="parallel.cp")
    seq_len = getattr(data, "seq_len", None)
    if isinstance(seq_len, int) and seq_len % (2 * cp * par.tp):
        yield PresetError(f"{seq_len} is not divisible by 2 x cp x tp = {2 * cp * par.tp} (head-tail "
                          f"balancing cuts each sequence into 2 x cp chunks; e.g. {seq_len - seq_len % (2 * cp * par.tp)})",
                          key="data.seq_len")
    impl = chosen_cp_impl(par.cp_impl, bool(getattr(data, "document_mask", False)))
    heads = getattr(model, "n_heads", None)
    kv_heads = getattr(model, "n_kv_heads", None) or heads
    if impl == "ulysses" and isinstance(heads, int) and (heads % (cp * par.tp) or kv_heads % (cp * par.tp)):
        yield PresetError(f"\"ulysses\" gives each of the cp x tp = {cp * par.tp} ranks whole heads: "
                          f"model.n_heads = {heads} and n_kv_heads = {kv_heads} must both divide by it (valid: ring, "
                          f"allgather)", key="parallel.cp_impl")
    native = _native_problem() if impl == "native" else None
    if native:
        yield PresetError(native, key="parallel.cp_impl")
    if par.ep > 1:
        yield PresetError("parallel.cp > 1 with expert parallelism is not built: EP groups are drawn from the "
                          "data-parallel ranks alone (torchtitan also lends them the cp ranks), and an MoE layer "
                          "routes the tokens it holds, which cp cuts per rank (valid with cp > 1: parallel.ep = 1)",
                          key="parallel.ep")
    if par.pp > 1 and par.pp_schedule in SPLIT_BACKWARD_SCHEDULES:
        yield PresetError(f"{par.pp_schedule!r} with parallel.cp > 1: a zero-bubble schedule splits each stage's "
                          f"backward into an input and a weight pass, which the cp attentions' backward (a collective "
                          f"over the cp ranks) does not survive (valid: gpipe, 1f1b, interleaved-1f1b, looped-bfs)",
                          key="parallel.pp_schedule")
    if preset.model.name != "transformer" or getattr(model, "kind", "decoder") != "decoder":
        yield PresetError("parallel.cp > 1 splits the from-scratch decoder's attention (model.name = 'transformer', "
                          "kind = 'decoder'); an encoder-decoder or another model plugin is not split by cp yet",
                          key="model.kind" if preset.model.name == "transformer" else "model.name")
    if preset.finetune.objective == "dpo" and preset.finetune.preference.reference == "copy":
        yield PresetError("'copy' with parallel.cp > 1: the frozen copy's attention is not split over the cp ranks "
                          "(valid: 'adapters_off', 'precomputed', 'none', 'auto')",
                          key="finetune.preference.reference")
    if preset.strategy.name not in STRATEGIES:
        yield PresetError(f"{preset.strategy.name!r} with parallel.cp > 1 is not supported yet (valid: "
                          f"{', '.join(STRATEGIES)})", key="strategy.name")
    if preset.training.compile:
        yield PresetError("true with parallel.cp > 1 is not supported yet (valid: false)",
                          key="training.compile")
    dropout = getattr(model, "dropout", 0.0)
    if isinstance(dropout, float) and dropout > 0:
        yield PresetError(f"{dropout}: the context-parallel attentions apply no attention dropout "
                          f"(valid with parallel.cp > 1: 0)", key="model.dropout")
