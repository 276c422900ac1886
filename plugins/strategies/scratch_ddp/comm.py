"""The one collective the synchronizers use, counted and timed, and what the four of them share."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist


def grad_or_zeros(p: torch.nn.Parameter) -> torch.Tensor:
    """``p.grad``; zeros for a parameter that got no gradient, so that every rank reduces the same tensors."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


class CountedAllReduce:
    """``dist.all_reduce`` (a sum over the data-parallel ranks, in place: the default group, or the mesh's "dp"
    dimension under pipeline parallelism), counted and timed for ``step_stats``.

    ``stats`` since the last :meth:`take_stats`: ``allreduce_calls``, ``allreduce_bytes`` (this rank's payload,
    numel × element size of every tensor reduced; a ring all-reduce over N ranks sends 2(N-1)/N times the payload
    from each rank) and ``comm_s`` (seconds this rank waited for communication: a blocking call, or :meth:`wait`
    on an asynchronous one; an asynchronous call that finishes while backward computes costs nothing here).

    Args:
        ctx: this rank's ``DistContext`` (``distributed``, ``world_size``).
    """

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.group = None if ctx.mesh is None else ctx.mesh["dp"].get_group()
        self.stats = self._zero()

    @staticmethod
    def _zero() -> dict[str, Any]:
        return {"comm_s": 0.0, "allreduce_calls": 0, "allreduce_bytes": 0}

    @property
    def active(self) -> bool:
        """Whether a process group exists; without one there is nothing to average with."""
        return self.ctx.distributed

    @property
    def world_size(self) -> int:
        """The ranks a gradient is averaged over, those it is summed over: the data-parallel degree, times cp under
        context parallelism (its ranks hold the same replica and see other tokens)."""
        return dist.get_world_size(self.group) if self.active else 1

    def __call__(self, tensor: torch.Tensor, async_op: bool = False) -> Any:
        """Sum ``tensor`` over the ranks in place.

        Returns:
            The ``dist.Work`` handle when ``async_op`` (pass it to :meth:`wait`), else None.
        """
        self.stats["allreduce_calls"] += 1
        self.stats["allreduce_bytes"] += tensor.numel() * tensor.element_size()
        if async_op:
            return dist.all_reduce(tensor, group=self.group, async_op=True)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=self.group)
        self.stats["comm_s"] += time.perf_counter() - start
        return None

    def wait(self, work: Any) -> None:
        start = time.perf_counter()
        work.wait()
        self.stats["comm_s"] += time.perf_counter() - start

    def take_stats(self) -> dict[str, Any]:
        """The figures since the previous call, then start counting afresh."""
        stats, self.stats = self.stats, self._zero()
        return stats


class GradientSync:
    """Averages the gradients of ``params`` over the ranks: one subclass per ``[strategy] sync`` mode.

    The strategy calls :meth:`finish_gradient_synchronization` after the backward of a step's last micro-batch
    (only with a process group); afterwards every ``.grad`` of ``params`` is the mean over the ranks. A mode that
    overlaps communication with backward registers hooks (:meth:`hook_each`) that start it earlier; they launch
    nothing unless :meth:`launching`, so the earlier micro-batches of gradient accumulation accumulate into
    ``.grad`` locally, as under DDP's ``no_sync``.

    Args:
        params: the parameters that get gradients, in registration order, the same on every rank.
        all_reduce: the counted all-reduce of this rank.
    """

    def __init__(self, params: list[torch.nn.Parameter], all_reduce: CountedAllReduce) -> None:
        self.params = params
        self.all_reduce = all_reduce
        self.last_micro_batch = True
        """False while gradients accumulate (set by the strategy's ``accumulating(sync)``)."""
        self.hooks: list[Any] = []

    def hook_each(self, hook: Callable[[torch.nn.Parameter], None]) -> None:
        """Call ``hook(p)`` whenever autograd has accumulated ``p.grad`` for this backward."""
        self.hooks = [p.register_post_accumulate_grad_hook(hook) for p in self.params]

    def launching(self) -> bool:
        """Whether a hook may start communication now: on the last micro-batch, with a process group."""
        return self.last_micro_batch and self.all_reduce.active

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Remove the hooks and forget anything in flight (idempotent). Nothing is waited for: after a failure
        a peer may never answer, and the process group's teardown ends the collectives anyway."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
