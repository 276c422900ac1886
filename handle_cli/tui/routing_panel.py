"""The dashboard's routing panel, for a mixture-of-experts run: a layer × expert heatmap of the load of the last
:data:`~torch_handle.observe.routing_view.WINDOW` steps (each expert's tokens over its layer's mean), the dead and
hot experts named above it, the steps, drop rate and aux loss in its bottom border
(:mod:`torch_handle.observe.routing_view` reads the step events' ``moe``).

Where the width allows, a cell is the load as a number (``1.3``: 1.3 times the mean; ``×``: no token); else one
character a cell, ``▁▂▃▄▅▆▇`` from no load up to the hot mark and ``█`` hot, wrapped over several lines per layer
when the experts outnumber the columns (64 experts at 80×24), in a list that scrolls (``Tab``) or, with ``e``, over
the charts. Dead experts are a red ``×``, hot ones white on red, near the mean green.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from rich.text import Text
from textual.widget import Widget

from handle_cli.tui.text_fit import fit
from torch_handle.observe.fields import MOE_AUX_LOSS
from torch_handle.observe.routing_view import (HOT_RATIO, WINDOW, LayerLoad, layer_loads, layer_means, marks,
                                               ratio_text, routing_steps, window_figures)

BARS = "▁▂▃▄▅▆▇"
CELL_W = 4
"""Columns of a number cell: `` 1.3``."""


def cell_style(ratio: float, dead: bool) -> str:
    if dead:
        return "bold red"
    if ratio >= HOT_RATIO:
        return "bold white on red3"
    if ratio >= 1.25:
        return "yellow"
    if ratio >= 0.8:
        return "green"
    return "cyan" if ratio >= 0.5 else "blue"


def bar_char(ratio: float, dead: bool) -> str:
    """One cell of the compact map: ``×`` dead, ``█`` hot, else ``▁`` .. ``▇`` by the load up to the hot mark."""
    if dead:
        return "×"
    if ratio >= HOT_RATIO:
        return "█"
    return BARS[min(len(BARS) - 1, int(ratio / HOT_RATIO * len(BARS)))]


class RoutingTracker:
    """The ``moe`` objects of the newest :data:`WINDOW` steps (a step run again after a restart replaces the later
    ones)."""

    def __init__(self, window: int = WINDOW) -> None:
        self.recent: deque[tuple[int, dict[str, Any]]] = deque(maxlen=window)

    def apply(self, events: list[dict[str, Any]]) -> bool:
        """Take a batch of events; True when one of them carried routing figures."""
        seen = routing_steps(events)
        for step, moe in seen:
            while self.recent and self.recent[-1][0] >= step:
                self.recent.pop()
            self.recent.append((step, moe))
        return bool(seen)

    @property
    def steps(self) -> tuple[int, int] | None:
        return (self.recent[0][0], self.recent[-1][0]) if self.recent else None

    def loads(self) -> list[LayerLoad]:
        return layer_loads([moe for _, moe in self.recent])

    def figures(self) -> dict[str, float | None]:
        return window_figures([moe for _, moe in self.recent])


class _Drawn(Widget):
    """A part of the panel, drawn from the tracker it is given."""

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.tracker: RoutingTracker | None = None

    def set_tracker(self, tracker: RoutingTracker) -> None:
        self.tracker = tracker
        self.refresh(layout=True)


class RoutingMarks(_Drawn):
    """Above the map, always in view: the hot experts, busiest first, and the dead ones, by layer and expert."""

    DEFAULT_CSS = """
    RoutingMarks { height: auto; padding: 0 1; }
    """

    def get_content_height(self, container, viewport, width: int) -> int:  # noqa: ANN001
        return 1

    def line(self, width: int) -> Text:
        loads = self.tracker.loads() if self.tracker is not None else []
        if not loads:
            return Text("waiting for routing figures", "dim", no_wrap=True, overflow="ellipsis", end="")
        for limit in (4, 3, 2, 1):  # as many names as fit, the rest counted (+2)
            text = self._marks(loads, limit)
            if text.cell_len <= width:
                break
        text.truncate(width, overflow="ellipsis")
        return text

    @staticmethod
    def _marks(loads: list[LayerLoad], limit: int) -> Text:
        hot, hot_more, dead, dead_more = marks(loads, limit)
        text = Text(no_wrap=True, overflow="ellipsis", end="")
        for word, names, more, style in (("hot", hot, hot_more, "bold white on red3"),
                                         ("dead", dead, dead_more, "bold red")):
            if names:
                text.append(" · " if text else "")
                text.append(word, style)
                text.append(" " + " · ".join(names) + (f" +{more}" if more else ""))
        if not text:
            text.append(f"no dead or hot (≥ {HOT_RATIO:g}×) expert", "dim")
        return text

    def render(self) -> Text:
        return self.line(max(20, self.size.width))


class RoutingMap(_Drawn):
    """The heatmap: one row per MoE layer (several when its experts need more than the width), one cell per
    expert, in expert order; where the width allows, the layer's mean aux loss (and drop rate, once anything was
    dropped) at the end of its row; where the height allows (``room``), the experts' numbers above and a key
    below."""

    DEFAULT_CSS = """
    RoutingMap { height: auto; padding: 0 1; }
    """

    def get_content_height(self, container, viewport, width: int) -> int:  # noqa: ANN001
        return len(self.lines(max(20, width), container.height or None))

    def lines(self, width: int, room: int | None = None) -> list[Text]:
        """Number cells when every expert of a layer fits on its row, else a character a cell, wrapped."""
        loads = self.tracker.loads() if self.tracker is not None else []
        if not loads:
            return []
        label_w = max(len(x.label) for x in loads) + 1
        experts = len(loads[0].counts)
        numbers = label_w + CELL_W * experts <= width
        per_line = experts if numbers else max(1, width - label_w)
        rows = []
        for x in loads:
            ratios, dead = x.ratios, set(x.dead)
            for start in range(0, experts, per_line):
                line = Text(no_wrap=True, overflow="ellipsis", end="")
                line.append(f"{x.label if start == 0 else '':<{label_w}}", "bold")
                for e in range(start, min(experts, start + per_line)):
                    style = cell_style(ratios[e], e in dead)
                    if numbers:
                        line.append(" ")
                        line.append("  ×" if e in dead else ratio_text(ratios[e]), style)
                    else:
                        line.append(bar_char(ratios[e], e in dead), style)
                rows.append(line)
        if numbers:
            self._layer_figures(rows, loads, width)
        if room is None or room > len(rows):
            if numbers:
                head = " " * label_w + "".join(f"{f'e{e}':>{CELL_W}}" for e in range(experts))
            else:  # a tick every 8 experts
                head = " " * label_w + "".join(f"{e:<8}" for e in range(0, min(experts, per_line), 8))
            rows.insert(0, Text(head, "dim", no_wrap=True, overflow="ellipsis", end=""))
        if room is None or room > len(rows):
            scale = f"{BARS} up to hot █ (≥ {HOT_RATIO:g}×)" if not numbers else f"hot ≥ {HOT_RATIO:g}×"
            rows.append(Text(f"tokens ÷ the layer's mean · {scale} · × dead · last {len(self.tracker.recent)} steps",
                             "dim", no_wrap=True, overflow="ellipsis", end=""))
        for line in rows:
            line.truncate(width, overflow="ellipsis")
        return rows

    def _layer_figures(self, rows: list[Text], loads: list[LayerLoad], width: int) -> None:
        """``aux 1.052`` (and ``drop 1.2%`` once the run dropped any) after each layer's cells, where every row
        has the room."""
        aux = layer_means([moe for _, moe in self.tracker.recent], MOE_AUX_LOSS) if self.tracker else []
        drops = any(x.dropped for x in loads)
        texts = [(f"  aux {a:.3f}" if a is not None else "") + (f" drop {x.drop_rate:.1%}" if drops else "")
                 for x, a in zip(loads, aux)]
        if texts and all(row.cell_len + len(t) <= width for row, t in zip(rows, texts)):
            for row, t in zip(rows, texts):
                row.append(t, "dim")

    def render(self) -> Text:
        room = self.parent.size.height if isinstance(self.parent, Widget) else 0  # the scrolling list's rows
        return Text("\n", no_wrap=True, overflow="ellipsis", end="").join(
            self.lines(max(20, self.size.width), room or None))


def routing_title(tracker: RoutingTracker) -> str:
    loads = tracker.loads()
    if not loads:
        return "routing"
    return f"routing · load ÷ mean · {len(loads[0].counts)} experts"


def routing_subtitle(tracker: RoutingTracker, width: int = 40) -> str:
    """The bottom border: which steps the map adds up, their drop rate and mean aux loss, as many as fit."""
    steps = tracker.steps
    if steps is None:
        return ""
    figures = tracker.figures()
    first, last = steps
    pieces = [(0, Text(f"step {last}" if first == last else f"steps {first}–{last}"))]
    if (aux := figures.get("aux_loss")) is not None:
        pieces.append((1, Text(f" · aux {aux:.3f}")))
    if (drop := figures.get("drop_rate")) is not None:
        pieces.append((2, Text(f" · drop {drop:.1%}")))  # gives way first: 0 without a capacity
    return fit(pieces, max(10, width - 6)).plain
