"""A tensor-parallel model's checkpoint in the one-process layout: gathered to full tensors on save, sliced back on
load, so that a TP run's state is the state a one-process run would have.

The full state is the portable form's content (:mod:`torch_handle.checkpoint.convert`): the model's
``state_dict()`` names and shapes (tied weights once as a tensor, under both names, as the unsplit model has them),
and the optimizer's state keyed by parameter name, ``{name: {"step": float32 scalar, "exp_avg": tensor shaped like
the parameter, "exp_avg_sq": ...}}`` for AdamW (any state tensor shaped like its parameter is split as the
parameter is; scalars are the same on every rank). So a TP checkpoint converts to the portable form without
knowing tp, and any portable form loads into a TP run.

``impl`` and ``tp`` are those of :func:`torch_handle.model.parallelize.parallelize_tensor`:

- ``"scratch"`` (``tp`` a :class:`~torch_handle.parallel.tensor.mappings.TPGroup`): parameters are plain tensors
  holding this rank's slice; :func:`~torch_handle.parallel.tensor.plan.unshard` gathers them and
  :func:`~torch_handle.parallel.tensor.plan.shard` cuts them, by the plan, with the layers' own slicing rule.
- ``"native"`` (``tp`` the "tp" ``DeviceMesh``): parameters are DTensors, which carry their layout;
  ``DTensor.full_tensor()`` gathers and ``distribute_tensor(full, mesh, placements, src_data_rank=None)`` cuts
  locally, with each parameter's own placements, the fused QKV's ``_StridedShard(0, split_factor=3)`` included
  (torch DCP docs, ``torch.distributed.checkpoint.state_dict``; DTensor docs, ``distribute_tensor``).

DCP's own ``set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`` is not
used: it cuts each DTensor as one contiguous block (``compute_local_shape_and_global_offset``), which is not the
strided layout of the fused QKV.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torch_handle.errors import CheckpointError
from torch_handle.parallel.tensor.mappings import TPGroup
from torch_handle.parallel.tensor.plan import Plan, shard, unshard

StateByName = dict[str, dict[str, Tensor]]
"""Optimizer state by parameter name, as the portable form keeps it (``convert.StateByName``)."""


def _check(impl: str) -> None:
    if impl not in ("scratch", "native"):
        raise ValueError(f"unknown tensor-parallel implementation {impl!r}; expected 'scratch' or 'native'")


def _tp_rank(impl: str, tp: Any) -> int:
    return tp.rank if impl == "scratch" else tp.get_local_rank()


def _split_by_hand(impl: str, value: Tensor, tp: Any) -> TPGroup | None:
    """The TP group when ``value`` holds its TP slice as a plain tensor (the hand-written path's parameters, and on
    the native path a fused QKV of unequal parts: :func:`~torch_handle.parallel.tensor.plan.apply_native`), possibly
    under FSDP's DTensor over "dp"; None for a DTensor that carries its TP layout."""
    if impl == "scratch":
        return tp
    mesh = value.device_mesh if isinstance(value, DTensor) else None
    return None if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) else TPGroup(tp.get_group())


def _fsdp_over_tp(t: Any) -> bool:
    """Whether ``t`` is FSDP2's shard of a native TP shard: a DTensor on a ("dp", "tp") mesh."""
    return isinstance(t, DTensor) and tuple(t.device_mesh.mesh_dim_names or ()) == ("dp", "tp")


def _gather_fsdp_over_tp(value: DTensor) -> Tensor:
    """The one-process tensor of an FSDP2 shard of a native TP shard, gathered one dimension at a time: FSDP2's
    chunks (``torch.chunk`` on dim 0, possibly uneven) over "dp" into the TP shard, then the TP shard over "tp" by its
    own placement. ``full_tensor()`` of the 2-D DTensor itself puts the rows of a fused QKV (``_StridedShard`` on
    "tp" under FSDP2's ``Shard(0)`` on "dp") in the wrong order in torch 2.13."""
    import torch.distributed as dist

    mesh, chunk = value.device_mesh, value.to_local()
    group = mesh["dp"].get_group()
    rows = [torch.zeros((), dtype=torch.long) for _ in range(mesh["dp"].size())]
    dist.all_gather(rows, torch.tensor(chunk.shape[0] if chunk.dim() else 0), group=group)
    most = max(int(r) for r in rows)
    padded = torch.zeros((most, *chunk.shape[1:]), dtype=chunk.dtype, device=chunk.device)
    padded[:chunk.shape[0]] = chunk
    parts = [torch.empty_like(padded) for _ in rows]
    dist.all_gather(parts, padded, group=group)
    tp_shard = torch.cat([part[:int(r)] for part, r in zip(parts, rows)])
    return DTensor.from_local(tp_shard, mesh["tp"], [value.placements[1]], run_check=False).full_tensor()


def _slice_fsdp_over_tp(full: Tensor, like: DTensor) -> Tensor:
    """This rank's FSDP2 chunk of its TP shard of ``full`` (the inverse of :func:`_gather_fsdp_over_tp`), a DTensor
    laid out as ``like``; no communication."""
    mesh = like.device_mesh
    tp_shard = distribute_tensor(full, mesh["tp"], [like.placements[1]], src_data_rank=None).to_local()
    chunks = torch.chunk(tp_shard, mesh["dp"].size(), dim=0)
    rank = mesh["dp"].get_local_rank()
    piece = chunks[rank] if rank < len(chunks) else tp_shard[:0]
    return DTensor.from_local(piece.contiguous(), mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def _full(name: str, value: Tensor, impl: str, plan: Plan, tp: Any) -> Tensor:
    """The one-process tensor of ``value`` (parameter ``name``, or state shaped like it), a CPU copy; a collective
    for a split tensor. A DTensor is gathered first (native TP, or a data-parallel shard of a scratch TP slice)."""
    with torch.no_grad():
        if _fsdp_over_tp(value):
            return _gather_fsdp_over_tp(value).detach().to("cpu", copy=True)
        full = value.full_tensor() if isinstance(value, DTensor) else value  # native, or FSDP over scratch
        by_hand = _split_by_hand(impl, value, tp)
        if by_hand is not None and full.dim() > 0:
            full = unshard(name, full, plan, by_hand)
        return full.detach().to("cpu", copy=True)


def _local(name: str, full: Tensor, like: Tensor, impl: str, plan: Plan, tp: Any) -> Tensor:
    """This rank's slice of the one-process tensor ``full``, laid out as ``like`` (the parameter or its state):
    a DTensor with ``like``'s placements for a DTensor, else a plain tensor. No communication."""
    local = full.detach().to(like.device)
    if _fsdp_over_tp(like):
        return _slice_fsdp_over_tp(local, like)
    by_hand = _split_by_hand(impl, like, tp)
    if by_hand is not None and local.dim() > 0:
        local = shard(name, local, plan, by_hand)
    if isinstance(like, DTensor):  # native, or FSDP over scratch
        local = distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)
    return local


def full_model_state(model: nn.Module, impl: str, plan: Plan, tp: Any) -> dict[str, Tensor] | None:
    """The state dict the unsplit model would return (same names, shapes and values; a tied weight is one tensor
    under both of its names), on TP rank 0 as CPU copies; None on the other TP ranks. A collective: every TP rank
    calls it.

    Raises:
        ValueError: an unknown ``impl``."""
    _check(impl)
    keep = _tp_rank(impl, tp) == 0
    out: dict[str, Tensor] = {}
    done: dict[int, Tensor] = {}  # id(parameter) -> its full tensor: tied weights gathered once
    for name, value in model.state_dict(keep_vars=True).items():
        full = done.get(id(value))
        if full is None:
            full = done[id(value)] = _full(name, value, impl, plan, tp)
        if keep:
            out[name] = full
    return out if keep else None


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, impl: str, plan: Plan, tp: Any
                         ) -> StateByName | None:
    """The optimizer's per-parameter state in the one-process layout, keyed by the names of
    ``model.named_parameters()`` (a tied weight under its first name), on TP rank 0 as CPU copies; None on the
    other TP ranks. Parameters without state (never stepped) are left out. A collective.

    Raises:
        ValueError: an unknown ``impl``."""
    _check(impl)
    keep = _tp_rank(impl, tp) == 0
    out: StateByName = {}
    for name, param in model.named_parameters():
        state = optimizer.state.get(param)
        if not state:
            continue
        entry = {key: _full(name, value, impl, plan, tp) if torch.is_tensor(value) else torch.tensor(float(value))
                 for key, value in state.items()}
        if keep:
            out[name] = entry
    return out if keep else None


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_state: dict[str, Tensor],
                    optim_state_by_name: StateByName | None, impl: str, plan: Plan, tp: Any) -> None:
    """Load a one-process state (every rank holds it whole, e.g. from ``convert.read_portable``) into a model
    split by ``parallelize_tensor`` and its optimizer: each rank keeps its slice. The optimizer keeps its param
    groups (learning rate, betas); ``optimizer`` or ``optim_state_by_name`` None loads the model only. No
    communication.

    Raises:
        CheckpointError: a name the model has and the state lacks, or the reverse (one line naming it), or what
            the model's own load hooks raise (a LoRA model's: a base that changed since the checkpoint).
        ValueError: an unknown ``impl``."""
    _check(impl)
    for hook in model._load_state_dict_pre_hooks.values():  # what load_state_dict runs first (LoRA: the base's hash)
        hook(model_state, "", {}, True, [], [], [])
    own = model.state_dict(keep_vars=True)
    for names, which in ((own.keys() - model_state.keys(), "model state has no"),
                         (model_state.keys() - own.keys(), "the model has no")):
        if names:
            raise CheckpointError(f"{which} {sorted(names)[0]} ({len(names)} name(s) differ)")
    with torch.no_grad():
        for name, value in own.items():
            local = _local(name, model_state[name], value, impl, plan, tp)
            target = value.to_local() if isinstance(value, DTensor) else value
            target.copy_(local.to_local() if isinstance(local, DTensor) else local)
    if optimizer is None or optim_state_by_name is None:
        return
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    state: dict[int, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if id(param) not in index:
            continue
        entry = optim_state_by_name.get(name)
        if entry is None:
            raise CheckpointError(f"optimizer state has no {name}")
        entry = {key: torch.as_tensor(value) for key, value in entry.items()}
        state[index[id(param)]] = {key: _local(name, value, param, impl, plan, tp) if value.dim() else value.clone()
                                   for key, value in entry.items()}
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
