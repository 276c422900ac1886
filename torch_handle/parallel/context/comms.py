"""The communication context parallelism needs, written once: the ring's point-to-point passes, and the all-gather,
reduce-scatter and all-to-all of one tensor along one dimension (picotron's ``cp_communications.py``).

Every call takes the cp process group (None: the default group) and works on gloo (CPU) as on NCCL: gloo has
``isend``/``irecv`` (so ``batch_isend_irecv``), ``all_to_all_single`` and ``all_gather_into_tensor``; its
``reduce_scatter_tensor`` is torch's emulation by an all-reduce (the same result, more bytes on the wire).

Shape letters: B batch, H heads, T/cp the local share of the sequence, D channels per head.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

# torch 2.13 renamed the tensor collectives (the old names warn); older torch has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """What this process's context-parallel communication did since :meth:`reset`: ``calls``, ``bytes`` (what it
    sent: a ring pass's tensors, an all-gather's or all-to-all's input, a reduce-scatter's input) and ``wait_s``,
    host seconds blocked in it (a collective's call; a ring pass's ``wait``, after the compute it overlapped). On
    CUDA the host does not wait for NCCL's kernels, so ``wait_s`` is the launch time there."""

    calls: int = 0
    bytes: int = 0
    wait_s: float = 0.0

    def reset(self) -> None:
        self.calls, self.bytes, self.wait_s = 0, 0, 0.0

    def add(self, tensors: Sequence[Tensor], seconds: float) -> None:
        self.calls += 1
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.wait_s += seconds


STATS = CommStats()
"""The process's counters (one cp group per process): the CP share resets them each step and reports them in its
step event (``cp_comm_calls``, ``cp_comm_bytes``, ``cp_comm_s``)."""


def cp_size(group: dist.ProcessGroup | None) -> int:
    """cp: the ranks of the group that share one sequence (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def cp_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index in the cp group (0 .. cp - 1): which shard of the sequence it holds."""
    return dist.get_rank(group) if dist.is_initialized() else 0


class Ring:
    """The cp ranks as a ring: each rank sends to the next one (rank + 1 mod cp) and receives from the previous one
    (rank - 1 mod cp), so after s passes rank r holds what rank r - s started with (Liu et al. 2023, Ring Attention,
    §3; ring-flash-attention's ``RingComm``).

    A pass is posted as one ``batch_isend_irecv`` of every tensor given and waited for later
    (:meth:`Pass.wait`), so the caller computes on the block it holds while the next one travels. Both neighbours
    post their sends and receives in the same order, which is how the messages between one pair of ranks are
    matched. A ring of one rank passes to itself: the pass returns what was given, with no message.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size, self.rank = cp_size(group), cp_rank(group)
        world = group if group is not None else dist.group.WORLD
        # P2P calls take global ranks; the ring is defined on the group's ranks
        self.next = dist.get_global_rank(world, (self.rank + 1) % self.size) if self.size > 1 else 0
        self.prev = dist.get_global_rank(world, (self.rank - 1) % self.size) if self.size > 1 else 0

    def pass_on(self, tensors: Sequence[Tensor]) -> Pass:
        """Send ``tensors`` to the next rank and receive the previous rank's, of the same shapes and dtypes."""
        if self.size == 1:
            return Pass(list(tensors), [])
        tensors = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return Pass(received, dist.batch_isend_irecv(ops), sum(t.numel() * t.element_size() for t in tensors))


class Pass:
    """One ring pass in flight: :meth:`wait` returns the received tensors once they have arrived."""

    def __init__(self, received: list[Tensor], requests: list, sent_bytes: int = 0) -> None:
        self.received, self.requests, self.sent_bytes = received, requests, sent_bytes

    def wait(self) -> list[Tensor]:
        t0 = time.perf_counter()
        for request in self.requests:
            request.wait()
        if not self.requests:  # a ring of one rank: nothing travelled
            return self.received
        STATS.calls += 1
        STATS.bytes += self.sent_bytes
        STATS.wait_s += time.perf_counter() - t0
        return self.received


def all_gather(x: Tensor, dim: int, group: dist.ProcessGroup | None) -> Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order: (..., n, ...) -> (..., cp · n, ...)."""
    cp = cp_size(group)
    if cp == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()  # all_gather_into_tensor fills dim 0
    out = moved.new_empty((cp * moved.shape[0], *moved.shape[1:]))
    t0 = time.perf_counter()
    _all_gather_single(out, moved, group=group)
    STATS.add([moved], time.perf_counter() - t0)
    return out.movedim(0, dim)


def reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup | None) -> Tensor:
    """The sum over ranks of ``x``, of which this rank keeps its slice along ``dim`` (the r-th of cp equal slices):
    (..., cp · n, ...) -> (..., n, ...). The adjoint of :func:`all_gather`."""
    cp = cp_size(group)
    if cp == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // cp, *moved.shape[1:]))
    t0 = time.perf_counter()
    _reduce_scatter_single(out, moved, group=group)
    STATS.add([moved], time.perf_counter() - t0)
    return out.movedim(0, dim)


def all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup | None) -> Tensor:
    """Cut ``x`` into cp slices along ``scatter_dim``, send slice j to rank j, and concatenate what arrives along
    ``gather_dim`` in rank order (DeepSpeed-Ulysses' ``_SeqAllToAll``). Sequence shards to head shards:
    (B, H, T/cp, D) with scatter_dim 1, gather_dim 2 -> (B, H/cp, T, D); the reverse call undoes it."""
    cp = cp_size(group)
    if cp == 1:
        return x
    pieces = torch.stack(x.tensor_split(cp, dim=scatter_dim)).contiguous()  # (cp, ...): piece j for rank j
    out = torch.empty_like(pieces)
    t0 = time.perf_counter()
    dist.all_to_all_single(out, pieces, group=group)  # out[i]: rank i's piece for this rank
    STATS.add([pieces], time.perf_counter() - t0)
    return torch.cat(out.unbind(0), dim=gather_dim)


class _GatherSequence(torch.autograd.Function):
    """:func:`all_gather` whose backward is :func:`reduce_scatter`: each rank's gradient of the gathered tensor, summed
    over the ranks, back to the slice's owner (Megatron-LM's ``_GatherFromSequenceParallelRegion``)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: dist.ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return reduce_scatter(grad, ctx.dim, ctx.group), None, None


def gather_sequence(x: Tensor, dim: int, group: dist.ProcessGroup | None) -> Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, differentiable: (..., n, ...) -> (..., cp · n,
    ...), and in backward each rank's slice gets the sum over the ranks of the gradient of its slice. When every rank
    computes the same loss of the gathered tensor, a shard's gradient is then cp times its own term, which the
    strategy's mean over the dp × cp ranks turns back into the one-process gradient."""
    return _GatherSequence.apply(x, dim, group) if cp_size(group) > 1 else x
