"""The dashboard on runs with tensor and pipeline parallelism, driven headless with Textual's pilot.

``tests/fixtures/recorded-3d/3d-running`` is what the 8 processes of a real ``handle run presets/3d.toml`` (dp 2 ×
tp 2 × pp 2) wrote, cut back to step 38 of 40 (``tests/fixtures/trim_3d_run.py`` says how it was made); the pp = 2
and tp = 2 runs come from ``tests/fixtures/make_runs.py``. Every test works on a copy in ``tmp_path``.
Snapshots (tests/__snapshots__/test_tui_parallel/) are refreshed with
``pytest tests/test_tui_parallel.py --snapshot-update``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from handle_cli.runner import summary_text
from handle_cli.tui.app import HandleDashboard
from handle_cli.tui.header import StatusHeader
from handle_cli.tui.memory_panel import MemoryBars, short_bytes
from handle_cli.tui.pipeline_panel import PipelinePanel
from handle_cli.tui.screens import HELP, HelpScreen
from handle_cli.tui.time_panel import TimePanel
from tests.tui_helpers import async_test, copy_runs, header, loaded, screen_text, step_event
from torch_handle.common.run_layout import RunLayout
from torch_handle.observe.comm import comm_fields
from torch_handle.observe.state import RunState
from torch_handle.rundir import read_run_info

FIXTURES = Path(__file__).parent / "fixtures"
PIPELINE_FIXTURES = FIXTURES / "recorded-pipeline"
TP_FIXTURES = FIXTURES / "recorded-tp"
RECORDED_3D = FIXTURES / "recorded-3d"


@pytest.fixture
def runs_3d(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return copy_runs(RECORDED_3D, tmp_path, monkeypatch) / "3d-running"


def events_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def legend_ms(line_texts: list[str]) -> dict[str, float]:
    """The time panel's legend, ``■ data 0.8 ■ fwd 585.8 ...``, as {label: ms}."""
    return {name: float(ms) for name, ms in re.findall(r"■ ([a-z ]+?) (\d+\.\d)", " ".join(line_texts))}


# ---------------------------------------------------------------------------------------------------------------
# the recorded dp 2 × tp 2 × pp 2 run (8 processes)
# ---------------------------------------------------------------------------------------------------------------


@async_test
async def test_recorded_3d_run_at_80x24_reaches_every_rank(runs_3d: Path) -> None:
    memory = next(e["memory"] for e in reversed(events_of(runs_3d)) if "memory" in e)  # step 35's, all 8 ranks
    rank7 = "rank 7 dp1 tp1 pp1 "
    rss7 = short_bytes(next(m["rss_bytes"] for m in memory if m["rank"] == 7))
    app = HandleDashboard(runs_3d, runs_3d.parent)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        first, second = header(app).splitlines()
        assert "RUNNING   3d  dp2×tp2×pp2  world 8  step 38/40" in first and "elapsed 01:35" in first
        assert "grad norm 0.38" in second

        screen = screen_text(app)
        # the summary names the rank with the largest RSS; the list shows rank 0, the rest scrolls
        assert "8 ranks    min median    max largest" in screen and "rss     500.6M 522.2M 533.0M rank 0" in screen
        assert "rank 0 " in screen and "rank 7" not in screen and "8 ranks · m: expand" in screen
        await pilot.press("tab")  # the memory list takes the focus, and the keys scroll it
        assert app.focused is app.query_one("#memory-scroll")
        await pilot.press("end")
        await pilot.pause(0.1)
        screen = screen_text(app)
        assert re.search(r"rank 7 .*" + re.escape(rss7), screen) and "8 ranks    min" in screen  # summary stays

        await pilot.press("m")  # expanded: every rank at once, with its coordinates
        await pilot.pause(0.1)
        screen = screen_text(app)
        for rank in range(8):
            where = RunLayout.from_record(app.state.info["layout"]).coordinate_text(rank)
            assert f"rank {rank} {where} " in screen, rank
        assert rank7 in screen and rss7 in screen and "loss" not in screen.split("memory per rank")[1]
        await pilot.press("m")
        await pilot.pause(0.1)
        assert not app.screen.has_class("-memory") and "time per step" in screen_text(app)

        # time per step: the legend is the mean of the one bar drawn, named in the title
        panel = app.query_one(TimePanel)
        lines = [line.plain for line in panel.lines(panel.size.width, panel.size.height)]
        assert panel.border_title == "time per step · step 38" and lines[-1].startswith("38 ")
        step38 = events_of(runs_3d)[-1]
        assert legend_ms(lines) == {"data": round(step38["data_s"] * 1000, 1),
                                    "fwd": round(step38["forward_s"] * 1000, 1),
                                    "bwd": round(step38["backward_s"] * 1000, 1),
                                    "sync": round(step38["sync_s"] * 1000, 1),
                                    "opt": round(step38["optimizer_s"] * 1000, 1)}
        # every comm figure named by its dimension; torch DDP's gradient all-reduce is not measured: "–"
        assert "comm dp – · tp 767 · pp 656 ms" in lines

        # the pipeline: rank 0's (dp0 tp0) at its newest log step, rows by global rank, every micro-batch labelled
        box = app.query_one("#pipeline-panel")
        assert box.border_title == "pipeline 1F1B m 4" and box.border_subtitle == "step 35 · spans every 5 steps"
        panel = app.query_one(PipelinePanel)
        rows = [line.plain for line in panel.lines(panel.size.width, panel.size.height)][3:]
        assert [row[:7] for row in rows] == ["rank 0 ", "rank 4 "]
        assert [re.findall(r"[FB]\d", row) for row in rows] == [
            ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"], ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]]

        assert len(app.charts["loss"].y_labels["left"]) >= 2  # a y axis that can be read


@async_test
async def test_recorded_3d_run_at_120x40(runs_3d: Path) -> None:
    app = HandleDashboard(runs_3d, runs_3d.parent)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        assert "dp 2 × tp 2 × pp 2  world 8  step 38/40 95%" in header(app)
        memory = [line.plain for line in app.query_one(MemoryBars).lines(56)]
        assert memory[1].startswith("rank 0 dp0 tp0 pp0 ") and memory[8].startswith("rank 7 dp1 tp1 pp1 ")
        panel = app.query_one(TimePanel)
        head, bars = panel.layout_rows(panel.size.width, panel.size.height)
        assert panel.border_title == "time per step · steps 36–38" and [b[0] for b in bars] == [36, 37, 38]
        legend = legend_ms([line.plain for line in head])
        assert legend["fwd"] == round(sum(p["forward"] for _, _, p in bars) / 3 * 1000, 1)
        # the parts tile the step: the legend adds up to the mean bar, within the unaccounted microseconds
        assert abs(sum(legend.values()) - sum(st for _, st, _ in bars) / 3 * 1000) < 2.0
        assert "slowest rank 0 (dp0 tp0 pp0) +130 ms" in "\n".join(line.plain for line in head)
        assert len(app.charts["loss"].y_labels["left"]) >= 2


def test_elapsed_is_the_same_in_the_header_and_the_summary(runs_3d: Path) -> None:
    """Both count from the launch (run.json's start_time), start-up included, to the end."""
    info = read_run_info(runs_3d)
    state = RunState(runs_3d, info=info)
    state.apply(events_of(runs_3d))
    widget = StatusHeader()
    widget.state = state
    shown = re.search(r"elapsed (\d\d:\d\d)", widget.lines(200)[0].plain).group(1)
    assert shown == "01:35" and state.elapsed_s() == pytest.approx(state.last_time - info["start_time"])
    final = {**info, "status": "finished", "end_time": state.last_time + 2.0}
    state.info = final
    assert re.search(r"elapsed (\d\d:\d\d)", summary_text(state, runs_3d, final)).group(1) == "01:37"
    assert re.search(r"elapsed (\d\d:\d\d)", widget.lines(200)[0].plain).group(1) == "01:37"


@async_test
async def test_help_names_every_panel_and_scrolls_at_80x24(runs_3d: Path) -> None:
    text = HELP.replace("[b]", "").replace("[/b]", "").replace("\n", " ")
    for words in ("Pipeline: rank 0's pipeline", "Memory per rank", "Time per step", "m memory",
                  "rank 4 (dp0 tp0 pp1)", "min / median / max", "– where not measured"):
        assert words in text, words
    app = HandleDashboard(runs_3d, runs_3d.parent)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        await pilot.press("question_mark")
        await pilot.pause(0.1)
        assert isinstance(app.screen, HelpScreen) and "Pipeline: rank 0's" not in screen_text(app)  # below
        await pilot.press("end")  # scrolls: the help stays open
        await pilot.pause(0.1)
        assert isinstance(app.screen, HelpScreen) and "Pipeline: rank 0's pipeline (dp0 tp0)" in screen_text(app)
        await pilot.press("x")  # any other key closes it
        assert not isinstance(app.screen, HelpScreen)


def test_snapshot_recorded_3d_run_80x24(runs_3d: Path, snap_compare) -> None:
    assert snap_compare(HandleDashboard(runs_3d, runs_3d.parent), terminal_size=(80, 24), run_before=loaded)


def test_snapshot_recorded_3d_run_120x40(runs_3d: Path, snap_compare) -> None:
    assert snap_compare(HandleDashboard(runs_3d, runs_3d.parent), terminal_size=(120, 40), run_before=loaded)


def test_snapshot_recorded_3d_run_memory_expanded_80x24(runs_3d: Path, snap_compare) -> None:
    async def expand(pilot) -> None:
        await loaded(pilot)
        await pilot.press("m")
        await pilot.pause(0.1)

    assert snap_compare(HandleDashboard(runs_3d, runs_3d.parent), terminal_size=(80, 24), run_before=expand)


# ---------------------------------------------------------------------------------------------------------------
# fabricated runs: pp = 2, tp = 2, and the pp run made a scratch-ddp mesh
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def pipeline_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the recorded pp = 2 run (1F1B, m = 4, timelines every 4th step) at ./runs."""
    return copy_runs(PIPELINE_FIXTURES, tmp_path, monkeypatch)


@async_test
async def test_pipeline_run_shows_the_pipeline_panel(pipeline_runs: Path) -> None:
    app = HandleDashboard(pipeline_runs / "pp-1f1b", pipeline_runs)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        assert app.screen.has_class("-pipeline") and app.query_one("#pipeline-panel").display
        box = app.query_one("#pipeline-panel")
        assert box.border_title == "pipeline 1F1B m 4" and box.border_subtitle == "step 12 · spans every 4 steps"
        panel = app.query_one(PipelinePanel)
        assert panel.size.width <= 40 and panel.size.height == 5
        lines = [line.plain for line in panel.lines(panel.size.width, panel.size.height)]
        assert lines[0] == "bubble 25.0% · theory 20.0%"
        assert lines[1].startswith("rank 0 ████") and lines[1].endswith(" 75% busy")
        assert lines[2].startswith("rank 1 ████") and "~" in lines[2] and "·" in lines[2]
        assert lines[3].startswith("rank 0 F0") and lines[4].startswith("rank 1 ~~")
        assert [re.findall(r"[FB]\d", line) for line in lines[3:]] == [
            ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"], ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]]
        short = [line.plain for line in panel.lines(36, 3)]  # no room for the chart: the figures stay
        assert len(short) == 3 and short[2].startswith("rank 1 ")


@pytest.fixture
def mesh_runs(pipeline_runs: Path) -> Path:
    """The recorded pp = 2 run made a dp 2 × tp 2 × pp 2 run of scratch-ddp on 8 ranks: every step event also
    carries the strategy's ``comm_s``, the hand-written TP's ``tp_comm_s`` and the ``comm`` the trainer derives
    from them (synthetic figures, deterministic)."""
    run = pipeline_runs / "pp-1f1b"
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    for e in events:
        if e["kind"] == "status" and e.get("strategy"):
            e.update(strategy="scratch-ddp", world_size=8)
        if e["kind"] == "step":
            e.update(layout={"dp": 2, "tp": 2, "pp": 2}, comm_s=0.0008 + 0.0001 * e["step"], tp_comm_s=0.0215)
            e.update(comm_fields(e))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "strategy": "scratch-ddp", "world_size": 8}))
    return pipeline_runs


@async_test
async def test_a_3d_run_shows_its_mesh_and_the_comm_of_each_dimension(mesh_runs: Path) -> None:
    app = HandleDashboard(mesh_runs / "pp-1f1b", mesh_runs)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        assert "dp 2 × tp 2 × pp 2" in header(app)
        panel = app.query_one(TimePanel)
        lines = [line.plain for line in panel.lines(panel.size.width, panel.size.height)]
        wait = app.state.comm["pp"]  # rank 0's blocked receives in step 12's pipeline
        # scratch-ddp measures its gradient communication: the legend has it, by name, beside the loss all-reduce
        assert lines[0].startswith("■ data 1.0 ■ fwd") and lines[1] == "■ dp comm 2.0 ■ sync 0.5 "
        assert lines[2].startswith("■ opt 2.5 ms")
        assert lines[3] == f"comm dp 2.0 · tp 21.5 · pp {wait * 1000:.1f} ms"
        assert len(lines) == panel.size.height and max(map(len, lines)) <= panel.size.width
        assert lines[-1].startswith("12 ")  # the bars keep the newest step
    assert TimePanel.comm_line({"tp": 0.1234}).plain == "comm tp 123 ms"
    layout = RunLayout.from_parts(8, "ddp", None, 2, 2)  # torch DDP: no dp figure, and the line says so
    assert TimePanel.comm_line({"tp": 0.1234, "pp": 0.004}, layout).plain == "comm dp – · tp 123 · pp 4.0 ms"


def test_header_shows_the_layout_of_run_json_or_of_an_old_runs_steps(tmp_path: Path) -> None:
    widget = StatusHeader()
    widget.state = RunState(tmp_path, info={"world_size": 4, "preset": "tp"})  # no record, no preset.toml
    widget.state.apply([step_event(1)])
    assert widget.lines(200)[0].plain.count("  -  world 4  step") == 1  # not known: neither degrees nor strategy
    widget.state.apply([{**step_event(2), "layout": {"dp": 2, "tp": 2}}])
    assert "  dp 2 × tp 2  world 4  step" in widget.lines(200)[0].plain
    assert "  dp 2 × tp 2  world 4  step" in widget.lines(70)[0].plain  # narrow: the degrees and the world stay
    assert "  dp2×tp2  world 4  step" in widget.lines(60)[0].plain
    widget.state.apply([{**step_event(3), "layout": {"dp": 1, "tp": 1, "pp": 2}}])  # a later degree: no new code
    assert "  dp 1 × pp 2  world 4  step" in widget.lines(200)[0].plain
    widget.state.apply([{**step_event(4), "layout": {"dp": "x", "tp": True}}, step_event(5)])
    assert "  -  world 4  step" in widget.lines(200)[0].plain  # a resume without tp: the newest step says
    record = RunLayout.from_parts(8, "ddp", None, 2, 2, "scratch", True, "scratch", "1f1b").record()
    widget.state = RunState(tmp_path, info={"world_size": 8, "strategy": "ddp", "layout": record})
    assert "  dp 2 × tp 2 × pp 2 (ddp; tp scratch + sp; pp 1F1B scratch)  world 8  step" in \
        widget.lines(200)[0].plain  # run.json's record: what the summary, handle runs and handle validate say


def test_snapshot_pipeline_run_80x24(pipeline_runs: Path, snap_compare) -> None:
    assert snap_compare(HandleDashboard(pipeline_runs / "pp-1f1b", pipeline_runs), terminal_size=(80, 24),
                        run_before=loaded)


def test_snapshot_3d_run_80x24(mesh_runs: Path, snap_compare) -> None:
    assert snap_compare(HandleDashboard(mesh_runs / "pp-1f1b", mesh_runs), terminal_size=(80, 24), run_before=loaded)


def test_snapshot_tensor_parallel_run_80x24(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, snap_compare) -> None:
    runs = copy_runs(TP_FIXTURES, tmp_path, monkeypatch)
    assert snap_compare(HandleDashboard(runs / "fsdp-tp", runs), terminal_size=(80, 24), run_before=loaded)
