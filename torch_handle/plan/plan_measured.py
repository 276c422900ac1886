"""``handle plan --measure``: a planned layout's prediction beside what a short real run of it measured, and how well
the planner ordered the layouts (Spearman's rank correlation). Standard library only.

Measured memory is the run's own telemetry, the largest rank of each: the peak of parameters + gradients + optimizer
state (the ``memory`` reports, :func:`torch_handle.plan.bench_scaling.summarize`), and the most activation bytes
autograd held saved at once (:func:`peak_saved_activations`), compared with the estimate's
``activation_saved_bytes`` (its in-flight peak, without the logits buffer and recompute it adds on top).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch_handle.observe.fields import ACTIVATION_SAVED_BYTES, Kind
from torch_handle.observe.tail import integer
from torch_handle.plan.bench_scaling import peak_over_ranks, summarize
from torch_handle.plan.plan_cost import spearman


def peak_saved_activations(events: Iterable[dict[str, Any]]) -> int | None:
    """The most bytes autograd held saved at once on any rank: with a pipeline the largest
    ``activation_peak_bytes`` of the step events' ``pipeline`` ranks (the micro-batches in flight), else the
    largest ``activation_saved_bytes`` (one micro-batch) of any rank's memory report; None when no event has it."""
    peaks, saved = [], []
    for e in events:
        if e.get("kind") != Kind.STEP:
            continue
        pipeline = e.get("pipeline")
        rows = pipeline.get("ranks") if isinstance(pipeline, dict) else None
        for row in rows if isinstance(rows, list) else []:
            value = integer(row.get("activation_peak_bytes")) if isinstance(row, dict) else None
            if value is not None:
                peaks.append(value)
        for m in e.get("memory") if isinstance(e.get("memory"), list) else []:
            value = integer(m.get(ACTIVATION_SAVED_BYTES)) if isinstance(m, dict) else None
            if value is not None:
                saved.append(value)
    found = peaks or saved
    return max(found) if found else None


def measured_record(row: dict[str, Any], status: str, message: str | None, events: list[dict[str, Any]],
                    skip: int, run_dir: str) -> dict[str, Any]:
    """One measured layout: ``row`` (a plan row's ``as_dict``) with ``status``, ``message``, ``run_dir`` and the
    measured ``tokens_per_s``, ``step_time_s``, ``state_bytes`` and ``activation_bytes`` (largest rank), and
    ``error_*`` = measured / predicted - 1 for each."""
    events = list(events)
    summary = summarize(events, skip)
    state = peak_over_ranks(summary["memory"], "model_state_bytes")
    saved = peak_saved_activations(events)
    out = {"label": row["label"], "status": status, "message": message, "run_dir": run_dir,
           "predicted_tokens_per_s": row["predicted_tokens_per_s"], "tokens_per_s": summary["tokens_per_s"],
           "step_time_s": summary["step_time_s"], "measured_steps": summary["measured_steps"],
           "predicted_state_bytes": row["largest_state_bytes"], "state_bytes": state,
           "predicted_activation_bytes": row.get("largest_saved_activation_bytes"), "activation_bytes": saved}
    for key, predicted in (("tokens_per_s", "predicted_tokens_per_s"), ("state_bytes", "predicted_state_bytes"),
                           ("activation_bytes", "predicted_activation_bytes")):
        ok = out[key] is not None and out[predicted]
        out[f"error_{key}"] = out[key] / out[predicted] - 1 if ok else None
    return out


def comparison(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the measured layouts, in the planner's order: ``spearman`` of predicted and measured tokens/s,
    ``fastest`` (the label measured fastest), ``first_choice_ratio`` (the planner's first choice's measured
    tokens/s over the fastest's) -- None where fewer than two (or one) finished."""
    ok = [r for r in records if r["status"] == "finished" and r.get("tokens_per_s")]
    fastest = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
    first = records[0] if records and records[0] in ok else None
    return {"spearman": spearman([r["predicted_tokens_per_s"] for r in ok], [r["tokens_per_s"] for r in ok]),
            "fastest": fastest["label"] if fastest else None,
            "first_choice": records[0]["label"] if records else None,
            "first_choice_ratio": first["tokens_per_s"] / fastest["tokens_per_s"] if first and fastest else None}
