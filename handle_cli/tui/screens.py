"""The run picker (``r``) and the help screen (``?``)."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import DataTable, Footer, Static

from handle_cli.tui.model import RunRow, run_rows
from handle_cli.tui.header import STATUS_STYLES

COLUMNS = ("run", "status", "layout", "world", "steps", "loss", "started")
NARROW = 100
"""Below this width the layout and start time are abbreviated so that 80 columns show every column."""


class RunPicker(Screen[Path | None]):
    """Runs under the output directory, newest first; Enter switches the dashboard to the selected one."""

    BINDINGS = [
        Binding("escape,r", "close", "Back"),
        Binding("enter", "select", "Open", show=True, priority=False),
        Binding("q", "app.quit", "Quit"),
    ]
    DEFAULT_CSS = """
    RunPicker { layout: vertical; }
    RunPicker #picker-title { height: 1; padding: 0 1; background: $panel; text-style: bold; }
    RunPicker DataTable { height: 1fr; }
    """
    REFRESH_S = 2.0

    def __init__(self, output_dirs: list[Path], current: Path):
        super().__init__()
        self.output_dirs = output_dirs
        self.current = Path(current)
        self.rows: list[RunRow] = []

    def compose(self) -> ComposeResult:
        dirs = ", ".join(str(d) for d in self.output_dirs)
        yield Static(Text(f"runs under {dirs} · times in UTC · Enter: open · Esc: back", no_wrap=True,
                          overflow="ellipsis"), id="picker-title")
        table: DataTable = DataTable(cursor_type="row", zebra_stripes=True)
        table.add_columns(*COLUMNS)
        yield table
        yield Footer()

    def on_mount(self) -> None:
        self.reload(select_current=True)
        self.set_interval(self.REFRESH_S, self.reload)
        self.query_one(DataTable).focus()

    def _is_current(self, path: Path) -> bool:
        try:
            return path.resolve() == self.current.resolve()
        except OSError:  # pragma: no cover
            return False

    def reload(self, select_current: bool = False) -> None:
        table = self.query_one(DataTable)
        keep = None
        if not select_current and self.rows and 0 <= table.cursor_row < len(self.rows):
            keep = self.rows[table.cursor_row].path
        self.rows = run_rows(self.output_dirs)
        table.clear()
        target = 0
        narrow = self.app.size.width < NARROW
        for i, row in enumerate(self.rows):
            current = self._is_current(row.path)
            layout = row.layout.replace("deepspeed ", "ds ") if narrow else row.layout
            started = row.started[5:] if narrow and row.started != "-" else row.started
            table.add_row(
                Text(("▶ " if current else "  ") + row.name, "bold" if current else ""),
                Text(f" {row.status} ", STATUS_STYLES.get(row.status, "")),
                Text(layout), Text(row.world_size, justify="right"), Text(row.steps, justify="right"),
                Text(row.last_loss, justify="right"), Text(started),
                key=str(row.path),
            )
            if (keep is not None and row.path == keep) or (keep is None and current):
                target = i
        if self.rows:
            table.move_cursor(row=target, animate=False)
        else:
            self.query_one("#picker-title", Static).update(
                Text(f"no runs under {', '.join(str(d) for d in self.output_dirs)} (Esc: back)"))

    def on_resize(self) -> None:
        self.reload()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self._choose(event.cursor_row)

    def action_select(self) -> None:
        self._choose(self.query_one(DataTable).cursor_row)

    def _choose(self, index: int) -> None:
        if 0 <= index < len(self.rows):
            self.dismiss(self.rows[index].path)

    def action_close(self) -> None:
        self.dismiss(None)


HELP = """\
[b]handle tui[/b]: live dashboard of a training run
 [b]?[/b] help   [b]r[/b] runs: pick another   [b]m[/b] memory: every rank
 [b]q[/b] quit   [b]l[/b] logs: expand         [b]p[/b] pause/resume following
 [b]e[/b] routing: expand (an MoE run)
 [b]Tab[/b] focus the memory (or routing) list (↑↓ scroll)
 here: ↑↓ scroll, [b]Esc[/b] or any other key closes
Header: status, layout dp × tp × pp, world size, step, ETA,
elapsed since the launch (as handle run's summary); loss, val,
tok/s (SFT: trained share, trained/s), s/step, mfu, lr, grad
norm. Charts: loss (train, val), throughput (tok/s, trained/s,
s/step), lr.
Memory per rank: params | grads | optim stacked, RSS; on GPU
CUDA allocated, reserved, peak │. Above 2 ranks: min / median /
max over the ranks and the rank with the most, then one line per
rank that scrolls (m: all at once).
Time per step (rank 0): data, fwd, bwd, dp comm (where the
strategy measures it), sync (the loss all-reduce), opt; one bar
per step, the legend the mean of the steps drawn (the title
names them). comm: the newest step's communication per
dimension, dp · tp · pp (tp and pp happen inside fwd and bwd; –
where not measured: torch DDP and FSDP overlap dp with
backward); the slowest rank and its lag.
Pipeline: rank 0's pipeline (dp0 tp0) at one step: the bubble
against (p-1)/(m+p-1), busy █ / receive wait ~ / idle · per
rank, the schedule as it ran (F forward, B backward, W weight
grad). Only log steps keep their spans: the bottom border says
which step it shows.
Routing (an MoE run, in place of the lr chart): per MoE layer
(L0, L1, ...) and expert (e0, e1, ...) the tokens of the last
10 steps over the layer's mean: 1.0 a fair share, × dead (no
token), white on red hot (≥ 1.5×); many experts: one character
a cell, ▁..▇ up to hot █. Above, the hot and dead experts by
name; below, the steps, mean aux loss and drop rate.
Preference (a DPO run, in place of the lr chart): rewards of the
chosen and rejected completions, their margin and the accuracy:
newest, a sparkline over every step, the newest eval (val@N).
Ranks are global, as handle estimate names them: rank 4 (dp0 tp0
pp1). Logs: rank 0 and any rank that logged an error. Elapsed
and ETA come from event times. While paused, events wait on
disk; resuming catches up."""

SCROLL_KEYS = ("up", "down", "pageup", "pagedown", "home", "end")


class HelpScreen(ModalScreen[None]):
    """The keys and what each panel shows; scrolls where the terminal is shorter than the text (80×24), any
    other key closes it."""

    BINDINGS = [Binding("escape,question_mark,q", "close", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: auto; max-width: 90%; height: auto; max-height: 90%;
                                  border: round $accent; background: $surface; padding: 0 1; }
    HelpScreen Static { width: auto; }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(HELP)  # fixed text: markup is ours, nothing from a run goes in here

    def on_mount(self) -> None:
        self.query_one(VerticalScroll).focus()

    def on_key(self, event) -> None:  # noqa: ANN001 - any key but scrolling closes help
        if event.key in SCROLL_KEYS:
            return
        event.stop()
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)
