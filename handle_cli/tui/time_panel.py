"""The time per step panel: where rank 0's step time goes, and the communication of each parallel dimension."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from handle_cli.tui.text_fit import fit, wrap_pieces
from torch_handle.common.run_layout import RunLayout
from torch_handle.common.text import clean
from torch_handle.observe.comm import DIMENSIONS as DIMS
from torch_handle.observe.fields import BACKWARD_S, COMM_S, DATA_S, FORWARD_S, OPTIMIZER_S, SYNC_S
from torch_handle.observe.state import RunState


class TimePanel(Widget):
    """Where rank 0's step time goes: a legend with the mean of each part over the steps drawn below it (the
    border title names them), the newest step's communication per dimension of the layout (when its event carries
    ``comm``), the slowest rank and its lag, then one stacked bar per recent step (newest last; the width is the
    slowest shown step).

    The parts tile the step: data, forward, backward, ``dp comm`` (the strategy's gradient communication not
    hidden behind backward, ``comm_s``: only strategies that measure it, and only then in the legend), ``sync``
    (the trainer's loss/stop all-reduce, ``sync_s``) and the optimizer. Tensor- and pipeline-parallel
    communication happens inside forward and backward; the comm line gives it per dimension."""

    DEFAULT_CSS = """
    TimePanel { height: 1fr; width: 1fr; padding: 0 1; border: round $primary 50%; border-title-color: $text;
                border-title-style: bold; }
    """
    PARTS = (("data", "cyan", "data", DATA_S), ("forward", "green", "fwd", FORWARD_S),
             ("backward", "yellow", "bwd", BACKWARD_S), ("dp comm", "red", "dp comm", COMM_S),
             ("sync", "blue", "sync", SYNC_S), ("optimizer", "magenta", "opt", OPTIMIZER_S))
    """(part, colour, legend label, the step event's field), in the order a step runs them."""
    TITLE = "time per step"

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.state: RunState | None = None
        self.border_title = self.TITLE

    def set_state(self, state: RunState) -> None:
        self.state = state
        self._retitle()
        self.refresh()

    def on_resize(self) -> None:
        self._retitle()

    def _retitle(self) -> None:
        """The border names the steps the legend averages (the bars drawn at this size)."""
        width, height = self.size
        bars = self.layout_rows(max(20, width), max(1, height))[1] if width and height else []
        title = self.TITLE
        if bars:
            first, last = bars[0][0], bars[-1][0]
            title += f" · step {last}" if first == last else f" · steps {first}–{last}"
        if self.border_title != title:
            self.border_title = title

    def rows(self, n: int) -> list[tuple[int, float | None, dict[str, float | None]]]:
        """The newest ``n`` steps with a breakdown: (step, step time, part -> seconds; None where the event has
        no such field)."""
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
            out.append((s.steps[i], s.step_time_s[i], {key: seconds[field] for key, _, _, field in self.PARTS}))
        return out[::-1]

    def head_lines(self, bars: list[tuple[int, float | None, dict[str, float | None]]], width: int) -> list[Text]:
        """The legend (each part's mean over ``bars``, ms), the comm line and the slowest rank."""
        s = self.state
        assert s is not None
        legend = []
        for key, color, label, _ in self.PARTS:
            values = [p[key] for _, _, p in bars if p[key] is not None]
            if key == "dp comm" and not values:
                continue  # a strategy that does not measure it (torch DDP, FSDP): the comm line says so
            mean = sum(values) / max(1, len(values))
            legend.append(Text.assemble(("■ ", color), f"{label} {mean * 1000:.1f} "))
        legend[-1].append("ms", "dim")
        lines = wrap_pieces(legend, width)
        if s.comm:
            lines.append(self.comm_line(s.comm, s.run_layout))
        slow = s.slowest
        if slow is not None:
            name = s.run_layout.rank_name(slow["rank"])
            strong = "bold yellow" if slow["ratio"] > 0.2 else "bold"
            lines.append(fit([(0, Text("slowest ", "dim")),
                              [(3, Text(name, strong)), (0, Text(f"rank {slow['rank']}", strong))],
                              (0, Text(f" +{slow['lag_s'] * 1000:.0f} ms")),
                              [(2, Text(f" ({slow['ratio']:.0%} of a step)")), (4, Text(f" ({slow['ratio']:.0%})"))],
                              (5, Text(f"  spread {slow['spread_s'] * 1000:.0f} ms", "dim"))], width))
        for line in lines:
            line.truncate(width, overflow="ellipsis")
        return lines

    def layout_rows(self, width: int, height: int) -> tuple[list[Text], list[tuple[int, float | None, dict]]]:
        """The head lines and the bars that fit under them in ``height`` lines: the legend's means are over
        exactly these bars (the head's height depends on the means' widths, so this settles in a pass or two)."""
        n = height
        for _ in range(4):
            bars = self.rows(max(0, n))
            head = self.head_lines(bars, width)
            fits = max(0, height - len(head))
            if len(bars) <= fits:
                return head, bars
            n = fits
        bars = self.rows(max(0, height - len(head)))
        return self.head_lines(bars, width), bars

    def lines(self, width: int, height: int) -> list[Text]:
        s = self.state
        if s is None or not s.breakdown_seen:
            return [Text("waiting for step times", "dim", no_wrap=True, overflow="ellipsis")]
        lines, bars = self.layout_rows(width, height)
        if not bars:
            return lines[:max(1, height)]
        label_w = max(len(str(step)) for step, _, _ in bars) + 1
        value_w = 8  # " 1234 ms"
        bar_w = max(4, width - label_w - value_w)
        scale = max([st or sum(v or 0.0 for v in p.values()) for _, st, p in bars] + [1e-9])
        for step, st, parts in bars:
            total = st if st is not None else sum(v or 0.0 for v in parts.values())
            line = Text(no_wrap=True, overflow="ellipsis", end="")
            line.append(f"{step:>{label_w - 1}} ", "dim")
            used, acc = 0, 0.0
            for key, color, _, _ in self.PARTS:
                acc += parts[key] or 0.0
                end = min(bar_w, round(acc / scale * bar_w))
                line.append("█" * max(0, end - used), color)
                used = max(used, end)
            rest = min(bar_w, round(total / scale * bar_w))
            line.append("▒" * max(0, rest - used), "grey50")  # the step outside the parts (microseconds)
            used = max(used, rest)
            line.append(" " * (bar_w - used))
            line.append(f"{total * 1000:>5.0f} ms")
            lines.append(line)
        return lines

    @staticmethod
    def comm_line(comm: dict[str, float], layout: RunLayout | None = None) -> Text:
        """The newest step's communication per dimension of the layout, each figure named by its dimension:
        ``comm dp 12.0 · tp 30.0 · pp 4.0 ms``; a dimension of ``layout`` above 1 whose figure the run does not
        measure (dp under torch DDP or FSDP, which overlap it with backward) shows ``–``."""
        wide = [] if layout is None or layout.dp is None else \
            [dim for dim, n in (("dp", layout.dp), ("tp", layout.tp), ("pp", layout.pp)) if (n or 1) > 1]
        names = [d for d in ("dp", "tp", "pp") if d in wide or d in comm] + [k for k in comm if k not in DIMS]
        line = Text(no_wrap=True, overflow="ellipsis", end="")
        line.append("comm", "dim")
        for i, name in enumerate(names):
            line.append(" · " if i else " ", "dim")
            line.append(clean(name, 8), "red")
            seconds = comm.get(name)
            if seconds is None:
                line.append(" –", "dim")
                continue
            ms = seconds * 1000
            line.append(f" {ms:.1f}" if ms < 100 else f" {ms:.0f}")
        line.append(" ms", "dim")
        return line

    def render(self) -> Text:
        return Text("\n", no_wrap=True, overflow="ellipsis", end="").join(
            self.lines(max(20, self.size.width), max(1, self.size.height)))
