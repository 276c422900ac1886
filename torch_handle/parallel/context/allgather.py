"""All-gather attention by hand (Llama 3 paper, Dubey et al. 2024, §3.3.2 "context parallelism"; Megatron-Core's
``cp_comm_type = "all_gather"``).

Llama 3 gathers the keys and values instead of passing them around a ring: with grouped-query attention K and V
are much smaller than Q, so one all-gather per layer costs little, and with every key in hand a rank can apply
any mask -- the document mask of packed sequences included -- in one ordinary attention. Each rank computes its
own queries' rows::

    forward, cp = 4                                    backward

    K0 K1 K2 K3 ── all-gather ──▶ K (every rank)        dK, dV (every rank: its queries' terms for all keys)
    rank r: Qr · K  (mask: positions, documents)         ── reduce-scatter ──▶ rank r: dKr, dVr summed over ranks

The gathered K/V are transient: the forward keeps only the local shards, and the backward gathers them again
(one more all-gather, instead of holding cp × the K/V of every layer until backward). The gathered positions and
document ids make the mask, so the shards may come in any order (head-tail balanced or contiguous).

Shape letters: B batch, H query heads, H_kv key/value heads, T/cp the local shard, T = cp · T/cp, D channels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from torch_handle.parallel.context.blocks import (Tokens, attend_tiles, attend_tiles_backward, default_scale,
                                                  empty_output, row_delta, tile_size)
from torch_handle.parallel.context.comms import all_gather, reduce_scatter


def _gathered(queries: Tokens, group: dist.ProcessGroup | None) -> Tokens:
    """Every rank's tokens in rank order, (B, T): the gathered keys' positions and documents."""
    return Tokens(all_gather(queries.positions, 1, group),
                  None if queries.documents is None else all_gather(queries.documents, 1, group))


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, queries: Tokens, group: dist.ProcessGroup | None,
                causal: bool, scale: float) -> Tensor:
        keys, size = _gathered(queries, group), tile_size(q.shape[2])
        out, lse = empty_output(q)  # (B, H, T/cp, D), (B, H, T/cp)
        attend_tiles(q, all_gather(k, 2, group), all_gather(v, 2, group), queries, keys, causal, scale, size, out,
                     lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.queries, ctx.keys, ctx.group, ctx.causal, ctx.scale = queries, keys, group, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        dq = torch.zeros_like(out)
        dk, dv = attend_tiles_backward(q, all_gather(k, 2, group), all_gather(v, 2, group), ctx.queries, ctx.keys,
                                       ctx.causal, ctx.scale, tile_size(q.shape[2]), dout, lse,
                                       row_delta(dout, out), dq)  # dk, dv: (B, H_kv, T, D), this rank's queries' terms
        dk, dv = reduce_scatter(dk, 2, group), reduce_scatter(dv, 2, group)  # (B, H_kv, T/cp, D), summed
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, group: dist.ProcessGroup | None = None,
                        *, document_ids: Tensor | None = None, causal: bool = True,
                        scale: float | None = None) -> Tensor:
    """Attention of this rank's queries to the keys of every rank of ``group``, K/V all-gathered once.

    Args:
        q: (B, H, T/cp, D); k, v: (B, H_kv, T/cp, D), H_kv dividing H; positions, document_ids: (B, T/cp) long;
            group, causal, scale: as for :func:`~torch_handle.parallel.context.ring.ring_attention`.

    Returns:
        (B, H, T/cp, D) in q's dtype, differentiable in q, k and v (a written-out backward whose dK/dV are
        reduce-scattered to their owners: ``_AllGatherAttention``).
    """
    return _AllGatherAttention.apply(q, k, v, Tokens(positions, document_ids), group, causal, default_scale(q, scale))
