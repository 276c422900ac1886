"""The dashboard's routing panel, driven headless with Textual's pilot.

``tests/fixtures/recorded-moe/moe-running`` is what the 2 processes of a real ``handle run presets/moe.toml`` (an MoE
feed-forward in each of the 4 layers: 8 experts, top-2, DDP) wrote, cut back to step 58 of 60
(``tests/fixtures/trim_3d_run.py`` says how it was made). The 64-expert run is that run with every step's counts
spread over 64 experts, three of them never chosen. Every test works on a copy in ``tmp_path``. Snapshots
(tests/__snapshots__/test_tui_routing/) are refreshed with ``pytest tests/test_tui_routing.py --snapshot-update``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from handle_cli.tui.app import HandleDashboard
from handle_cli.tui.routing_panel import RoutingMap, RoutingMarks
from handle_cli.tui.screens import HELP, HelpScreen
from tests.tui_helpers import async_test, copy_runs, loaded, screen_text
from torch_handle.observe.routing_view import HOT_RATIO, layer_loads, routing_steps

RECORDED_MOE = Path(__file__).parent / "fixtures" / "recorded-moe"


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the recorded run at ./runs (relative, so what the screens show does not depend on tmp_path)."""
    return copy_runs(RECORDED_MOE, tmp_path, monkeypatch)


def events_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def last_window(run: Path) -> list[dict]:
    """The ``moe`` of the run's last 10 steps: what the heatmap adds up."""
    return [moe for _, moe in routing_steps(events_of(run))][-10:]


@pytest.fixture
def wide_runs(runs: Path) -> Path:
    """The recorded run with 64 experts a layer: each step's counts of expert e spread over experts 8e..8e+7 (a
    fixed uneven split), experts 5, 17 and 40 of layer 2 never chosen."""
    run = runs / "moe-running"
    split = [3, 1, 2, 1, 1, 4, 2, 2]
    events = events_of(run)
    for e in events:
        if "moe" in e:
            rows = []
            for i, row in enumerate(e["moe"]["tokens_per_expert"]):
                wide = [c * split[j] // 16 for c in row for j in range(8)]
                for dead in ((5, 17, 40) if i == 2 else ()):
                    wide[dead] = 0
                rows.append(wide)
            e["moe"]["tokens_per_expert"] = rows
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return runs


@async_test
async def test_the_routing_panel_takes_the_lr_charts_place_at_80x24(runs: Path) -> None:
    run = runs / "moe-running"
    app = HandleDashboard(run, runs)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        assert app.screen.has_class("-moe") and not app.query_one("#lr").display
        box = app.query_one("#routing-panel")
        assert box.border_title == "routing · load ÷ mean · 8 experts"
        assert box.border_subtitle.startswith("steps 49–58 · aux ")
        rows = app.query_one(RoutingMap).render().plain.splitlines()  # what it draws at this size
        loads = layer_loads(last_window(run))
        # every layer with all 8 experts in view, each cell its load over the mean of the last 10 steps
        assert [row[:3] for row in rows] == ["L0 ", "L1 ", "L2 ", "L3 "]
        for row, load in zip(rows, loads):
            assert re.findall(r"\d+\.\d", row)[:8] == [f"{r:.1f}" for r in load.ratios]
        screen = screen_text(app)
        assert all(row.rstrip() in screen for row in rows)
        hot = max(((r, x.label, e) for x in loads for e, r in enumerate(x.ratios)), key=lambda t: t[0])
        assert hot[0] >= HOT_RATIO and f"hot {hot[1]} e{hot[2]} {hot[0]:.1f}" in screen  # the hottest, named first
        assert "e Routing" in screen and "m Memory" in screen

        await pilot.press("e")  # expanded: the experts' numbers above, the key below
        await pilot.pause(0.1)
        screen = screen_text(app)
        assert "loss" not in screen.split("routing")[1] and "   e0  e1  e2" in screen
        assert "tokens ÷ the layer's mean · hot ≥ 1.5× · × dead · last 10 steps" in screen
        await pilot.press("e")
        await pilot.pause(0.1)
        assert not app.screen.has_class("-routing") and "memory per rank" in screen_text(app)

        await pilot.press("question_mark")  # the help has the panel, at the end of what scrolls
        await pilot.press("end")
        await pilot.pause(0.1)
        assert isinstance(app.screen, HelpScreen) and "× dead (no" in screen_text(app)


@async_test
async def test_64_experts_wrap_at_80x24_scroll_and_name_the_dead(wide_runs: Path) -> None:
    app = HandleDashboard(wide_runs / "moe-running", wide_runs)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        marks = app.query_one(RoutingMarks).line(36).plain
        assert "dead L2 e5" in marks and marks.startswith("hot ")
        screen = screen_text(app)
        row = next(line for line in screen.splitlines() if "│ L0 " in line)
        assert re.search(r"L0 [▁▂▃▄▅▆▇█]{30,}", row)  # one character an expert, wrapped over 2 lines
        assert "L3" not in screen  # below: the list scrolls
        await pilot.press("tab")
        assert app.focused is app.query_one("#routing-scroll")
        await pilot.press("end")
        await pilot.pause(0.1)
        assert "│ L3 " in screen_text(app) and "dead L2 e5" in screen_text(app)  # the marks stay in view

        await pilot.press("e")  # expanded: a row per layer, ticks every 8 experts, the dead as ×
        await pilot.pause(0.1)
        rows = [line for line in screen_text(app).splitlines() if re.search(r"│ L\d ", line)]
        assert len(rows) == 4 and "    0       8       16" in screen_text(app)
        cells = re.search(r"L2 (\S{64})", rows[2]).group(1)
        assert [i for i, c in enumerate(cells) if c == "×"] == [5, 17, 40]


@async_test
async def test_a_dense_run_has_no_routing_panel_nor_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = copy_runs(Path(__file__).parent / "fixtures" / "recorded-3d", tmp_path, monkeypatch)
    app = HandleDashboard(runs / "3d-running", runs)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        assert not app.screen.has_class("-moe") and not app.query_one("#routing-panel").display
        assert "Routing" not in screen_text(app)
        await pilot.press("e")
        await pilot.pause(0.1)
        assert not app.screen.has_class("-routing")
    text = HELP.replace("[b]", "").replace("[/b]", "").replace("\n", " ")
    assert "e routing" in text and "Routing (an MoE run, in place of the lr chart)" in text


def test_snapshot_recorded_moe_run_80x24(runs: Path, snap_compare) -> None:
    assert snap_compare(HandleDashboard(runs / "moe-running", runs), terminal_size=(80, 24), run_before=loaded)


def test_snapshot_recorded_moe_run_120x40(runs: Path, snap_compare) -> None:
    assert snap_compare(HandleDashboard(runs / "moe-running", runs), terminal_size=(120, 40), run_before=loaded)
