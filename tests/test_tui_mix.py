"""The dashboard's ``data`` line: a data mixture's share of the tokens by source, in the status header.

``tests/fixtures/recorded-mix/mix-finished`` is what the 2 processes of a real ``handle run`` of the ``tokens``
dataset on a mixture of three prepared sources (Tiny Shakespeare 0.5, WikiText-2 0.3, Multi30k 0.2; the model of
tests/helpers.py's tiny preset, 24 steps of 8 samples x 32 tokens) wrote; /tmp paths replaced by relative ones.
The snapshot (tests/__snapshots__/test_tui_mix/) is refreshed with ``pytest tests/test_tui_mix.py
--snapshot-update``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from handle_cli.tui.app import HandleDashboard
from tests.tui_helpers import async_test, header, loaded
from torch_handle.observe.state import RunState
from torch_handle.observe.tail import EventReader

RECORDED = Path(__file__).parent / "fixtures" / "recorded-mix"


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shutil.copytree(RECORDED, tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    return Path("runs")


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


def test_snapshot_mixture_run_80x24(runs: Path, snap_compare) -> None:
    assert snap_compare(HandleDashboard(runs / "mix-finished", runs), terminal_size=(80, 24), run_before=loaded)
