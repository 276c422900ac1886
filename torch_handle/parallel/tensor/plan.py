"""A tensor-parallel plan, and the two ways of carrying it out: by hand (the modules of
:mod:`torch_handle.parallel.tensor.layers`) and natively (DTensor's ``parallelize_module``, as torchtitan does).

A plan maps module names to a :class:`Style`; the model owns its plan (:func:`torch_handle.model.parallelize.
tensor_parallel_plan`), this module knows nothing of any model. Both implementations build the same layout, so
either can be checked against the other and both against the one-process model:

=================  ====================================  ===============================================
style              by hand                               native (torch.distributed.tensor.parallel)
=================  ====================================  ===============================================
``COLWISE``        ColumnParallelLinear                  ColwiseParallel
``Stacked(parts)`` ColumnParallelLinear(parts=parts)      equal parts: ColwiseParallel, weight as
                                                         _StridedShard(0, n); unequal: the hand-written layer
``ROWWISE``        RowParallelLinear                     RowwiseParallel
``VOCAB_EMBED``    VocabParallelEmbedding                RowwiseParallel(input_layouts=Replicate())
``VOCAB_HEAD``     ColumnParallelLinear, local logits    ColwiseParallel(output Shard(-1)) + loss_parallel
``NORM``           (SP) grads all-reduced over TP        (SP) SequenceParallel
``TO_SEQUENCE``    (SP) output split along the sequence  (SP) PrepareModuleOutput(Replicate -> Shard(1))
``DROPOUT``        (SP) SequenceParallelDropout          (SP) SequenceParallelDropout
``HEAD_NORM``      grads all-reduced over TP             grads all-reduced over TP
``SLICE_DROPOUT``  SequenceParallelDropout(dim=-1)       SequenceParallelDropout(dim=-1)
=================  ====================================  ===============================================

``Stacked`` is a fused projection, several column-parallel outputs in one weight (the attention's [W_q; W_k; W_v]):
each part is split on its own, so every rank keeps whole heads of each. With grouped-query attention the parts
differ in size (H·d_k rows of Q, H_kv·d_k of K and of V), and no DTensor placement describes "slice r of each of
three unequal blocks" (``_StridedShard`` needs equal blocks), so the native path uses the hand-written
``ColumnParallelLinear`` for that one module: its parameters are plain tensors holding this rank's slice, as the
hand-written path's are, and checkpoints and the gradient norm find them split by the plan (:func:`split_rule`).
``HEAD_NORM`` is a norm applied to each head (Qwen 3's q/k norm): replicated, it sees only this rank's heads, so its
gradient is a partial sum over the TP group with or without sequence parallelism (:func:`partial_grad`).

``NORM`` and ``TO_SEQUENCE`` act only under sequence parallelism: a module marked ``TO_SEQUENCE`` (the positional
encoding: the last step on the whole sequence) hands its output over as this rank's 1/tp of the sequence, and the
norms then run on that shard, and so do the dropouts marked ``DROPOUT`` (drawing the one-process mask and keeping
this rank's slice: :mod:`torch_handle.parallel.tensor.random`). ``SLICE_DROPOUT`` is a dropout on this rank's slice
of the features (the input of a row-parallel linear, as LoRA's adapter sees it): in every layout it draws the
one-process mask and keeps this rank's features.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.distributed.tensor.placement_types import _StridedShard

from torch_handle.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                                 mark_sequence_parallel, shard_along)
from torch_handle.parallel.tensor.mappings import TPGroup, split_to_sp
from torch_handle.parallel.tensor.random import SequenceParallelDropout


class Style(enum.Enum):
    COLWISE = "colwise"
    ROWWISE = "rowwise"
    VOCAB_EMBED = "vocab_embed"
    VOCAB_HEAD = "vocab_head"
    NORM = "norm"
    TO_SEQUENCE = "to_sequence"
    DROPOUT = "dropout"
    HEAD_NORM = "head_norm"
    SLICE_DROPOUT = "slice_dropout"


@dataclasses.dataclass(frozen=True)
class Stacked:
    """Column-parallel over projections stacked along the output of one Linear: ``parts`` are their output
    features, in order (a fused QKV: (H·d_k, H_kv·d_k, H_kv·d_k)); each is split over the TP ranks on its own."""

    parts: tuple[int, ...]

    @property
    def equal(self) -> bool:
        return len(set(self.parts)) == 1


Plan = dict[str, "Style | Stacked"]
"""Module name (as ``model.named_modules()`` gives it) -> how it is split."""


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def apply_scratch(model: nn.Module, plan: Plan, tp: TPGroup, *, sequence_parallel: bool = False) -> nn.Module:
    """Replace the planned modules of ``model`` (built identically on every TP rank) by their hand-written
    tensor-parallel versions, in place; returns ``model``. The model's forward then returns this rank's
    vocabulary slice of the logits, (B, T, V/tp): use :func:`~torch_handle.parallel.tensor.cross_entropy.
    vocab_parallel_cross_entropy`. With ``sequence_parallel``, call :func:`~torch_handle.parallel.tensor.layers.
    all_reduce_sp_grads` after each backward.

    Raises:
        ValueError: a planned size not divisible by tp (names the module)."""
    sp = sequence_parallel
    for name, style in plan.items():
        module = model.get_submodule(name)
        try:
            if style is Style.COLWISE or style is Style.VOCAB_HEAD:
                _set(model, name, ColumnParallelLinear.from_linear(module, tp, sequence_parallel=sp))
            elif isinstance(style, Stacked):
                _set(model, name, ColumnParallelLinear.from_linear(module, tp, sequence_parallel=sp,
                                                                   parts=style.parts))
            elif style is Style.ROWWISE:
                _set(model, name, RowParallelLinear.from_linear(module, tp, sequence_parallel=sp))
            elif style is Style.VOCAB_EMBED:
                _set(model, name, VocabParallelEmbedding.from_embedding(module, tp))
            elif style is Style.NORM and sp:
                mark_sequence_parallel(module)
            elif style is Style.TO_SEQUENCE and sp:
                module.register_forward_hook(lambda _m, _args, out: split_to_sp(out, tp))
            elif style is Style.DROPOUT and sp:
                _set(model, name, SequenceParallelDropout(module, tp.rank, tp.size))
            elif style is Style.HEAD_NORM:
                mark_sequence_parallel(module)
            elif style is Style.SLICE_DROPOUT:
                _set(model, name, SequenceParallelDropout(module, tp.rank, tp.size, dim=-1))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    return model


def apply_native(model: nn.Module, plan: Plan, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False
                 ) -> nn.Module:
    """``parallelize_module`` with the DTensor styles of ``plan``, in place; returns ``model``. Parameters become
    DTensors on ``tp_mesh``; activations between modules stay plain local tensors. The model's forward returns a
    DTensor of logits sharded over the vocabulary (Shard(-1)): compute the loss, and run backward, inside
    ``torch.distributed.tensor.parallel.loss_parallel()``. A :class:`Stacked` projection of unequal parts is the
    hand-written ``ColumnParallelLinear`` (plain local parameters; see the module docstring), and the parameters of a
    ``HEAD_NORM`` stay plain tensors, flagged as :func:`apply_scratch` flags them: sum their gradients over the TP
    group (:func:`~torch_handle.parallel.tensor.layers.all_reduce_sp_grads`) after each backward."""
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()  # the layout between the TP regions
    styles = {
        Style.COLWISE: lambda: ColwiseParallel(input_layouts=seq),
        Style.ROWWISE: lambda: RowwiseParallel(output_layouts=seq),
        Style.VOCAB_EMBED: lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        Style.VOCAB_HEAD: lambda: ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                                  use_local_output=False),
        Style.NORM: lambda: SequenceParallel(use_local_output=True),
        Style.TO_SEQUENCE: lambda: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
    }
    native, by_hand = {}, TPGroup(tp_mesh.get_group())
    for name, style in plan.items():
        if style is Style.DROPOUT and sp:
            _set(model, name, SequenceParallelDropout(model.get_submodule(name), tp_mesh.get_local_rank(),
                                                      tp_mesh.size()))
        elif style is Style.SLICE_DROPOUT:
            _set(model, name, SequenceParallelDropout(model.get_submodule(name), tp_mesh.get_local_rank(),
                                                      tp_mesh.size(), dim=-1))
        elif isinstance(style, Stacked) and style.equal:
            native[name] = FusedColwiseParallel(parts=len(style.parts), input_layouts=seq)
        elif isinstance(style, Stacked) or style is Style.HEAD_NORM:
            apply_scratch(model, {name: style}, by_hand, sequence_parallel=sp)
        elif style is not Style.DROPOUT and (sp or style not in (Style.NORM, Style.TO_SEQUENCE)):
            native[name] = styles[style]()
    return parallelize_module(model, tp_mesh, native)


class FusedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for ``parts`` projections stacked in one weight ([W_q; W_k; W_v]): each part is split on its
    own, so rank r keeps slice r of every part, i.e. whole heads of Q, K and V (Megatron's per-group layout). DTensor
    names that placement ``_StridedShard(0, split_factor=parts)``; the global weight keeps the one-process layout,
    so a checkpoint needs no permutation. A module that computes only some parts (the model's ``StackedLinear``,
    called with ``parts=``: a cross-attention's Q, or K and V) selects them through the view (parts, C/tp, C) of
    the weight, a plain ``Shard(1)``: no communication."""

    def __init__(self, parts: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        placement = _StridedShard(0, split_factor=self.parts)
        for pname, param in list(module.named_parameters()):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, device_mesh, [placement])))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        # (B, T, parts·C/tp) locally: [Q_r, K_r, V_r] (or the parts selected); the strided placement is the layout
        return outputs.to_local() if use_local_output else outputs


def split_rule(name: str, plan: Plan) -> tuple[int, int | tuple[int, ...]] | None:
    """How :func:`apply_scratch` splits the parameter ``name`` (e.g. ``"layers.0.ff.linear1.weight"``): ``(dim,
    parts)`` for :func:`~torch_handle.parallel.tensor.layers.shard_along` (parts: 1, or the sizes of the stacked
    parts along ``dim``), or None for a tensor every TP rank holds whole (norms, the row-parallel bias, buffers)."""
    module, _, kind = name.rpartition(".")
    style = plan.get(module)
    if style in (Style.COLWISE, Style.VOCAB_HEAD, Style.VOCAB_EMBED):
        return 0, 1
    if isinstance(style, Stacked):
        return 0, style.parts
    if style is Style.ROWWISE and kind == "weight":
        return 1, 1
    return None


def shard(name: str, full: Tensor, plan: Plan, tp: TPGroup) -> Tensor:
    """This rank's slice of the one-process tensor ``full`` of parameter ``name`` (or of a tensor shaped like it:
    a gradient, an Adam moment), as :func:`apply_scratch` cuts it; no communication. A new tensor, or ``full``
    itself when the parameter is not split."""
    rule = split_rule(name, plan)
    return full if rule is None else shard_along(full, tp, *rule)


def unshard(name: str, local: Tensor, plan: Plan, tp: TPGroup) -> Tensor:
    """The one-process tensor of parameter ``name`` of a model split by :func:`apply_scratch`, from this rank's
    ``local`` slice of it (the parameter, its gradient or an Adam moment): the inverse of :func:`shard`. A
    collective: every TP rank calls it for the same names in the same order. Replicated tensors are returned as
    they are."""
    rule = split_rule(name, plan)
    if rule is None:
        return local
    dim, parts = rule  # each part gathered on its own: [Q_0 Q_1 .. ; K_0 K_1 .. ; V_0 V_1 ..]
    sizes = [p // tp.size for p in parts] if isinstance(parts, tuple) else [local.shape[dim]]
    return torch.cat([_gather(part, tp, dim) for part in local.split(sizes, dim=dim)], dim=dim)


def _gather(x: Tensor, tp: TPGroup, dim: int) -> Tensor:
    """All-gather along ``dim`` outside the counted TP traffic (checkpoints and tests, not the step)."""
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)


def partial_grad(name: str, plan: Plan, sequence_parallel: bool) -> bool:
    """Whether parameter ``name``'s gradient on one TP rank is a partial sum that must be summed over the TP group
    before the step: a per-head norm's (each rank saw its own heads) always; under sequence parallelism also the
    norms' parameters and the row-parallel biases (each rank saw its 1/tp of the sequence)."""
    module, _, kind = name.rpartition(".")
    style = plan.get(module)
    if style is Style.HEAD_NORM:
        return True
    return sequence_parallel and (style is Style.NORM or (style is Style.ROWWISE and kind == "bias"))
