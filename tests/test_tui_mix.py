"""The dashboard's ``data`` line: a data mixture's share of the tokens by source, in the status header.

``tests/fixtures/recorded-mix/mix-finished`` is what the 2 processes of a real ``handle run`` of the ``tokens``
dataset on a mixture of three prepared sources (Tiny Shakespeare 0.5, WikiText-2 0.3, Multi30k 0.2; the model of
tests/helpers.py's tiny preset, 24 steps of 8 samples x 32 tokens) wrote; /tmp paths replaced by relative ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handle_cli.tui.app import HandleDashboard
from tests.tui_helpers import async_test, copy_runs, header, loaded, screen_text
from torch_handle.observe.state import RunState
from torch_handle.observe.tail import EventReader

RECORDED = Path(__file__).parent / "fixtures" / "recorded-mix"


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return copy_runs(RECORDED, tmp_path, monkeypatch)


def _totals(run: Path) -> dict[str, int]:
    totals: dict[str, int] = {}
    for line in (run / "events.jsonl").read_text().splitlines():
        for name, n in json.loads(line).get("source_tokens", {}).items():
            totals[name] = totals.get(name, 0) + n
    return totals


def test_the_state_adds_up_each_sources_tokens_and_a_restart_replaces_its_steps(runs: Path) -> None:
    run = runs / "mix-finished"
    state = RunState(run)
    evs = EventReader(run / "events.jsonl").poll()
    state.apply(evs)
    totals = _totals(run)
    assert state.source_totals == totals and sum(totals.values()) == 24 * 8 * 32
    steps = [e for e in evs if e["kind"] == "step"]
    state.apply(steps[-4:])  # the last 4 steps again (a restart from step 20's checkpoint): counted once
    assert state.source_totals == totals


@async_test
async def test_the_header_shows_the_shares_at_80_columns(runs: Path) -> None:
    totals = _totals(runs / "mix-finished")
    total = sum(totals.values())
    app = HandleDashboard(runs / "mix-finished", runs)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        line = next(x for x in header(app).splitlines() if x.startswith("data "))
        assert line.split() == ["data", *(w for n, t in totals.items() for w in (n, f"{t / total:.1%}"))]


@async_test
async def test_the_data_line_is_whole_on_an_80x24_screen(runs: Path) -> None:
    """What the terminal shows (not only the header's text): the whole data line, every source and share, at
    80 × 24. (A frame-by-frame snapshot of this run is not kept: its charts' axis ticks differ between renders of
    the same events, 6.4/6.6 and 0.02/0.03, which no other recorded run shows; the data line is what this adds.)"""
    totals = _totals(runs / "mix-finished")
    total = sum(totals.values())
    want = " ".join(["data", *(w for n, t in totals.items() for w in (n, f"{t / total:.1%}"))])
    app = HandleDashboard(runs / "mix-finished", runs)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        shown = [" ".join(line.split()) for line in screen_text(app).splitlines()]
        assert any(want in line for line in shown), shown
