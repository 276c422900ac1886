"""Telemetry of a data mixture: how many tokens each source gave, per step and over the run.

The samples of a step are a function of the seed and the step alone (:class:`~torch_handle.data.datasets
.GlobalBatchSampler`), so rank 0 knows the whole global batch without a collective: its sampler hands out every
rank's share of it and returns the whole when the step consumed it. A dataset that is a mixture answers
``tokens_per_source(indices)`` (:class:`~torch_handle.data.mixture.MixedWindows`); the step event carries
``source_tokens`` (``{name: tokens}``), which :class:`~torch_handle.observe.state.RunState` adds up over the run
(the summary and the dashboard's ``data`` line show the shares). Nothing is added to the batches the model sees.
"""

from __future__ import annotations

from typing import Any

SOURCE_TOKENS = "source_tokens"
"""Step events: ``{source name: label tokens of the step's global batch}`` (mixtures only)."""


def step_source_tokens(dataset: Any, indices: Any) -> dict[str, Any]:
    """``{"source_tokens": {name: tokens}}`` of the samples ``indices`` (a step's global batch, as the sampler
    handed it to the ranks: :meth:`~torch_handle.data.datasets.GlobalBatchSampler.advance`), or ``{}`` when
    ``dataset`` is not a mixture or no batch was drawn."""
    count = getattr(dataset, "tokens_per_source", None)
    if count is None or indices is None or not len(indices):
        return {}
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
