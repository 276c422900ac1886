"""How a layer's auxiliary loss (a mixture-of-experts router's balancing and z-losses) reaches the gradients
without passing through the loss the training loop computes.

A router's losses are born inside a layer, deep in the model; the loop only sees the logits and the cross-entropy
it computes from them. Rather than carrying the losses out of the model (a second return value every wrapper,
pipeline stage and loss function would have to pass on), each layer hangs its loss onto its own output:
:func:`attach_aux_loss` is the identity in forward; in backward the attached loss receives the gradient the
loop's loss received, so backward computes ∇(loss + aux) as if aux had been added to the loss (Megatron-LM's
``MoEAuxLossAutoScaler``; DeepSeek-V3's reference ``AddAuxiliaryLoss``, which uses a gradient of 1).

That gradient -- the factor the loop multiplied its loss by before ``backward()`` (1 / grad_accum, times the fp16
loss scale, whatever the strategy does) -- is not known inside the model: the layer reads it in backward from the
object it holds (``MoEFeedForward.aux_loss_scale``), which the training code owns, records and binds
(:class:`torch_handle.train.loss.AuxLossScale`). Unbound, the attached loss gets a gradient of 1. No process-wide
state: two models in one process each have their own.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class LossScaleSource(Protocol):
    """What an attached loss reads its gradient from in backward: ``value``, a float or a 0-d tensor on the loss's
    device (:class:`torch_handle.train.loss.AuxLossScale`)."""

    value: Tensor | float


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x``; backward passes ``x``'s gradient through and gives ``aux`` the gradient ``scale.value``
    (∂(s·(loss + aux))/∂aux = s), read when backward runs."""

    @staticmethod
    def forward(ctx, x: Tensor, aux: Tensor, scale: LossScaleSource | None) -> Tensor:
        ctx.aux_shape, ctx.aux_dtype, ctx.scale = aux.shape, aux.dtype, scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        value = 1.0 if ctx.scale is None else ctx.scale.value
        scale = torch.as_tensor(value, dtype=ctx.aux_dtype, device=grad.device)
        return grad, scale.expand(ctx.aux_shape), None


def attach_aux_loss(x: Tensor, aux: Tensor, scale: LossScaleSource | None = None) -> Tensor:
    """``x`` unchanged, with the scalar ``aux`` added to the training objective: backward of the loop's loss
    also computes ∇aux, scaled by ``scale.value`` as read in backward (1 when ``scale`` is None). Nothing is
    attached when ``aux`` needs no gradient.

    Shape:
        x any shape (a layer's output), aux () -> x's shape.
    """
    return _AttachAuxLoss.apply(x, aux, scale) if aux.requires_grad and torch.is_grad_enabled() else x
