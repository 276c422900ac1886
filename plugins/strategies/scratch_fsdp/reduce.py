"""Gradients reduce-scattered unit by unit: each rank ends a step with each trainable parameter's gradient shard."""

from __future__ import annotations

from typing import Any, Callable

import torch

from handle_plugins.strategies.scratch_fsdp.comm import CountedCollectives
from handle_plugins.strategies.scratch_fsdp.units import Unit


class GradientReducer:
    """Reduce-scatters each unit's gradients as soon as its backward is complete (ZeRO-2 and ZeRO-3).

    A hook on every trainable parameter counts its gradient as ready in its unit; when a unit's last trainable
    gradient is ready, ``on_grads_done(unit)`` runs (ZeRO-3 may free the unit's gathered weights then) and, on a
    step's last micro-batch, the unit's gradients are laid out for one reduce-scatter: each cut into
    ``world_size`` chunks of rows, padded, rank ``r``'s chunks end to end in row ``r`` of a ``(world_size,
    per_rank)`` fp32 buffer (``torch._chunk_cat``, FSDP2's copy-in for ``foreach_reduce``), the parameters' own
    ``.grad`` dropped, and an asynchronous reduce-scatter started into a ``(per_rank,)`` buffer. Units start
    strictly in backward order (the blocks last to first, the root unit last), so every rank issues the same
    collectives in the same order, as the buckets of ``scratch-ddp`` do. :meth:`finish` starts the rest, waits,
    divides by the world size and gives each parameter's shard its rows as ``.grad``: a ``shard_shape`` view of
    the received buffer (as FSDP2 views its reduce-scatter output). Frozen parameters get no hook, no gradient and
    no place in the buffer; a unit with no trainable parameter sends nothing.

    Earlier micro-batches of gradient accumulation accumulate full gradients in ``.grad`` locally, as under DDP's
    ``no_sync`` (so, like FSDP's ``no_sync``, a full gradient is resident until the last micro-batch). The
    reduction is in fp32 whatever the compute dtype (as this project's ``fsdp`` sets ``reduce_dtype``).

    Sends per step: every trainable gradient once in fp32 (4 bytes per parameter, plus padding), in one
    reduce-scatter per unit: half of an all-reduce's traffic (Rajbhandari et al. 2020, section 7.2).

    Args:
        units: every unit, in forward order, the root unit (name "") last if there is one.
        comm: this rank's counted collectives.
    """

    def __init__(self, units: list[Unit], comm: CountedCollectives) -> None:
        self.units, self.comm = [u for u in units if u.trainable], comm
        blocks = [u for u in self.units if u.name != ""]
        self.order = blocks[::-1] + [u for u in self.units if u.name == ""]
        self.unit_of = {sp.param: u for u in self.units for sp in u.trainable}
        self.ready = {id(u): 0 for u in self.units}
        self.next = 0
        """Index in ``order`` of the first unit not started in this backward."""
        self.in_flight: list[tuple[Unit, torch.Tensor, torch.Tensor, Any]] = []
        self.last_micro_batch = True
        self.on_grads_done: Callable[[Unit], None] = lambda unit: None
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.unit_of]

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        unit = self.unit_of[p]
        self.ready[id(unit)] += 1
        if self.ready[id(unit)] < len(unit.trainable):
            return
        self.on_grads_done(unit)
        while self.last_micro_batch and self.next < len(self.order):
            unit = self.order[self.next]
            if self.ready[id(unit)] < len(unit.trainable):
                break
            self._launch(unit)
            self.next += 1

    @torch.no_grad()
    def _launch(self, unit: Unit) -> None:
        grads = []
        for sp in unit.trainable:
            g = sp.param.grad if sp.param.grad is not None else torch.zeros(sp.shape, device=sp.shard.device)
            grads.append(g.float().reshape(sp.dim0, sp.row_numel))
            sp.param.grad = None
        per_rank = sum(sp.chunk_numel for sp in unit.trainable)
        full = torch.empty(self.comm.world_size, per_rank, dtype=torch.float32, device=unit.trainable[0].shard.device)
        torch._chunk_cat(grads, 0, self.comm.world_size, out=full)
        shard = torch.empty(per_rank, dtype=torch.float32, device=full.device)
        self.in_flight.append((unit, full, shard, self.comm.reduce_scatter(shard, full.view(-1))))

    @torch.no_grad()
    def finish(self, sync: bool) -> None:
        """After a micro-batch's backward: when ``sync`` (the last micro-batch), start the units not started
        (zeros for missing gradients), wait for every reduce-scatter and set each trainable ``shard.grad`` to its
        rows of the mean over the ranks; either way, reset the counts for the next backward."""
        if sync:
            for unit in self.order[self.next:]:
                self._launch(unit)
            for unit, _, received, work in self.in_flight:
                self.comm.wait(work)
                received.div_(self.comm.world_size)
                for sp, chunk in zip(unit.trainable, received.split([sp.chunk_numel for sp in unit.trainable])):
                    sp.shard.grad = chunk[:sp.shard.numel()].view(sp.shard_shape)
        self.in_flight, self.next = [], 0
        self.ready = {id(u): 0 for u in self.units}

    def drop_gradients(self) -> None:
        """Forget every full gradient accumulated so far (a skipped step)."""
        for unit in self.units:
            for sp in unit.trainable:
                sp.param.grad = None

    def close(self) -> None:
        """Remove the hooks (idempotent); nothing in flight is waited for."""
        for handle in self.hooks:
            handle.remove()
        self.hooks, self.in_flight = [], []
