"""Ring attention by hand (Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context";
ring-flash-attention's ``zigzag_ring_flash_attn``; picotron's ``context_parallel/``).

Each of the cp ranks holds its shard of the queries, keys and values. The K/V shards travel around the ring, each
with the positions and document ids of its tokens, and at every step a rank attends its queries to the block it
holds, merging the partial result by its log-sum-exp (:func:`~torch_handle.parallel.context.blocks.merge`)::

    forward, cp = 4 (Kj: rank j's K/V block; → the pass to the next rank, overlapped with the compute)

    step      0        1        2        3
    rank 0   Q0·K0 →  Q0·K3 →  Q0·K2 →  Q0·K1
    rank 1   Q1·K1 →  Q1·K0 →  Q1·K3 →  Q1·K2
    rank 2   Q2·K2 →  Q2·K1 →  Q2·K0 →  Q2·K3
    rank 3   Q3·K3 →  Q3·K2 →  Q3·K1 →  Q3·K0

The backward is given the final output and log-sum-exp (FlashAttention-2's backward, block by block): the K/V
blocks travel the ring again, and with each block travels the sum of its dK/dV terms from the ranks it has
visited; after the last step one more pass brings every block's dK/dV home to its owner (ring-flash-attention's
``zigzag_ring_flash_attn_backward``). dQ stays local.

**What is skipped.** Each shard is attended as its two halves (with head-tail balancing, its head and tail chunks:
the zigzag's tiles), so a block is four tiles; a tile whose queries see none of its keys (the causal future,
documents that do not overlap) is not computed (:func:`~torch_handle.parallel.context.blocks.visible_tiles`). Under
causal head-tail balancing every rank computes 2cp + 1 of its 4cp tiles.

**Overlap.** The next block's pass is posted (``batch_isend_irecv``) before the current block is computed and waited
for after, so on a backend with asynchronous point-to-point (NCCL; gloo's run on its own threads) transfer and
compute overlap. The backward's dK/dV pass must wait for the block's compute; it is posted right after.

Shape letters: B batch, H query heads, H_kv key/value heads, T/cp the local shard, D channels per head.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from torch_handle.parallel.context.blocks import (TileCounts, Tokens, attend_tiles, attend_tiles_backward,
                                                  default_scale, empty_output, row_delta, tile_size)
from torch_handle.parallel.context.comms import Ring


def _message(k: Tensor, v: Tensor, keys: Tokens) -> list[Tensor]:
    """What travels with a K/V block: its keys, values, positions and (with documents) document ids."""
    return [k, v, keys.positions] + ([] if keys.documents is None else [keys.documents])


def _unpack(message: list[Tensor]) -> tuple[Tensor, Tensor, Tokens]:
    return message[0], message[1], Tokens(message[2], message[3] if len(message) > 3 else None)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, queries: Tokens, group: dist.ProcessGroup | None,
                causal: bool, scale: float, counts: TileCounts | None) -> Tensor:
        ring = Ring(group)
        size = tile_size(q.shape[2])
        out, lse = empty_output(q)  # (B, H, T/cp, D), (B, H, T/cp)
        message = _message(k, v, queries)
        for step in range(ring.size):
            if step + 1 < ring.size:
                incoming = ring.pass_on(message)  # the next block travels while this one is computed
            block_k, block_v, keys = _unpack(message)
            attend_tiles(q, block_k, block_v, queries, keys, causal, scale, size, out, lse, counts)
            if step + 1 < ring.size:
                message = incoming.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.queries, ctx.group, ctx.causal, ctx.scale, ctx.counts = queries, group, causal, scale, counts
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring = Ring(ctx.group)
        size = tile_size(q.shape[2])
        delta = row_delta(dout, out)  # (B, H, T/cp)
        dq = torch.zeros_like(out)
        message = _message(k, v, ctx.queries)
        returning = None  # the dK/dV sums of the block this rank holds next, on their way from the previous rank
        for step in range(ring.size):
            if step + 1 < ring.size:
                incoming = ring.pass_on(message)
            block_k, block_v, keys = _unpack(message)
            dk, dv = attend_tiles_backward(q, block_k, block_v, ctx.queries, keys, ctx.causal, ctx.scale, size, dout,
                                           lse, delta, dq, ctx.counts)
            if returning is not None:  # add the terms of the ranks this block visited before
                earlier_dk, earlier_dv = returning.wait()
                dk += earlier_dk
                dv += earlier_dv
            returning = ring.pass_on([dk, dv])  # to the next rank, which holds this block next (or owns it)
            if step + 1 < ring.size:
                message = incoming.wait()
        dk, dv = returning.wait()  # this rank's own block, back after visiting every rank
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, group: dist.ProcessGroup | None = None, *,
                   document_ids: Tensor | None = None, causal: bool = True, scale: float | None = None,
                   counts: TileCounts | None = None) -> Tensor:
    """Attention of this rank's queries to the keys of every rank of ``group``, by ring.

    Args:
        q: (B, H, T/cp, D), this rank's shard of the queries (after RoPE).
        k, v: (B, H_kv, T/cp, D), this rank's shard of the keys and values; H_kv divides H (GQA; 1 is MQA).
        positions: (B, T/cp) long, each local token's position: its index in the whole sequence, or its position
            inside its document (``position_ids``; with ``document_ids``): what the causal mask compares.
        group: the cp process group (None: the default group); cp = its size, any cp ≥ 1.
        document_ids: (B, T/cp) long, each local token's document (``sharding.document_ids_of`` on the whole
            sequence, then sharded); None: one document.
        causal: mask the future (the decoder); False: full attention inside each document.
        scale: the scores' factor, default 1/√D.
        counts: when given, the tiles computed and skipped are added to it.

    Returns:
        (B, H, T/cp, D) in q's dtype: this rank's rows of softmax(scale · Q Kᵀ + mask) V over the whole sequence.
        Differentiable in q, k and v (a written-out backward: ``_RingAttention``).
    """
    return _RingAttention.apply(q, k, v, Tokens(positions, document_ids), group, causal, default_scale(q, scale),
                                counts)
