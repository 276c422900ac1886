"""``sync = "naive"``: one blocking all-reduce per gradient, after backward."""

from __future__ import annotations

from handle_plugins.strategies.scratch_ddp.comm import GradientSync, grad_or_zeros


class NaiveSync(GradientSync):
    """After backward, ``all_reduce`` every parameter's gradient, one at a time, then divide by the world size.

    Source: Stanford CS336 (Spring 2025) assignment 2, "naive DDP"; Li et al. 2020 ("PyTorch Distributed",
    VLDB), section 3.2.1 "A Naive Solution".

    Sends per step: every gradient once, 4 bytes per parameter in fp32, in one message per parameter tensor
    (``len(params)`` calls). A Transformer has hundreds of small tensors (norm weights, biases), so most of the
    time is each collective's fixed cost, and none of it hides behind backward: ``comm_s`` is all of it.
    """

    def finish_gradient_synchronization(self) -> None:
        for p in self.params:
            self.all_reduce(grad_or_zeros(p))
            p.grad.div_(self.all_reduce.world_size)
