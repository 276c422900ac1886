"""What a micro-batch's activations hold: :class:`SavedTensorCounter` counts the distinct storages autograd saves
for backward. The trainer reports it as ``activation_saved_bytes`` in the memory telemetry; ``handle estimate``
(:mod:`torch_handle.plan.estimate`) runs the same counter on fake tensors.

torch is imported inside the methods, so importing this module is cheap.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    import torch


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of the storage behind ``t``; works for real, meta and fake tensors alike (views share
    the storage, so they count once), and for a DTensor its local shard's (a DTensor wrapper has a storage of its
    own, sized like the global tensor)."""
    t = getattr(t, "_local_tensor", t)  # a DTensor's shard
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


class SavedTensorCounter:
    """Counts the distinct storages autograd saves for backward while it is active (a
    ``torch.autograd.graph.saved_tensors_hooks`` pair that saves every tensor unchanged).

    Storages of ``exclude`` (the model's parameters and buffers: model state, counted elsewhere) are skipped. With
    ``blocks`` (a model's ``blocks()`` when activation checkpointing is on) the tensors passed into each block
    during forward count too: non-reentrant checkpointing keeps them instead of the block's own saved tensors.
    Keys are storage identities of tensors that autograd keeps alive until backward, so none is reused while
    counting. Use as a context manager around the forward (and backward) of one micro-batch; ``bytes`` is the
    result.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), blocks: Iterable[torch.nn.Module] = ()):
        self._exclude = {_storage(t)[0] for t in exclude}
        self._blocks = list(blocks)
        self._seen: dict[int, int] = {}
        self._stack: list[Any] = []

    @property
    def bytes(self) -> int:
        """Bytes counted so far."""
        return sum(self._seen.values())

    def add(self, t: Any) -> None:
        """Count ``t``'s storage (once; skipped when excluded or not a tensor)."""
        import torch

        if isinstance(t, torch.Tensor) and t.numel() > 0:
            key, nbytes = _storage(t)
            if key not in self._exclude:
                self._seen.setdefault(key, nbytes)

    def _pack(self, t: Any) -> Any:
        self.add(t)
        return t

    def _block_inputs(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:  # forward, not the recompute
            for x in [*args, *kwargs.values()]:
                self.add(x)

    def __enter__(self) -> Self:
        import torch

        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        hooks.__enter__()
        self._stack = [hooks, *(b.register_forward_pre_hook(self._block_inputs, with_kwargs=True)
                                for b in self._blocks)]
        return self

    def __exit__(self, *exc: object) -> None:
        hooks, *handles = self._stack
        for h in handles:
            h.remove()
        hooks.__exit__(*exc)
        self._stack = []
