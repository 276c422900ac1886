"""The objectives ``lm`` and ``sft``: token-mean cross-entropy over a micro-batch's labels (every token of a
window, or the trained tokens of packed conversations; the data decides which), :func:`~torch_handle.train.loss
.micro_batch_loss`. No metrics beyond the loss."""

from __future__ import annotations

from typing import Any

import torch

from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.train.loss import micro_batch_loss


class TokenLoss:
    """``lm`` / ``sft``: training steps use ``training.label_smoothing``, evaluation (``train=False``) plain
    cross-entropy, so validation losses stay comparable across settings."""

    def __init__(self, name: str = "lm", label_smoothing: float = 0.0) -> None:
        self.name, self.label_smoothing = name, label_smoothing

    def forward_loss(self, trainer: Any, batch: dict[str, torch.Tensor], *, train: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        labels = batch.pop("labels")
        loss, n = micro_batch_loss(trainer.strategy, batch, labels, trainer.loss_impl,
                                   self.label_smoothing if train else 0.0, share=trainer.share,
                                   compiled=trainer.training.compile)
        return trainer.aux_loss_scale.probe(loss), n

    # -- a pipeline's micro-batches (parallel.pp > 1) --------------------------------------------------------
    def split(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the model's inputs, ``{"labels": (B, T)}``) of a micro-batch."""
        labels = batch.pop("labels")
        return batch, {"labels": labels}

    def units(self, target: dict[str, torch.Tensor]) -> torch.Tensor:
        """The labelled tokens of a micro-batch's target."""
        return (target["labels"] != IGNORE_INDEX).sum()

    def prepare(self, trainer: Any, inputs: list[dict[str, torch.Tensor]], targets: list[dict[str, torch.Tensor]],
                forward: Any, *, train: bool = True) -> None:
        return None

    def output_loss(self, trainer: Any, output: Any, target: dict[str, torch.Tensor], *, train: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token-mean loss, tokens) of the last stage's logits (B, T, V or V/tp): the share's loss."""
        return trainer.share.loss(output, target["labels"], self.label_smoothing if train else 0.0)

    def attach(self, vector: torch.Tensor) -> torch.Tensor:
        return vector

    def fields(self, reduced: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        return {}, reduced
