"""Telemetry sink plugins: ``tensorboard`` (scalars in ``<run_dir>/tensorboard``, for ``tensorboard --logdir``).

Importing this module is cheap: TensorBoard (and torch) are imported by the factory, on rank 0 of a run.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from torch_handle.api import Kind, Sink, hookimpl
from torch_handle.observe.fields import (BREAKDOWN, COMM_S, PREFERENCE_METRICS, TASK_SCORES, TRAINED_SHARE,
                                        TRAINED_TOKENS_PER_S)

TRAIN_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", COMM_S, "mfu", TRAINED_TOKENS_PER_S,
                 TRAINED_SHARE, *PREFERENCE_METRICS)
"""Fields of ``step`` events written as ``train/<field>`` (when the event has them: ``comm_s`` only from
strategies that report it, ``mfu`` when the peak is known, the trained tokens/s and share from an SFT run, a DPO
run's rewards and log-probs as ``train/rewards/chosen`` etc., nats, accuracies 0..1)."""
VALID_SCALARS = PREFERENCE_METRICS
"""Fields of ``eval`` events written as ``valid/<field>`` beside ``valid/loss`` (a DPO run's validation rewards
and log-probs, ``objectives.preference.METRICS``)."""
TIME_SCALARS = BREAKDOWN
"""The step breakdown, written as ``time/<field>`` (seconds) so TensorBoard groups the parts in one section."""


def task_scalars(event: dict[str, Any]) -> dict[str, float]:
    """A ``tasks`` event's scores as ``tasks/<task>/<metric>`` -> value (the in-loop downstream evaluation's:
    acc, acc_norm 0..1, perplexities; ``exact_match,strip`` as ``exact_match_strip``: every character but a
    letter, digit or one of ``_-/.`` becomes ``_``, as TensorBoard would rename it with a warning); what is not a
    number is left out."""
    scores = event.get(TASK_SCORES)
    return {re.sub(r"[^-/\w.]", "_", f"tasks/{task}/{metric}"): float(value)
            for task, metrics in (scores.items() if isinstance(scores, dict) else ())
            if isinstance(metrics, dict)
            for metric, value in metrics.items() if isinstance(value, (int, float)) and not isinstance(value, bool)}


class TensorBoardSink(Sink):
    """``train/<field>`` and ``time/<part>`` for every step, ``valid/loss`` (and a DPO run's ``valid/rewards/*``,
    ``valid/logps/*``) for every eval after step 0 (the untrained baseline at step 0 is in events.jsonl only),
    ``tasks/<task>/<metric>`` for every in-loop downstream evaluation (:func:`task_scalars`);
    x axis: the step, wall time: the event's time."""

    def __init__(self, writer: Any):
        self.writer = writer

    def emit(self, event: dict[str, Any]) -> None:
        kind, step, t = event.get("kind"), event.get("step"), event.get("time")
        if kind == Kind.STEP:
            for key in TRAIN_SCALARS:
                if key in event:  # non-finite figures arrive as None: TensorBoard shows them as NaN
                    value = event[key]
                    self.writer.add_scalar(f"train/{key}", math.nan if value is None else value, step, walltime=t)
            for key in TIME_SCALARS:
                if key in event:
                    value = event[key]
                    self.writer.add_scalar(f"time/{key}", math.nan if value is None else value, step, walltime=t)
        elif kind == Kind.EVAL and step:
            value = event.get("val_loss")
            self.writer.add_scalar("valid/loss", math.nan if value is None else value, step, walltime=t)
            for key in VALID_SCALARS:
                if key in event:
                    value = event[key]
                    self.writer.add_scalar(f"valid/{key}", math.nan if value is None else value, step, walltime=t)
        elif kind == Kind.TASKS:
            for key, value in task_scalars(event).items():
                self.writer.add_scalar(key, value, step, walltime=t)

    def close(self) -> None:
        self.writer.close()


def build_tensorboard(run_dir: Path, preset: Any) -> TensorBoardSink:
    from torch.utils.tensorboard import SummaryWriter

    return TensorBoardSink(SummaryWriter(str(Path(run_dir) / "tensorboard")))


@hookimpl
def handle_register_sinks(register):
    register("tensorboard", build_tensorboard,
             "TensorBoard scalars (train/*, time/*, valid/*, tasks/*) in <run_dir>/tensorboard")
