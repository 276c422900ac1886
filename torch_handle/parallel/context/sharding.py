"""Which tokens each cp rank holds: the head-tail (zigzag) permutation, sharding by it, and the work it balances.

**Why a permutation.** Under a causal mask query t attends t + 1 keys, so cutting the sequence into cp contiguous
shards gives rank r about (2r + 1)/cp² of the T²/2 query-key pairs: the last rank does (2cp - 1)/cp times the
mean (1.75 at cp 4, toward 2 as cp grows) and every other rank waits for it. Cut instead into 2·cp chunks and let
rank r hold chunks r and 2cp - 1 - r (a head chunk and the mirrored tail chunk): chunk c costs about 2c + 1 units
of the triangle, so rank r gets (2r + 1) + (4cp - 2r - 1) = 4cp units, the same for all (Megatron-LM's context
parallelism with Transformer Engine; ring-flash-attention's ``zigzag_ring_flash_attn``; torchtitan's
``_HeadTailLoadBalancer``; Llama 3 §3.3.2).

**Packed documents.** With a document mask the triangle is one per document, and head-tail on the whole sequence
no longer balances (random documents of mean T/16 at cp 4: 1.45 × the mean, worse than contiguous shards). So each
document is cut into 2·cp chunks and rank r takes chunks r and 2cp - 1 - r of every document (Megatron's THD
layout and ring-flash-attention's ``zigzag_ring_flash_attn_varlen``, which require every length to divide by 2·cp).
Here a length need not divide: a document's first n mod 2·cp tokens, its cheapest, go to a pool dealt head-tail
across the ranks (``_document_head_tail_order``), so every rank still holds exactly T/cp tokens.

**What is sharded.** The permutation is computed on the whole sequence, and tokens, labels (already shifted by
one on the whole sequence, so a shard's last token keeps its label), positions and document ids are all sharded
by it (torchtitan's ``context_parallel`` buffers): RoPE then rotates each token by its true position and the mask
(:mod:`~torch_handle.parallel.context.blocks`) compares true positions. An ``order`` (B, T) lists the sequence's
indices in shard order: rank r holds ``order[:, r·T/cp : (r+1)·T/cp]``.

Pure functions on tensors; no process group. Shape letters: B batch, T the whole sequence, T/cp a shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def document_ids_of(position_ids: Tensor) -> Tensor:
    """The document of each token, (B, T) long, from handle's ``position_ids`` (B, T), which restart at 0 at each
    document start: ``cumsum(position_ids == 0)``, the segments ``transformer.document_mask_of`` uses. Computed on
    the whole sequence, before sharding (a shard cannot tell where its first document began)."""
    return (position_ids == 0).cumsum(dim=1)


def head_tail_order(seq_len: int, cp: int) -> Tensor:
    """The head-tail permutation of one sequence, (T,) long: rank r's tokens are chunks r and 2cp - 1 - r of 2·cp.

    Raises:
        ValueError: ``seq_len`` not divisible by 2·cp.
    """
    if seq_len % (2 * cp):
        raise ValueError(f"head-tail balancing needs seq_len ({seq_len}) divisible by 2 × cp ({2 * cp})")
    chunks = torch.arange(seq_len).view(2 * cp, seq_len // (2 * cp))
    return torch.cat([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def _document_head_tail_order(documents: Tensor, cp: int) -> Tensor:
    """Head-tail per document for one row, documents (T,) contiguous ids, T divisible by 2·cp: (T,) in shard order.

    A document of n = 2cp·m + rem tokens gives its last 2cp·m tokens to the ranks head-tail (m tokens of chunk r and
    m of chunk 2cp - 1 - r to rank r: the same work for every rank, whatever the offset rem) and its first rem tokens
    to a pool; the pool (a multiple of 2·cp tokens, since T is) is dealt head-tail too. The pool's tokens are the
    cheapest of their documents (position < 2·cp: at most 2·cp keys each), so the balance they disturb is small."""
    lengths = torch.unique_consecutive(documents, return_counts=True)[1].tolist()
    per_rank: list[list[Tensor]] = [[] for _ in range(cp)]
    pool, start = [], 0
    for n in lengths:
        rem = n % (2 * cp)
        pool.append(torch.arange(start, start + rem))
        if n > rem:
            share = head_tail_order(n - rem, cp).view(cp, (n - rem) // cp) + start + rem  # (cp, m): rank r's row
            for r in range(cp):
                per_rank[r].append(share[r])
        start += n
    pooled = torch.cat(pool)
    if len(pooled):
        dealt = pooled[head_tail_order(len(pooled), cp)].view(cp, -1)
        for r in range(cp):
            per_rank[r].append(dealt[r])
    return torch.cat([torch.cat(share).sort().values for share in per_rank])  # each shard in sequence order


def shard_order(batch_size: int, seq_len: int, cp: int, document_ids: Tensor | None = None,
                balance: bool = True) -> Tensor:
    """The permutation every rank shards by, (B, T) long, rank r holding ``order[:, r·T/cp : (r+1)·T/cp]``.

    Args:
        batch_size, seq_len: B and T of the whole batch.
        cp: the context-parallel degree.
        document_ids: (B, T), the whole sequence's documents (:func:`document_ids_of`), contiguous along T: each
            row is balanced per document (its own permutation). None: one document per row.
        balance: False gives contiguous shards (rank r holds tokens r·T/cp .. (r+1)·T/cp - 1): the unbalanced
            layout, for comparison.

    Raises:
        ValueError: T not divisible by 2·cp (balance) or by cp (not).
    """
    if not balance:
        if seq_len % cp:
            raise ValueError(f"context parallelism needs seq_len ({seq_len}) divisible by cp ({cp})")
        return torch.arange(seq_len).expand(batch_size, seq_len).clone()
    whole = head_tail_order(seq_len, cp)
    if document_ids is None:
        return whole.expand(batch_size, seq_len).clone()
    return torch.stack([_document_head_tail_order(row, cp) for row in document_ids.cpu()]).to(document_ids.device)


def shard(x: Tensor, order: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """This rank's share of ``x``: the tokens ``order[:, rank·T/cp : (rank+1)·T/cp]`` along ``dim`` (T long),
    batch along dim 0. (B, T, ...) -> (B, T/cp, ...); for q/k/v (B, H, T, D) pass ``dim=2``."""
    T = order.shape[1]
    local = order[:, rank * T // cp:(rank + 1) * T // cp].to(x.device)  # (B, T/cp)
    moved = x.movedim(dim, 1)  # (B, T, ...)
    rows = torch.arange(moved.shape[0], device=x.device)[:, None]
    return moved[rows, local].movedim(1, dim)


def unshard(gathered: Tensor, order: Tensor, dim: int = 1) -> Tensor:
    """The whole sequence back in its own order from every rank's share concatenated in rank order along ``dim``
    (what an all-gather of the shards gives): the inverse of :func:`shard` over all ranks."""
    moved = gathered.movedim(dim, 1)
    rows = torch.arange(moved.shape[0], device=gathered.device)[:, None]
    out = torch.empty_like(moved)
    out[rows, order.to(gathered.device)] = moved
    return out.movedim(1, dim)


@dataclass
class LocalBatch:
    """One cp rank's share of a batch, every field (B, T/cp) long, sharded by one ``order`` (B, T).

    ``positions`` are the RoPE positions (handle's ``position_ids``, or 0 .. T - 1 without documents), also what the
    attention's mask compares; ``document_ids`` None means one document per row."""

    input_ids: Tensor
    labels: Tensor
    positions: Tensor
    document_ids: Tensor | None
    order: Tensor


def shard_batch(input_ids: Tensor, labels: Tensor, cp: int, rank: int, position_ids: Tensor | None = None,
                balance: bool = True) -> LocalBatch:
    """Shard a language-model batch for cp rank ``rank`` (torchtitan's ``cp_shard``).

    Args:
        input_ids: (B, T); labels: (B, T), already shifted on the whole sequence (labels[t] is the token after
            input_ids[t]), so the label of each shard's last token is the next shard's first token, not lost.
        position_ids: (B, T) restarting at 0 at each packed document, or None (positions 0 .. T - 1, one document).
        cp, rank, balance: as for :func:`shard_order`.
    """
    B, T = input_ids.shape
    documents = None if position_ids is None else document_ids_of(position_ids)
    positions = (torch.arange(T, device=input_ids.device).expand(B, T) if position_ids is None else position_ids)
    order = shard_order(B, T, cp, documents, balance)
    return LocalBatch(input_ids=shard(input_ids, order, cp, rank), labels=shard(labels, order, cp, rank),
                      positions=shard(positions, order, cp, rank),
                      document_ids=None if documents is None else shard(documents, order, cp, rank), order=order)


def attention_pairs(order: Tensor, cp: int, document_ids: Tensor | None = None, causal: bool = True) -> Tensor:
    """Unmasked query-key pairs per rank, (cp,) float64: the attention work each rank does (summed over the batch).

    A query at index t of a document starting at index a attends t - a + 1 keys under a causal mask, the whole
    document's length without; ``document_ids`` (B, T) on the whole sequence, contiguous along T, None: one
    document per row."""
    B, T = order.shape
    documents = torch.zeros(B, T, dtype=torch.long) if document_ids is None else document_ids.cpu()
    index = torch.arange(T).expand(B, T)
    if causal:
        starts = torch.ones(B, T, dtype=torch.bool)
        starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # each document's start
        keys = (index - first + 1).double()  # (B, T): keys each query sees
    else:
        dense = documents - documents.min(dim=1, keepdim=True).values  # ids from 0 per row
        lengths = torch.zeros(B, T, dtype=torch.double).scatter_add_(1, dense, torch.ones(B, T, dtype=torch.double))
        keys = lengths.gather(1, dense)
    per_rank = keys.gather(1, order.cpu()).view(B, cp, T // cp)  # (B, cp, T/cp) in shard order
    return per_rank.sum(dim=(0, 2))


def imbalance(pairs: Tensor) -> float:
    """max ÷ mean of the per-rank work (:func:`attention_pairs`): 1.0 is perfect balance, the step's attention
    waits for the busiest rank."""
    return float(pairs.max() / pairs.mean())
