"""Telemetry of a data mixture: how many tokens each source gave, per step and over the run.

The samples of a step are a function of the seed and the step alone (:class:`~torch_handle.data.datasets
.GlobalBatchSampler`), so rank 0 knows the whole global batch without a collective: it is the ``global_batch``
samples of the epoch's order that end at the data position. A dataset that is a mixture answers
``tokens_per_source(indices)`` (:class:`~torch_handle.data.mixture.MixedWindows`); the step event carries
``source_tokens`` (``{name: tokens}``), which :class:`~torch_handle.observe.state.RunState` adds up over the run
(the summary and the dashboard's ``data`` line show the shares). Nothing is added to the batches the model sees.
"""

from __future__ import annotations

import functools
from typing import Any

SOURCE_TOKENS = "source_tokens"
"""Step events: ``{source name: label tokens of the step's global batch}`` (mixtures only)."""


@functools.lru_cache(maxsize=2)
def _order(sampler: Any, epoch: int):
    return sampler.order_array(epoch)  # once an epoch (the sampler draws it once too)


def step_source_tokens(dataset: Any, sampler: Any, epoch: int, samples_in_epoch: int) -> dict[str, Any]:
    """``{"source_tokens": {name: tokens}}`` for the global batch that ends at ``samples_in_epoch`` of ``epoch``
    (the trainer's data position after the step), or ``{}`` when ``dataset`` is not a mixture."""
    count = getattr(dataset, "tokens_per_source", None)
    if count is None or samples_in_epoch < sampler.global_batch:
        return {}
    indices = _order(sampler, epoch)[samples_in_epoch - sampler.global_batch: samples_in_epoch]
    return {SOURCE_TOKENS: count(indices)}


def add_source_tokens(totals: dict[str, int], value: Any) -> None:
    """Add a step event's ``source_tokens`` to ``totals`` (malformed entries are skipped)."""
    if not isinstance(value, dict):
        return
    for name, tokens in value.items():
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
            totals[str(name)] = totals.get(str(name), 0) + tokens


def shares_text(totals: dict[str, int], width: int | None = None) -> str:
    """``web 50.1%  code 29.9%  math 20.0%`` (of the tokens in ``totals``), cut to ``width`` with an ellipsis."""
    total = sum(totals.values())
    if not total:
        return ""
    text = "  ".join(f"{name} {tokens / total:.1%}" for name, tokens in totals.items())
    return text if width is None or len(text) <= width else text[: max(0, width - 1)] + "…"
