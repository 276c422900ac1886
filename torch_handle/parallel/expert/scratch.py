"""Expert parallelism by hand: an MoE layer's dispatch and combine as two all-to-alls over the EP group, with the
per-expert counts exchanged first (GShard, Lepikhin et al. 2020, §2.2; Megatron-Core's ``MoEAlltoAllTokenDispatcher``).

Each rank holds L = E/ep experts, rank r experts [r·L, (r+1)·L). One layer's forward on a rank:

1. ``dispatch`` (``moe.dispatch``, local) sorts the rank's N·k assignments by expert: M rows, ``counts`` (E,).
2. counts exchange: one ``all_to_all_single`` of the E counts (slice j goes to rank j): each rank learns how many
   rows every rank sends each of its local experts, (ep, L). Their row sums are the split sizes of step 3: how
   many rows this rank sends to each rank (``in_splits``) and receives from each (``out_splits``).
3. dispatch all-to-all: the M sorted rows, cut by ``in_splits``, to their experts' ranks.
4. regroup source-major -> expert-major (:mod:`~torch_handle.parallel.expert.permute`), the local experts' grouped
   matmul over the L runs, and back to source-major.
5. combine all-to-all: the expert outputs back to the ranks that sent the rows (the splits swapped); ``moe.combine``
   then puts them in token order and mixes them by the router's weights.

The backward of an all-to-all is the all-to-all of the gradients with the splits swapped (:class:`_AllToAll`), so
autograd runs steps 5 and 3 in reverse, and every expert's gradient gathers the contributions of the tokens of every
EP rank. A rank may send or receive zero rows (for one expert, or at all): every split size may be 0.

Every all-to-all of rows is counted (bytes this rank hands to the collective, the whole buffer including its own
share; seconds in the call: waiting for the others plus the transfer) and named in the heartbeat's phase while it
runs (``ep dispatch layer 3: send [5, 11] recv [7, 9]``), so a hang report names a rank stuck in the dispatch or the
combine and the split sizes it used (:mod:`torch_handle.observe.heartbeat`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torch_handle.observe import heartbeat
from torch_handle.parallel.expert.permute import inverse, source_to_expert_order

Record = Callable[[int, float, bool], None]
"""``record(nbytes, seconds, backward)``: who is told of each all-to-all of rows (the layer's counters,
``torch_handle.train.routing.AllToAllTraffic.record``)."""


@contextlib.contextmanager
def waiting(what: str, send: list[int] | None = None, recv: list[int] | None = None) -> Iterator[None]:
    """The heartbeat's phase while an all-to-all runs: ``ep dispatch layer 3: send [5, 11] recv [7, 9]`` (rows to
    and from each EP rank), ``ep dispatch layer 3: counts`` while the counts are exchanged; the phase before it is
    restored after it."""
    hb = heartbeat.current()
    before = hb.phase if hb is not None else None
    heartbeat.beat(f"ep {what}: send {send} recv {recv}" if send is not None else f"ep {what}: counts")
    try:
        yield
    finally:
        if before is not None:
            heartbeat.beat(before)


def split_sizes(counts: Tensor, received: Tensor) -> tuple[list[int], list[int]]:
    """(in_splits, out_splits): rows this rank sends to each EP rank (its E counts summed per destination's L
    experts) and receives from each (the exchanged (ep, L) counts summed per source). One host read."""
    ep = received.shape[0]
    return counts.view(ep, -1).sum(1).tolist(), received.sum(1).tolist()


def row_bytes(x: Tensor) -> int:
    """Bytes of one row of ``x`` (M, C), also when M is 0."""
    return math.prod(x.shape[1:]) * x.element_size()


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with split sizes; backward: the same with the splits swapped."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any, name: str,
                record: Record | None) -> Tensor:
        ctx.args = out_splits, in_splits, group, name, record
        return _all_to_all(x, out_splits, in_splits, group, name, record, backward=False)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        out_splits, in_splits, group, name, record = ctx.args
        return (_all_to_all(grad, in_splits, out_splits, group, f"{name} backward", record, backward=True),
                None, None, None, None, None)


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any, name: str,
                record: Record | None, backward: bool) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    start = time.perf_counter()
    with waiting(name, in_splits, out_splits):
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    if record is not None:
        record(x.shape[0] * row_bytes(x), time.perf_counter() - start, backward)
    return out


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any, name: str = "all-to-all",
               record: Record | None = None) -> Tensor:
    """Rows of ``x`` (sum(in_splits), C), ``in_splits[j]`` of them to rank j of ``group``, in rank order; returns
    the (sum(out_splits), C) rows received, ``out_splits[j]`` from rank j. Differentiable (the backward is the
    reverse all-to-all). ``name`` is the heartbeat's phase while it runs; ``record`` is told its bytes and time."""
    return _AllToAll.apply(x, out_splits, in_splits, group, name, record)


def exchange_counts(counts: Tensor, group: Any) -> Tensor:
    """Rows this rank sends per expert, (E,) int64 -> rows it receives per source rank and local expert, (ep, L): one
    ``all_to_all_single`` of E values in equal slices of L (slice j, the counts for rank j's experts, goes to j)."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ep, -1)


def shard_experts(module: nn.Module, rank: int, ep: int) -> None:
    """Keep experts [rank·L, (rank+1)·L) of every stacked parameter (E, ...) of ``module`` (its own parameters, not
    its children's), in place: plain tensors of E/ep experts."""
    for name, param in list(module.named_parameters(recurse=False)):
        local = param.detach().chunk(ep, dim=0)[rank].clone()
        module.register_parameter(name, nn.Parameter(local, requires_grad=param.requires_grad))


class ScratchExpertParallel:
    """One MoE layer's experts split over the EP group, its dispatch and combine written out (see the module).

    ``apply(experts)`` keeps this rank's experts of the module that computes them (``GroupedExperts``: forward(x
    (M, C) rows sorted by expert, counts (E,)) -> (M, C)) and wraps its forward: a pre-hook dispatches (the module
    then sees the (R, C) rows of its L experts, grouped by expert, and their (L,) counts) and a hook combines (the
    layer gets its own M rows back, in its order). The parameter names stay those of the one-process model.

    Args:
        group: the EP process group (the mesh's "ep" dimension).
        layer: the layer's index, for the heartbeat's phase.
        record: told the bytes and seconds of each all-to-all of rows, or None.
    """

    def __init__(self, group: Any, layer: int = 0, record: Record | None = None) -> None:
        self.group, self.layer, self.record = group, layer, record
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.in_splits: list[int] = []
        self.out_splits: list[int] = []
        self.index: Tensor | None = None

    def apply(self, experts: nn.Module) -> nn.Module:
        shard_experts(experts, self.rank, self.ep)
        experts.register_forward_pre_hook(lambda module, args: self.dispatch(*args))
        experts.register_forward_hook(lambda module, args, output: self.combine(output))
        return experts

    def dispatch(self, x: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """(M, C) rows sorted by expert and their (E,) counts -> (R, C) rows of this rank's L experts, grouped by
        expert, and (L,) counts."""
        with waiting(f"dispatch layer {self.layer}"):
            received = exchange_counts(counts, self.group)  # (ep, L)
        self.in_splits, self.out_splits = split_sizes(counts, received)
        rows = all_to_all(x, self.out_splits, self.in_splits, self.group, f"dispatch layer {self.layer}",
                          self.record)
        self.index = source_to_expert_order(received)
        return rows[self.index], received.sum(0)

    def combine(self, y: Tensor) -> Tensor:
        """The local experts' (R, C) outputs -> this rank's (M, C) rows, in its sorted order."""
        y = y[inverse(self.index)]  # expert-major -> source-major, as the rows arrived
        return all_to_all(y, self.in_splits, self.out_splits, self.group, f"combine layer {self.layer}",
                          self.record)
