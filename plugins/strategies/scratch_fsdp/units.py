"""The units of sharding: which parameters are gathered together, in one all-gather per dtype."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from handle_plugins.strategies.scratch_fsdp.comm import CountedCollectives
from handle_plugins.strategies.scratch_fsdp.shard import ShardedParam
from torch_handle.model.parallelize import model_blocks


def find_units(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """``(module name, module, parameters)`` per unit, in forward order, the model itself ("the rest") last.

    The units are the model's ``blocks()`` (the ``BlockModel`` protocol) when it declares them; otherwise every
    module with parameters of its own (``recurse=False``), so any ``nn.Module`` works. A parameter used by several
    modules (tied weights) and every parameter in no unit belong to the last unit, the root ``model``, which stays
    gathered for the whole forward and backward. Units without parameters are left out. Frozen parameters
    (``requires_grad = False``) belong to units like the others: they are sharded and gathered too.
    """
    blocks = model_blocks(model, default=None)
    if blocks is not None:
        candidates = [(m, list(m.parameters())) for m in blocks]
    else:
        owners = Counter(p for m in model.modules() for p in m.parameters(recurse=False))
        candidates = [(m, [p for p in m.parameters(recurse=False) if owners[p] == 1])
                      for m in model.modules() if m is not model]
    module_names = {m: n for n, m in model.named_modules()}
    units, taken = [], set()
    for module, params in candidates:
        own = [p for p in params if p not in taken]
        taken.update(own)
        if own:
            units.append((module_names[module], module, own))
    rest = [p for p in model.parameters() if p not in taken]
    if rest:
        units.append(("", model, rest))
    return units


class Unit:
    """The parameters one module computes with, each a :class:`ShardedParam`, gathered and freed together.

    :meth:`start_gather` sends one all-gather per gather dtype (``groups``: a bf16 frozen weight beside fp32
    trainable ones makes two), each of one flat buffer: every parameter's padded shard laid end to end
    (copy-in), so rank ``r``'s part of the output is its shards in ``params`` order. :meth:`finish_gather` waits
    and copies each parameter's column of ``(world_size, per_rank)`` into its ``full`` buffer (copy-out). The
    same copy-in/copy-out as FSDP2's ``foreach_all_gather`` and ``foreach_all_gather_copy_out``
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py).

    Args:
        name: the unit's module name ("" for the root).
        module: the module whose forward uses the unit (hooks go there).
        params: the unit's parameters, the same order on every rank.
        rank, world_size: this rank's place among the data-parallel ranks.
        dtype: compute dtype (torch.float32, bfloat16 or float16): what fp32 parameters are gathered in.
    """

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter], rank: int, world_size: int,
                 dtype: torch.dtype) -> None:
        self.name, self.module, self.world_size = name, module, world_size
        self.params = [ShardedParam(p, rank, world_size, dtype) for p in params]
        self.trainable = [sp for sp in self.params if sp.trainable]
        """The parameters whose gradients are reduce-scattered and whose shards the optimizer steps."""
        self.groups: dict[torch.dtype, list[ShardedParam]] = {}
        for sp in self.params:
            self.groups.setdefault(sp.gather_dtype, []).append(sp)
        self.gathered = True
        """Whether every ``full`` holds the current weights."""
        self.pending: list[tuple[list[ShardedParam], torch.Tensor, torch.Tensor, Any]] | None = None
        """All-gathers started and not yet waited for (prefetch): (parameters, input, output, work)."""

    @torch.no_grad()
    def start_gather(self, comm: CountedCollectives, trainable_only: bool = False) -> None:
        """Start one all-gather per dtype group into the parameters' ``full`` buffers (``trainable_only``: of the
        trainable parameters alone, ZeRO-2 after a step: the frozen ones have not changed)."""
        self.pending = []
        for group in self.groups.values():
            group = [sp for sp in group if sp.trainable or not trainable_only]
            if not group:
                continue
            sizes = [sp.chunk_numel for sp in group]
            source = torch.zeros(sum(sizes), dtype=group[0].gather_dtype, device=group[0].shard.device)
            for sp, chunk in zip(group, source.split(sizes)):
                sp.alloc()
                chunk[:sp.shard.numel()].copy_(sp.shard.detach().reshape(-1))
            output = torch.empty(self.world_size * source.numel(), dtype=source.dtype, device=source.device)
            self.pending.append((group, source, output, comm.all_gather(output, source)))

    @torch.no_grad()
    def finish_gather(self, comm: CountedCollectives) -> None:
        """Wait for the all-gathers :meth:`start_gather` started and copy each parameter's rows into its ``full``
        (rank ``r``'s rows are elements ``[r * chunk_numel, (r + 1) * chunk_numel)``; the padding lies past the
        parameter's ``numel``, outside its view)."""
        for group, _, output, work in self.pending or []:
            comm.wait(work)
            torch.split_with_sizes_copy(output.view(self.world_size, -1), [sp.chunk_numel for sp in group], dim=1,
                                        out=[sp.full.view(self.world_size, -1) for sp in group])
        self.pending = None
        self.gathered = True

    def free(self) -> None:
        """Release every ``full``; the parameters keep their shapes and must not be read until the next gather."""
        for sp in self.params:
            sp.free()
        self.gathered = False

    def full_bytes(self) -> int:
        """Bytes the gathered weights hold now (0 when freed)."""
        return sum(sp.full_bytes() for sp in self.params)
