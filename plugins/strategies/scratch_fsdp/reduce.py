"""Gradients reduce-scattered unit by unit: each rank ends a step holding the mean gradient of its shard only."""

from __future__ import annotations

from typing import Any, Callable

import torch

from handle_plugins.strategies.scratch_fsdp.comm import CountedCollectives
from handle_plugins.strategies.scratch_fsdp.units import FlatUnit


class GradientReducer:
    """Reduce-scatters each unit's gradients as soon as its backward is complete (ZeRO-2 and ZeRO-3).

    A hook on every parameter counts its gradient as ready in its unit; when a unit's last gradient is ready,
    ``on_unit_done(unit)`` runs (ZeRO-3 frees the unit's gathered weights there) and, on a step's last
    micro-batch, the unit's gradients are copied into one flat fp32 ``(padded,)`` buffer, the parameters' own
    ``.grad`` dropped, and an asynchronous reduce-scatter started into a ``(shard_numel,)`` shard. Units start
    strictly in backward order (the blocks last to first, the root unit last), so every rank issues the same
    collectives in the same order, as the buckets of ``scratch-ddp`` do. :meth:`finish` starts the rest, waits,
    divides by the world size and makes each shard its unit's ``master.grad``.

    Earlier micro-batches of gradient accumulation accumulate full gradients in ``.grad`` locally, as under DDP's
    ``no_sync`` (so, like FSDP's ``no_sync``, a full gradient is resident until the last micro-batch). The
    reduction is in fp32 whatever the compute dtype (as this project's ``fsdp`` sets ``reduce_dtype``).

    Sends per step: every gradient once in fp32 (4 bytes per parameter, plus padding), in one reduce-scatter
    per unit: half of an all-reduce's traffic (Rajbhandari et al. 2020, section 7.2).

    Args:
        units: every unit, in forward order, the root unit (name "") last if there is one.
        comm: this rank's counted collectives.
    """

    def __init__(self, units: list[FlatUnit], comm: CountedCollectives) -> None:
        self.units, self.comm = units, comm
        blocks = [u for u in units if u.name != ""]
        self.order = blocks[::-1] + [u for u in units if u.name == ""]
        self.unit_of = {p: u for u in units for p in u.params}
        self.ready = {id(u): 0 for u in units}
        self.next = 0
        """Index in ``order`` of the first unit not started in this backward."""
        self.in_flight: list[tuple[FlatUnit, torch.Tensor, torch.Tensor, Any]] = []
        self.last_micro_batch = True
        self.on_unit_done: Callable[[FlatUnit], None] = lambda unit: None
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for u in units for p in u.params]

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        unit = self.unit_of[p]
        self.ready[id(unit)] += 1
        if self.ready[id(unit)] < len(unit.params):
            return
        self.on_unit_done(unit)
        while self.last_micro_batch and self.next < len(self.order):
            unit = self.order[self.next]
            if self.ready[id(unit)] < len(unit.params):
                break
            self._launch(unit)
            self.next += 1

    @torch.no_grad()
    def _launch(self, unit: FlatUnit) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros(p.shape, dtype=unit.dtype, device=unit.master.device) for p in unit.params]
        flat = unit.flatten(grads, torch.float32)
        for p in unit.params:
            p.grad = None
        shard = torch.empty(unit.shard_numel, dtype=torch.float32, device=flat.device)
        self.in_flight.append((unit, flat, shard, self.comm.reduce_scatter(shard, flat)))

    @torch.no_grad()
    def finish(self, sync: bool) -> None:
        """After a micro-batch's backward: when ``sync`` (the last micro-batch), start the units not started
        (zeros for missing gradients), wait for every reduce-scatter and set each ``master.grad`` to the mean
        over the ranks; either way, reset the counts for the next backward."""
        if sync:
            for unit in self.order[self.next:]:
                self._launch(unit)
            for unit, _, shard, work in self.in_flight:
                self.comm.wait(work)
                unit.master.grad = shard.div_(self.comm.world_size)
        self.in_flight, self.next = [], 0
        self.ready = {id(u): 0 for u in self.units}

    def drop_gradients(self) -> None:
        """Forget every full gradient accumulated so far (a skipped step)."""
        for unit in self.units:
            for p in unit.params:
                p.grad = None

    def close(self) -> None:
        """Remove the hooks (idempotent); nothing in flight is waited for."""
        for handle in self.hooks:
            handle.remove()
        self.hooks, self.in_flight = [], []
