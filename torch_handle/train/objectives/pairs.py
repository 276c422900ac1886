"""The objective ``dpo``: preference pairs (:class:`~torch_handle.data.chat.pair_samples.PreferencePairs`) and a
preference loss (:mod:`torch_handle.train.objectives.preference`, ``[finetune.preference]``).

A micro-batch of B pairs, ``input_ids`` and ``labels`` (B, 2, T), runs as ONE forward of 2B rows, the B chosen
rows first, then the B rejected (torchtune's and TRL's ``concatenated_forward``); each row's summed log-probability
of its trained tokens (the completion's) is the policy's ``s``. The reference model's, for a reference-based loss,
is the same model with its LoRA adapters switched off (:func:`~torch_handle.finetune.lora.adapters_disabled`, no
second copy; peft's ``disable_adapter`` as TRL and torchtune use it), in evaluation mode (no dropout), under
``no_grad``. The loss is the mean over pairs; a step's and an evaluation's metrics are the means over the pairs of
every data-parallel rank (their sums ride on the trainer's one all-reduce: :meth:`DirectPreference.attach`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.finetune.lora import adapters_disabled
from torch_handle.model.linear_cross_entropy import sequence_logps as chunked_sequence_logps
from torch_handle.train.objectives.preference import METRICS, PairLogps, PreferenceLoss, preference_loss

TRAINED_TOKENS = "tokens"
"""The step record's key for the labels a step counted (the trainer's ``tokens``; the step report adds the
positions computed beside them)."""


def sequence_logps(strategy: Any, input_ids: torch.Tensor, labels: torch.Tensor, loss_impl: str) -> torch.Tensor:
    """Σ_t log π(labels_t | input_ids_≤t) over each row's labels other than ``IGNORE_INDEX``: input_ids, labels
    (N, T) -> (N,) fp32, differentiable. The forward of ``strategy.model`` under ``strategy.autocast()``, as
    :func:`~torch_handle.train.loss.micro_batch_loss` runs it: ``"chunked"`` from the hidden states a chunk of
    tokens at a time (:func:`~torch_handle.model.linear_cross_entropy.sequence_logps`), else from the logits
    (N, T, V) in fp32."""
    model = strategy.unwrapped()
    checked = getattr(model, "checked_inputs", None)
    inputs = {"input_ids": input_ids} if checked is None else checked(input_ids=input_ids)
    with strategy.autocast():
        if loss_impl == "chunked":
            hidden = strategy.model(**inputs, return_hidden=True)  # (N, T, C)
            return chunked_sequence_logps(hidden, model.lm_head.weight, labels, IGNORE_INDEX)
        logits = strategy.model(**inputs)  # (N, T, V)
    token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                            reduction="none")  # (N·T,), 0 where ignored
    return -token.view_as(labels).sum(1)


@contextlib.contextmanager
def reference_model(model: torch.nn.Module) -> Iterator[None]:
    """``model`` as its reference inside the block: adapters off, evaluation mode (no dropout: TRL's
    ``disable_dropout``), no gradients; the training mode restored after."""
    training = model.training
    model.train(False)
    try:
        with torch.no_grad(), adapters_disabled(model):
            yield
    finally:
        model.train(training)


class DirectPreference:
    """``dpo``: the preference loss of ``options`` (a :class:`~torch_handle.config.schema.PreferenceConfig`) on
    pairs. ``reference``: ``adapters_off`` or ``none`` (``auto``: none for a reference-free loss)."""

    name = "dpo"

    def __init__(self, options: Any) -> None:
        self.loss: PreferenceLoss = preference_loss(options.loss, options.beta, options.label_smoothing,
                                                    options.gamma)
        auto = "none" if self.loss.reference_free else "adapters_off"
        self.reference = auto if options.reference == "auto" else options.reference
        self.sums: torch.Tensor | None = None
        """Σ over pairs of each of :data:`METRICS`, then the trained tokens, since the last :meth:`attach`."""

    def forward_loss(self, trainer: Any, batch: dict[str, torch.Tensor], *, train: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the mean of the micro-batch's per-pair losses, its pairs B) of ``batch`` (``input_ids``, ``labels``:
        (B, 2, T))."""
        ids, labels = batch.pop("input_ids"), batch.pop("labels")
        B = ids.shape[0]
        ids, labels = (x.transpose(0, 1).reshape(2 * B, -1) for x in (ids, labels))  # (2B, T): chosen, rejected
        strategy = trainer.strategy
        policy = sequence_logps(strategy, ids, labels, trainer.loss_impl)  # (2B,)
        counts = (labels != IGNORE_INDEX).sum(1)
        ref: tuple[torch.Tensor, ...] = ()
        if self.reference == "adapters_off":
            with reference_model(strategy.unwrapped()):
                logps = sequence_logps(strategy, ids, labels, trainer.loss_impl)
            ref = (logps[:B], logps[B:])
        lengths = counts.to(policy.dtype)
        losses, metrics = self.loss(PairLogps(policy[:B], policy[B:], lengths[:B], lengths[B:], *ref))
        once = float(trainer.ctx.tp_rank == 0)
        sums = torch.stack([*(metrics[k].sum() for k in METRICS), counts.sum().float()]).double() * once
        self.sums = sums if self.sums is None else self.sums + sums
        return trainer.aux_loss_scale.probe(losses.mean()), torch.tensor(B, device=losses.device)

    def attach(self, vector: torch.Tensor) -> torch.Tensor:
        sums = self.sums if self.sums is not None else vector.new_zeros(len(METRICS) + 1)
        self.sums = None
        return torch.cat([vector, sums.to(vector)])

    def fields(self, reduced: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        """The pair means of :data:`METRICS` (``reduced[1]``: the pairs counted) and the trained tokens as
        ``tokens``."""
        k = len(METRICS) + 1
        tail, pairs = reduced[-k:].tolist(), max(float(reduced[1]), 1.0)
        out: dict[str, Any] = {name: tail[i] / pairs for i, name in enumerate(METRICS)}
        out[TRAINED_TOKENS] = int(tail[-1])
        return out, reduced[:-k]
