"""Ulysses by hand (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
Long Sequence Transformer Models"; DeepSpeed's ``sequence/layer.py``, ``DistributedAttention``).

Instead of moving keys past queries, Ulysses moves the heads: one all-to-all turns each rank's sequence shard of
all heads into the whole sequence of 1/cp of the heads, every rank runs ordinary attention on its heads, and a
second all-to-all turns the output back into sequence shards::

    cp = 4, H heads, T tokens

    rank r: q, k, v (B, H, T/4, D) ── all-to-all ──▶ (B, H/4, T, D): heads [r·H/4, (r+1)·H/4), every token
            attention over the whole sequence on those heads (mask from the gathered positions and documents)
    rank r: (B, H/4, T, D) ── all-to-all ──▶ out (B, H, T/4, D)

The backward of an all-to-all is the reverse all-to-all of the gradients, so the backward is the same two
exchanges in the other direction around :class:`~torch_handle.parallel.context.blocks.LocalAttention`'s written-out
backward. Each all-to-all moves 1/cp of the tensor per rank pair, so its volume per rank stays constant as cp grows
with the sequence -- the paper's point -- but cp cannot exceed the number of heads: query heads and key/value heads
must both be divisible by cp (a K/V head's query group then lands on the rank that holds the K/V head).

Shape letters: B batch, H query heads, H_kv key/value heads, T/cp the local shard, T = cp · T/cp, D channels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from torch_handle.parallel.context.blocks import LocalAttention, Tokens, default_scale, tile_size
from torch_handle.parallel.context.comms import all_gather, all_to_all, cp_size


class _AllToAll(torch.autograd.Function):
    """:func:`~torch_handle.parallel.context.comms.all_to_all` with its adjoint, the reverse all-to-all, as backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_to_all(grad, ctx.gather_dim, ctx.scatter_dim, ctx.group), None, None, None


def check_heads(n_heads: int, n_kv_heads: int, cp: int) -> None:
    """Raises ValueError (one line) unless cp divides both n_heads and n_kv_heads."""
    if n_heads % cp or n_kv_heads % cp:
        raise ValueError(f"ulysses needs n_heads ({n_heads}) and n_kv_heads ({n_kv_heads}) divisible by cp ({cp}); "
                         f"use ring or allgather")


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, group: dist.ProcessGroup | None = None,
                      *, document_ids: Tensor | None = None, causal: bool = True,
                      scale: float | None = None) -> Tensor:
    """Attention of this rank's queries to the keys of every rank of ``group``, by two all-to-alls over heads.

    Args:
        q: (B, H, T/cp, D); k, v: (B, H_kv, T/cp, D); positions, document_ids: (B, T/cp) long; group, causal,
            scale: as for :func:`~torch_handle.parallel.context.ring.ring_attention`.

    Returns:
        (B, H, T/cp, D) in q's dtype, differentiable in q, k and v.

    Raises:
        ValueError: H or H_kv not divisible by cp.
    """
    cp = cp_size(group)
    check_heads(q.shape[1], k.shape[1], cp)
    # sequence shards -> head shards: (B, H, T/cp, D) -> (B, H/cp, T, D), tokens in rank order
    q_heads, k_heads, v_heads = (_AllToAll.apply(x, group, 1, 2) for x in (q, k, v))
    tokens = Tokens(all_gather(positions, 1, group),  # (B, T), in the same rank order as the tokens
                    None if document_ids is None else all_gather(document_ids, 1, group))
    # tiles of half a shard: each inside one head or tail chunk, the causal future's skipped
    out = LocalAttention.apply(q_heads, k_heads, v_heads, tokens, tokens, causal, default_scale(q, scale),
                               tile_size(q.shape[2]))  # (B, H/cp, T, D)
    return _AllToAll.apply(out, group, 2, 1)  # head shards -> sequence shards: (B, H, T/cp, D)
