"""How a run's ranks are arranged: pipeline × data parallel × context parallel × tensor parallel on one device mesh, the
data-parallel ranks split again into expert-data-parallel × expert parallel.

Ranks are laid out with tensor parallelism varying fastest and pipeline parallelism slowest, as in Megatron-LM,
picotron and torchtitan: with tp = 2 and world_size = 4, ranks (0, 1) split one model replica and (2, 3) the
other, so a TP group is consecutive ranks and stays inside a node (TP sends activations every layer; data
parallelism sends gradients once a step; a pipeline sends one activation per stage boundary and micro-batch).

    rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank

Context parallelism (cp ranks sharing one sequence) sits between dp and tp, as in picotron's grid and torchtitan's
ParallelDims: its ring or all-gather moves K/V every layer, more often than data parallelism's once-a-step
gradients, less than TP's every-linear activations. The cp ranks of a replica read the same samples (the samplers
use ``dp_rank`` and ``dp``), and the data-parallel strategy reduces over dp × cp (torchtitan's ``dp_shard_cp``).

Expert parallelism draws its ranks from the data-parallel ones, as torchtitan does: the dp ranks of a (pp, tp)
coordinate are edp × ep, ep varying fastest,

    dp_rank = edp_rank · ep + ep_rank

so ep consecutive dp ranks split the experts (an EP group) and the edp = dp / ep groups hold the same experts
(the ranks of one ep_rank form an expert-data-parallel group, over which expert gradients are reduced). EP is the
inner one because its traffic is the heavier: two all-to-alls of every routed token per MoE layer, forward and
backward, against one all-reduce of the expert gradients a step; consecutive ranks share a node when they can.

The degrees and a rank's coordinates are :class:`~torch_handle.common.parallel_dims.ParallelDims` (their one home:
the layout line and the estimate read the same arithmetic). The mesh is torch's ``init_device_mesh`` with the named
dimensions ("dp", "tp"), and ("pp", "dp", "tp") with a
pipeline (torchtitan's ParallelDims does the same, with more dimensions); with ep > 1 a second mesh over the same
ranks splits "dp" into ("edp", "ep") (:func:`build_expert_mesh`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch_handle.common.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torch_handle.config.schema import ParallelConfig


def build_mesh(layout: ParallelDims, device_type: str) -> DeviceMesh:
    """The ("dp", "tp") device mesh of ``layout`` over the default process group (already initialised), with "pp"
    first for a pipeline and "cp" before "tp" for context parallelism. ``mesh["tp"]`` is this rank's TP group,
    ``mesh["dp"]`` its data-parallel group, ``mesh["pp"]`` its pipeline, ``mesh["cp"]`` the ranks sharing its
    sequences."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = [(n, d) for n, d in (("pp", layout.pp), ("dp", layout.dp), ("cp", layout.cp), ("tp", layout.tp))
            if d > 1 or n in ("dp", "tp")]
    return init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=tuple(n for n, _ in dims))


def build_expert_mesh(layout: ParallelDims, device_type: str) -> DeviceMesh:
    """The same ranks with dp split: ("edp", "ep", "tp"), ("pp", "edp", "ep", "tp") with a pipeline.
    ``mesh["ep"]`` is this rank's EP group (the ranks that split its experts), ``mesh["edp"]`` the ranks holding the
    same experts. A mesh of its own rather than "dp" split and flattened back in one mesh: torch deprecates slicing
    a flattened dimension from its root mesh, and every other part of a run reads "dp" whole."""
    from torch.distributed.device_mesh import init_device_mesh

    pp = ((layout.pp,), ("pp",)) if layout.pp > 1 else ((), ())
    return init_device_mesh(device_type, (*pp[0], layout.edp, layout.ep, layout.tp),
                            mesh_dim_names=(*pp[1], "edp", "ep", "tp"))


def attach_layout(ctx: Any, parallel: ParallelConfig) -> Any:
    """``ctx`` (a ``DistContext``, copied) with the pp × dp × tp layout of ``parallel`` (dp as edp × ep): the device
    mesh, the TP group (tp > 1) and the pipeline group (pp > 1), the data-parallel rank and size (``ctx.dp_rank``,
    ``ctx.dp_size``) and the expert-parallel implementation and mesh (ep > 1). With tp = pp = ep = 1: ``ctx``
    unchanged (dp = world size). Collective: every rank calls it (the mesh's process groups).

    With cp > 1 alone: the layout and the ("dp", "cp", "tp") mesh as ``ctx.cp_mesh``, ``ctx.mesh`` left None, so that
    the data-parallel strategy reduces over its default group, dp × cp (torchtitan's ``dp_shard_cp``), while the
    samplers read ``ctx.dp_rank``. With cp > 1 and tp or pp > 1: ``ctx.mesh`` is ("pp", "dp", "tp") with "dp" the
    dp × cp ranks of a (pp, tp) coordinate (the strategy's), consecutive in the rank order, and ``ctx.cp_mesh`` the
    ("pp", "dp", "cp", "tp") mesh of the same ranks.

    Raises:
        ValueError: tp · pp (· cp) does not divide the world size, or ep the data-parallel degree (:class:`~torch_handle.common.parallel_dims.ParallelDims`)."""
    cp = getattr(parallel, "cp", 1)
    if parallel.tp == 1 and parallel.pp == 1 and parallel.ep == 1:
        if cp == 1:
            return ctx
        layout = ParallelDims(ctx.world_size, cp=cp)
        return replace(ctx, layout=layout, cp_mesh=build_mesh(layout, ctx.device.type))
    if cp > 1:  # with tp and/or pp (ep: refused): ctx.mesh's "dp" is dp x cp, the strategy's ranks, TP innermost
        from torch.distributed.device_mesh import init_device_mesh

        layout = ParallelDims(ctx.world_size, parallel.tp, parallel.pp, cp=cp)
        pp = ((layout.pp,), ("pp",)) if layout.pp > 1 else ((), ())
        mesh = init_device_mesh(ctx.device.type, (*pp[0], layout.dp_cp, layout.tp),
                                mesh_dim_names=(*pp[1], "dp", "tp"))
        tp_group = None
        if layout.tp > 1:
            from torch_handle.parallel.tensor.mappings import TPGroup

            tp_group = TPGroup(mesh["tp"].get_group())
        return replace(ctx, layout=layout, mesh=mesh, tp_group=tp_group, cp_mesh=build_mesh(layout, ctx.device.type),
                       pp_group=mesh["pp"].get_group() if layout.pp > 1 else None)
    layout = ParallelDims(ctx.world_size, parallel.tp, parallel.pp, parallel.ep)
    mesh = build_mesh(layout, ctx.device.type)
    tp_group = None
    if layout.tp > 1:  # an EP-only or pipeline-only run imports nothing of tensor parallelism
        from torch_handle.parallel.tensor.mappings import TPGroup

        tp_group = TPGroup(mesh["tp"].get_group())
    return replace(ctx, layout=layout, mesh=mesh, tp_group=tp_group,
                   pp_group=mesh["pp"].get_group() if layout.pp > 1 else None, ep_impl=parallel.ep_impl,
                   ep_mesh=build_expert_mesh(layout, ctx.device.type) if layout.ep > 1 else None)
