"""ZeRO-3: a unit's full weights exist only while it computes."""

from __future__ import annotations

from typing import Any

import torch

from handle_plugins.strategies.scratch_fsdp.comm import CountedCollectives
from handle_plugins.strategies.scratch_fsdp.units import FlatUnit


def in_backward() -> bool:
    """Whether autograd is running a backward in this thread (activation checkpointing recomputes a forward
    there: the weights it gathers must stay until the unit's gradients are done)."""
    return torch._C._current_graph_task_id() != -1


class ParameterGatherer:
    """Forward and backward hooks that all-gather a unit's weights just before it computes and free them after.

    - before a unit's forward: all-gather its master shards (cast to the compute dtype) into ``full``;
    - after it: free ``full`` (``reshard_after_forward``; without it the weights stay until the unit's backward,
      ZeRO-2's memory with ZeRO-3's communication), and hook the outputs, so that
    - before the unit's backward (when the gradient of its output arrives): all-gather again;
    - when its gradients are complete (:meth:`release`, called by the :class:`GradientReducer`): free again.

    The root unit (name "", the embedding, final norm, output layer and anything tied) stays gathered from its
    forward to the end of its backward, as FSDP2 keeps its root; in ``no_grad`` (evaluation) every unit is freed
    after its forward. With ``prefetch``, gathering unit ``i`` also starts the asynchronous all-gather of the unit
    that computes next (``i + 1`` in forward, ``i - 1`` in backward), so it runs while unit ``i`` computes.

    Source: Zhao et al. 2023, "PyTorch FSDP", VLDB, sections 3.3 (reshard after forward) and 3.4.1 (forward and
    backward prefetching); Rajbhandari et al. 2020, section 5.3 (P_p).

    Sends per step: every parameter twice (forward and backward; once when ``reshard_after_forward`` is off),
    in the compute dtype, one all-gather per unit each time.

    Args:
        units: every unit, in forward order, the root unit last if there is one.
        comm: this rank's counted collectives.
        reshard_after_forward: free a block's weights after its forward.
        prefetch: start the next unit's all-gather early.
    """

    def __init__(self, units: list[FlatUnit], comm: CountedCollectives, reshard_after_forward: bool,
                 prefetch: bool) -> None:
        self.units, self.comm = units, comm
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.blocks = [u for u in units if u.name != ""]
        self.sources: dict[int, torch.Tensor] = {}
        """Per unit in flight, the shard being sent (kept alive until the all-gather is waited for)."""
        self.hooks = []
        for unit in units:
            self.hooks.append(unit.module.register_forward_pre_hook(self._before_forward(unit)))
            self.hooks.append(unit.module.register_forward_hook(self._after_forward(unit)))

    @torch.no_grad()
    def start(self, unit: FlatUnit) -> None:
        """Start gathering ``unit`` (nothing if it is gathered or on its way)."""
        if unit.gathered or unit.pending is not None:
            return
        unit.alloc()
        self.sources[id(unit)] = unit.master.detach().to(unit.dtype)
        unit.pending = self.comm.all_gather(unit.full, self.sources[id(unit)])

    def gather(self, unit: FlatUnit) -> None:
        """Make ``unit``'s weights whole (starting the all-gather if no prefetch did, then waiting for it)."""
        self.start(unit)
        if unit.pending is not None:
            self.comm.wait(unit.pending)
            unit.pending = None
            del self.sources[id(unit)]
            unit.gathered = True

    def release(self, unit: FlatUnit) -> None:
        """Free ``unit``'s weights (after waiting for an all-gather still writing into them)."""
        if unit.pending is not None:
            self.gather(unit)
        if unit.gathered:
            unit.free()

    def release_all(self) -> None:
        """After a backward: free what is still gathered (the root, units whose parameters got no gradient)."""
        for unit in self.units:
            self.release(unit)

    def _neighbour(self, unit: FlatUnit, step: int) -> FlatUnit | None:
        if unit not in self.blocks:  # the root: the first block computes after it starts, the last before it ends
            return (self.blocks[0] if step > 0 else self.blocks[-1]) if self.blocks else None
        i = self.blocks.index(unit) + step
        return self.blocks[i] if 0 <= i < len(self.blocks) else None

    def _before_forward(self, unit: FlatUnit):
        def hook(module: torch.nn.Module, args: Any) -> None:
            self.gather(unit)
            nxt = self._neighbour(unit, +1)
            if self.prefetch and nxt is not None and not in_backward():
                self.start(nxt)
        return hook

    def _after_forward(self, unit: FlatUnit):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if in_backward():
                return  # a recomputation (activation checkpointing): the backward needs the weights now
            if not torch.is_grad_enabled():
                self.release(unit)
                return
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outputs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._before_backward(unit))
            if self.reshard_after_forward and unit.name != "":
                self.release(unit)
        return hook

    def _before_backward(self, unit: FlatUnit):
        def hook(grad: torch.Tensor) -> None:
            self.gather(unit)
            previous = self._neighbour(unit, -1)
            if self.prefetch and previous is not None:
                self.start(previous)
        return hook

    def close(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
