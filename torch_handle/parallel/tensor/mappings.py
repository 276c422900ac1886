"""The four conjugate communication functions of Megatron-style tensor parallelism, written as autograd functions.

A tensor-parallel (TP) region is the stretch of a block between a column-parallel linear's input and a
row-parallel linear's output: inside it every rank holds 1/tp of the features (whole attention heads, a slice of
d_ff). Outside it every rank holds the same activations (or, with sequence parallelism, 1/tp of the sequence).
Crossing the border costs one collective each way, and each forward collective has a conjugate in backward
(Shoeybi et al. 2019, "Megatron-LM", §3 and Fig. 3; Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", §4.2.2 and Fig. 5):

=============================  =========================  ==========================
function (entering / leaving)   forward                    backward
=============================  =========================  ==========================
``copy_to_tp`` (Megatron f)     identity                   all-reduce
``reduce_from_tp`` (g)          all-reduce                 identity
``gather_from_sp`` (f, SP)      all-gather along sequence  reduce-scatter along sequence
``scatter_to_sp`` (g, SP)       reduce-scatter along seq.  all-gather along sequence
=============================  =========================  ==========================

An all-reduce of n elements moves the same data as a reduce-scatter followed by an all-gather, so sequence
parallelism costs no extra communication; what it buys is that LayerNorm and dropout, outside the TP region, work
on 1/tp of the sequence (their activations shrink by tp).

Every collective is counted in the group's :class:`CommStats` (calls, bytes of the full tensor each rank
contributes or receives, seconds spent waiting) so that a run can report ``tp_comm_calls``/``tp_comm_bytes`` and
tests can hold the counts to the analytic volume. On gloo, ``reduce_scatter_tensor`` is emulated with an
all-reduce (torch's ProcessGroupGloo), so its time on CPU is not what NCCL's would be; the bytes are the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

# torch 2.13 renamed the tensor collectives (the old names warn); older torch has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """What one rank's TP collectives moved since the last :meth:`reset`.

    ``bytes`` counts, per collective, the size of the full (unsharded) tensor: an all-reduce of a (b, s, h) bf16
    activation counts 2·b·s·h bytes, and so do the all-gather and the reduce-scatter that replace it under
    sequence parallelism. ``wait_s`` is wall time inside the collective calls (blocking calls: the time this rank
    waited for the others plus the transfer)."""

    calls: int = 0
    bytes: int = 0
    wait_s: float = 0.0
    by_op: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        self.calls, self.bytes, self.wait_s = 0, 0, 0.0
        self.by_op.clear()

    def record(self, op: str, nbytes: int, seconds: float) -> None:
        self.calls += 1
        self.bytes += nbytes
        self.wait_s += seconds
        self.by_op[op] = self.by_op.get(op, 0) + 1


class TPGroup:
    """A tensor-parallel process group and its counters.

    ``group``: the ranks that split one layer (a ``DeviceMesh``'s "tp" dimension, or the default group when
    world_size == tp). ``rank`` and ``size`` are this process's index in it and its size (tp)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.stats = CommStats()

    def all_reduce(self, x: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        """Sum (or ``op``) of ``x`` over the group, in place when ``x`` is contiguous; returns the result."""
        x = x.contiguous()
        start = time.perf_counter()
        dist.all_reduce(x, op=op, group=self.group)
        self.stats.record("all_reduce", x.numel() * x.element_size(), time.perf_counter() - start)
        return x

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        """Concatenation along ``dim`` of every rank's ``x`` (all the same shape), in rank order, contiguous (as
        :meth:`reduce_scatter`'s result)."""
        moved = x.movedim(dim, 0).contiguous()  # gather along dim 0, the layout all_gather_into_tensor fills
        out = torch.empty((self.size * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
        start = time.perf_counter()
        _all_gather_single(out, moved, group=self.group)
        self.stats.record("all_gather", out.numel() * out.element_size(), time.perf_counter() - start)
        return out.movedim(0, dim).contiguous()

    def reduce_scatter(self, x: Tensor, dim: int) -> Tensor:
        """This rank's 1/size slice along ``dim`` of the sum over the group of ``x``, contiguous: the collective
        fills dim 0, and a strided view would travel on (a bias-free block's residual stream, the gradient a pipeline
        stage sends back: torch's schedules receive it into a buffer with the sender's strides, and gloo receives
        only into contiguous tensors)."""
        if x.shape[dim] % self.size:
            raise ValueError(f"reduce_scatter: dimension {dim} of size {x.shape[dim]} is not divisible by {self.size}")
        moved = x.movedim(dim, 0).contiguous()
        out = torch.empty((moved.shape[0] // self.size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
        start = time.perf_counter()
        _reduce_scatter_single(out, moved, group=self.group)
        self.stats.record("reduce_scatter", moved.numel() * moved.element_size(), time.perf_counter() - start)
        return out.movedim(0, dim).contiguous()

    def split(self, x: Tensor, dim: int) -> Tensor:
        """This rank's slice of ``x`` along ``dim`` (no communication)."""
        return x.chunk(self.size, dim)[self.rank].contiguous()


class _Conjugate(torch.autograd.Function):
    """y = forward(x), dL/dx = backward(dL/dy): each function of the table above is one such pair."""

    @staticmethod
    def forward(ctx, x: Tensor, forward: Callable[[Tensor], Tensor], backward: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.backward_fn = backward
        return forward(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.backward_fn(grad), None, None


def _identity(x: Tensor) -> Tensor:
    return x.view_as(x)


def copy_to_tp(x: Tensor, tp: TPGroup) -> Tensor:
    """Megatron's f, entering a TP region: identity forward, all-reduce of the gradient backward.
    x (..., h) replicated on every TP rank -> the same tensor."""
    return _Conjugate.apply(x, _identity, tp.all_reduce)


def reduce_from_tp(x: Tensor, tp: TPGroup) -> Tensor:
    """Megatron's g, leaving a TP region: all-reduce forward (each rank holds a partial sum), identity backward.
    x (..., h) partial sums -> (..., h) the full sum, replicated."""
    return _Conjugate.apply(x, tp.all_reduce, _identity)


def gather_from_sp(x: Tensor, tp: TPGroup, dim: int = 1) -> Tensor:
    """Sequence-parallel f: all-gather along the sequence forward, reduce-scatter backward.
    x (b, s/tp, h), this rank's sequence shard -> (b, s, h) replicated."""
    return _Conjugate.apply(x, partial(tp.all_gather, dim=dim), partial(tp.reduce_scatter, dim=dim))


def scatter_to_sp(x: Tensor, tp: TPGroup, dim: int = 1) -> Tensor:
    """Sequence-parallel g: reduce-scatter along the sequence forward, all-gather backward.
    x (b, s, h) partial sums -> (b, s/tp, h), this rank's shard of the full sum."""
    return _Conjugate.apply(x, partial(tp.reduce_scatter, dim=dim), partial(tp.all_gather, dim=dim))


def split_to_sp(x: Tensor, tp: TPGroup, dim: int = 1) -> Tensor:
    """Enter the sequence-parallel layout from a replicated tensor: keep this rank's shard forward (no
    communication), all-gather the gradient backward. x (b, s, h) replicated -> (b, s/tp, h)."""
    return _Conjugate.apply(x, partial(tp.split, dim=dim), partial(tp.all_gather, dim=dim))


def gather_sequence(x: Tensor, tp: TPGroup, dim: int = 1) -> Tensor:
    """Leave the sequence-parallel layout into a replicated tensor: all-gather forward, keep this rank's slice of
    the gradient backward (the conjugate of :func:`split_to_sp`). x (b, s/tp, h) -> (b, s, h)."""
    return _Conjugate.apply(x, partial(tp.all_gather, dim=dim), partial(tp.split, dim=dim))


def step_volume(*, n_layers: int, micro_batch_size: int, seq_len: int, d_model: int, grad_accum: int = 1,
                sequence_parallel: bool = False, element_bytes: int = 4, sp_grad_elements: int = 0,
                src_len: int | None = None) -> dict[str, int]:
    """The TP collectives of one optimizer step of the decoder (or, with ``src_len``, the encoder-decoder) split by
    hand with fused QKV, counted as :class:`CommStats` counts them: ``{"calls", "bytes"}`` (bytes of the full
    tensors), with every activation ``element_bytes`` wide (fp32: 4; under autocast the row-parallel outputs are
    16-bit while the gradients entering the TP regions stay fp32).

    Per micro-batch, with A = micro_batch_size · seq_len · d_model · element_bytes (one activation of the target, or
    only, sequence) and N = micro_batch_size · seq_len tokens:

    - each of the 2·n_layers TP regions (attention, FFN): one all-reduce forward (g) and one backward (f), 2A; with
      sequence parallelism an all-gather and a reduce-scatter each way instead, 4A (the same data: an all-reduce
      is a reduce-scatter followed by an all-gather; Korthikanti et al. 2022 §4.2.2);
    - the vocabulary-parallel embedding: one all-reduce forward (A); with sequence parallelism the hand-over to
      the sequence shards adds an all-gather of the gradient backward (A);
    - the LM head's input: f's all-reduce backward (A); with sequence parallelism an all-gather forward and a
      reduce-scatter backward (2A);
    - the vocabulary-parallel cross-entropy: an all-reduce of N fp32 maxima and one of (N, 3) fp32 sums: 16N.

    The encoder-decoder adds, with A_src the source's activation (``src_len`` tokens, the encoder's sequence):
    2·n_layers encoder regions on A_src, the embedding of the source (as above, on A_src), and in each decoder layer
    a cross-attention region (Q in, output out: as any region, on A) plus the memory entering it for K and V: f's
    all-reduce of A_src backward, or with sequence parallelism an all-gather forward and a reduce-scatter backward.
    Under sequence parallelism both lengths must be multiples of tp (the model pads them so).

    Per step, with sequence parallelism: one all-reduce of the ``sp_grad_elements`` fp32 gradients of the
    LayerNorms and row-parallel biases (:func:`~torch_handle.parallel.tensor.layers.all_reduce_sp_grads`).
    """
    n = micro_batch_size * seq_len
    act = n * d_model * element_bytes
    per = 4 if sequence_parallel else 2  # collectives of one TP region, one activation each
    edge = per // 2  # collectives where the embedding hands over, at the LM head, and of the memory
    calls, nbytes = per * 2 * n_layers + edge + edge + 2, (per * 2 * n_layers + edge + edge) * act + 16 * n
    if src_len is not None:
        src_act = micro_batch_size * src_len * d_model * element_bytes
        calls += per * 2 * n_layers + edge + n_layers * (per + edge)
        nbytes += (per * 2 * n_layers + edge) * src_act + n_layers * (per * act + edge * src_act)
    calls, nbytes = calls * grad_accum, nbytes * grad_accum
    if sequence_parallel and sp_grad_elements:
        calls, nbytes = calls + 1, nbytes + 4 * sp_grad_elements
    return {"calls": calls, "bytes": nbytes}
