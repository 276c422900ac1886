"""The gradient norm of a model split over a device mesh, and clipping by it.

Each rank holds some gradients whole and others in shards: a tensor-parallel shard (split over "tp": a hand-written
slice the plan names, or a DTensor placed on "tp"), an FSDP shard (a DTensor placed on "dp"), both, or neither
(replicated); a pipeline rank holds only its stages' parameters. The norm of the one-process model is the square
root of the sum of every element's square counted once, so each rank sums its squares by where their tensor is
split and each partial sum is added over the ranks that hold different parts of it: over "tp", over "dp", over
both, not at all; then over the pipeline's stages. Megatron-LM's ``get_grad_norm_fp32`` does the same with its
model-parallel group (Shoeybi et al. 2019; torchtitan's ``clip_grad_norm_`` over DTensors).
"""

from __future__ import annotations

import math
from typing import Any, Container, Iterable

import torch
import torch.distributed as dist
from torch import nn

from torch_handle.parallel.tensor.plan import Plan, split_rule


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def split_over(p: torch.Tensor) -> tuple[bool, bool]:
    """Whether the DTensor ``p`` (a parameter or its gradient) is split over the data-parallel ranks (FSDP) and over
    the TP ranks (native TP); ``(False, False)`` for a plain tensor. A hand-written TP shard is a plain tensor (or
    FSDP's DTensor over dp): the plan says it is split (:func:`~torch_handle.parallel.tensor.plan.split_rule`)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    over = {"dp": False, "tp": False}
    mesh = getattr(p, "device_mesh", None)
    for dim_name, placement in zip(getattr(mesh, "mesh_dim_names", None) or (), getattr(p, "placements", ())):
        # _StridedShard (the fused QKV) is neither a Shard subclass nor is_shard() in torch 2.13
        if placement.is_shard() or isinstance(placement, _StridedShard):
            over[dim_name] = True
    return over["dp"], over["tp"]


def _summed(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient with a Partial placement (a ``SequenceParallel`` norm's under DTensor sequence parallelism:
    each TP rank's sum over its sequence shard) as the sum it stands for, Replicate there; a collective over those
    mesh dimensions. Any other gradient as it is."""
    placements = getattr(grad, "placements", ())
    if not any(placement.is_partial() for placement in placements):
        return grad
    from torch.distributed.tensor import Replicate

    return grad.redistribute(grad.device_mesh, [Replicate() if pl.is_partial() else pl for pl in placements])


def mesh_grad_norm(named: Iterable[tuple[str, nn.Parameter]], mesh: Any, plan: Plan | None = None,
                   exclude: Container[str] = (), pp_group: Any = None, experts: Container[str] = (),
                   ep_group: Any = None) -> float:
    """The 2-norm of every gradient of the one-process model, from this rank's parts of them; a collective over
    ``mesh`` (the ("dp", "tp") or ("pp", "dp", "tp") ``DeviceMesh``; every rank calls it).

    Args:
        named: this rank's (name, parameter) pairs; parameters without a gradient are skipped.
        plan: the hand-written TP plan (which names are split over "tp"), or None.
        exclude: names counted on another rank (a tied weight's second copy on the last pipeline stage).
        pp_group: the pipeline group (each stage's parameters are its own), or None.
        experts: names of expert parameters split over ``ep_group`` (each EP rank holds other experts; expert
            parallelism), summed over that group; a tuple of groups: over each (FSDP's "edp" shards of them too).
    Returns:
        The norm (float; inf or nan when a gradient is)."""
    device = next((p.grad.device for _, p in named if p.grad is not None), None)
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # replicated, over tp, over dp, over both; over ep
    for name, p in named:
        if p.grad is None or name in exclude:
            continue
        if name in experts:
            sums[4] += local(p.grad).detach().double().pow(2).sum()
            continue
        # the gradient's own layout, not the parameter's: DTensor hands an untied vocabulary-parallel embedding
        # (Shard(0)) a Replicate gradient, the whole of it on every TP rank
        grad = _summed(p.grad)
        over_dp, over_tp = split_over(grad)
        if plan is not None and "tp" not in (getattr(getattr(grad, "device_mesh", None), "mesh_dim_names", None)
                                             or ()):  # a hand-written slice, plain or under FSDP's "dp" DTensor
            over_tp = split_rule(name, plan) is not None
        sums[2 * over_dp + over_tp] += local(grad).detach().double().pow(2).sum()
    dist.all_reduce(sums[1:2], group=mesh["tp"].get_group())  # outside the counted step traffic: scalars
    dist.all_reduce(sums[2:3], group=mesh["dp"].get_group())
    dist.all_reduce(sums[3:4])  # every rank holds a different part (and every stage different parameters)
    for group in ep_group if isinstance(ep_group, tuple) else () if ep_group is None else (ep_group,):
        dist.all_reduce(sums[4:5], group=group)
    if pp_group is not None:
        total = sums[:3].sum() + sums[4]
        dist.all_reduce(total, group=pp_group)
        return math.sqrt(float(total + sums[3]))
    return math.sqrt(float(sums.sum()))


def clip_(params: Iterable[nn.Parameter], norm: float, max_norm: float) -> None:
    """Scale every gradient by ``max_norm / norm`` when ``norm`` exceeds ``max_norm`` (``clip_grad_norm_``'s rule,
    with the norm given); a non-finite norm clips nothing (the trainer skips or stops the step)."""
    if math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                local(p.grad).mul_(scale)
