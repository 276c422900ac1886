"""Attention on one block of keys, with its log-sum-exp: the piece every context-parallel algorithm is made of.

A rank holding a shard of the queries sees the keys one block at a time (the ring), all at once (all-gather) or for
its heads only (Ulysses). What makes blocks composable is the log-sum-exp of each query row's scores (Milakov &
Gimelshein 2018, "Online normalizer calculation for softmax"; FlashAttention, Dao et al. 2022, §3.1): with
``lse = log Σ_s exp(score_s)`` over a block, the softmax over the union of two blocks a and b is

    lse   = logaddexp(lse_a, lse_b)
    out   = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b

and the backward needs only the final ``out`` and ``lse`` (FlashAttention-2, Dao 2023, Algorithm 2): per block,
``P = exp(S - lse)`` is the block's share of the final softmax, and

    dV = Pᵀ dO     dP = dO Vᵀ     dS = P ∘ (dP - Δ),  Δ = rowsum(dO ∘ O)     dQ = scale · dS K     dK = scale · dSᵀ Q

**Tiles.** A block is attended as tiles of half a shard (:func:`tile_size`), and a tile whose queries see none of
its keys is skipped; the mask, the merge and the backward are per tile.

**Masks.** A key s is visible to a query t when both lie in one document and, for causal attention, s does not
come after t; each token carries its ``position`` (its index in the whole sequence, or its position inside its
document: handle's ``position_ids``; either orders one document's tokens) and its document id, so a block's mask is
computed from the tokens it holds, whatever shard or permutation they came from. The model's document mask
(``transformer.document_mask_of``) is the same relation. A query row that sees no key of a block has
``lse = -inf`` and output 0 there; the merge and the backward read such rows as weight 0 (never ``-inf - -inf``).

**Grouped-query attention.** q has H heads, k and v H_kv (dividing H); query head h reads K/V head h // (H / H_kv),
as in ``attention.repeat_kv``. Here the query heads are viewed as (H_kv, G) groups instead of repeating K and V.

Everything is computed in ``accumulation_dtype`` (float32 for half-precision inputs, else the inputs' dtype).

Shape letters: B batch, H query heads, H_kv key/value heads, G = H / H_kv, T query tokens, S key tokens, D channels.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where block outputs, log-sum-exps and gradients are accumulated: float32 at least, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def default_scale(q: Tensor, scale: float | None) -> float:
    """1 / √D unless given: SDPA's and the model's scale."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


@dataclass
class Tokens:
    """What the mask needs to know of a run of tokens: ``positions`` (B, n) long and ``documents`` (B, n) long, or
    None for one document. ``tokens[s]`` is the run's slice s along n."""

    positions: Tensor
    documents: Tensor | None = None

    def __getitem__(self, s: slice) -> Tokens:
        return Tokens(self.positions[:, s], None if self.documents is None else self.documents[:, s])

    def __len__(self) -> int:
        return self.positions.shape[1]


def visible(queries: Tokens, keys: Tokens, causal: bool) -> Tensor | None:
    """The mask of one block: bool (B, 1, 1, T, S), True where query t may attend key s (same document and, when
    ``causal``, ``k_position <= q_position``); None when everything is visible (not causal, no documents)."""
    mask = None
    if causal:
        mask = keys.positions[:, None, :] <= queries.positions[:, :, None]  # (B, T, S)
    if queries.documents is not None:
        same = keys.documents[:, None, :] == queries.documents[:, :, None]  # (B, T, S)
        mask = same if mask is None else mask & same
    return None if mask is None else mask[:, None, None]  # (B, 1, 1, T, S): broadcast over (H_kv, G)


def _grouped(x: Tensor, n_kv_heads: int) -> Tensor:
    """(B, H, T, D) -> (B, H_kv, G, T, D): query heads grouped by the K/V head they read."""
    B, H, T, D = x.shape
    return x.reshape(B, n_kv_heads, H // n_kv_heads, T, D)


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """scale · Q Kᵀ with masked scores at -inf: (B, H_kv, G, T, S) in q's dtype."""
    scores = _grouped(q, k.shape[1]) @ k.unsqueeze(2).transpose(-2, -1) * scale  # (B, H_kv, G, T, S)
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _finite(lse: Tensor) -> Tensor:
    """lse with -inf (a row that sees no key) replaced by 0, to subtract without NaN: exp(-inf - 0) = 0."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """softmax(scale · Q Kᵀ) V over one block of keys, and the block's log-sum-exp.

    Args:
        q: (B, H, T, D); k, v: (B, H_kv, S, D); mask: bool (B, 1, 1, T, S) or None (:func:`visible`).

    Returns:
        out (B, H, T, D) and lse (B, H, T), in the accumulation dtype; rows that see no key: out 0, lse -inf.
    """
    B, H, T, D = q.shape
    dtype = accumulation_dtype(q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scores = _scores(q, k, mask, scale)  # (B, H_kv, G, T, S)
    lse = scores.logsumexp(dim=-1, keepdim=True)  # (B, H_kv, G, T, 1); -inf where every key is masked
    out = torch.exp(scores - _finite(lse)) @ v.unsqueeze(2)  # (B, H_kv, G, T, D)
    return out.reshape(B, H, T, D), lse.reshape(B, H, T)


def merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial attentions of the same queries over disjoint keys, merged into one (the formula above).

    out, block_out (B, H, T, D); lse, block_lse (B, H, T). ``logaddexp`` never overflows; where both are -inf the
    merged lse is -inf and both weights are exp(-inf - 0) = 0."""
    merged = torch.logaddexp(lse, block_lse)  # (B, H, T)
    safe = _finite(merged)
    out = out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return out, merged


def attend_backward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, dout: Tensor, lse: Tensor,
                    delta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One block's share of the gradients, given the final (merged over every block) ``lse`` and ``delta``.

    Args:
        q, dout: (B, H, T, D); k, v: (B, H_kv, S, D); mask as for :func:`attend`.
        lse: (B, H, T), the log-sum-exp over all keys; delta: (B, H, T), rowsum(dout ∘ out) of the final out.

    Returns:
        dq (B, H, T, D) -- this block's term of the query gradient -- and dk, dv (B, H_kv, S, D), all in the
        accumulation dtype; the K/V heads' gradients summed over their query groups.
    """
    B, H, T, D = q.shape
    H_kv = k.shape[1]
    dtype = accumulation_dtype(q.dtype)
    q, k, v, dout = q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)
    scores = _scores(q, k, mask, scale)  # (B, H_kv, G, T, S)
    p = torch.exp(scores - _finite(_grouped(lse.unsqueeze(-1), H_kv)))  # the block's part of the final softmax
    grouped_dout = _grouped(dout, H_kv)  # (B, H_kv, G, T, D)
    dv = (p.transpose(-2, -1) @ grouped_dout).sum(dim=2)  # (B, H_kv, S, D)
    dp = grouped_dout @ v.unsqueeze(2).transpose(-2, -1)  # (B, H_kv, G, T, S)
    ds = p * (dp - _grouped(delta.unsqueeze(-1), H_kv))  # (B, H_kv, G, T, S)
    dq = (ds @ k.unsqueeze(2)).reshape(B, H, T, D) * scale
    dk = (ds.transpose(-2, -1) @ _grouped(q, H_kv)).sum(dim=2) * scale  # (B, H_kv, S, D)
    return dq, dk, dv


def row_delta(dout: Tensor, out: Tensor) -> Tensor:
    """Δ = rowsum(dO ∘ O): (B, H, T), in the accumulation dtype."""
    dtype = accumulation_dtype(out.dtype)
    return (dout.to(dtype) * out.to(dtype)).sum(dim=-1)


# ---- tiles: a block attended piece by piece, the pieces that see nothing skipped --------------------------------


@dataclass
class TileCounts:
    """How many (query tile, key tile) pairs a rank computed and skipped, forward and backward together."""

    computed: int = 0
    skipped: int = 0


def tile_size(shard_len: int) -> int:
    """Half a shard of T/cp tokens: under head-tail balancing its head and its tail chunk, the zigzag's halves, so
    that a tile lies inside one chunk and the causal future's tiles are whole and skippable."""
    return max(1, shard_len // 2)


def _tiles(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def visible_tiles(queries: Tokens, keys: Tokens, causal: bool, size: int,
                  counts: TileCounts | None = None) -> Iterator[tuple[slice, slice, Tensor | None]]:
    """(query slice, key slice, mask) of each tile of ``size`` × ``size`` tokens that has a visible pair; the others
    (no query sees any of their keys: the causal future, other documents) are counted in ``counts`` and left out.

    Which tiles to skip is decided for the whole block with one host read (the tiles' ``any`` stacked), not one per
    tile: on a GPU each read waits for the device, which would stall the host once per tile (four times a block).
    The tiles' bool masks, (B, size, size) each, are kept until used: each is 1/(4·H) of its tile's fp32 scores
    (B, H, size, size), a block's four together 1/H of one tile's."""
    tiles = [(qs, ks, visible(queries[qs], keys[ks], causal))
             for qs in _tiles(len(queries), size) for ks in _tiles(len(keys), size)]
    masks = [mask for _, _, mask in tiles if mask is not None]
    seen = iter(torch.stack([mask.any() for mask in masks]).tolist() if masks else [])
    for qs, ks, mask in tiles:
        if mask is not None and not next(seen):
            if counts is not None:
                counts.skipped += 1
            continue
        if counts is not None:
            counts.computed += 1
        yield qs, ks, mask


def empty_output(q: Tensor) -> tuple[Tensor, Tensor]:
    """The merge's start: out 0 (B, H, T, D) and lse -inf (B, H, T), in the accumulation dtype."""
    dtype = accumulation_dtype(q.dtype)
    return q.new_zeros(q.shape, dtype=dtype), q.new_full(q.shape[:-1], float("-inf"), dtype=dtype)


def attend_tiles(q: Tensor, k: Tensor, v: Tensor, queries: Tokens, keys: Tokens, causal: bool, scale: float,
                 size: int, out: Tensor, lse: Tensor, counts: TileCounts | None = None) -> None:
    """Attend q (B, H, T, D) to one block of keys k, v (B, H_kv, S, D) tile by tile, merging each visible tile into
    ``out`` (B, H, T, D) and ``lse`` (B, H, T) in place (:func:`empty_output` to start)."""
    for qs, ks, mask in visible_tiles(queries, keys, causal, size, counts):
        tile_out, tile_lse = attend(q[:, :, qs], k[:, :, ks], v[:, :, ks], mask, scale)
        out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], tile_out, tile_lse)


def attend_tiles_backward(q: Tensor, k: Tensor, v: Tensor, queries: Tokens, keys: Tokens, causal: bool, scale: float,
                          size: int, dout: Tensor, lse: Tensor, delta: Tensor, dq: Tensor,
                          counts: TileCounts | None = None) -> tuple[Tensor, Tensor]:
    """One block's gradients, tile by tile (:func:`attend_backward`, given the final ``lse`` and ``delta``): adds the
    block's terms to ``dq`` (B, H, T, D) in place and returns its dk, dv (B, H_kv, S, D), in the accumulation
    dtype."""
    dtype = accumulation_dtype(q.dtype)
    dk, dv = torch.zeros_like(k, dtype=dtype), torch.zeros_like(v, dtype=dtype)
    for qs, ks, mask in visible_tiles(queries, keys, causal, size, counts):
        tile_dq, tile_dk, tile_dv = attend_backward(q[:, :, qs], k[:, :, ks], v[:, :, ks], mask, scale, dout[:, :, qs],
                                                    lse[:, :, qs], delta[:, :, qs])
        dq[:, :, qs] += tile_dq
        dk[:, :, ks] += tile_dk
        dv[:, :, ks] += tile_dv
    return dk, dv


class LocalAttention(torch.autograd.Function):
    """Masked attention of one process over tiles of ``size`` tokens, as an autograd function: forward
    :func:`attend_tiles`, backward :func:`attend_tiles_backward` (no score matrix is saved, only q, k, v, the output
    and its lse). Ulysses runs it on its heads over the whole sequence."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, queries: Tokens, keys: Tokens, causal: bool, scale: float,
                size: int) -> Tensor:
        out, lse = empty_output(q)
        attend_tiles(q, k, v, queries, keys, causal, scale, size, out, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.queries, ctx.keys, ctx.causal, ctx.scale, ctx.size = queries, keys, causal, scale, size
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq = torch.zeros_like(out)
        dk, dv = attend_tiles_backward(q, k, v, ctx.queries, ctx.keys, ctx.causal, ctx.scale, ctx.size, dout, lse,
                                       row_delta(dout, out), dq)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
