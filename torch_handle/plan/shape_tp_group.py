"""A tensor-parallel group that only computes shapes: how ``handle estimate`` splits a model the way a ``tp > 1`` run
does without starting a process group.

The hand-written TP layers (:mod:`torch_handle.parallel.tensor`) do all their communication through the methods of
:class:`~torch_handle.parallel.tensor.mappings.TPGroup`. :class:`ShapeTPGroup` replaces those methods by local
operations that return what the real collectives return on one rank -- same shape, dtype and device, a new storage
where the real one allocates one -- so the split model runs on the meta device or on fake tensors
(``FakeTensorMode``) exactly as the real layers run, and what autograd saves on one TP rank can be counted. Its
``stats`` count the collectives the real group would make (calls and bytes, no time).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from torch_handle.parallel.tensor.mappings import CommStats, TPGroup


class ShapeTPGroup(TPGroup):
    """Rank ``rank`` of a TP group of ``size`` ranks, with no processes behind it: every collective returns a
    tensor shaped like the real one's result, with meaningless values (use it on meta or fake tensors).

    Raises:
        ValueError: ``rank`` outside ``[0, size)``."""

    def __init__(self, size: int, rank: int = 0) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        self.group, self.rank, self.size = None, rank, size
        self.stats = CommStats()

    def all_reduce(self, x: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        x = x.contiguous()  # the real one reduces in place into this tensor
        self.stats.record("all_reduce", x.numel() * x.element_size(), 0.0)
        return x

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        out = torch.cat([x] * self.size, dim=dim)
        self.stats.record("all_gather", out.numel() * out.element_size(), 0.0)
        return out

    def reduce_scatter(self, x: Tensor, dim: int) -> Tensor:
        if x.shape[dim] % self.size:
            raise ValueError(f"reduce_scatter: dimension {dim} of size {x.shape[dim]} is not divisible by {self.size}")
        self.stats.record("reduce_scatter", x.numel() * x.element_size(), 0.0)
        return x.chunk(self.size, dim)[self.rank].clone(memory_format=torch.contiguous_format)
