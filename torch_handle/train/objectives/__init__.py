"""Training objectives: what one micro-batch's loss is, the batch it reads, and the metrics its events carry.

``[finetune] objective`` picks one (:func:`objective_for`), and the trainer talks to it alone, with no branch per
objective:

==========  ==========================================  ==================================================
objective   batch (a micro-batch of B samples)          loss and metrics
==========  ==========================================  ==================================================
lm          ``input_ids``, ``labels`` (B, T): windows    token-mean cross-entropy; none
sft         the same, packed conversations, labels on   the same, over the trained tokens; none
            the trained tokens (and ``position_ids``)
dpo         ``input_ids``, ``labels`` (B, 2, T): each    a preference loss (``[finetune.preference]``), the
            pair's chosen and rejected rows              mean over pairs; TRL's ``rewards/*``, ``logps/*``
==========  ==========================================  ==================================================

The contract (:class:`Objective`): ``forward_loss`` gives a micro-batch's mean loss and what it is the mean over
(the loop sums ``loss · count`` and ``count`` over the step's micro-batches and ranks); ``attach`` appends the
step's (or evaluation's) metric sums to the trainer's one all-reduced vector and ``fields`` reads them back as the
event's fields. :class:`~torch_handle.train.objectives.tokens.TokenLoss` is lm and sft,
:class:`~torch_handle.train.objectives.pairs.DirectPreference` dpo.

A split model runs the same objective. Under tensor parallelism the logits are vocabulary-split and the share
computes the losses from them (``share.loss``: token-mean; ``share.token_losses``: per token, which dpo sums per
row). A pipeline (``parallel.pp > 1``) runs the forward itself, so the objective hands it the pieces instead of
``forward_loss``:

==============  ==========================================  ==============================================
piece           lm, sft                                     dpo
==============  ==========================================  ==============================================
``split``       inputs: the batch but ``labels``; target:    inputs: ``input_ids`` (2B, T); target:
                ``labels``                                  ``labels`` (2B, T), ``pair`` (B,)
``units``       labelled tokens                             pairs
``prepare``     nothing                                     the reference's log-probabilities per target:
                                                            a forward-only pass with the adapters off, or
                                                            the precomputed table's rows
``output_loss`` the share's token-mean loss of the last     the preference loss of the rows' summed
                stage's logits                              log-probabilities; the metric sums
==============  ==========================================  ==============================================
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Objective(Protocol):
    name: str

    def forward_loss(self, trainer: Any, batch: dict[str, torch.Tensor], *, train: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss (a scalar), what it is the mean over: tokens or pairs (a scalar tensor)) of one micro-batch
        (``batch`` without its labels afterwards)."""

    def split(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the model's keyword inputs, the loss's target) of one pipeline micro-batch (``batch`` emptied)."""

    def units(self, target: dict[str, torch.Tensor]) -> torch.Tensor:
        """What a micro-batch's loss is the mean over (a scalar tensor): tokens or pairs."""

    def prepare(self, trainer: Any, inputs: list[dict[str, torch.Tensor]], targets: list[dict[str, torch.Tensor]],
                forward: Any, *, train: bool = True) -> None:
        """Before a pipeline's schedule of these micro-batches: complete ``targets`` in place; ``forward(inputs,
        fn)`` runs a forward-only pass and returns ``fn(output, i)`` of each micro-batch on the last stage
        (empty elsewhere). Collective when it calls ``forward``."""

    def output_loss(self, trainer: Any, output: Any, target: dict[str, torch.Tensor], *, train: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss, units) of a micro-batch from the last stage's ``output`` (logits, vocabulary-split under
        tensor parallelism); metrics as ``forward_loss`` records them."""

    def attach(self, vector: torch.Tensor) -> torch.Tensor:
        """``vector`` (the trainer's step or evaluation sums, float64, on the device) with this objective's metric
        sums since the last call appended (and reset); ``vector`` itself when it has none."""

    def fields(self, reduced: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        """(the event's fields, the rest of ``reduced``) from the all-reduced vector :meth:`attach` returned
        (on the host); ``({}, reduced)`` without metrics."""


def objective_for(preset: Any) -> Objective:
    """The objective ``preset.finetune.objective`` names, with its options."""
    finetune = preset.finetune
    if finetune.objective == "dpo":
        from torch_handle.train.objectives.pairs import DirectPreference

        return DirectPreference(finetune.preference, finetune.method)
    from torch_handle.train.objectives.tokens import TokenLoss

    return TokenLoss(finetune.objective, preset.training.label_smoothing)
