"""The main screen's panels. All text reaches the terminal as ``rich.text.Text`` built from cleaned strings."""

from __future__ import annotations

import math
import textwrap
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from rich.text import Text
from textual.app import RenderResult
from textual.widget import Widget
from textual.widgets import RichLog
from textual_plotext import PlotextPlot

from torch_handle.common.text import clean, fmt_duration, fmt_float
from torch_handle.common.units import fmt_bytes
from torch_handle.observe.fields import (BACKWARD_S, COMM_S, CUDA_ALLOCATED_BYTES, CUDA_MAX_ALLOCATED_BYTES,
                                         CUDA_RESERVED_BYTES, DATA_S, FORWARD_S, GRAD_BYTES, OPTIMIZER_BYTES,
                                         OPTIMIZER_S, PARAM_BYTES, RSS_BYTES, SYNC_S, Level, Status)
from torch_handle.observe.state import Notice, RunState

STATUS_STYLES = {
    Status.RUNNING: "bold black on green",
    Status.FINISHED: "bold white on blue",
    Status.FAILED: "bold white on red",
    Status.STOPPED: "bold black on yellow",
    Status.RESTARTING: "bold black on magenta",
    Status.STARTING: "bold black on cyan",
    Status.LOST: "bold white on red",
    Status.HUNG: "bold white on red",
}
MESSAGE_STYLES = {Status.FAILED: "bold red", Status.LOST: "bold red", Status.HUNG: "bold red",
                  Status.STOPPED: "yellow", Status.RESTARTING: "magenta"}
HANG_LINES = 3
"""A watchdog's hang message (where each rank waits) may wrap over this many header lines; others take one."""


def fit(pieces: list[tuple[int, Text]], width: int) -> Text:
    """Join ``(priority, piece)`` in order, leaving out the least important pieces (highest number) until the
    line fits ``width``; whatever still overflows ends in an ellipsis."""
    kept = list(pieces)
    while len(kept) > 1 and sum(p.cell_len for _, p in kept) > width:
        worst = max(range(len(kept)), key=lambda i: (kept[i][0], i))
        if kept[worst][0] == 0:
            break
        del kept[worst]
    line = Text(no_wrap=True, overflow="ellipsis", end="")
    for _, piece in kept:
        line.append_text(piece)
    line.truncate(width, overflow="ellipsis")
    return line


def _piece(*parts: str | tuple[str, str]) -> Text:
    return Text.assemble(*parts)


class StatusHeader(Widget):
    """Status badge, preset, layout (:class:`~torch_handle.common.run_layout.RunLayout`'s line: dp × tp × pp and
    the strategy), precision, world size, progress, ETA, elapsed; then
    the latest numbers; then the failure or stop message. Parts that do not fit the width are left out, least
    important first."""

    DEFAULT_CSS = """
    StatusHeader { height: auto; padding: 0 1; background: $panel; }
    """

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.state: RunState | None = None
        self.paused = False
        self.bad_lines = 0

    def show(self, state: RunState, *, paused: bool, bad_lines: int) -> None:
        self.state, self.paused, self.bad_lines = state, paused, bad_lines
        self.refresh(layout=True)

    def get_content_height(self, container, viewport, width: int) -> int:  # noqa: ANN001
        return len(self.lines(max(20, width)))

    def render(self) -> Text:
        return Text("\n", no_wrap=True, end="").join(self.lines(max(20, self.size.width)))

    @property
    def plain(self) -> str:
        return "\n".join(line.plain for line in self.lines(max(20, self.size.width)))

    def lines(self, width: int) -> list[Text]:
        state = self.state
        if state is None:
            return [Text("loading…")]
        status = state.status
        total = state.steps_total
        step = state.step
        p1: list[tuple[int, Text]] = [(0, Text(f" {status.upper()} ", STATUS_STYLES.get(status, "reverse")))]
        p1.append((1, _piece("  ", (state.preset, "bold"))))
        layout = state.run_layout  # the line every view shows (dp × tp × pp, implementations, strategy)
        p1.append((2, _piece("  ", (layout.label() if layout.dp is not None else layout.strategy_text, "cyan"))))
        if state.precision:  # run.json's: the concrete one "auto" resolved to
            p1.append((7, _piece("  ", (state.precision, "cyan"))))  # the first to go on a narrow screen
        world = _piece(f"  world {state.world_size if state.world_size is not None else '?'}")
        p1.append((5 if layout.dp is not None else 3, world))  # a known layout names the ranks too: it goes first
        p1.append((0, _piece("  step ", (f"{step}/{total if total else '?'}", "bold"))))
        if total:
            frac = min(1.0, max(0.0, step / total))
            filled = int(round(frac * 10))
            p1.append((6, _piece(" ", ("━" * filled, "green"), ("━" * (10 - filled), "grey37"))))
            p1.append((4, _piece(f" {frac * 100:.0f}%")))
        p1.append((1, _piece(f"  ETA {fmt_duration(state.eta_s())}")))
        p1.append((2, _piece(f"  elapsed {fmt_duration(state.elapsed_s())}")))
        if state.restarts:
            p1.append((1, _piece(("  restarts ", "magenta"), (str(state.restarts), "bold magenta"))))
        if self.paused:
            p1.append((0, _piece("  ", (" PAUSED ", "bold black on yellow"))))

        p2: list[tuple[int, Text]] = [(0, _piece("loss ", (fmt_float(state.last_loss), "bold")))]
        p2.append((1, _piece("  val ", (fmt_float(state.last_val_loss), "bold"))))
        tps = state.last(state.tokens_per_s)
        p2.append((2, _piece(f"  {tps:,.0f} tok/s" if tps is not None else "  - tok/s")))
        st = state.last(state.step_time_s)
        p2.append((4, _piece(f"  {st:.3f} s/step" if st is not None else "  - s/step")))
        comm = state.last(state.comm_s)
        if comm is not None:  # only strategies that report it (scratch-ddp): the line is unchanged otherwise
            p2.append((4, _piece(f"  comm {comm * 1000:.0f} ms")))
        if state.mfu is not None:  # only runs whose events carry it: the line is unchanged otherwise
            p2.append((2, _piece("  mfu ", (f"{state.mfu:.1%}", "bold"))))
        lr = state.last(state.lr)
        p2.append((3, _piece(f"  lr {lr:.2e}" if lr is not None else "  lr -")))
        if state.grad_norm is not None:
            p2.append((5, _piece(f"  grad norm {state.grad_norm:.2f}")))
        if self.bad_lines:
            n = self.bad_lines
            p2.append((0, _piece("  ", (f"⚠ {n} bad line{'s' if n != 1 else ''}", "bold yellow"))))
        p2.append((6, _piece("  ", (clean(state.run_dir.name, 80), "dim"))))

        lines = [fit(p1, width), fit(p2, width)]
        message = state.message
        if message and status in MESSAGE_STYLES:
            text = ("error: " if status == Status.FAILED else "") + message
            if message.startswith("hang:"):
                for part in textwrap.wrap(text, width, max_lines=HANG_LINES, placeholder=" …"):
                    lines.append(Text(part, MESSAGE_STYLES[status], no_wrap=True, end=""))
                return lines
            line = Text(text, MESSAGE_STYLES[status], no_wrap=True, overflow="ellipsis", end="")
            line.truncate(width, overflow="ellipsis")
            lines.append(line)
        return lines


def wrap_pieces(pieces: list[Text], width: int) -> list[Text]:
    """``pieces`` joined into lines of at most ``width`` cells, breaking only between pieces (a piece wider than
    ``width`` gets a line of its own), so that the caller knows how many lines it draws."""
    lines: list[Text] = []
    for piece in pieces:
        if lines and lines[-1].cell_len + piece.cell_len <= width:
            lines[-1].append_text(piece)
        else:
            lines.append(Text(no_wrap=True, overflow="ellipsis", end="").append_text(piece))
    return lines


@dataclass
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float | None]
    color: str
    yside: str = "left"
    marker: str = "braille"


def _points(xs: Sequence[float], ys: Sequence[float | None], max_points: int) -> tuple[list[float], list[float]]:
    """The plottable points (missing values dropped), thinned by a stride to at most about ``max_points`` (the
    newest point always kept); costs O(max_points), not O(len(xs)), so long runs redraw as fast as short ones."""
    n = min(len(xs), len(ys))
    stride = max(1, -(-n // max_points))
    idx = list(range(0, n, stride))
    if n and idx[-1] != n - 1:
        idx.append(n - 1)
    out_x, out_y = [], []
    for i in idx:
        y = ys[i]
        if y is not None:
            out_x.append(xs[i])
            out_y.append(y)
    return out_x, out_y


def nice_ticks(lo: float, hi: float, n: int, integer: bool = False) -> list[float]:
    """The most round tick values (1, 2, 2.5, 5 times a power of ten) within ``[lo, hi]``, at most ``n``."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    n = max(2, n)
    mag = 10 ** (math.floor(math.log10((hi - lo) / n)) - 1)
    step = mag
    for _ in range(40):
        for m in (1, 2, 2.5, 5):
            step = m * mag
            if integer and step < 1:
                continue
            if integer and m == 2.5:
                continue
            if math.floor(hi / step + 1e-9) - math.ceil(lo / step - 1e-9) + 1 <= n:
                break
        else:
            mag *= 10
            continue
        break
    first = math.ceil(lo / step - 1e-9)
    last = math.floor(hi / step + 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def tick_labels(ticks: list[float]) -> list[str]:
    """Short labels with a shared format: 12k / 1.5M for large values, 2.5e-04 for small, else fixed decimals."""
    if not ticks:
        return []
    step = ticks[1] - ticks[0] if len(ticks) > 1 else (abs(ticks[0]) or 1.0)
    big = max(abs(t) for t in ticks)
    if big >= 1e6:
        return [f"{t / 1e6:.{_decimals(step / 1e6)}f}M" for t in ticks]
    if big >= 1e4:
        return [f"{t / 1e3:.{_decimals(step / 1e3)}f}k" for t in ticks]
    if big < 1e-2:
        for digits in range(1, 6):
            labels = [f"{t:.{digits}e}" if t else "0" for t in ticks]
            if all(abs(float(lab) - t) <= step * 1e-3 for lab, t in zip(labels, ticks)):
                break
        return labels
    return [f"{t:.{_decimals(step)}f}" for t in ticks]


def _decimals(step: float) -> int:
    if step >= 1 or step <= 0:
        return 0
    d = -math.floor(math.log10(step) + 1e-9)
    return d + (0 if round(step * 10 ** d, 6) in (1.0, 2.0, 5.0) else 1)


class Chart(PlotextPlot):
    """A line chart of a few series over steps, drawn when it is refreshed (the app throttles that)."""

    DEFAULT_CSS = """
    Chart { border: round $primary 50%; border-title-color: $text; border-title-style: bold; }
    """
    MAX_POINTS = 600

    def __init__(self, title: str, *, id: str | None = None):
        super().__init__(id=id)
        self.border_title = title
        self.series: list[Series] = []
        self.plotted: dict[str, tuple[list[float], list[float]]] = {}
        """label -> the points given to plotext (thinned, missing values dropped), for tests and debugging."""

    def set_series(self, series: list[Series]) -> None:
        self.series = series
        self.plotted = {s.label: _points(s.xs, s.ys, self.MAX_POINTS) for s in series}
        self.refresh()

    def on_resize(self) -> None:
        self.refresh()  # the ticks depend on the size: never keep a drawing made at another height

    def render(self) -> RenderResult:
        plt = self.plt
        plt.clear_data()
        width, height = self.size
        xs_all = [x for xs, _ in self.plotted.values() for x in xs]
        if not xs_all:
            plt.title("waiting for data")
            plt.xticks([], [])
            plt.yticks([], [])
            return super().render()
        plt.title("")
        for s in self.series:
            xs, ys = self.plotted[s.label]
            if xs:
                plt.plot(xs, ys, label=s.label, color=s.color, marker=s.marker, yside=s.yside)
        xt = nice_ticks(min(xs_all), max(xs_all), max(2, width // 10), integer=True)
        plt.xticks(xt, tick_labels(xt))
        for side in ("left", "right"):
            ys_all = [y for s in self.series if s.yside == side for y in self.plotted[s.label][1]]
            if not ys_all:
                continue
            # at most about one tick per 1.5 plot rows: two ticks on one row are drawn in an arbitrary order
            yt = nice_ticks(min(ys_all), max(ys_all), max(2, (height - 3) * 2 // 3))
            plt.yticks(yt, tick_labels(yt), yside=side)
        return super().render()


class MemoryBars(Widget):
    """Per-rank memory: model state (params|grads|optimizer, stacked), RSS, and CUDA when reported."""

    DEFAULT_CSS = """
    MemoryBars { height: auto; padding: 0 1; }
    """
    PARTS = ((PARAM_BYTES, "green", "params"), (GRAD_BYTES, "yellow", "grads"),
             (OPTIMIZER_BYTES, "magenta", "optim"))

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.memory: dict[int, dict[str, int]] = {}

    def set_memory(self, memory: dict[int, dict[str, int]]) -> None:
        self.memory = {r: dict(m) for r, m in memory.items()}
        self.refresh(layout=True)

    def _has_cuda(self) -> bool:
        return any(CUDA_RESERVED_BYTES in m or CUDA_ALLOCATED_BYTES in m for m in self.memory.values())

    def get_content_height(self, container, viewport, width: int) -> int:  # noqa: ANN001
        if not self.memory:
            return 1
        return 1 + len(self.memory) * (4 if self._has_cuda() else 3)

    def render(self) -> Text:
        if not self.memory:
            return Text("waiting for memory figures", "dim", no_wrap=True, overflow="ellipsis")
        width = max(20, self.size.width)
        cuda = self._has_cuda()
        legend = Text(no_wrap=True, overflow="ellipsis")
        for _, color, label in self.PARTS:
            legend.append("■ ", color)
            legend.append(label + " ")
        legend.append("■ ", "cyan")
        legend.append("rss ")
        if cuda:
            legend.append("■ ", "red")
            legend.append("cuda alloc ")
            legend.append("▒ ", "red")
            legend.append("reserved ")
            legend.append("│", "bold white")
            legend.append(" peak")
        value_w = 10  # " 682.2 MiB"
        head_w = 14  # "rank 0 " + " state "
        bar_w = max(4, width - head_w - value_w)

        def state_total(m: dict[str, int]) -> int:
            return sum(m.get(k, 0) for k, _, _ in self.PARTS)

        max_state = max([state_total(m) for m in self.memory.values()] + [1])
        max_rss = max([m.get(RSS_BYTES, 0) for m in self.memory.values()] + [1])
        max_cuda = max([max(m.get(CUDA_RESERVED_BYTES, 0), m.get(CUDA_MAX_ALLOCATED_BYTES, 0),
                            m.get(CUDA_ALLOCATED_BYTES, 0)) for m in self.memory.values()] + [1])
        lines = [legend]
        for rank in sorted(self.memory):
            m = self.memory[rank]
            # model state: stacked
            line = Text(no_wrap=True, overflow="ellipsis")
            line.append(f"rank {rank:<2}"[:7], "bold")
            line.append(" state ")
            used = 0
            bars = Text()
            for key, color, _ in self.PARTS:
                n = int(round(m.get(key, 0) / max_state * bar_w))
                n = min(n, bar_w - used)
                bars.append("█" * n, color)
                used += n
            bars.append("·" * (bar_w - used), "grey30")
            line.append_text(bars)
            line.append(f"{fmt_bytes(state_total(m)):>{value_w}}")
            lines.append(line)

            detail = " · ".join(f"{label} {fmt_bytes(m[key])}" for key, _, label in self.PARTS if key in m)
            if 14 + len(detail) > width:
                detail = " ".join(f"{label[:3]} {fmt_bytes(m[key]).replace(' ', '')[:-2]}"
                                  for key, _, label in self.PARTS if key in m)
            line = Text(" " * max(1, min(14, width - len(detail))) + detail, "dim", no_wrap=True, overflow="ellipsis")
            lines.append(line)

            rss = m.get(RSS_BYTES)
            line = Text(no_wrap=True, overflow="ellipsis")
            line.append(" " * 7)
            line.append(" rss   ")
            n = int(round((rss or 0) / max_rss * bar_w))
            line.append("█" * n, "cyan")
            line.append("·" * (bar_w - n), "grey30")
            line.append(f"{fmt_bytes(rss):>{value_w}}")
            lines.append(line)

            if cuda:
                alloc = m.get(CUDA_ALLOCATED_BYTES, 0)
                peak = m.get(CUDA_MAX_ALLOCATED_BYTES, 0)
                reserved = m.get(CUDA_RESERVED_BYTES, 0)
                a = min(bar_w, int(round(alloc / max_cuda * bar_w)))
                r = min(bar_w, max(a, int(round(reserved / max_cuda * bar_w))))
                p = min(bar_w - 1, int(round(peak / max_cuda * bar_w))) if peak else -1
                cells = ["█"] * a + ["▒"] * (r - a) + ["·"] * (bar_w - r)
                styles = ["red"] * r + ["grey30"] * (bar_w - r)
                if p >= 0:
                    cells[p], styles[p] = "│", "bold white"
                line = Text(no_wrap=True, overflow="ellipsis")
                line.append(" " * 7)
                line.append(" cuda  ")
                for c, s in zip(cells, styles):
                    line.append(c, s)
                line.append(f"{fmt_bytes(alloc):>{value_w}}")
                lines.append(line)
        return Text("\n", no_wrap=True, overflow="ellipsis", end="").join(lines)

    def labels(self) -> list[str]:
        """The plain text of each line (for tests)."""
        return self.render().plain.splitlines()


class TimePanel(Widget):
    """Where the step time goes: a legend with the mean of each part over the recent steps, the newest step's
    communication per dimension of the layout (when its event carries ``comm``), the slowest rank and its lag, then
    one stacked bar per recent step (newest last; the width is the slowest shown step)."""

    DEFAULT_CSS = """
    TimePanel { height: 1fr; padding: 0 1; }
    """
    PARTS = (("data", "cyan", "data", (DATA_S,)), ("forward", "green", "fwd", (FORWARD_S,)),
             ("backward", "yellow", "bwd", (BACKWARD_S,)), ("optimizer", "magenta", "opt", (OPTIMIZER_S,)),
             ("comm", "red", "comm", (COMM_S, SYNC_S)))
    """(part, colour, label, the step event's fields it adds up)."""
    MEAN_OF = 20

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.state: RunState | None = None

    def set_state(self, state: RunState) -> None:
        self.state = state
        self.refresh()

    def rows(self, n: int) -> list[tuple[int, float | None, dict[str, float]]]:
        """The newest ``n`` steps with a breakdown: (step, step time, part -> seconds); ``comm`` is the strategy's
        ``comm_s`` plus the trainer's ``sync_s`` (both communication)."""
        s = self.state
        out = []
        if s is None:
            return out
        for i in range(len(s.steps) - 1, -1, -1):
            if len(out) >= n:
                break
            seconds = s.breakdown(i)
            if seconds[FORWARD_S] is None:
                continue
            parts = {key: sum(seconds[k] or 0.0 for k in keys) for key, _, _, keys in self.PARTS}
            out.append((s.steps[i], s.step_time_s[i], parts))
        return out[::-1]

    def lines(self, width: int, height: int) -> list[Text]:
        s = self.state
        if s is None or not s.breakdown_seen:
            return [Text("waiting for step times", "dim", no_wrap=True, overflow="ellipsis")]
        recent = self.rows(self.MEAN_OF)
        legend = []
        for key, color, label, _ in self.PARTS:
            mean = sum(p[key] for _, _, p in recent) / max(1, len(recent))
            legend.append(Text.assemble(("■ ", color), f"{label} {mean * 1000:.1f} "))
        legend[-1].append("ms", "dim")
        lines = wrap_pieces(legend, width)
        if s.comm:
            lines.append(self.comm_line(s.comm))
        slow = s.slowest
        if slow is not None:
            line = Text(no_wrap=True, overflow="ellipsis", end="")
            line.append("slowest ", "dim")
            line.append(f"rank {slow['rank']}", "bold yellow" if slow["ratio"] > 0.2 else "bold")
            line.append(f" +{slow['lag_s'] * 1000:.0f} ms ({slow['ratio']:.0%} of a step)")
            line.append(f"  spread {slow['spread_s'] * 1000:.0f} ms", "dim")
            lines.append(line)
        for line in lines:
            line.truncate(width, overflow="ellipsis")
        n_bars = max(0, height - len(lines))
        bars = self.rows(n_bars)
        if not bars:
            return lines
        label_w = max(len(str(step)) for step, _, _ in bars) + 1
        value_w = 8  # " 1234 ms"
        bar_w = max(4, width - label_w - value_w)
        scale = max([st or sum(p.values()) for _, st, p in bars] + [1e-9])
        for step, st, parts in bars:
            total = st if st is not None else sum(parts.values())
            line = Text(no_wrap=True, overflow="ellipsis", end="")
            line.append(f"{step:>{label_w - 1}} ", "dim")
            used, acc = 0, 0.0
            for key, color, _, _ in self.PARTS:
                acc += parts[key]
                end = min(bar_w, int(round(acc / scale * bar_w)))
                line.append("█" * max(0, end - used), color)
                used = max(used, end)
            rest = min(bar_w, int(round(total / scale * bar_w)))
            line.append("▒" * max(0, rest - used), "grey50")  # the step outside the parts (microseconds)
            used = max(used, rest)
            line.append(" " * (bar_w - used))
            line.append(f"{total * 1000:>5.0f} ms")
            lines.append(line)
        return lines

    @staticmethod
    def comm_line(comm: dict[str, float]) -> Text:
        """The newest step's communication per dimension of the layout: ``comm dp 12.0 · tp 30.0 · pp 4.0 ms``."""
        line = Text(no_wrap=True, overflow="ellipsis", end="")
        line.append("comm", "dim")
        for i, (name, seconds) in enumerate(comm.items()):
            ms = seconds * 1000
            line.append(" · " if i else " ", "dim")
            line.append(clean(name, 8), "red")
            line.append(f" {ms:.1f}" if ms < 100 else f" {ms:.0f}")
        line.append(" ms", "dim")
        return line

    def render(self) -> Text:
        return Text("\n", no_wrap=True, overflow="ellipsis", end="").join(
            self.lines(max(20, self.size.width), max(1, self.size.height)))


LEVEL_STYLES = {Level.ERROR: "bold red", Level.WARNING: "yellow", Level.INFO: "cyan"}
SOURCE_STYLES = ["green", "cyan", "magenta", "yellow", "blue", "bright_green", "bright_cyan", "bright_magenta"]


def source_tag(source: str) -> tuple[str, str]:
    if source.startswith("rank"):
        n = int(source[4:]) if source[4:].isdigit() else 0
        return f"r{n}", SOURCE_STYLES[n % len(SOURCE_STYLES)]
    if source == "launcher":
        return "ln", "blue"
    return source[:3], "white"


class LogPanel(RichLog):
    """Rank 0's log, failing ranks' logs, warnings from the events and skipped bad lines, newest last.

    Lines are kept as records and wrapped (with a hanging indent under the source tag) at the panel's width;
    when the width changes (terminal resized, ``l`` expands the panel) the kept records are wrapped again.
    Nothing is written before the width is known, so what shows never depends on timing.
    """

    DEFAULT_CSS = """
    LogPanel { border: round $primary 50%; border-title-color: $text; border-title-style: bold;
               scrollbar-gutter: stable; overflow-x: hidden; }
    LogPanel:focus { border: round $accent; }
    """
    KEEP = 500

    def __init__(self, *, id: str | None = None):
        super().__init__(max_lines=4 * self.KEEP, wrap=True, markup=False, highlight=False, min_width=20, id=id)
        self.border_title = "logs"
        self.records: deque[tuple[str, str, str, str]] = deque(maxlen=self.KEEP)
        """(tag, tag style, text, text style) of the newest lines."""
        self._rendered_width = 0

    @property
    def plain_lines(self) -> list[str]:
        """The kept lines as plain text, newest last (for tests)."""
        return [f"{tag:>2} {text}" for tag, _, text, _ in self.records]

    def reset(self) -> None:
        self.records.clear()
        self.clear()

    def _width(self) -> int:
        return self.scrollable_content_region.width if self._size_known else 0

    def _render_record(self, record: tuple[str, str, str, str], width: int) -> None:
        tag, tag_style, text, style = record
        body = Text(text, style).wrap(self.app.console, max(8, width - 3), overflow="fold")
        lines = [Text.assemble((f"{tag:>2}" if i == 0 else "  ", tag_style), " ", line) for i, line in enumerate(body)]
        self.write(Text("\n", end="").join(lines or [Text(f"{tag:>2}", tag_style)]), width=width)

    def on_resize(self, event) -> None:  # noqa: ANN001 - runs before RichLog's own handler
        if event.size.width:
            self._size_known = True
        width = self._width()
        if width and width != self._rendered_width:
            self._rendered_width = width
            self.clear()
            for record in self.records:
                self._render_record(record, width)

    def add(self, tag: str, tag_style: str, text: str, style: str = "") -> None:
        record = (tag, tag_style, clean(text), style)
        self.records.append(record)
        width = self._width()
        if width:
            if width != self._rendered_width:  # pragma: no cover - resized without a Resize event yet
                self._rendered_width = width
                self.clear()
                for r in self.records:
                    self._render_record(r, width)
            else:
                self._render_record(record, width)

    def add_log(self, source: str, text: str, error: bool) -> None:
        tag, style = source_tag(source)
        self.add(tag, style, text, "red" if error else "")

    def add_notice(self, notice: Notice) -> None:
        self.add("ev", LEVEL_STYLES.get(notice.level, ""), notice.text, LEVEL_STYLES.get(notice.level, ""))
