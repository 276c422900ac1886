"""The ``handle tui`` dashboard, driven headless with Textual's pilot on recorded runs.

The recorded runs (tests/fixtures/recorded/) are made by ``tests/fixtures/make_runs.py``; every test works on a
copy in ``tmp_path``. Runs with tensor or pipeline parallelism: tests/test_tui_parallel.py.
Snapshots (tests/__snapshots__/) are refreshed with ``pytest tests/test_tui.py --snapshot-update``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from handle_cli.tui.app import HandleDashboard
from handle_cli.tui.charts import Chart, nice_ticks, tick_labels
from handle_cli.tui.header import StatusHeader
from handle_cli.tui.log_panel import LogPanel
from handle_cli.tui.memory_panel import MemoryBars
from handle_cli.tui.model import LogTail, run_rows
from handle_cli.tui.screens import HelpScreen, RunPicker
from handle_cli.tui.time_panel import TimePanel
from tests.tui_helpers import async_test, header, loaded, step_event, wait_for
from torch_handle.common.text import clean
from torch_handle.observe.state import RunState

FIXTURES = Path(__file__).parent / "fixtures" / "recorded"
BREAKDOWN_FIXTURES = Path(__file__).parent / "fixtures" / "recorded-breakdown"
SIZE = (120, 40)


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the recorded runs at ./runs (relative, so what the screens show does not depend on tmp_path)."""
    shutil.copytree(FIXTURES, tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    return Path("runs")


def log_text(app: HandleDashboard) -> str:
    return "\n".join(app.log_panel.plain_lines)


def chart(app: HandleDashboard, name: str) -> Chart:
    return app.charts[name]


# ---------------------------------------------------------------------------------------------------------------
# recorded runs
# ---------------------------------------------------------------------------------------------------------------


@async_test
async def test_finished_run_shows_every_panel(runs: Path) -> None:
    app = HandleDashboard(runs / "zero2-finished", runs)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        text = header(app)
        assert "FINISHED" in text
        assert "zero2" in text and "deepspeed ZeRO-2" in text and "world 2" in text
        assert "step 20/20" in text and "100%" in text
        assert "elapsed 00:09" in text  # from run.json start/end, not the clock
        assert "ETA --:--" in text
        assert "loss 6.8070" in text and "val 7.0167" in text

        train_x, train_y = chart(app, "loss").plotted["train"]
        assert train_x == list(range(1, 21)) and len(train_y) == 20
        assert chart(app, "loss").plotted["val"][0] == [0, 10, 20]
        assert len(chart(app, "throughput").plotted["tokens/s"][0]) == 20
        assert len(chart(app, "throughput").plotted["s/step"][0]) == 20
        assert len(chart(app, "lr").plotted["lr"][0]) == 20

        memory = "\n".join(app.query_one(MemoryBars).labels())
        for label in ("rank 0", "rank 1", "state", "rss", "cuda", "params", "grads", "optim", "36.6 MiB"):
            assert label in memory, label
        assert app.state.memory[1]["cuda_reserved_bytes"] == 1664 * 1024 * 1024

        logs = log_text(app)
        assert "exported model.safetensors" in logs
        assert "run finished" in logs
        assert "rank1" not in logs  # a healthy rank's log stays out of the panel


@async_test
async def test_breakdown_run_shows_mfu_time_panel_and_slow_rank(breakdown_runs: Path) -> None:
    app = HandleDashboard(breakdown_runs / "ddp-breakdown", breakdown_runs)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert "mfu 13.1%" in header(app)
        assert app.screen.has_class("-breakdown") and app.query_one("#time-row").display
        panel = app.query_one(TimePanel)
        text = "\n".join(line.plain for line in panel.lines(100, 7))
        # the legend is the mean of the 5 steps drawn under it (26..30), not of a longer window
        assert "data 2.0" in text and "fwd 61.6" in text and "bwd 172.1" in text and "opt 25.1" in text
        assert "sync 1.2 ■ opt 25.1 ms" in text and "dp comm" not in text  # the trainer's sync_s; DDP measures no comm_s
        assert "slowest rank 1 +60 ms (23% of a step)" in text
        assert [row[0] for row in panel.rows(5)] == [26, 27, 28, 29, 30]
        assert text.splitlines()[-1].startswith("30 ") and text.endswith("262 ms")
        assert panel.border_title == "time per step · steps 26–30"  # the 5 bars the 120x40 panel draws
        assert "rank 1 is slow: 60 ms per step" in log_text(app)
        assert app.state.peak_flops == 3.12e14 and app.state.mfu == 0.1305


@async_test
async def test_runs_without_breakdown_keep_their_layout(runs: Path) -> None:
    app = HandleDashboard(runs / "zero2-finished", runs)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert not app.screen.has_class("-breakdown") and not app.query_one("#time-row").display
        assert not app.screen.has_class("-pipeline") and not app.query_one("#pipeline-panel").display
        assert "mfu" not in header(app)


@async_test
async def test_failed_run_shows_error_and_failing_rank_log(runs: Path) -> None:
    app = HandleDashboard(runs / "fsdp-failed", runs)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        text = header(app)
        assert "FAILED" in text and "step 7/50" in text
        assert "error: rank 1: RuntimeError: CUDA out of memory" in text
        logs = log_text(app)
        assert "rank1.log: error" in logs
        assert "r1 Traceback (most recent call last):" in logs
        assert "r1 RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB" in logs
        assert "r0 2026-01-05 09:00:07,000 rank0 WARNING" in logs
        assert "loss spike at step 7" in logs  # a log event
        assert len(chart(app, "loss").plotted["train"][0]) == 7
        assert app.state.status == "failed"


@async_test
async def test_restarted_run_keeps_the_resumed_history(runs: Path) -> None:
    app = HandleDashboard(runs / "zero3-restarted", runs)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert "restarts 1" in header(app)
        assert "world 4" in header(app) and "deepspeed ZeRO-3" in header(app)
        # the attempt that resumed from step 8 replaces steps 9.. of the first attempt
        assert chart(app, "loss").plotted["train"][0] == list(range(1, 17))
        assert "restarting: rank 2: RuntimeError: connection reset" in log_text(app)
        assert sorted(app.state.memory) == [0, 1, 2, 3]


@async_test
async def test_garbage_and_truncated_lines_are_reported_not_fatal(runs: Path) -> None:
    app = HandleDashboard(runs / "ddp-garbage", runs)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert app.bad_line_count == 3
        text = header(app)
        assert "RUNNING" in text and "step 6/40" in text and "3 bad lines" in text
        logs = log_text(app)
        assert "events.jsonl line 6 skipped" in logs
        assert "not a JSON object" in logs
        # no markup injection and no escape sequences reach the screen
        assert "this is not json [red]markup[/red]" in logs
        assert "[b]not markup[/b]" in logs
        assert "\x1b" not in logs and "title" not in logs
        assert len(chart(app, "loss").plotted["train"][0]) == 6  # the half-written last line is not an event
        assert any("bad line" in n.message or "unreadable" in n.message for n in app._notifications)


@async_test
async def test_stopped_run(runs: Path) -> None:
    app = HandleDashboard(runs / "zero1-stopped", runs)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        assert "STOPPED" in header(app) and "step 12/100" in header(app)
        assert "run stopped" in log_text(app)


# ---------------------------------------------------------------------------------------------------------------
# a live run
# ---------------------------------------------------------------------------------------------------------------


def make_live_run(root: Path, steps: int = 3) -> tuple[Path, list[dict]]:
    run = root / "live-run"
    (run / "logs").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"status": "running", "name": "live", "preset": "presets/ddp.toml",
                                              "strategy": "ddp", "world_size": 2, "steps": 100,
                                              "start_time": 1767700000.0}))
    events = [{"seq": 0, "time": 1767700001.0, "kind": "status", "status": "running", "world_size": 2,
               "strategy": "ddp", "steps": 100, "restart": 0}]
    events += [step_event(i) for i in range(1, steps + 1)]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "logs" / "rank0.log").write_text("2026-01-06 12:00:00,000 rank0 INFO torch_handle: started\n")
    (run / "logs" / "rank1.log").write_text("2026-01-06 12:00:00,000 rank1 INFO torch_handle: started\n")
    return run, events


def test_header_shows_comm_only_when_the_strategy_reports_it(tmp_path: Path) -> None:
    widget = StatusHeader()
    widget.state = RunState(tmp_path)
    widget.state.apply([step_event(1)])
    without = widget.lines(200)[1].plain
    assert "  comm " not in without
    widget.state.apply([{**step_event(2), "comm_s": 0.0123}])
    assert "0.500 s/step  dp comm 12 ms" in widget.lines(200)[1].plain  # scratch-ddp's comm_s: data parallel


def append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()


@async_test
async def test_follows_a_growing_run_with_partial_lines(tmp_path: Path) -> None:
    run, _ = make_live_run(tmp_path)
    events = run / "events.jsonl"
    app = HandleDashboard(run, poll_interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert "step 3/100" in header(app)

        append(events, json.dumps(step_event(4)) + "\n")
        await wait_for(pilot, lambda: "step 4/100" in header(app), what="step 4")

        line = json.dumps(step_event(5))
        append(events, line[:25])  # the writer is caught mid-line
        await pilot.pause(0.3)
        assert "step 4/100" in header(app) and app.bad_line_count == 0
        append(events, line[25:] + "\n")
        await wait_for(pilot, lambda: "step 5/100" in header(app), what="step 5")
        assert len(chart(app, "loss").plotted["train"][0]) == 5

        # a rank that starts failing shows up in the log panel, and the final status in the header
        append(run / "logs" / "rank1.log", "RuntimeError: boom\n")
        # (an unbalanced closing tag would raise MarkupError if the message were parsed as markup anywhere)
        message = "rank 1: RuntimeError: boom [/bold] \x1b[2J\x1b]0;evil\x07"
        append(events, json.dumps({"seq": 6, "time": 1767700005.0, "kind": "status", "status": "failed",
                                   "step": 5, "message": message}) + "\n")
        await wait_for(pilot, lambda: "FAILED" in header(app), what="the failed status")
        await wait_for(pilot, lambda: "r1 RuntimeError: boom" in log_text(app), what="rank 1's error")
        await pilot.pause(0.2)
        assert "error: rank 1: RuntimeError: boom [/bold]" in header(app)
        assert "\x1b" not in header(app) and "evil" not in header(app)
        assert any("boom [/bold]" in n.message for n in app._notifications)  # the live failure is announced
        assert app.bad_line_count == 0 and app.is_running


@async_test
async def test_bursts_are_coalesced(tmp_path: Path) -> None:
    run, _ = make_live_run(tmp_path)
    app = HandleDashboard(run, poll_interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        before_batches, before_redraws = app.batches_applied, app.redraws
        append(run / "events.jsonl", "".join(json.dumps(step_event(i)) + "\n" for i in range(4, 5004)))
        await wait_for(pilot, lambda: "step 5003/100" in header(app), what="the burst")
        await pilot.pause(0.3)
        assert app.batches_applied - before_batches <= 3
        assert app.redraws - before_redraws <= 4
        assert len(app.state.steps) == 5003
        assert len(chart(app, "loss").plotted["train"][0]) <= Chart.MAX_POINTS + 1
        assert chart(app, "loss").plotted["train"][0][-1] == 5003


# ---------------------------------------------------------------------------------------------------------------
# keys
# ---------------------------------------------------------------------------------------------------------------


@async_test
async def test_pause_stops_following_and_resume_catches_up(tmp_path: Path) -> None:
    run, _ = make_live_run(tmp_path)
    app = HandleDashboard(run, poll_interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("p")
        assert app.paused and "PAUSED" in header(app)
        append(run / "events.jsonl", json.dumps(step_event(4)) + "\n")
        await pilot.pause(0.4)
        assert "step 3/100" in header(app)
        await pilot.press("p")
        await wait_for(pilot, lambda: "step 4/100" in header(app), what="catching up")
        assert "PAUSED" not in header(app)


@async_test
async def test_picker_lists_runs_and_switches(runs: Path) -> None:
    app = HandleDashboard(runs / "zero2-finished", runs)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("r")
        picker = app.screen
        assert isinstance(picker, RunPicker)
        names = [row.name for row in picker.rows]
        assert names == ["zero1-stopped", "zero3-restarted", "ddp-garbage", "fsdp-failed", "zero2-finished"]
        failed = next(r for r in picker.rows if r.name == "fsdp-failed")
        assert (failed.status, failed.layout, failed.world_size, failed.steps, failed.last_loss, failed.started) == (
            "failed", "dp 2 (fsdp)", "2", "7/50", "7.4862", "2026-01-05 09:00")
        from textual.widgets import DataTable
        assert picker.query_one(DataTable).cursor_row == 4  # the current run is selected
        await pilot.press("up", "enter")
        await wait_for(pilot, lambda: not isinstance(app.screen, RunPicker), what="the picker to close")
        assert app.run_dir.name == "fsdp-failed"
        await wait_for(pilot, lambda: "FAILED" in header(app), what="the other run")
        await pilot.pause(0.2)
        assert len(chart(app, "loss").plotted["train"][0]) == 7
        assert "exported model.safetensors" not in log_text(app)  # the old run's log is gone

        await pilot.press("r")
        assert isinstance(app.screen, RunPicker)
        await pilot.press("escape")
        assert not isinstance(app.screen, RunPicker) and app.run_dir.name == "fsdp-failed"


@async_test
async def test_updates_keep_flowing_under_the_picker_and_help(tmp_path: Path) -> None:
    run, _ = make_live_run(tmp_path)
    app = HandleDashboard(run, poll_interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        for key, screen_type, step in (("r", RunPicker, 4), ("question_mark", HelpScreen, 5)):
            await pilot.press(key)
            assert isinstance(app.screen, screen_type)
            append(run / "events.jsonl", json.dumps(step_event(step)) + "\n")
            append(run / "logs" / "rank0.log", f"rank0 says {step}\n")
            await wait_for(pilot, lambda: app.state.step == step, what=f"step {step} under {screen_type.__name__}")
            await wait_for(pilot, lambda: f"rank0 says {step}" in log_text(app), what="the log line")
            await pilot.press("escape")
            await pilot.pause(0.2)
            assert app.screen is app.header_widget.screen
            assert f"step {step}/100" in header(app)
        assert app.is_running


@async_test
async def test_help_logs_and_quit(runs: Path) -> None:
    app = HandleDashboard(runs / "fsdp-failed", runs)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        logs = app.query_one(LogPanel)
        assert not logs.display or logs.region.height == 0  # 80x24: the charts get the room
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)

        await pilot.press("l")
        await pilot.pause()
        assert app.screen.has_class("-logs") and app.focused is logs and logs.region.height > 10
        shown = "\n".join(strip.text for strip in logs.lines)  # what the panel has rendered, wrapped at 80 columns
        assert "r1 RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB" in shown
        await pilot.press("l")
        await pilot.pause()
        assert not app.screen.has_class("-logs")

        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0 and not app.is_running


@async_test
async def test_cli_attaches_to_the_newest_run(runs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from handle_cli.main import cli

    opened = []
    monkeypatch.setattr(HandleDashboard, "run", lambda self: opened.append((self.run_dir, self.output_dirs)))
    assert CliRunner().invoke(cli, ["tui", "--output-dir", "runs"]).exit_code == 0
    assert opened[-1] == (runs / "zero1-stopped", [runs])
    assert CliRunner().invoke(cli, ["tui", "runs/fsdp-failed"]).exit_code == 0
    assert opened[-1][0] == runs / "fsdp-failed"
    result = CliRunner().invoke(cli, ["tui", "runs/nope"])
    assert result.exit_code == 2 and "not a run directory" in result.output


# ---------------------------------------------------------------------------------------------------------------
# plain-Python parts
# ---------------------------------------------------------------------------------------------------------------


def test_clean_strips_control_sequences() -> None:
    assert clean("\x1b[31mred\x1b[0m [b]x[/b]") == "red [b]x[/b]"
    assert clean("a\x1b]0;evil title\x07b") == "ab"
    assert clean("a\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\b") == "alinkb"
    assert clean("50%\r100%") == "100%"
    assert clean("tab\there\x00\x07\x9b2J") == "tab    here"
    assert clean("x" * 50, limit=10) == "x" * 9 + "…"


def test_log_tail_reads_incrementally(tmp_path: Path) -> None:
    path = tmp_path / "rank1.log"
    path.write_text("one\ntw")
    tail = LogTail(path)
    assert tail.poll() == ["one"]
    append(path, "o\nTraceback (most recent call last):\n")
    assert tail.poll() == ["two", "Traceback (most recent call last):"]
    assert tail.has_error


def test_state_survives_odd_events(tmp_path: Path) -> None:
    state = RunState(tmp_path)
    notices = state.apply([
        {"seq": 0, "time": "x", "kind": "step", "step": 1, "loss": float("nan"), "memory": "nope"},
        {"seq": 1, "time": 2.0, "kind": "step", "step": "two"},
        {"seq": 2, "time": 3.0, "kind": "step", "step": 2, "loss": 1.0, "memory": [None, {"rank": "a"}, {"rank": 0}]},
        {"seq": 3, "time": 4.0, "kind": "mystery"},
        {"seq": 4, "kind": "status", "status": "running", "steps": 10},
    ])
    assert notices == []
    assert state.steps == [1, 2] and state.loss == [None, 1.0] and state.memory == {0: {}}
    assert state.status == "running" and state.steps_total == 10


def test_status_through_a_restart_and_a_resume(tmp_path: Path) -> None:
    state = RunState(tmp_path, info={"status": "running", "steps": 10})
    state.apply([{"seq": 0, "time": 1.0, "kind": "status", "status": "running", "restart": 0},
                 *({"seq": i, "time": 1.0 + i, "kind": "step", "step": i, "loss": 5.0} for i in range(1, 6))])
    notices = state.apply([{"seq": 6, "time": 7.0, "kind": "status", "status": "restarting", "message": "rank 1 died"}])
    assert state.status == "restarting" and state.restarts == 1
    assert [n.level for n in notices] == ["warning"] and "rank 1 died" in notices[0].text
    state.apply([{"seq": 7, "time": 9.0, "kind": "status", "status": "running", "restart": 1},
                 {"seq": 8, "time": 10.0, "kind": "step", "step": 5, "loss": 4.0}])  # resumed from step 4
    assert state.status == "running" and state.steps == [1, 2, 3, 4, 5] and state.loss[-1] == 4.0
    # the launcher's verdict in run.json wins once it is final
    state.info = {"status": "failed", "message": "rank 1: \x1b[31mOOM", "end_time": 12.0, "start_time": 0.5}
    assert state.status == "failed" and state.message == "rank 1: OOM" and state.elapsed_s() == 11.5
    assert state.eta_s() is None


def test_picker_rows_are_deterministic(runs: Path) -> None:
    rows = {r.name: r for r in run_rows([runs])}
    assert rows["zero2-finished"].started == "2026-01-05 08:00"
    assert rows["zero3-restarted"].layout == "dp 4 (deepspeed ZeRO-3)"  # the line every view shows
    assert rows["ddp-garbage"].steps == "6/40"


def test_ticks() -> None:
    assert nice_ticks(1, 20, 5, integer=True) == [5, 10, 15, 20]
    assert tick_labels([4000, 6000, 8000, 10000]) == ["4k", "6k", "8k", "10k"]
    assert tick_labels([0.00025, 0.0005]) == ["2.5e-04", "5.0e-04"]
    assert tick_labels(nice_ticks(6.6, 8.78, 4)) == ["7.0", "7.5", "8.0", "8.5"]


# ---------------------------------------------------------------------------------------------------------------
# snapshots (fixed terminal size, recorded data: elapsed/ETA come from event times, "started" is UTC)
# ---------------------------------------------------------------------------------------------------------------


def test_snapshot_main_screen(runs: Path, snap_compare) -> None:
    assert snap_compare(HandleDashboard(runs / "zero2-finished", runs), terminal_size=SIZE, run_before=loaded)


def test_snapshot_failed_run_80x24(runs: Path, snap_compare) -> None:
    assert snap_compare(HandleDashboard(runs / "fsdp-failed", runs), terminal_size=(80, 24), run_before=loaded)


@pytest.fixture
def breakdown_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the recorded run with the step breakdown, mfu and ranks at ./runs."""
    shutil.copytree(BREAKDOWN_FIXTURES, tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    return Path("runs")


def test_snapshot_breakdown_run(breakdown_runs: Path, snap_compare) -> None:
    assert snap_compare(HandleDashboard(breakdown_runs / "ddp-breakdown", breakdown_runs), terminal_size=SIZE,
                        run_before=loaded)


def test_snapshot_breakdown_run_80x24(breakdown_runs: Path, snap_compare) -> None:
    assert snap_compare(HandleDashboard(breakdown_runs / "ddp-breakdown", breakdown_runs), terminal_size=(80, 24),
                        run_before=loaded)


def test_snapshot_run_picker(runs: Path, snap_compare) -> None:
    async def open_picker(pilot) -> None:
        await loaded(pilot)
        await pilot.press("r")
        await pilot.pause()

    assert snap_compare(HandleDashboard(runs / "zero2-finished", runs), terminal_size=SIZE, run_before=open_picker)


@async_test
async def test_a_dashboard_reattached_mid_run_shows_the_whole_history(tmp_path: Path) -> None:
    """Close the dashboard while the run goes on, open a new one: every event is there, seq without a gap, and
    the run's files are exactly as the writer left them (the dashboard only reads)."""
    run, _ = make_live_run(tmp_path)
    events = run / "events.jsonl"
    app = HandleDashboard(run, poll_interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        append(events, json.dumps(step_event(4)) + "\n")
        await wait_for(pilot, lambda: "step 4/100" in header(app), what="step 4")
    for step in range(5, 9):  # the run goes on while no dashboard is attached
        append(events, json.dumps(step_event(step)) + "\n")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    app = HandleDashboard(run, poll_interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await wait_for(pilot, lambda: "step 8/100" in header(app), what="step 8")
        assert app.state.steps == list(range(1, 9))
        assert app.state.last_seq == 8 and app.state.n_events == 9 and app.state.seq_gaps == 0
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_gap_in_seq_is_reported(tmp_path: Path) -> None:
    state = RunState(tmp_path)
    notices = state.apply([{"seq": 0, "kind": "status", "status": "running"}, {"seq": 3, "kind": "step", "step": 1}])
    assert state.seq_gaps == 1 and any("events 1..2 are missing" in n.text for n in notices)
