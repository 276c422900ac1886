"""``sync = "flat"``: every gradient in one flat buffer, one all-reduce after backward."""

from __future__ import annotations

from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from handle_plugins.strategies.scratch_ddp.comm import GradientSync, grad_or_zeros


class FlatSync(GradientSync):
    """Copy every gradient into one contiguous buffer, all-reduce it once, divide, copy the means back.

    Source: Stanford CS336 (Spring 2025) assignment 2, "minimal DDP flat"; Li et al. 2020 ("PyTorch Distributed",
    VLDB), section 3.2.2 "Gradient Bucketing", taken to one bucket: one large message pays the latency once.

    Sends per step: every gradient once, 4 bytes per parameter in fp32, in one message (one call), at the price
    of two copies of the gradients. Still entirely after backward.
    """

    def finish_gradient_synchronization(self) -> None:
        grads = [grad_or_zeros(p) for p in self.params]
        flat = _flatten_dense_tensors(grads)  # (sum of numels,)
        self.all_reduce(flat)
        flat.div_(self.all_reduce.world_size)
        for g, mean in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(mean)
