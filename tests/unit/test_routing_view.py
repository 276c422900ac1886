"""The routing view (torch_handle/observe/routing_view.py) on hand-made step events: loads against the mean, the hot
and dead experts, a run's summary across a restart, and events it must skip rather than raise on."""

from __future__ import annotations

import pytest

from torch_handle.observe.routing_view import (LayerLoad, format_summary, layer_loads, marks_text, ratio_text,
                                               read_moe, routing_steps, summarize)


def step(n: int, rows: list[list[int]], dropped: list[int] | None = None, aux: float = 1.0) -> dict:
    return {"kind": "step", "step": n, "moe": {"layers": [f"layers.{2 * i + 1}" for i in range(len(rows))],
                                               "top_k": 2, "tokens_per_expert": rows,
                                               "dropped_tokens": dropped or [0] * len(rows), "aux_loss": [aux] * len(rows)}}


def test_loads_are_read_against_the_layers_mean_and_name_the_hot_and_dead():
    load = LayerLoad("layers.1", (8, 0, 2, 6), dropped=4)
    assert load.label == "L1" and load.ratios == [2.0, 0.0, 0.5, 1.5]
    assert load.dead == [1] and load.hot == [0, 3] and load.drop_rate == pytest.approx(4 / 20)
    assert LayerLoad("layers.3", (0, 0), 0).dead == []  # no tokens at all: nothing to call dead
    loads = layer_loads([step(1, [[8, 0, 2, 6], [4, 4, 4, 4]])["moe"]])
    assert marks_text(loads) == "hot L1 e0 2.0 · L1 e3 1.5 · dead L1 e1"
    assert marks_text(loads, limit=1) == "hot L1 e0 2.0 +1 · dead L1 e1"
    assert [ratio_text(r) for r in (0.04, 1.25, 9.96, 31.7, 120.0)] == ["0.0", "1.2", " 10", " 32", "99+"]


def test_a_summary_counts_a_step_run_again_after_a_restart_once():
    events = [step(1, [[10, 0, 6, 0]], aux=2.0), step(2, [[1, 1, 1, 1]], aux=1.5),
              step(2, [[3, 3, 1, 1]], dropped=[4], aux=1.2), step(3, [[2, 2, 2, 2]], aux=1.0)]
    summary = summarize(routing_steps(events), window=1)
    (layer,) = summary["layers"]
    # steps 1, 2 (its second copy) and 3: expert totals 15, 5, 9, 3 of 32
    assert summary["steps"] == [1, 3] and summary["logged_steps"] == 3
    assert layer["share_max"] == pytest.approx(15 / 32) and layer["expert_max"] == 0
    assert layer["share_min"] == pytest.approx(3 / 32) and layer["expert_min"] == 3
    assert layer["dead"] == [] and layer["dead_last"] == [] and layer["drop_rate"] == pytest.approx(4 / 36)
    assert layer["aux_loss"] == [2.0, 1.0]  # the first and the last window of 1 step
    text = format_summary(summary)
    assert "L1    " in text and "46.9% e0" in text and "2.000 → 1.000" in text and max(map(len, text.splitlines())) <= 80


@pytest.mark.parametrize("moe", [
    None, "x", {"layers": ["layers.1"]}, {"layers": ["layers.1"], "tokens_per_expert": [[1, 2], [3, 4]]},
    {"layers": ["layers.1", "layers.3"], "tokens_per_expert": [[1, 2], [3]]},
    {"layers": ["layers.1"], "tokens_per_expert": [[1, -2]]}, {"layers": ["layers.1"], "tokens_per_expert": [["1"]]},
    {"layers": [], "tokens_per_expert": []}])
def test_a_malformed_moe_object_is_skipped(moe):
    assert read_moe({"kind": "step", "step": 1, "moe": moe}) is None
    assert routing_steps([{"kind": "step", "step": 1, "moe": moe}, step(2, [[1, 1]])]) == [(2, step(2, [[1, 1]])["moe"])]


def test_steps_of_another_model_do_not_add_to_the_newest_ones_loads():
    old, new = step(1, [[5, 5, 5]]), step(2, [[1, 2], [3, 4]])
    assert [x.counts for x in layer_loads([old["moe"], new["moe"]])] == [(1, 2), (3, 4)]
