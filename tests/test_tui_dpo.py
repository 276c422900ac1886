"""The dashboard of a DPO run (issue 47): a preference panel in the learning-rate chart's place with the rewards
of the chosen and rejected completions, their margin and the accuracy (newest value, a sparkline of the recent
steps, the newest evaluation's value), readable at 80 × 24; runs without the metrics keep the lr chart.

``tests/fixtures/recorded-dpo/dpo-lora`` is written by ``tests/fixtures/make_runs.py`` (``dpo()``): LoRA DPO on 1
process whose step and eval events carry ``rewards/*`` and ``logps/*``. The snapshot
(tests/__snapshots__/test_tui_dpo/) is refreshed with ``pytest tests/test_tui_dpo.py --snapshot-update``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handle_cli.tui.app import HandleDashboard
from handle_cli.tui.preference_panel import sparkline
from tests.tui_helpers import async_test, copy_runs, loaded, screen_text
from torch_handle.observe.state import RunState
from torch_handle.observe.tail import EventReader
from torch_handle.train.objectives.preference import METRICS

RECORDED = Path(__file__).parent / "fixtures" / "recorded-dpo"


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return copy_runs(RECORDED, tmp_path, monkeypatch)


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["kind"] == kind]


def test_the_state_keeps_every_steps_metrics_and_each_evals(runs: Path) -> None:
    run = runs / "dpo-lora"
    state = RunState(run)
    state.apply(EventReader(run / "events.jsonl").poll())
    steps, evals = _events(run, "step"), _events(run, "eval")
    assert state.preference_steps == [e["step"] for e in steps]
    assert state.preference == {k: [e[k] for e in steps] for k in METRICS}
    assert state.val_preference == [{k: e[k] for k in METRICS} for e in evals]
    state.apply([{"seq": 99, "time": 1.0, "kind": "step", "step": 11, "loss": 0.5}])  # a restart from step 10
    assert state.preference_steps == list(range(1, 11)) and len(state.preference["rewards/margins"]) == 10
    assert len(state.val_preference) == len(state.val_steps) == 2  # steps 0 and 10


def test_sparkline_scales_from_the_minimum_to_the_maximum() -> None:
    assert sparkline([0.0, 0.5, 1.0, None], 4) == "▁▅█ "
    assert sparkline([2.0, 2.0], 4) == "▄▄"
    assert sparkline([1.0, 3.0, 5.0, 7.0], 2) == "▁█"  # longer than the width: averaged over runs of steps


@async_test
async def test_the_panel_shows_the_newest_rewards_and_eval_only_for_a_dpo_run(runs: Path, tmp_path: Path) -> None:
    last, val = _events(runs / "dpo-lora", "step")[-1], _events(runs / "dpo-lora", "eval")[-1]
    app = HandleDashboard(runs / "dpo-lora", runs)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        text = screen_text(app)
        assert "preference · step 30" in text and "val@30" in text and "learning rate" not in text, text
        lines = text.splitlines()
        for label, value, val_value in (("chosen", f"{last['rewards/chosen']:+.3f}", f"{val['rewards/chosen']:+.3f}"),
                                        ("margin", f"{last['rewards/margins']:+.3f}",
                                         f"{val['rewards/margins']:+.3f}"),
                                        ("accuracy", f"{last['rewards/accuracies']:.0%}",
                                         f"{val['rewards/accuracies']:.0%}")):
            assert f"{label} {value} " in (shown := next(" ".join(ln.split()) for ln in lines if f" {label} " in ln))
            assert f" {val_value} │" in shown, (label, shown)
    lm = tmp_path / "runs" / "lm-run"  # the same run without the metrics: the lr chart, no panel
    lm.mkdir()
    (lm / "events.jsonl").write_text("".join(
        json.dumps({k: v for k, v in e.items() if k not in METRICS}) + "\n"
        for e in map(json.loads, (runs / "dpo-lora" / "events.jsonl").read_text().splitlines())))
    app = HandleDashboard(runs / "lm-run", runs)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        text = screen_text(app)
        assert "learning rate" in text and "preference" not in text, text


def test_snapshot_dpo_run_80x24(runs: Path, snap_compare) -> None:
    assert snap_compare(HandleDashboard(runs / "dpo-lora", runs), terminal_size=(80, 24), run_before=loaded)
