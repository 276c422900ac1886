"""ZeRO-3: a unit's full weights exist only while it computes."""

from __future__ import annotations

from typing import Any

import torch

from handle_plugins.strategies.scratch_fsdp.comm import CountedCollectives
from handle_plugins.strategies.scratch_fsdp.units import Unit


def in_backward() -> bool:
    """Whether autograd is running a backward in this thread (activation checkpointing recomputes a forward
    there: the weights it gathers must stay until the unit's gradients are done)."""
    return torch._C._current_graph_task_id() != -1


class InputsGradDone(torch.autograd.Function):
    """Identity on a module's inputs whose backward calls ``callback``: it runs once every gradient with respect
    to those inputs is computed, so no node of the module's backward is left that could read its weights (FSDP2's
    ``RegisterPostBackwardFunction``, torch/distributed/fsdp/_fully_shard/_fsdp_state.py)."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


class ParameterGatherer:
    """Forward and backward hooks that all-gather a unit's weights just before it computes and free them after.

    - before a unit's forward: all-gather its master shards (cast to the compute dtype) into ``full``;
    - after it: free ``full`` (``reshard_after_forward``; without it the weights stay until the unit's backward,
      ZeRO-2's memory with ZeRO-3's communication), and hook the outputs, so that
    - before the unit's backward (when the gradient of its output arrives): all-gather again;
    - when its backward is over: free again. Over means both that its trainable parameters' gradients are
      accumulated (:meth:`grads_done`, called by the :class:`GradientReducer`) and that the gradients of its
      inputs are computed (:class:`InputsGradDone`, wrapped around the inputs that require a gradient). The
      first alone would do if every weight were trainable, since the node that reads a weight also produces
      its gradient; a frozen weight (a LoRA base layer, a frozen norm) is read by nodes that produce only the
      input's gradient, and those may run after the last trainable gradient is in.

    The root unit (name "", the embedding, final norm, output layer and anything tied) stays gathered from its
    forward to the end of its backward, as FSDP2 keeps its root; in ``no_grad`` (evaluation) every unit is freed
    after its forward. With ``prefetch``, gathering unit ``i`` also starts the asynchronous all-gather of the unit
    that computes next (``i + 1`` in forward, ``i - 1`` in backward), so it runs while unit ``i`` computes.

    Source: Zhao et al. 2023, "PyTorch FSDP", VLDB, sections 3.3 (reshard after forward) and 3.4.1 (forward and
    backward prefetching); Rajbhandari et al. 2020, section 5.3 (P_p).

    Sends per step: every parameter twice (forward and backward; once when ``reshard_after_forward`` is off),
    in the compute dtype, one all-gather per unit and gather dtype each time.

    Args:
        units: every unit, in forward order, the root unit last if there is one.
        comm: this rank's counted collectives.
        reshard_after_forward: free a block's weights after its forward.
        prefetch: start the next unit's all-gather early.
    """

    def __init__(self, units: list[Unit], comm: CountedCollectives, reshard_after_forward: bool,
                 prefetch: bool) -> None:
        self.units, self.comm = units, comm
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.blocks = [u for u in units if u.name != ""]
        self.waiting: dict[int, set[str]] = {}
        """Per block gathered for a backward: what that backward has yet to finish, of "grads" and "inputs"."""
        self.hooks = []
        for unit in units:
            self.hooks.append(unit.module.register_forward_pre_hook(self._before_forward(unit), with_kwargs=True))
            self.hooks.append(unit.module.register_forward_hook(self._after_forward(unit)))

    def start(self, unit: Unit) -> None:
        """Start gathering ``unit`` (nothing if it is gathered or on its way)."""
        if unit.gathered or unit.pending is not None:
            return
        unit.start_gather(self.comm)

    def gather(self, unit: Unit) -> None:
        """Make ``unit``'s weights whole (starting the all-gather if no prefetch did, then waiting for it)."""
        self.start(unit)
        if unit.pending is not None:
            unit.finish_gather(self.comm)

    def release(self, unit: Unit) -> None:
        """Free ``unit``'s weights (after waiting for an all-gather still writing into them)."""
        if unit.pending is not None:
            self.gather(unit)
        if unit.gathered:
            unit.free()

    def grads_done(self, unit: Unit) -> None:
        """Every trainable gradient of ``unit`` is accumulated (this backward)."""
        self._finished(unit, "grads")

    def _finished(self, unit: Unit, what: str) -> None:
        waits = self.waiting.get(id(unit))
        if waits is None:
            return
        waits.discard(what)
        if not waits:
            del self.waiting[id(unit)]
            self.release(unit)

    def release_all(self) -> None:
        """After a backward: free what is still gathered (the root, units whose parameters got no gradient)."""
        self.waiting = {}
        for unit in self.units:
            self.release(unit)

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        if unit not in self.blocks:  # the root: the first block computes after it starts, the last before it ends
            return (self.blocks[0] if step > 0 else self.blocks[-1]) if self.blocks else None
        i = self.blocks.index(unit) + step
        return self.blocks[i] if 0 <= i < len(self.blocks) else None

    def _before_forward(self, unit: Unit):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            self.gather(unit)
            nxt = self._neighbour(unit, +1)
            if self.prefetch and nxt is not None and not in_backward():
                self.start(nxt)
            if unit.name == "" or in_backward() or not torch.is_grad_enabled():
                return None
            self.waiting[id(unit)] = {"grads"} if unit.trainable else set()
            return self._watch_inputs(unit, args, kwargs)
        return hook

    def _watch_inputs(self, unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """``args`` and ``kwargs`` with the tensors that require a gradient passed through
        :class:`InputsGradDone` (top-level ones: a block's hidden states)."""
        keys = [("a", i) for i, t in enumerate(args) if isinstance(t, torch.Tensor) and t.requires_grad]
        keys += [("k", k) for k, t in kwargs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
        if not keys:
            return None
        self.waiting[id(unit)].add("inputs")
        args, kwargs = list(args), dict(kwargs)
        tensors = [args[i] if where == "a" else kwargs[i] for where, i in keys]
        watched = InputsGradDone.apply(lambda: self._finished(unit, "inputs"), *tensors)
        for (where, i), t in zip(keys, watched):
            if where == "a":
                args[i] = t
            else:
                kwargs[i] = t
        return tuple(args), kwargs

    def _after_forward(self, unit: Unit):
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

    def _before_backward(self, unit: Unit):
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
