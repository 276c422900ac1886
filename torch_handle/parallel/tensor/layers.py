"""Tensor-parallel layers written by hand: column- and row-parallel linears and a vocabulary-parallel embedding.

Each layer is made from the one-process layer it replaces (``from_linear`` / ``from_embedding``) by keeping this
rank's slice of the weights, so a model built with one seed on every rank and then split equals the one-process
model exactly. Parameter names stay ``weight``/``bias``: a checkpoint or a gradient can be matched name by name
with the one-process model after gathering the slices (:func:`~torch_handle.parallel.tensor.plan.unshard`).

Megatron's layout (Shoeybi et al. 2019, §3): in an attention block Q, K, V are column-parallel (each rank gets
n_heads/tp whole heads) and the output projection is row-parallel; in the FFN the first linear is column-parallel
(a slice of d_ff) and the second row-parallel. Then the block needs one collective forward (``g`` after the
row-parallel linear) and one backward (``f`` before the column-parallel ones).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_handle.parallel.tensor.mappings import (TPGroup, copy_to_tp, gather_from_sp, reduce_from_tp,
                                                   scatter_to_sp)

SHARD_ATTR = "tensor_parallel_shard"
"""Set on a parameter of which this rank holds a slice (the weight of a column- or row-parallel linear, the bias of
a column-parallel one, the vocabulary-parallel table): its gradient norm is a sum over the TP group."""
SP_GRAD_ATTR = "sequence_parallel_grad"
"""Set on a parameter whose gradient is a partial sum over the TP group: over the sequence shards (LayerNorm weights
and the bias of a row-parallel linear under sequence parallelism), or over the heads (a per-head q/k norm, which
each rank applies to its own heads, with or without sequence parallelism): :func:`all_reduce_sp_grads` must sum it
over the TP group before the optimizer step, or each rank steps with the gradient of its share of the tokens or
heads."""


def _shard(t: Tensor) -> nn.Parameter:
    p = nn.Parameter(t)
    setattr(p, SHARD_ATTR, True)
    return p


def shard_along(full: Tensor, tp: TPGroup, dim: int, parts: int | Sequence[int] = 1) -> Tensor:
    """Rank ``tp.rank``'s slice of ``full`` along ``dim``, a new contiguous tensor: the one slicing rule of every
    layer here and of checkpoint loading (:func:`~torch_handle.parallel.tensor.plan.shard`).

    ``parts`` when ``full`` is several blocks stacked along ``dim``: their number when they are equal (3 for a fused
    [Q; K; V] weight (3·C, C) or bias (3·C,)), or their sizes (grouped-query attention: (H·d_k, H_kv·d_k,
    H_kv·d_k)). The rank keeps its slice of every block, so that it holds whole heads of Q, K and V (Megatron's
    per-group layout; torchtitan's FusedQKVLinear). Shape: ``full``'s with ``dim`` divided by tp."""
    full = full.detach()
    blocks = full.split(list(parts), dim=dim) if isinstance(parts, Sequence) else full.chunk(parts, dim=dim)
    return torch.cat([tp.split(block, dim) for block in blocks], dim=dim)


def _part_sizes(out_features: int, parts: int | Sequence[int]) -> tuple[int, ...]:
    """The output features of each stacked part: ``parts`` itself, or ``parts`` equal shares of out_features."""
    return tuple(parts) if isinstance(parts, Sequence) else (out_features // parts,) * parts


class ColumnParallelLinear(nn.Module):
    """y_r = x A_r + b_r: this rank's slice of the output features (Megatron's column-parallel linear).

    Input: x (b, s, h_in) replicated on every TP rank, or (b, s/tp, h_in) under sequence parallelism (gathered
    here). Output: (b, s, h_out/tp), this rank's features, never gathered (the next layer is row-parallel or the
    vocabulary-parallel loss). weight (h_out/tp, h_in), bias (h_out/tp,) or None.

    ``parts`` when the output is several projections stacked: their number when equal (fused QKV: 3), else their
    output features (fused QKV with grouped-query attention: (H·d_k, H_kv·d_k, H_kv·d_k)). Each part is split on
    its own, and ``forward(x, parts=slice(i, j))`` computes only parts i..j-1 of this rank's slice, (b, s, their
    features / tp) (the model's ``StackedLinear``: a cross-attention's Q of the decoder state, K and V of the
    memory). ``local_parts``: this rank's features of each part.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, tp: TPGroup, *, sequence_parallel: bool = False,
                 parts: int | Sequence[int] = 1) -> None:
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.local_parts = _part_sizes(weight.shape[0], parts)
        self.weight = _shard(weight)
        self.bias = None if bias is None else _shard(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp: TPGroup, *, sequence_parallel: bool = False,
                    parts: int | Sequence[int] = 1) -> ColumnParallelLinear:
        """Raises ValueError when a part's output features (``out_features`` / parts when equal) are not divisible
        by tp, or the part sizes do not add up to ``out_features``."""
        sizes = _part_sizes(linear.out_features, parts)
        if sum(sizes) != linear.out_features or any(size % tp.size for size in sizes):
            raise ValueError(f"parts {sizes} are not each divisible by tp {tp.size}" if isinstance(parts, Sequence)
                             else f"out_features {linear.out_features} is not divisible by {parts} x tp {tp.size}")
        bias = None if linear.bias is None else shard_along(linear.bias, tp, 0, parts)
        return cls(shard_along(linear.weight, tp, 0, parts), bias, tp, sequence_parallel=sequence_parallel,
                   parts=[size // tp.size for size in sizes])

    def forward(self, x: Tensor, parts: slice | None = None) -> Tensor:
        x = gather_from_sp(x, self.tp) if self.sequence_parallel else copy_to_tp(x, self.tp)
        weight, bias = self.weight, self.bias
        if parts is not None:  # local [A_0,r; A_1,r; ...]: this rank's rows of each part, the selected ones' a view
            start, stop, _ = parts.indices(len(self.local_parts))
            offset, rows = sum(self.local_parts[:start]), sum(self.local_parts[start:stop])
            weight = weight.narrow(0, offset, rows)
            bias = None if bias is None else bias.narrow(0, offset, rows)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return (f"local {tuple(self.weight.shape)}, tp={self.tp.size}, parts={self.local_parts}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = sum_r x_r A_r + b: each rank multiplies its slice of the input features; the partial sums are reduced
    (Megatron's row-parallel linear).

    Input: x (b, s, h_in/tp), this rank's features (from a column-parallel layer). Output: (b, s, h_out) the full
    sum replicated, or (b, s/tp, h_out) this rank's sequence shard under sequence parallelism. weight
    (h_out, h_in/tp); bias (h_out,) replicated, added once after the reduction."""

    def __init__(self, weight: Tensor, bias: Tensor | None, tp: TPGroup, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.weight = _shard(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        if self.bias is not None and sequence_parallel:
            setattr(self.bias, SP_GRAD_ATTR, True)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp: TPGroup, *, sequence_parallel: bool = False) -> RowParallelLinear:
        """Raises ValueError when ``in_features`` is not divisible by tp."""
        if linear.in_features % tp.size:
            raise ValueError(f"in_features {linear.in_features} is not divisible by tp {tp.size}")
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(shard_along(linear.weight, tp, 1), bias, tp, sequence_parallel=sequence_parallel)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        y = scatter_to_sp(y, self.tp) if self.sequence_parallel else reduce_from_tp(y, self.tp)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"local {tuple(self.weight.shape)}, tp={self.tp.size}, sequence_parallel={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across the TP group: rank r holds rows
    [r·V/tp, (r+1)·V/tp) of the (V, h) table (Megatron's VocabParallelEmbedding).

    Each rank looks up the ids in its range and writes zeros for the others; the sum over the group (``g``, or a
    reduce-scatter along the sequence under sequence parallelism) is the one-process lookup.
    ids (b, s) long -> (b, s, h) replicated, or (b, s/tp, h) under sequence parallelism. weight (V/tp, h)."""

    def __init__(self, weight: Tensor, vocab_size: int, tp: TPGroup, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.weight = _shard(weight)
        self.vocab_start = tp.rank * weight.shape[0]
        self.vocab_size = vocab_size

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, tp: TPGroup, *,
                       sequence_parallel: bool = False) -> VocabParallelEmbedding:
        """Raises ValueError when the vocabulary size is not divisible by tp."""
        vocab = embedding.num_embeddings
        if vocab % tp.size:
            raise ValueError(f"vocab_size {vocab} is not divisible by tp {tp.size}")
        return cls(shard_along(embedding.weight, tp, 0), vocab, tp, sequence_parallel=sequence_parallel)

    @property
    def embedding_dim(self) -> int:
        return self.weight.shape[1]

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])  # (b, s): ids another rank holds
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (b, s, h)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return scatter_to_sp(out, self.tp) if self.sequence_parallel else reduce_from_tp(out, self.tp)

    def extra_repr(self) -> str:
        return f"rows [{self.vocab_start}, {self.vocab_start + self.weight.shape[0]}) of {self.vocab_size}"


def mark_sequence_parallel(module: nn.Module) -> None:
    """Flag every parameter of ``module`` (a LayerNorm run on a sequence shard) for :func:`all_reduce_sp_grads`."""
    for p in module.parameters():
        setattr(p, SP_GRAD_ATTR, True)


def all_reduce_sp_grads(model: nn.Module, tp: TPGroup) -> int:
    """Sum over the TP group the gradients of the parameters flagged with ``SP_GRAD_ATTR`` (Korthikanti et al. 2022
    §4.2.2: LayerNorm parameters see 1/tp of the tokens on each rank). Call after backward, before clipping and the
    optimizer step. Returns the number of elements reduced."""
    return all_reduce_grads([p.grad for p in model.parameters() if getattr(p, SP_GRAD_ATTR, False)], tp)


def all_reduce_grads(grads: list[Tensor | None], tp: TPGroup) -> int:
    """Sum ``grads`` (plain tensors; None skipped) over the TP group in one flat all-reduce, in place. Returns the
    number of elements reduced."""
    grads = [g for g in grads if g is not None]
    if not grads:
        return 0
    flat = tp.all_reduce(torch.cat([g.reshape(-1) for g in grads]))
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return offset
