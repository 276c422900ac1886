"""The model ``handle estimate`` sizes: a preset's model built on the meta device or on fake tensors (no memory),
and, with ``[parallel] tp > 1``, split the way a tensor-parallel run splits it.

The split is the model's own plan (:func:`torch_handle.model.parallelize.tensor_parallel_plan`) carried out by the
hand-written layers (``parallelize_tensor(..., "scratch", ...)``) with a :class:`~torch_handle.plan.shape_tp_group.
ShapeTPGroup` in place of a process group. So what one rank holds -- column-parallel weights and biases and the
vocabulary-split embedding and LM head at 1/tp, row-parallel weights at 1/tp with their biases whole, LayerNorms
whole -- comes from the code that splits real runs, not from a formula beside it. DTensor's ``native`` split keeps
the same local shapes (``torch.chunk`` on the same dimensions); where the vocabulary is not divisible by tp (only
``native`` allows it), rank 0's ceil(V/tp) rows are estimated: the vocabulary is rounded up to a multiple of tp.

torch is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from torch_handle.config.schema import Preset
    from torch_handle.parallel.tensor.mappings import TPGroup
    from torch_handle.registry import PluginRegistry

__all__ = ["ModelBuild", "ModelShape", "build_model", "model_build", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """The trainable parameters of a model, each tensor once (tied weights once), in registration order, and what
    a fine-tuning run holds frozen beside them (its base: parameters, QLoRA's NF4 storage among them)."""

    numels: tuple[int, ...]
    """Elements of each parameter tensor."""
    dim0: tuple[int, ...]
    """Size of each tensor's first dimension (FSDP2 shards on it); 1 for a scalar."""
    experts: tuple[bool, ...] = field(default=(), compare=False)
    """Per tensor: whether it holds routed experts (stacked on dim 0, split by ``[parallel] ep``:
    :mod:`torch_handle.plan.estimate_moe`); empty for a model without experts."""
    frozen_numels: tuple[int, ...] = ()
    """Elements of each frozen parameter tensor (``requires_grad`` False: a LoRA run's base), registration order."""
    frozen_dim0: tuple[int, ...] = ()
    stored_bytes: int = 0
    """Bytes of the quantised base (QLoRA's NF4 weights, frozen uint8 parameters priced apart from
    ``frozen_numels``: :func:`~torch_handle.plan.model_states.nf4_rank_bytes`)."""
    nf4_stored: tuple[int, ...] = ()
    """Bytes of each NF4 linear's ``weight_nf4`` (QLoRA; uint8, (bytes,): its dim 0), registration order."""

    @property
    def frozen(self) -> ModelShape:
        """The frozen parameters as a shape of their own (what the strategies' sharding formulas take)."""
        return ModelShape(self.frozen_numels, self.frozen_dim0)

    @property
    def n_params(self) -> int:
        return sum(self.numels)

    @property
    def n_tensors(self) -> int:
        return len(self.numels)

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        from torch_handle.model.moe import GroupedExperts

        from torch_handle.finetune.nf4 import nf4_storage

        nf4 = nf4_storage(model)
        params = [p for p in model.parameters() if p.requires_grad]
        frozen = [p for p in model.parameters() if not p.requires_grad and all(p is not t for t in nf4)]
        routed = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
        return cls(tuple(p.numel() for p in params), _dim0(params),
                   experts=tuple(id(p) in routed for p in params) if routed else (),
                   frozen_numels=tuple(p.numel() for p in frozen), frozen_dim0=_dim0(frozen),
                   stored_bytes=sum(t.numel() for t in nf4), nf4_stored=tuple(t.numel() for t in nf4))


def _dim0(params: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(p.shape[0] if p.dim() else 1 for p in params)


@dataclass(frozen=True)
class ModelBuild:
    """How to build a preset's model: its plugin's factory and options, and the layout of one rank."""

    factory: Callable[..., Any]
    options: Any
    vocab_size: int
    pad_id: int
    max_len: int
    kind: str
    """``"lm"`` or ``"translation"``: the model's forward arguments."""
    tp: int = 1
    """Tensor-parallel degree ``[parallel] tp``: the model is split over this many ranks."""
    sequence_parallel: bool = False
    finetune: tuple[str, int, float, float, tuple[str, ...]] | None = None
    """``[finetune]``'s (method, rank, alpha, dropout, target_modules) when it is LoRA or QLoRA: the adapters and
    the frozen (and, under QLoRA, NF4-stored) base are built as the run builds them (:func:`build_model`)."""
    document_mask: bool = False
    """``[data] document_mask``: a language-model batch carries ``position_ids`` of packed documents, and the model
    builds and keeps its block-causal (B, 1, T, T) mask (:func:`lm_inputs`)."""


def model_build(preset: Preset, registry: PluginRegistry) -> ModelBuild:
    """The preset's model: ``[model]`` with the vocabulary ``[data] vocab_size`` (the tokenizer's actual vocabulary
    can only be smaller) and ``[parallel]``'s tp and sequence parallelism.

    Raises:
        PresetError: a dataset without ``vocab_size``/``seq_len`` options.
    """
    from torch_handle.data.datasets import PAD_ID
    from torch_handle.errors import PresetError

    data = preset.data.options
    vocab, seq_len = getattr(data, "vocab_size", None), getattr(data, "seq_len", None)
    if not isinstance(vocab, int) and isinstance(seq_len, int):
        vocab = prepared_vocab_size(preset)[0]
    if not isinstance(vocab, int) or not isinstance(seq_len, int):
        raise PresetError(f"dataset {preset.data.name!r} has no vocab_size/seq_len options, and no prepared "
                          f"directory or model.init_from says the vocabulary: cannot size the model",
                          file=preset.source, key="data")
    task = getattr(data, "task", "lm")
    factory = registry.get("model", preset.model.name).factory
    ft = preset.finetune
    finetune = None if ft.method == "none" else (ft.method, ft.rank, ft.alpha, ft.dropout, tuple(ft.target_modules))
    return ModelBuild(factory, preset.model.options, vocab, PAD_ID, seq_len + 1 if task == "translation" else seq_len,
                      task, preset.parallel.tp, preset.parallel.sequence_parallel, finetune,
                      bool(getattr(data, "document_mask", False)) or ft.objective == "sft")


def rows_per_sample(preset: Preset) -> int:
    """Rows each sample puts through the model: 2 for ``finetune.objective = "dpo"`` (a pair's chosen and rejected
    completions, each of ``seq_len`` positions, in one forward of 2 x ``micro_batch_size`` rows), else 1. The
    reference's forward (``reference = "adapters_off"`` or ``"copy"``) runs before the policy's under ``no_grad``:
    it saves nothing, and its buffers are freed before the policy saves anything; ``"precomputed"`` and ``"none"``
    run none."""
    return 2 if preset.finetune.objective == "dpo" else 1


def prepared_vocab_size(preset: Preset) -> tuple[int | None, str]:
    """``(vocabulary, where it was read)`` of a preset whose dataset has no ``vocab_size`` option (prepared token
    shards: the run's model takes the tokenizer's vocabulary): the ``tokenizer.vocab_size`` of the first prepared
    directory's ``meta.json`` (``data.path``, or the first of ``data.sources``), else ``model.init_from``'s
    ``config.json`` ``vocab_size`` (a fine-tuning preset whose data is not prepared yet: it is prepared with the
    base's tokenizer). ``(None, "")`` when neither says it."""
    import json

    from torch_handle.data.shards import prepared_parts

    data = preset.data.options
    path = getattr(data, "path", "") or next((s.get("path") for s in getattr(data, "sources", None) or []
                                              if isinstance(s, dict)), "")
    if path:
        try:
            directory, meta = prepared_parts(Path(path))[0]
            return int(meta["tokenizer"]["vocab_size"]), f"{directory}/meta.json"
        except Exception:  # noqa: BLE001 - not prepared (yet), unreadable: the next source says it
            pass
    init_from = getattr(preset.model.options, "init_from", None)
    if init_from:
        try:
            config = json.loads((Path(init_from) / "config.json").read_text(encoding="utf-8"))
            return int(config["vocab_size"]), f"{init_from}/config.json"
        except Exception:  # noqa: BLE001 - no such export (yet), not a Hugging Face config
            pass
    return None, ""


def lm_inputs(build: ModelBuild, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The keyword arguments of a language model's forward for token ids (B, T): ``input_ids``, and with
    ``build.document_mask`` ``position_ids`` (B, T) too. Under fake tensors their values cannot be read, so the model
    builds the block-causal mask as for a batch that crosses document boundaries
    (:func:`torch_handle.model.transformer.document_mask_of`): the estimate prices the mask."""
    import torch

    if not build.document_mask:
        return {"input_ids": ids}
    return {"input_ids": ids, "position_ids": torch.arange(ids.shape[1]).expand(ids.shape[0], -1)}


def build_model(build: ModelBuild, tp_group: TPGroup | None = None) -> torch.nn.Module:
    """The model on the current device and tensor mode (call it under ``torch.device("meta")`` or
    ``FakeTensorMode``), split over ``build.tp`` ranks when tp > 1 as TP rank ``tp_group.rank`` holds it (default:
    rank 0 of a :class:`ShapeTPGroup`, whose collectives only compute shapes).

    With ``build.finetune``, the full model is adapted first, as the run's ``prepare_model`` does it: LoRA's
    adapters on the targeted linears, everything else frozen (but the embedding and output projection of a base
    whose vocabulary a chat template grew: :mod:`torch_handle.finetune.vocab`), and under QLoRA every block
    linear of the base in NF4 (the linears :func:`torch_handle.finetune.build.quantize_base` replaces, each with a ``weight_nf4`` of the stored size,
    4 bits a weight plus the double-quantised constants, and no values: nothing is quantised).

    Raises:
        ValueError: one line, for a model that has no tensor-parallel plan.
    """
    if build.tp == 1:
        return _finetuned(build.factory(build.options, build.vocab_size, build.pad_id, build.max_len), build)
    from torch_handle.model.parallelize import parallelize_tensor
    from torch_handle.plan.shape_tp_group import ShapeTPGroup

    vocab = math.ceil(build.vocab_size / build.tp) * build.tp
    model = _finetuned(build.factory(build.options, vocab, build.pad_id, build.max_len), build)
    group = tp_group if tp_group is not None else ShapeTPGroup(build.tp)
    return parallelize_tensor(model, "scratch", group, sequence_parallel=build.sequence_parallel)


def _finetuned(model: torch.nn.Module, build: ModelBuild) -> torch.nn.Module:
    if build.finetune is None:
        return model
    from torch_handle.finetune.build import QLORA_SKIP
    from torch_handle.finetune.lora import wrap_lora
    from torch_handle.finetune.nf4 import quantize_linears
    from torch_handle.finetune.vocab import TRAINED_MODULES, grown_vocab

    method, rank, alpha, dropout, targets = build.finetune
    wrap_lora(model, rank, alpha, dropout, targets)
    if grown_vocab(getattr(build.options, "init_from", None), build.vocab_size):  # a chat template's tokens added
        for name in TRAINED_MODULES:  # trained whole beside the adapters, as prepare_model keeps them
            model.get_submodule(name).requires_grad_(True)
    if method == "qlora":  # the linears quantize_base replaces, weight_nf4 of the stored size
        quantize_linears(model, skip=QLORA_SKIP, shapes_only=True)
    return model


def model_shape(preset: Preset, registry: PluginRegistry, tp: int | None = None) -> ModelShape:
    """The parameter list of the preset's model built on the meta device (no memory, no initialisation cost): of
    one TP rank's shard when ``tp`` (default: ``[parallel] tp``) is above 1.

    Raises:
        PresetError: a dataset without ``vocab_size``/``seq_len`` options.
        ValueError: tp > 1 for a model that has no tensor-parallel plan.
    """
    import dataclasses

    import torch

    build = model_build(preset, registry)
    if tp is not None:
        build = dataclasses.replace(build, tp=tp)
    with torch.device("meta"):
        return ModelShape.of(build_model(build))
