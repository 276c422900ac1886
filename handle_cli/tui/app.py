"""The dashboard app: a background thread tails the run directory and posts batches; the app thread draws.

Flow: :meth:`HandleDashboard._tail` (a thread worker) calls :meth:`RunTailer.poll` every ``poll_interval``
seconds and posts one :class:`RunUpdate` per non-empty poll (all events of that poll in one message, so a fast
run cannot flood the app). The app applies the batch to its :class:`RunState` and marks panels dirty; panels
are redrawn at most ``1 / MAX_REDRAW_HZ`` apart. Pausing stops the polling; resuming catches up in one batch.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Footer
from textual.worker import get_current_worker

from torch_handle.observe.fields import Status
from torch_handle.observe.state import RunState
from torch_handle.rundir import RunDirError, read_run_info
from torch_handle.common.text import clean

from handle_cli.tui.model import Batch, RunTailer
from handle_cli.tui.pipeline_panel import PipelinePanel, PipelineTracker
from handle_cli.tui.preference_panel import PreferencePanel
from handle_cli.tui.tasks_panel import TasksPanel
from handle_cli.tui.routing_panel import RoutingMap, RoutingMarks, RoutingTracker, routing_subtitle, routing_title
from handle_cli.tui.screens import HelpScreen, RunPicker
from handle_cli.tui.charts import Chart, Series
from handle_cli.tui.header import StatusHeader
from handle_cli.tui.log_panel import LogPanel
from handle_cli.tui.memory_panel import MemoryBars, MemorySummary
from handle_cli.tui.time_panel import TimePanel


class RunUpdate(Message):
    """What one poll of the run directory found (posted from the tailing thread)."""

    def __init__(self, generation: int, batch: Batch):
        super().__init__()
        self.generation = generation
        self.batch = batch


class TailError(Message):
    def __init__(self, generation: int, error: str):
        super().__init__()
        self.generation = generation
        self.error = error


COMPACT_HEIGHT = 32
"""Below this many rows the log panel is hidden until ``l`` (80x24 shows the four charts)."""


class HandleDashboard(App[None]):
    TITLE = "handle tui"
    ENABLE_COMMAND_PALETTE = False  # keeps the footer to the dashboard's own keys
    CSS = """
    Screen { layout: vertical; }
    #charts { height: 1fr; }
    .row { height: 1fr; }
    #memory-panel { width: 1fr; height: 1fr; border: round $primary 50%; border-title-color: $text;
                    border-title-style: bold; border-subtitle-color: $text-muted; }
    #memory-panel:focus-within { border: round $accent; }
    #memory-scroll { height: 1fr; scrollbar-size-vertical: 1; }
    #time-row { display: none; height: 9; }
    Screen.-breakdown #time-row { display: block; }
    Screen.-compact #time-row { height: 7; }
    #pipeline-panel { display: none; width: 1fr; height: 1fr; border: round $primary 50%;
                      border-title-color: $text; border-title-style: bold; border-subtitle-color: $text-muted; }
    Screen.-pipeline #time-row { display: block; }
    Screen.-pipeline #pipeline-panel { display: block; }
    #logs { height: 12; }
    Screen.-compact #logs { display: none; }
    Screen.-logs #charts { display: none; }
    Screen.-logs #logs { display: block; height: 1fr; }
    Screen.-memory #top-row, Screen.-memory #lr, Screen.-memory #time-row { display: none; }
    #routing-panel { display: none; width: 1fr; height: 1fr; border: round $primary 50%; border-title-color: $text;
                     border-title-style: bold; border-subtitle-color: $text-muted; }
    #routing-panel:focus-within { border: round $accent; }
    #routing-scroll { height: 1fr; scrollbar-size-vertical: 1; }
    Screen.-moe #lr { display: none; }
    Screen.-moe #routing-panel { display: block; }
    Screen.-memory #routing-panel { display: none; }
    Screen.-routing #top-row, Screen.-routing #memory-panel, Screen.-routing #time-row { display: none; }
    #preference { display: none; border: round $primary 50%; border-title-color: $text; border-title-style: bold; }
    Screen.-preference #lr { display: none; }
    Screen.-preference #preference { display: block; }
    Screen.-memory #preference, Screen.-routing #preference { display: none; }
    #tasks { display: none; border: round $primary 50%; border-title-color: $text; border-title-style: bold; }
    Screen.-tasks #lr { display: none; }
    Screen.-tasks #tasks { display: block; }
    Screen.-memory #tasks, Screen.-routing #tasks { display: none; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("r", "runs", "Runs"),
        Binding("l", "logs", "Logs"),
        Binding("m", "memory", "Memory"),
        Binding("e", "routing", "Routing"),  # shown for a mixture-of-experts run only (check_action)
        Binding("p", "pause", "Pause"),
    ]
    MAX_REDRAW_HZ = 10.0
    MAX_LOG_LINES_PER_BATCH = 300

    def __init__(self, run_dir: Path, output_dir: Path | None = None, *, poll_interval: float = 0.1):
        super().__init__()
        self.run_dir = Path(run_dir)
        dirs = [Path(output_dir)] if output_dir is not None else []
        if not any(_same(d, self.run_dir.parent) for d in dirs):
            dirs.append(self.run_dir.parent)
        self.output_dirs = dirs
        self.poll_interval = poll_interval
        self.state = RunState(self.run_dir)
        self.pipeline = PipelineTracker()
        self.routing = RoutingTracker()
        self.generation = 0
        self.paused = False
        self._resume = threading.Event()
        self._resume.set()
        self._dirty = False
        self._last_redraw = 0.0
        self._redraw_timer = None
        self.bad_line_count = 0
        self.batches_applied = 0
        self.redraws = 0
        self.last_applied_at = 0.0
        """``time.time()`` of the newest poll drawn (for latency measurements)."""

    # -- layout ----------------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield StatusHeader(id="header")
        with Vertical(id="charts"):
            with Horizontal(classes="row", id="top-row"):
                yield Chart("loss", id="loss")
                yield Chart("throughput", id="throughput")
            with Horizontal(classes="row"):
                yield Chart("learning rate", id="lr")
                yield PreferencePanel(id="preference")  # in the lr chart's place once a step carries rewards/*
                yield TasksPanel(id="tasks")  # there once a tasks event arrives (a DPO run keeps its preference)
                with Vertical(id="routing-panel"):  # in the lr chart's place once a step event carries ``moe``
                    yield RoutingMarks(id="routing-marks")  # the hot and dead experts: stay in view
                    with VerticalScroll(id="routing-scroll") as scroll:  # Tab focuses it; e expands the panel
                        scroll.can_focus = False  # until the run turns out to be MoE (the memory list has the focus)
                        yield RoutingMap(id="routing-map")
                with Vertical(id="memory-panel"):
                    yield MemorySummary(id="memory-summary")  # more ranks than blocks fit: stays in view
                    with VerticalScroll(id="memory-scroll"):  # Tab focuses it; m expands the panel
                        yield MemoryBars(id="memory")
            # shown once a step event carries the breakdown (older runs keep their layout)
            with Horizontal(id="time-row"):
                yield TimePanel(id="time")
                with Vertical(id="pipeline-panel"):  # shown once a step event carries ``pipeline``
                    yield PipelinePanel(id="pipeline")
        yield LogPanel(id="logs")
        yield Footer()

    def on_mount(self) -> None:
        # kept references: updates keep flowing while the picker or help screen is on top
        self.header_widget = self.query_one(StatusHeader)
        self.log_panel = self.query_one(LogPanel)
        self.charts = {name: self.query_one(f"#{name}", Chart) for name in ("loss", "throughput", "lr")}
        self.memory_bars = self.query_one(MemoryBars)
        self.memory_summary = self.query_one(MemorySummary)
        self.query_one("#memory-panel").border_title = "memory per rank"
        self.time_panel = self.query_one(TimePanel)
        self.preference_panel = self.query_one(PreferencePanel)
        self.tasks_panel = self.query_one(TasksPanel)
        self.pipeline_panel = self.query_one(PipelinePanel)
        self.routing_marks, self.routing_map = self.query_one(RoutingMarks), self.query_one(RoutingMap)
        self.state.info = _read_info(self.run_dir)  # the header is right from the first frame
        self._apply_size()
        self._redraw()
        self._start_tailing()

    def on_resize(self) -> None:
        if self._main_screen_ready():
            self._apply_size()

    def _apply_size(self) -> None:
        self.header_widget.screen.set_class(self.size.height < COMPACT_HEIGHT, "-compact")

    # -- tailing ---------------------------------------------------------------------------------------------

    def _start_tailing(self) -> None:
        self.generation += 1
        self._tail(self.generation, RunTailer(self.run_dir))

    @work(thread=True, exclusive=True, group="tail", exit_on_error=False)
    def _tail(self, generation: int, tailer: RunTailer) -> None:
        worker = get_current_worker()
        failures = 0
        while not worker.is_cancelled:
            if not self._resume.wait(0.05):
                continue
            try:
                batch = tailer.poll()
                failures = 0
            except Exception as e:  # noqa: BLE001 - an unreadable file must not end the dashboard
                failures += 1
                if failures == 1:
                    self.post_message(TailError(generation, f"{type(e).__name__}: {e}"))
                batch = None
            if batch and not worker.is_cancelled:
                self.post_message(RunUpdate(generation, batch))
            deadline = time.monotonic() + self.poll_interval
            while not worker.is_cancelled and (left := deadline - time.monotonic()) > 0:
                time.sleep(min(left, 0.05))

    def on_run_update(self, message: RunUpdate) -> None:
        if message.generation != self.generation or not self._main_screen_ready():
            return  # from the run we switched away from, or the app is closing
        batch = message.batch
        state = self.state
        first = self.batches_applied == 0
        logs = self.log_panel
        was_final = state.status in Status.FINAL
        was_hung = state.status == Status.HUNG
        if batch.info is not None:
            state.info = batch.info
        self.pipeline.apply(batch.events)
        self.routing.apply(batch.events)
        for notice in state.apply(batch.events):
            logs.add_notice(notice)
        for bad in batch.bad_lines:
            self.bad_line_count += 1
            logs.add("!", "bold yellow", f"events.jsonl line {bad.line_no} skipped ({bad.error}): {bad.text}",
                     "yellow")
        if batch.bad_lines:
            n = len(batch.bad_lines)
            self.notify(f"{n} unreadable line{'s' if n != 1 else ''} in events.jsonl skipped (see logs)",
                        severity="warning", timeout=4, markup=False)
        lines = batch.logs
        if len(lines) > self.MAX_LOG_LINES_PER_BATCH:  # a chatty log cannot stall the screen
            skipped = len(lines) - self.MAX_LOG_LINES_PER_BATCH
            lines = lines[-self.MAX_LOG_LINES_PER_BATCH:]
            logs.add("…", "dim", f"{skipped} earlier log lines not shown (see {self.run_dir}/logs)", "dim")
        for line in lines:
            logs.add_log(line.source, line.text, line.error)
        status = state.status
        if not first and not was_final and status in (Status.FAILED, Status.STOPPED):
            self.notify(f"run {status}: {state.message}" if state.message else f"run {status}",
                        severity="error" if status == Status.FAILED else "warning", timeout=6, markup=False)
        elif not first and not was_hung and status == Status.HUNG:  # the launcher's watchdog, while we watch
            self.notify(state.message, severity="error", timeout=10, markup=False)
        self.batches_applied += 1
        self.last_applied_at = batch.polled_at
        self._mark_dirty()

    def on_tail_error(self, message: TailError) -> None:
        if message.generation == self.generation and self._main_screen_ready():
            self.log_panel.add("!", "bold red", f"reading the run failed: {clean(message.error)}", "red")

    # -- drawing ---------------------------------------------------------------------------------------------

    def _mark_dirty(self) -> None:
        self._dirty = True
        if self._redraw_timer is not None:
            return
        wait = self._last_redraw + 1.0 / self.MAX_REDRAW_HZ - time.monotonic()
        if wait <= 0:
            self._redraw()
        else:
            self._redraw_timer = self.set_timer(wait, self._timer_redraw)

    def _timer_redraw(self) -> None:
        self._redraw_timer = None
        if self._dirty:
            self._redraw()

    def _main_screen_ready(self) -> bool:
        """False before mount and while the app shuts down (a timer or a message can outlive the widgets)."""
        header = getattr(self, "header_widget", None)
        return header is not None and header.is_attached

    def _redraw(self) -> None:
        if not self._main_screen_ready():
            return
        self._dirty = False
        self._last_redraw = time.monotonic()
        self.redraws += 1
        s = self.state
        # the time row first: the charts below are then drawn at their final height
        self.header_widget.screen.set_class(s.breakdown_seen, "-breakdown")
        self.header_widget.screen.set_class(self.pipeline.figures is not None, "-pipeline")
        moe = bool(self.routing.recent)
        if moe != self.screen_has("-moe"):
            self.header_widget.screen.set_class(moe, "-moe")
            self.query_one("#routing-scroll").can_focus = moe
            self.refresh_bindings()  # the footer shows e once the run turns out to be MoE
        self.header_widget.show(s, paused=self.paused, bad_lines=self.bad_line_count)
        self.charts["loss"].set_series([
            Series("train", s.steps, s.loss, "cyan"),
            Series("val", s.val_steps, s.val_loss, "orange", marker="hd"),
        ])
        self.charts["throughput"].set_series([
            Series("tokens/s", s.steps, s.tokens_per_s, "green"),
            *([Series("trained/s", s.steps, s.trained_tokens_per_s, "cyan")] if s.trained_share is not None else []),
            Series("s/step", s.steps, s.step_time_s, "magenta", yside="right"),
        ])
        self.charts["lr"].set_series([Series("lr", s.steps, s.lr, "yellow")])
        preference = bool(s.preference_steps)  # a DPO run: its rewards in the lr chart's place
        self.header_widget.screen.set_class(preference, "-preference")
        if preference:
            self.preference_panel.set_state(s)
        tasks = bool(s.task_steps) and not (preference or moe)  # in-loop downstream scores ([eval])
        self.header_widget.screen.set_class(tasks, "-tasks")
        if tasks:
            self.tasks_panel.set_state(s)
        layout = s.run_layout
        self.memory_bars.set_memory(s.memory, layout)
        self.memory_summary.set_memory(s.memory, layout)
        ranks = len(s.memory)
        self.query_one("#memory-panel").border_subtitle = (
            f"{ranks} ranks · m: expand" if ranks > 2 and not self.screen_has("-memory") else "")
        self.time_panel.set_state(s)
        self.pipeline_panel.set_tracker(self.pipeline, layout)
        pipeline_box = self.query_one("#pipeline-panel")
        pipeline_box.border_title = self.pipeline_panel.title()
        pipeline_box.border_subtitle = self.pipeline_panel.subtitle()
        if moe:
            self.routing_marks.set_tracker(self.routing)
            self.routing_map.set_tracker(self.routing)
            routing_box = self.query_one("#routing-panel")
            routing_box.border_title = routing_title(self.routing)
            shown = routing_box.size.width or self.size.width // (1 if self.screen_has("-routing") else 2)
            routing_box.border_subtitle = routing_subtitle(self.routing, shown)  # before its first layout: the app's
        self.title = f"handle tui: {clean(s.run_dir.name, 80)}"

    # -- actions ---------------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("logs", "memory", "routing", "runs", "help") and len(self.screen_stack) > 1:
            return False  # only on the main screen (the picker and help have their own keys)
        if action == "routing":
            return bool(self.routing.recent)  # False: no key in the footer (a dense model has no routing)
        return True

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_runs(self) -> None:
        if not isinstance(self.screen, RunPicker):
            self.push_screen(RunPicker(self.output_dirs, self.run_dir), self._picked)

    def _picked(self, path: Path | None) -> None:
        if path is not None and not _same(path, self.run_dir):
            self.switch_run(path)

    def switch_run(self, run_dir: Path) -> None:
        """Show another run: drop the old state, replay the new run's history, follow it."""
        self.workers.cancel_group(self, "tail")
        self.run_dir = Path(run_dir)
        self.state = RunState(self.run_dir, info=_read_info(self.run_dir))
        self.pipeline = PipelineTracker()
        self.routing = RoutingTracker()
        self.bad_line_count = 0
        self.batches_applied = 0
        self.log_panel.reset()
        self._redraw()
        self._start_tailing()

    def action_logs(self) -> None:
        screen = self.log_panel.screen
        expanded = not screen.has_class("-logs")
        screen.set_class(expanded, "-logs")
        logs = self.log_panel
        if expanded:
            screen.set_class(False, "-memory")
            screen.set_class(False, "-routing")
            logs.focus()
            logs.scroll_end(animate=False)
        else:
            self.set_focus(None)

    def screen_has(self, name: str) -> bool:
        """Whether the main screen has the class ``name`` (``-logs``, ``-memory``: what is expanded)."""
        return self.header_widget.screen.has_class(name)

    def action_memory(self) -> None:
        """Expand the memory panel over the charts (every rank of an 8-rank run at 80×24) and focus its list, or
        put it back."""
        self._expand("-memory", "#memory-scroll")

    def action_routing(self) -> None:
        """Expand the routing panel over the charts (64 experts a layer wrap over several lines) and focus its map,
        or put it back."""
        self._expand("-routing", "#routing-scroll")

    def _expand(self, name: str, focus: str) -> None:
        """Toggle the main screen's class ``name`` (the others that expand a panel go when it comes) and focus the
        list ``focus`` while it is on."""
        screen = self.header_widget.screen
        expanded = not screen.has_class(name)
        for other in ("-logs", "-memory", "-routing"):
            if other == name or expanded:
                screen.set_class(expanded and other == name, other)
        if expanded:
            self.query_one(focus).focus()
        else:
            self.set_focus(None)
        self._redraw()

    def action_pause(self) -> None:
        self.paused = not self.paused
        if self.paused:
            self._resume.clear()
        else:
            self._resume.set()
        self.notify("following paused: press p to resume" if self.paused else "following resumed", timeout=2,
                    markup=False)
        self._redraw()


def _read_info(run_dir: Path) -> dict:
    try:
        info = read_run_info(run_dir)
    except RunDirError:
        return {}
    return info if isinstance(info, dict) else {}


def _same(a: Path, b: Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:  # pragma: no cover
        return False
