"""Dropout under tensor parallelism: which masks the TP ranks of one replica share and which each draws alone
(Megatron-LM's ``CudaRNGStatesTracker`` and ``model_parallel_cuda_manual_seed``, megatron/core/tensor_parallel/
random.py; Shoeybi et al. 2019, §3).

A dropout sits in one of three kinds of region, each with its rule:

* **replicated** (outside the TP regions without sequence parallelism: the embedding and residual dropouts). Every
  TP rank holds the same activation, so every rank must draw the same mask, or the copies drift apart. These
  draw from the default generators, seeded alike on the TP ranks of a replica.
* **tensor-parallel** (the attention probabilities of this rank's heads, its slice of the FFN hidden units). The
  ranks hold different parts of one activation and must draw different masks. These draw inside
  :func:`tensor_parallel_rng`, from a stream of this rank's own, which the model enters in every layout
  (tp = 1 too, as Megatron does), so the default stream is consumed the same way whatever tp is.
* **sequence-parallel** (the replicated dropouts when each rank holds 1/tp of the sequence).
  :class:`SequenceParallelDropout` draws the whole (B, T, C) mask from the default stream and keeps this rank's
  slice along the sequence. The masks are exactly one process's.

Seeds, per process (:func:`seed_tensor_parallel_rng`): the default generators get ``seed`` and the tensor-parallel
stream ``seed + 2718 + tp_rank`` (Megatron's offset). The trainer passes ``seed = run.seed + 1000 · dp_rank``, so
each data-parallel replica draws its own masks; Megatron instead uses one seed in every replica.

The stream is state that must survive what replays or resumes the default generators. A checkpoint saves it with
them (:func:`torch_handle.checkpoint.store.rng_state`). Activation checkpointing recomputes a block's forward, and
``torch.utils.checkpoint`` restores only the default generators' states for it; :func:`checkpoint_rng_contexts`,
its ``context_fn``, restores this stream too (what Megatron's own ``CheckpointFunction`` does).

Compiled (``training.compile``): swapping the generators' states is a side effect Dynamo cannot trace
(``torch.get_rng_state`` is on its skip list: each fork was a graph break, two in every block with dropout). Where
the process is the only TP rank of its replica (tp = 1) there is no other rank's mask to differ from, so inside a
compiled region :func:`tensor_parallel_rng` draws from the default generators and the graph stays whole (Inductor
draws its own masks there anyway, not eager's). With tp > 1 the fork stays, and with it one break per
tensor-parallel dropout: without it the TP ranks, seeded alike, would draw the same masks for their different heads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ContextManager

import torch
from torch import Tensor, nn

TP_STREAM = "tensor-parallel"
TP_SEED_OFFSET = 2718
"""Megatron-LM's offset from the default seed to the tensor-parallel stream's (``model_parallel_cuda_manual_seed``)."""


def _capture(cuda: bool) -> dict[str, Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore(state: dict[str, Tensor], cuda: bool) -> None:
    torch.set_rng_state(state["cpu"])
    if cuda:
        torch.cuda.set_rng_state(state["cuda"])


class RNGTracker:
    """Named random streams, each swapped in for the default generators inside :meth:`fork` (Megatron's
    ``CudaRNGStatesTracker``, for the CPU generator and, once CUDA is initialised, the current CUDA device's).

    A stream starts at :meth:`add`; each :meth:`fork` continues it where the last one left it, and restores the
    default generators on the way out. Forking a stream that was never added is a no-op: a model used without the
    trainer draws everything from the default generators."""

    def __init__(self) -> None:
        self._seeds: dict[str, int] = {}
        self._states: dict[str, dict[str, Tensor]] = {}
        self.tp_size = 1
        """The TP ranks of this process's replica (:func:`seed_tensor_parallel_rng`): with 1, a compiled region
        need not fork (:func:`tensor_parallel_rng`)."""

    def add(self, name: str, seed: int) -> None:
        """Start (or restart) stream ``name`` at ``seed``; the default generators are not touched."""
        self._seeds[name] = seed
        self._states[name] = {"cpu": torch.Generator().manual_seed(seed).get_state()}

    def reset(self) -> None:
        """Forget every stream."""
        self._seeds.clear()
        self._states.clear()

    def __contains__(self, name: str) -> bool:
        return name in self._states

    @property
    def active(self) -> bool:
        """Whether any stream was added."""
        return bool(self._states)

    def get_states(self) -> dict[str, Any]:
        """A copy of every stream's seed and position: ``{"seeds": {name: int}, "states": {name: {"cpu": uint8
        tensor, "cuda": uint8 tensor}}}`` ("cuda" once a fork has run with CUDA initialised); weights_only-loadable."""
        return {"seeds": dict(self._seeds),
                "states": {n: {d: t.clone() for d, t in s.items()} for n, s in self._states.items()}}

    def set_states(self, saved: dict[str, Any]) -> None:
        """Make the streams what :meth:`get_states` returned (a copy is kept)."""
        self._seeds = {n: int(s) for n, s in saved["seeds"].items()}
        self._states = {n: {d: t.clone() for d, t in s.items()} for n, s in saved["states"].items()}

    def _device_state(self, name: str) -> dict[str, Tensor]:
        state = self._states[name]
        if "cuda" not in state and torch.cuda.is_initialized():  # started by the first fork that needs it
            state["cuda"] = torch.Generator("cuda").manual_seed(self._seeds[name]).get_state()
        return state

    @contextlib.contextmanager
    def fork(self, name: str = TP_STREAM) -> Iterator[None]:
        """Inside the block, the default generators draw from stream ``name``; outside, from where they were."""
        if name not in self._states:
            yield
            return
        state = self._device_state(name)
        cuda = "cuda" in state and torch.cuda.is_initialized()  # a CUDA state read back on a CPU-only resume waits
        outer = _capture(cuda)
        _restore(state, cuda)
        try:
            yield
        finally:
            self._states[name] = {**state, **_capture(cuda)}
            _restore(outer, cuda)


_TRACKER = RNGTracker()


def get_rng_tracker() -> RNGTracker:
    """This process's tracker (one per process, as Megatron's ``get_cuda_rng_tracker()``)."""
    return _TRACKER


def seed_tensor_parallel_rng(seed: int, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Seed the default torch generators with ``seed`` and this process's tensor-parallel stream with
    ``seed + 2718 + tp_rank`` (Megatron's ``model_parallel_cuda_manual_seed``), of ``tp_size`` TP ranks. Call it
    with the same ``seed`` on the TP ranks of a replica, after the model is built (and on its device)."""
    torch.manual_seed(seed)
    _TRACKER.add(TP_STREAM, seed + TP_SEED_OFFSET + tp_rank)
    _TRACKER.tp_size = tp_size


def tensor_parallel_rng(enabled: bool = True) -> ContextManager:
    """The context a dropout inside a tensor-parallel region runs in: this rank's own stream (when ``enabled`` and
    seeded), else the default generators; the default generators also inside a compiled region at tp = 1 (the
    module's "Compiled": the fork would break the graph). The model wraps its attention-probability and FFN-hidden
    dropouts in it."""
    if not enabled or (_TRACKER.tp_size == 1 and torch.compiler.is_compiling()):
        return contextlib.nullcontext()
    return _TRACKER.fork()


class _Replay:
    """The recompute context of one checkpointed block: the tracker's streams as they were when the block's
    forward ran, then back to where they are now (reusable: a graph kept for a second backward recomputes again)."""

    def __init__(self, saved: dict[str, Any]) -> None:
        self.saved = saved
        self.now: dict[str, Any] = {}

    def __enter__(self) -> None:
        self.now = _TRACKER.get_states()
        _TRACKER.set_states(self.saved)

    def __exit__(self, *exc: object) -> None:
        _TRACKER.set_states(self.now)


def checkpoint_rng_contexts() -> tuple[ContextManager, ContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: called as the block's
    forward starts; the recompute then sees the tracker's streams as the forward did, so it draws the same
    tensor-parallel masks (torch restores the default generators itself)."""
    if not _TRACKER.active:
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), _Replay(_TRACKER.get_states())


class SequenceParallelDropout(nn.Module):
    """A dropout module run on this rank's 1/tp of the sequence that draws exactly the one-process mask: the
    wrapped ``dropout`` is applied to ones of the whole shape (B, T, C) (the default stream advances as one
    process's does) and this rank's slice along ``dim`` is kept.

    Costs tp× the random numbers of the shard and, for a moment, two full-size tensors (the ones and the mask);
    what autograd keeps for backward is the shard's mask, as without sequence parallelism.

    ``dropout``: a module with a drop probability ``p`` that maps x to x · mask (``nn.Dropout``, the model's
    ``Dropout``). forward(x (B, T/tp, C)) -> (B, T/tp, C); x itself in eval mode or with p = 0."""

    def __init__(self, dropout: nn.Module, rank: int, size: int, dim: int = 1) -> None:
        super().__init__()
        self.dropout, self.rank, self.size, self.dim = dropout, rank, size, dim

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and self.dropout.p > 0):
            return x
        n = x.shape[self.dim]
        full = list(x.shape)
        full[self.dim] = n * self.size
        mask = self.dropout(torch.ones(full, dtype=x.dtype, device=x.device))  # (B, T, C): 0 or 1/(1-p)
        return x * mask.narrow(self.dim, self.rank * n, n).clone(memory_format=torch.contiguous_format)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, size={self.size}, dim={self.dim}"
