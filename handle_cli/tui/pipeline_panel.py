"""The dashboard's pipeline panel: the measured bubble next to the schedule's theory, each pipeline rank's busy /
receive-wait / idle share of the newest step, and the newest recorded step's schedule as it ran (a compact Gantt
chart from :mod:`torch_handle.observe.pipeline_view`) when the panel has the rows for it."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widget import Widget

from torch_handle.observe.pipeline_view import IDLE, RECV, gantt_rows, has_timeline, pct, pipeline_steps

STYLES = {"F": "green", "B": "yellow", "W": "magenta", "recv": "red", "idle": "grey37"}


class PipelineTracker:
    """The newest step's ``pipeline`` figures and the newest one with a timeline (log steps only)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.figures: dict[str, Any] | None = None
        self.drawn_step: int | None = None
        self.drawn: dict[str, Any] | None = None

    def apply(self, events: list[dict[str, Any]]) -> bool:
        """Take a batch of events; True when one of them carried pipeline figures."""
        seen = pipeline_steps(events)
        for step, pipeline in seen:
            self.step, self.figures = step, pipeline
            if has_timeline(pipeline):
                self.drawn_step, self.drawn = step, pipeline
        return bool(seen)


class PipelinePanel(Widget):
    DEFAULT_CSS = """
    PipelinePanel { height: 1fr; padding: 0 1; }
    """

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.tracker: PipelineTracker | None = None

    def set_tracker(self, tracker: PipelineTracker) -> None:
        self.tracker = tracker
        self.refresh()

    def title(self) -> str:
        """The border title: the schedule, and which step the chart rows show (the figures above them are the
        newest step's)."""
        t = self.tracker
        if t is None or t.figures is None:
            return "pipeline"
        p = t.figures
        name = f"pipeline {p.get('schedule', '?')} m {p.get('microbatches')}"
        return name if t.drawn_step is None else f"{name} · step {t.drawn_step}"

    def lines(self, width: int, height: int) -> list[Text]:
        """The bubble line, one busy/wait/idle bar per rank, then (when ``height`` allows) one Gantt row per rank
        or stage of the newest recorded step (F green, B yellow, W magenta, ~ receive wait, · idle)."""
        t = self.tracker
        if t is None or t.figures is None:
            return [Text("waiting for pipeline figures", "dim", no_wrap=True, overflow="ellipsis")]
        p = t.figures
        head = Text(no_wrap=True, overflow="ellipsis", end="")
        head.append("bubble ")
        head.append(pct(p.get("bubble")), "bold")
        head.append(" · theory ")
        head.append(pct(p.get("bubble_theory")), "bold")
        lines = [head]
        ranks = [r for r in p.get("ranks") or [] if isinstance(r, dict)]
        bar_w = max(4, width - 14)
        for rank, r in enumerate(ranks):
            parts = [float(r.get(k) or 0.0) for k in ("busy_s", "wait_s", "idle_s")]
            total = sum(parts) or 1.0
            line = Text(no_wrap=True, overflow="ellipsis", end="")
            line.append(f"r{rank:<2} ", "bold")
            used, acc = 0, 0.0
            for part, char, style in zip(parts, ("█", RECV, IDLE), ("green", STYLES["recv"], STYLES["idle"])):
                acc += part
                end = round(acc / total * bar_w)
                line.append(char * (end - used), style)
                used = end
            line.append(f" {parts[0] / total:>4.0%} busy")
            lines.append(line)
        if t.drawn is not None:
            rows = gantt_rows(t.drawn, max(8, width - 4))
            if rows and len(lines) + len(rows) <= height:
                for row in rows:
                    line = Text(no_wrap=True, overflow="ellipsis", end="")
                    line.append(f"r{row.rank:<2} " if row.stage is None else f"s{row.stage:<2} ", "bold")
                    for cell in row.cells:
                        line.append(cell.char, STYLES.get(cell.kind, ""))
                    lines.append(line)
        return lines[:max(1, height)]

    def render(self) -> Text:
        return Text("\n", no_wrap=True, overflow="ellipsis", end="").join(
            self.lines(max(20, self.size.width), max(1, self.size.height)))
