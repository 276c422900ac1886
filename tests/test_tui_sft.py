"""The dashboard of an SFT run (issue 46): the status header shows the trained share of the positions computed and
the trained tokens/s beside the throughput, readable at 80 × 24.

``tests/fixtures/recorded-sft/sft-lora`` is written by ``tests/fixtures/make_runs.py`` (``sft()``): LoRA SFT on 2
processes whose step events carry ``trained_tokens``, ``trained_share`` and ``trained_tokens_per_s``. The snapshot
(tests/__snapshots__/test_tui_sft/) is refreshed with ``pytest tests/test_tui_sft.py --snapshot-update``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handle_cli.tui.app import HandleDashboard
from tests.tui_helpers import async_test, copy_runs, header, loaded, screen_text
from torch_handle.observe.state import RunState
from torch_handle.observe.tail import EventReader

RECORDED = Path(__file__).parent / "fixtures" / "recorded-sft"


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return copy_runs(RECORDED, tmp_path, monkeypatch)


def _last_step(run: Path) -> dict:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "step"][-1]


def test_the_state_keeps_the_newest_trained_share_and_rate(runs: Path) -> None:
    run = runs / "sft-lora"
    state = RunState(run)
    state.apply(EventReader(run / "events.jsonl").poll())
    last = _last_step(run)
    assert (state.trained_share, state.last(state.trained_tokens_per_s)) == (last["trained_share"],
                                                                             last["trained_tokens_per_s"])
    assert len(state.trained_tokens_per_s) == len(state.steps) == last["step"]
    assert RunState(run).trained_share is None  # nothing applied: no trained share (a pretraining run's header)


@async_test
async def test_the_header_shows_the_trained_share_and_the_chart_the_trained_rate(runs: Path) -> None:
    """80 × 24: the share in the header (the grad norm kept), the trained tokens/s as a throughput series; 100
    columns: the rate in the header too."""
    last = _last_step(runs / "sft-lora")
    share, rate = f"trained {last['trained_share']:.0%}", f"{last['trained_tokens_per_s']:,.0f}/s"
    for size, with_rate in (((80, 24), False), ((100, 30), True)):
        app = HandleDashboard(runs / "sft-lora", runs)
        async with app.run_test(size=size) as pilot:
            await loaded(pilot)
            line = header(app).splitlines()[1]
            assert f"{last['tokens_per_s']:,.0f} tok/s  {share}" in line and "grad norm" in line, line
            assert (f"{share} {rate}" in line) == with_rate, line
            assert any(share in shown for shown in screen_text(app).splitlines())
            assert [s.label for s in app.charts["throughput"].series] == ["tokens/s", "trained/s", "s/step"]


def test_snapshot_sft_run_80x24(runs: Path, snap_compare) -> None:
    assert snap_compare(HandleDashboard(runs / "sft-lora", runs), terminal_size=(80, 24), run_before=loaded)
