"""How a layer's auxiliary loss (a mixture-of-experts router's balancing and z-losses) reaches the gradients
without passing through the loss the training loop computes.

A router's losses are born inside a layer, deep in the model; the loop only sees the logits and the cross-entropy
it computes from them. Rather than carrying the losses out of the model (a second return value every wrapper,
pipeline stage and loss function would have to pass on), each layer hangs its loss onto its own output:

* :func:`attach_aux_loss` -- identity in forward; in backward the attached loss receives the gradient the
  loop's loss received, so backward computes ∇(loss + aux) as if aux had been added to the loss (Megatron-LM's
  ``MoEAuxLossAutoScaler``; DeepSeek-V3's reference ``AddAuxiliaryLoss``, which uses a gradient of 1).
* :func:`probe_loss_scale` -- the loop's loss passes through it (``torch_handle.train.loss.loss_fn``); in backward it
  records the gradient that loss received: the factor the loop multiplied it by before ``backward()``
  (1 / grad_accum, times the fp16 loss scale, whatever the strategy does). The attached losses read that factor,
  so an auxiliary coefficient means the same with gradient accumulation, loss scaling and every strategy.

Order: every path from the loss to a layer's output runs through the probe, so autograd runs the probe's backward
before any attached loss's backward. A backward that does not start from ``loss_fn``'s loss (a test's
``out.sum().backward()``) sees the last factor recorded, 1.0 until one was: set it with :func:`set_loss_scale`.
One training loop per process shares the factor (a process-wide value, readable from autograd's device threads).
"""

from __future__ import annotations

import torch
from torch import Tensor

_loss_scale: Tensor | float = 1.0
"""The gradient the loop's loss received in the latest backward (:func:`probe_loss_scale`): a 0-d tensor on the
loss's device, never read back to the host."""


def set_loss_scale(scale: Tensor | float) -> None:
    """Set the gradient an attached loss receives (normally recorded by :func:`probe_loss_scale`)."""
    global _loss_scale
    _loss_scale = scale


def loss_scale() -> Tensor | float:
    """The gradient an attached loss receives in backward (the factor the loop's loss was multiplied by)."""
    return _loss_scale


class _ProbeLossScale(torch.autograd.Function):
    """Identity on the loop's scalar loss; its backward records the incoming gradient (kept on the device: no
    synchronisation)."""

    @staticmethod
    def forward(ctx, loss: Tensor) -> Tensor:
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        # tensor parallelism's native loss is a replicated DTensor: the factor is its local value
        set_loss_scale((grad.to_local() if hasattr(grad, "to_local") else grad).detach().clone())
        return grad


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x``; backward passes ``x``'s gradient through and gives ``aux`` the gradient
    :func:`loss_scale` (∂(s·(loss + aux))/∂aux = s)."""

    @staticmethod
    def forward(ctx, x: Tensor, aux: Tensor) -> Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        scale = torch.as_tensor(loss_scale(), dtype=ctx.aux_dtype, device=grad.device)
        return grad, scale.expand(ctx.aux_shape)


def probe_loss_scale(loss: Tensor) -> Tensor:
    """``loss`` (a scalar), unchanged; in backward it records the gradient ``loss`` receives (see the module)."""
    return _ProbeLossScale.apply(loss) if loss.requires_grad else loss


def attach_aux_loss(x: Tensor, aux: Tensor) -> Tensor:
    """``x`` unchanged, with the scalar ``aux`` added to the training objective: backward of the loop's loss
    also computes ∇aux (scaled as that loss was). Nothing is attached when ``aux`` needs no gradient.

    Shape:
        x any shape (a layer's output), aux () -> x's shape.
    """
    return _AttachAuxLoss.apply(x, aux) if aux.requires_grad and torch.is_grad_enabled() else x
