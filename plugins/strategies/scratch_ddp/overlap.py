"""``sync = "overlap"``: one asynchronous all-reduce per gradient, started by a hook during backward."""

from __future__ import annotations

from typing import Any

import torch

from handle_plugins.strategies.scratch_ddp.comm import CountedAllReduce, GradientSync, grad_or_zeros


class OverlapSync(GradientSync):
    """A ``register_post_accumulate_grad_hook`` on every parameter starts an asynchronous all-reduce of its
    gradient the moment autograd has accumulated it, so the last layers' gradients travel while backward still
    computes the first layers'. After backward, only the handles are waited for; ``comm_s`` counts just that
    wait: the communication that did not hide.

    Source: Stanford CS336 (Spring 2025) assignment 2, "DDP overlapping individual parameter gradients";
    Li et al. 2020 ("PyTorch Distributed", VLDB), section 3.2.3 "Overlap Computation with Communication".

    Sends per step: every gradient once, 4 bytes per parameter in fp32, in one message per parameter tensor
    (``len(params)`` calls), most of them while backward runs.
    """

    def __init__(self, params: list[torch.nn.Parameter], all_reduce: CountedAllReduce) -> None:
        super().__init__(params, all_reduce)
        self.in_flight: list[tuple[torch.nn.Parameter, Any]] = []
        """(parameter, ``dist.Work``) of the all-reduces started in this backward, in launch order."""
        self.launched: set[int] = set()
        """``id`` of the parameters in :attr:`in_flight`."""
        self.hook_each(self._on_grad_ready)

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if self.launching():
            self._launch(p)

    def _launch(self, p: torch.nn.Parameter) -> None:
        self.in_flight.append((p, self.all_reduce(grad_or_zeros(p), async_op=True)))
        self.launched.add(id(p))

    def finish_gradient_synchronization(self) -> None:
        """Reduce the gradients whose hook did not fire (no gradient this step: zeros, so every rank issues the
        same collectives), then wait for every all-reduce and divide."""
        for p in self.params:
            if id(p) not in self.launched:
                self._launch(p)
        for p, work in self.in_flight:
            self.all_reduce.wait(work)
            p.grad.div_(self.all_reduce.world_size)
        self.in_flight, self.launched = [], set()

    def close(self) -> None:
        self.in_flight, self.launched = [], set()
        super().close()
