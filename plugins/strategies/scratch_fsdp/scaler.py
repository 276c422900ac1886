"""fp16 dynamic loss scaling when every rank holds only a shard of the gradients."""

from __future__ import annotations

from typing import Any

import torch

from handle_plugins.strategies.scratch_fsdp.comm import CountedCollectives


class ShardedLossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018, "Mixed Precision Training", ICLR; the policy of
    ``torch.amp.GradScaler``) for gradients that are sharded over the ranks.

    The loss is multiplied by ``scale`` before backward, so that small fp16 gradients do not flush to zero. Before
    the step each rank checks its own shards for inf/nan; one all-reduce (a sum of the ranks' flags, counted in
    ``allreduce_calls``) tells every rank whether *any* shard overflowed, so all ranks skip or all step
    (``GradScaler`` only sees its own rank's gradients, which here would let the ranks disagree). Without an
    overflow the shards are divided by ``scale``; with one the step is skipped and ``scale`` halves; after
    ``growth_interval`` steps in a row without one it doubles.

    Args:
        comm: the counted collectives (its all-reduce carries the overflow flag).
        init_scale, growth_factor, backoff_factor, growth_interval: ``GradScaler``'s defaults.
    """

    def __init__(self, comm: CountedCollectives, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.comm = comm
        self.scale = init_scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0
        """Steps in a row without an overflow."""

    @torch.no_grad()
    def unscale(self, grads: list[torch.Tensor]) -> bool:
        """Divide the gradient shards by ``scale`` unless any rank's shard holds inf/nan.

        Returns:
            Whether some rank's gradients overflowed (then the step must be skipped, on every rank).
        """
        overflow = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
        for g in grads:
            overflow += (~torch.isfinite(g)).any().float()
        self.comm(overflow)
        if overflow.item() > 0:
            return True
        for g in grads:
            g.mul_(1.0 / self.scale)
        return False

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
