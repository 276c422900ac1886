"""The training loss: token-mean cross-entropy over the whole vocabulary, from the logits (:func:`loss_fn`) or from
the last hidden states and the output weight a chunk of tokens at a time (:func:`chunked_loss_fn`; which one:
``training.loss_impl``, :func:`pick_loss_impl`); the tensor-parallel loss over a split vocabulary is
:func:`torch_handle.parallel.tensor.cross_entropy.vocab_parallel_cross_entropy`. And the scale a model's auxiliary
losses get in backward (:class:`AuxLossScale`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.model.kernels import cross_entropy
from torch_handle.model.linear_cross_entropy import linear_cross_entropy

AUTO_CHUNKED_LOGITS_BYTES = 256 << 20
"""``training.loss_impl = "auto"`` takes the chunked loss where a micro-batch's fp32 logits (B·T·V·4 bytes) would
reach this (256 MiB: Llama 3's vocabulary from 512 tokens a micro-batch; the quick start's 32 MiB stays full)."""


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0, *, compiled: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-mean cross-entropy in fp32. logits (B, T, V), labels (B, T) -> (scalar loss, tokens counted as a
    scalar tensor on the same device: counting must not force a host sync).

    ``label_smoothing`` eps in [0, 1): the target puts 1 - eps on the label and eps spread evenly over the
    vocabulary (Szegedy et al. 2016; Vaswani et al. 2017, eps = 0.1), exactly ``F.cross_entropy``'s
    ``label_smoothing``; 0 is plain cross-entropy. The trainer passes ``training.label_smoothing`` for training
    steps only: validation loss stays plain cross-entropy.

    Computed by ``torch_handle.model.kernels.cross_entropy`` (chunk by chunk in cache on CPU; ``compiled``: under
    ``torch.compile``, as ``training.compile`` asks). The trainer passes the loss through
    :meth:`AuxLossScale.probe` before backward."""
    n_tokens = (labels != IGNORE_INDEX).sum()
    flat, targets = logits.flatten(0, 1), labels.flatten()  # (B·T, V), (B·T,)
    return cross_entropy(flat, targets, label_smoothing, IGNORE_INDEX, compiled=compiled), n_tokens


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each token's cross-entropy in fp32: logits (B, T, V), labels (B, T) -> (B, T), 0 where the label is
    ``IGNORE_INDEX`` (``F.cross_entropy(reduction="none")``, chunked on CPU: :func:`~torch_handle.model.kernels.
    token_cross_entropy`); a preference loss sums a row's. A split model's share computes the same from its logits
    (:meth:`~torch_handle.train.shares.contract.ParallelShare.token_losses`)."""
    from torch_handle.model.kernels import token_cross_entropy

    return token_cross_entropy(logits.flatten(0, 1), labels.flatten(), IGNORE_INDEX).view_as(labels)


def chunked_loss_fn(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`loss_fn` of the logits ``hidden @ weight.T`` without them: hidden (B, T, C) (the model's final
    normalised hidden states, ``DecoderLM.forward(return_hidden=True)``), weight (V, C) (its output layer's, a tied
    embedding's table, frozen or not), labels (B, T) -> (scalar fp32 loss, tokens counted as a scalar tensor).

    The same loss and gradients as ``loss_fn(model(ids), labels, eps)`` (fp32: to rounding order; under bf16
    autocast the logits are rounded to bf16 as the output layer rounds them), the logits projected and reduced a
    chunk of tokens at a time (:func:`torch_handle.model.linear_cross_entropy.linear_cross_entropy`: Liger Kernel's
    ``FusedLinearCrossEntropy``; Wijmans et al. 2024, Cut Cross-Entropy; torchtune's chunked cross-entropy)."""
    n_tokens = (labels != IGNORE_INDEX).sum()
    return linear_cross_entropy(hidden, weight, labels, label_smoothing, IGNORE_INDEX), n_tokens


def pick_loss_impl(loss_impl: str, tokens: int, vocab_size: int, problem: str | None = None) -> str:
    """``"chunked"`` or ``"full"``: what ``training.loss_impl`` runs for micro-batches of ``tokens`` (B·T) tokens
    over ``vocab_size``. ``"auto"``: chunked where the fp32 logits would reach ``AUTO_CHUNKED_LOGITS_BYTES`` and
    nothing rules it out (``problem``: why the run cannot take it, from
    :func:`torch_handle.config.loss_impl.chunked_loss_problem`, or None).

    Raises:
        ValueError: ``"chunked"`` with a ``problem`` (``handle validate`` reports it first), or an unknown name."""
    if loss_impl == "full":
        return "full"
    if loss_impl == "chunked":
        if problem:
            raise ValueError(f"training.loss_impl = \"chunked\": {problem}")
        return "chunked"
    if loss_impl != "auto":
        raise ValueError(f"unknown training.loss_impl {loss_impl!r} (valid: auto, chunked, full)")
    return "chunked" if problem is None and tokens * vocab_size * 4 >= AUTO_CHUNKED_LOGITS_BYTES else "full"


def global_mean_weight(dataset: Any, indices: Any, grad_accum: int, dp_size: int) -> float | None:
    """The factor from a micro-batch's mean loss to its share of the global batch's mean per label:
    ``grad_accum * dp_size / labels of the global batch`` (its sample ``indices``, which every rank knows: the
    sampler's order depends on the seed and step only, so no collective). None when ``dataset`` has no
    ``label_counts`` (every sample as many labels: the mean of the micro-batches' means is the global mean). The
    gradient-accumulation normalisation transformers fixed in 4.46, for packed conversations."""
    count = getattr(dataset, "label_counts", None)
    return None if count is None else grad_accum * dp_size / max(1, count(indices))


def micro_batch_loss(strategy: Any, batch: dict[str, torch.Tensor], labels: torch.Tensor, loss_impl: str,
                     label_smoothing: float = 0.0, *, share: Any = None, compiled: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token-mean loss, tokens) of one micro-batch: the forward of ``strategy.model`` under ``strategy.autocast()``
    and the loss ``loss_impl`` names (``pick_loss_impl``), as the trainer computes it.

    The model's data-dependent checks (padding, packed documents) are made here, once per batch, in eager mode,
    when the model offers them (``checked_inputs`` of ``strategy.unwrapped()``) and is not split by a ``share``: a
    model compiled whole then runs without a graph break or a host read. ``"chunked"``: the model returns its hidden states (B, T, C)
    (``return_hidden=True``) and :func:`chunked_loss_fn` applies its output layer (``lm_head.weight``), under the
    autocast, as the output layer would run, or ``share.chunked_loss`` for a split model (tensor parallelism: this
    rank's vocabulary rows); ``"full"``: :func:`loss_fn` of the logits (B, T, V), or
    ``share.loss`` for a split model.

    Args:
        strategy: ``model`` (the module to call), ``unwrapped()`` (the model itself) and ``autocast()``.
        batch: the model's inputs (``input_ids``, ``position_ids``, ...); labels (B, T).
        compiled: ``training.compile`` (the full loss's cross-entropy compiled)."""
    model = strategy.unwrapped()
    # a split model (tp, pp, ep) decides its masks itself: a share may reshape the batch first (sequence
    # parallelism pads T to a multiple of tp), so masks decided here would not fit
    checked = getattr(model, "checked_inputs", None) if share is None else None
    inputs = batch if checked is None else checked(**batch)
    with strategy.autocast():
        if loss_impl == "chunked":  # the output layer inside the loss, chunk by chunk: no logits
            hidden = strategy.model(**inputs, return_hidden=True)  # (B, T, C); (B, T/tp, C) under sp
            chunked = chunked_loss_fn if share is None else share.chunked_loss
            return chunked(hidden, model.lm_head.weight, labels, label_smoothing)
        logits = strategy.model(**inputs)  # (B, T, V)
    if share is not None:
        return share.loss(logits, labels, label_smoothing)
    return loss_fn(logits, labels, label_smoothing, compiled=compiled)


class _Probe(torch.autograd.Function):
    """Identity on the loop's scalar loss; its backward records the incoming gradient in ``scale.value`` (kept on
    the device: no synchronisation)."""

    @staticmethod
    def forward(ctx, loss: Tensor, scale: AuxLossScale) -> Tensor:
        ctx.scale = scale
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        # tensor parallelism's native loss is a replicated DTensor: the factor is its local value
        ctx.scale.set(grad.to_local() if hasattr(grad, "to_local") else grad)
        return grad, None


class AuxLossScale:
    """The gradient a model's attached auxiliary losses (an MoE layer's balancing and z-losses,
    :mod:`torch_handle.model.aux_loss`) receive in backward: the factor the loop multiplied its loss by.

    :meth:`probe` wraps the loop's loss: an identity whose backward records the gradient that loss received
    (1 / grad_accum, times the fp16 loss scale, whatever the strategy does), so an auxiliary coefficient means the
    same with gradient accumulation, loss scaling and every strategy (Megatron-LM's
    ``MoEAuxLossAutoScaler.set_loss_scale``, recorded instead of computed). Every path from the loss to a layer's
    output runs through the probe, so autograd runs the probe's backward before any attached loss's. A backward
    that does not start from a probed loss (a pipeline schedule's, a test's ``out.sum().backward()``) sees the
    last value recorded or :meth:`set`, 1.0 until then.

    One per model: :meth:`bind` hands it to the model's MoE layers (their ``aux_loss_scale``). The factor is one
    0-d tensor on the model's device, written in place: a compiled block reads it when its backward runs (a graph
    input), where a number would be baked into the graph when it is traced (the aux losses of a compiled MoE block
    got a gradient of 1 whatever the loop's scale).

    Args:
        model: bound at once when given (on its device: bind after moving it).
        value: the initial factor.
    """

    def __init__(self, model: nn.Module | None = None, value: float = 1.0) -> None:
        self.value = torch.tensor(float(value))
        """The gradient the probed loss received in the latest backward (0-d fp32, never read back to the host)."""
        if model is not None:
            self.bind(model)

    def bind(self, model: nn.Module) -> AuxLossScale:
        """Make this the scale every MoE layer of ``model`` reads in backward, on the device of the model's
        parameters. Returns self."""
        from torch_handle.model.moe import moe_layers

        layers = moe_layers(model)
        if layers:
            self.value = self.value.to(layers[0].gate.weight.device)
        for layer in layers:
            layer.aux_loss_scale = self
        return self

    def set(self, value: Tensor | float) -> None:
        """Set the factor (the probe does; by hand where the losses bypass it: a pipeline schedule's, 1 /
        micro-batches). In place, through ``.data``: the attached losses of the step's earlier micro-batches hold
        the tensor for their backward, and a write through it would fail autograd's version check."""
        value = torch.as_tensor(value).detach()
        if value.device != self.value.device:  # bound before the model moved: follow the loss (a compiled block
            self.value = value.to(torch.float32).clone()  # traces once more)
        else:
            self.value.data.copy_(value)

    def probe(self, loss: Tensor) -> Tensor:
        """``loss`` (a scalar), unchanged; in backward it records the gradient ``loss`` receives."""
        return _Probe.apply(loss, self) if loss.requires_grad else loss
