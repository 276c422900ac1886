"""The time per step panel: where rank 0's step time goes."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from torch_handle.common.text import clean
from torch_handle.observe.fields import BACKWARD_S, COMM_S, DATA_S, FORWARD_S, OPTIMIZER_S, SYNC_S
from torch_handle.observe.state import RunState


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
