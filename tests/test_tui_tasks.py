"""The dashboard of a run with in-loop downstream tasks (issue 50): a tasks panel in the learning-rate chart's place,
one line per task and metric with the newest score, a sparkline over the evaluations and the first score, readable
at 80 × 24; the state keeps every evaluation's scores and drops those a restart scores again.

The run is ``tests/fixtures/recorded/zero2-finished`` (20 steps) with a ``tasks`` event after every 5th step, as
``torch_handle.train.eval_tasks`` writes them (scores made up here: a rising accuracy, a falling perplexity). The
snapshot (tests/__snapshots__/test_tui_tasks/) is refreshed with ``pytest tests/test_tui_tasks.py
--snapshot-update``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handle_cli.tui.app import HandleDashboard
from handle_cli.tui.tasks_panel import score_text, short_names
from tests.tui_helpers import async_test, copy_runs, loaded, screen_text
from torch_handle.observe.state import RunState
from torch_handle.observe.tail import EventReader

RECORDED = Path(__file__).parent / "fixtures" / "recorded"


def _scores(step: int) -> dict:
    return {"handle_wikitext_cloze": {"acc": 0.25 + step / 80, "acc_norm": 0.3 + step / 100},
            "handle_seed_answers": {"exact_match,strip": step / 40},
            "handle_wikitext_ppl": {"word_perplexity": 4000.0 / step, "bits_per_byte": 6.0 - step / 10}}


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """zero2-finished with a tasks event after steps 5, 10, 15 and 20 (events renumbered)."""
    runs = copy_runs(RECORDED, tmp_path, monkeypatch)
    path = runs / "zero2-finished" / "events.jsonl"
    events = []
    for e in map(json.loads, path.read_text().splitlines()):
        events.append(e)
        if e["kind"] == "step" and e["step"] % 5 == 0:
            events.append({"time": e["time"] + 0.1, "kind": "tasks", "step": e["step"], "scores": _scores(e["step"]),
                           "seconds": 1.5, "requests": [{"loglikelihood": 8}, {"loglikelihood": 8}]})
    path.write_text("".join(json.dumps({**e, "seq": i}) + "\n" for i, e in enumerate(events)))
    return runs / "zero2-finished"


def test_the_state_keeps_each_evaluations_scores(run: Path) -> None:
    state = RunState(run)
    state.apply(EventReader(run / "events.jsonl").poll())
    assert state.task_steps == [5, 10, 15, 20]
    assert state.task_scores["handle_wikitext_cloze acc"] == [_scores(s)["handle_wikitext_cloze"]["acc"]
                                                              for s in (5, 10, 15, 20)]
    assert list(state.task_scores)[2] == "handle_seed_answers exact_match,strip"
    state.apply([{"seq": 99, "time": 1.0, "kind": "step", "step": 11, "loss": 0.5}])  # a restart from step 10
    assert state.task_steps == [5, 10] and all(len(v) == 2 for v in state.task_scores.values())
    state.apply([{"seq": 100, "time": 2.0, "kind": "tasks", "step": 12, "scores": {"other": {"acc": 0.5}}}])
    assert state.task_scores["other acc"] == [None, None, 0.5]  # a metric seen late: None before
    assert state.task_scores["handle_wikitext_cloze acc"][-1] is None


def test_scores_and_names_as_the_panel_prints_them() -> None:
    assert score_text("acc", 0.4375) == "43.8%" and score_text("exact_match,strip", 1.0) == "100.0%"
    assert score_text("word_perplexity", 2300717934.7) == "2.301e+09" and score_text("acc", None) == "–"
    assert short_names(["handle_a acc", "handle_b x"]) == ["a acc", "b x"]
    assert short_names(["handle_a acc", "handle_a acc_norm"]) == ["handle_a acc", "handle_a acc_norm"]


@async_test
async def test_the_panel_shows_every_tasks_newest_score(run: Path) -> None:
    """At 80 × 24 every task and metric has its line with the newest score and a rising (falling) sparkline; at 60
    cells the first evaluation's score is there too."""
    from handle_cli.tui.tasks_panel import TasksPanel

    app = HandleDashboard(run, run.parent)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        text = screen_text(app)
        assert "tasks · step 20" in text and "learning rate" not in text, text
        lines = [" ".join(ln.split()) for ln in text.splitlines()]
        for name, task, metric, spark in (("wikitext_cloze acc_norm", "handle_wikitext_cloze", "acc_norm", "▁▃▆█"),
                                          ("exact_match", "handle_seed_answers", "exact_match,strip", "▁▃▆█"),
                                          ("wikitext_ppl word_ppl", "handle_wikitext_ppl", "word_perplexity", "█▃▂▁")):
            shown = next(ln for ln in lines if f"{name} " in ln)
            assert f" {score_text(metric, _scores(20)[task][metric])} {spark} " in shown, (name, shown)
        panel = app.query_one(TasksPanel)
        wide = [line.plain for line in panel.lines(60, 10)]
        assert wide[0].split()[-1] == "@5" and wide[1].split()[-1] == score_text("acc", _scores(5)[
            "handle_wikitext_cloze"]["acc"]), wide


def test_snapshot_tasks_run_80x24(run: Path, snap_compare) -> None:
    assert snap_compare(HandleDashboard(run, run.parent), terminal_size=(80, 24), run_before=loaded)
