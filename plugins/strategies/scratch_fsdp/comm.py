"""The collectives of sharded data parallelism, counted and timed."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from handle_plugins.strategies.scratch_ddp.comm import CountedAllReduce


class CountedCollectives(CountedAllReduce):
    """All-gather and reduce-scatter over the default group (``all_gather_single``, ``reduce_scatter_single``:
    gloo emulates both in torch 2.13, NCCL has them natively), beside scratch-ddp's counted all-reduce (the
    gradient norm's one float), all counted and timed for ``step_stats``.

    ``stats`` since the last :meth:`take_stats`: scratch-ddp's ``allreduce_calls``/``allreduce_bytes``;
    ``allgather_calls``, ``allgather_bytes`` (the gathered output, the unit's full padded buffer: what every rank
    receives, numel x element size); ``reducescatter_calls``, ``reducescatter_bytes`` (the full padded input each
    rank contributes); ``comm_s``: seconds this rank waited (a blocking all-reduce, or :meth:`wait` on an
    asynchronous collective: one that finished behind compute costs nothing here).

    Args:
        ctx: this rank's ``DistContext`` (``world_size``).
    """

    @staticmethod
    def _zero() -> dict[str, Any]:
        return {**CountedAllReduce._zero(), "allgather_calls": 0, "allgather_bytes": 0, "reducescatter_calls": 0,
                "reducescatter_bytes": 0}

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> Any:
        """Start gathering every rank's ``shard`` ``(padded / world_size,)`` into ``full`` ``(padded,)``, rank order.

        Returns:
            The ``dist.Work`` handle (pass it to :meth:`wait`).
        """
        self.stats["allgather_calls"] += 1
        self.stats["allgather_bytes"] += full.numel() * full.element_size()
        return dist.all_gather_single(full, shard, async_op=True)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> Any:
        """Start summing ``full`` ``(padded,)`` over the ranks, this rank receiving its slice into ``shard``.

        Returns:
            The ``dist.Work`` handle (pass it to :meth:`wait`).
        """
        self.stats["reducescatter_calls"] += 1
        self.stats["reducescatter_bytes"] += full.numel() * full.element_size()
        return dist.reduce_scatter_single(shard, full, async_op=True)
