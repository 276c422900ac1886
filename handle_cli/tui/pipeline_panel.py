"""The dashboard's pipeline panel: one step of rank 0's pipeline as it ran -- the measured bubble next to the
schedule's theory, each pipeline rank's busy / receive-wait / idle share, and the schedule as a compact Gantt chart
(:mod:`torch_handle.observe.pipeline_view`) when the panel has the rows for it.

Only log steps (every ``training.log_every``) keep the spans the chart needs, so the panel shows the newest step that
has them, all of it from that one step, and says which in its bottom border: while a run goes on it trails the
header's step by up to ``log_every - 1``. The rows are named by global rank
(:meth:`~torch_handle.common.run_layout.RunLayout.rank_name`): with dp × tp > 1, rank 0's pipeline is the ranks of
dp 0, tp 0 (ranks 0 and 4 of dp 2 × tp 2 × pp 2), as ``handle estimate`` numbers them.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widget import Widget

from torch_handle.common.run_layout import SCHEDULE_NAMES, RunLayout
from torch_handle.common.text import clean
from torch_handle.observe.pipeline_view import (IDLE, RECV, gantt_rows, has_timeline, pct, pipeline_steps,
                                                rank_name)

STYLES = {"F": "green", "B": "yellow", "W": "magenta", "recv": "red", "idle": "grey37"}


class PipelineTracker:
    """The newest step's ``pipeline`` figures and the newest one with a timeline (log steps only)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.figures: dict[str, Any] | None = None
        self.drawn_step: int | None = None
        self.drawn: dict[str, Any] | None = None
        self.every: int | None = None
        """Steps between the two newest steps with a timeline (``training.log_every``), once there are two."""

    def apply(self, events: list[dict[str, Any]]) -> bool:
        """Take a batch of events; True when one of them carried pipeline figures."""
        seen = pipeline_steps(events)
        for step, pipeline in seen:
            self.step, self.figures = step, pipeline
            if has_timeline(pipeline):
                if self.drawn_step is not None and step > self.drawn_step:
                    self.every = step - self.drawn_step
                self.drawn_step, self.drawn = step, pipeline
        return bool(seen)

    @property
    def shown(self) -> tuple[int | None, dict[str, Any] | None]:
        """The step the panel shows and its figures: the newest with a timeline, else the newest (a run whose
        log steps have not come yet, or whose schedule records no spans)."""
        if self.drawn is not None:
            return self.drawn_step, self.drawn
        return self.step, self.figures


class PipelinePanel(Widget):
    DEFAULT_CSS = """
    PipelinePanel { height: 1fr; padding: 0 1; }
    """

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.tracker: PipelineTracker | None = None
        self.run_layout = RunLayout()

    def set_tracker(self, tracker: PipelineTracker, layout: RunLayout | None = None) -> None:
        self.tracker = tracker
        self.run_layout = layout or RunLayout()
        self.refresh()

    def title(self) -> str:
        """The border title: the schedule and its micro-batches."""
        t = self.tracker
        if t is None or t.figures is None:
            return "pipeline"
        p = t.shown[1] or {}
        schedule = clean(p.get("schedule", "?"), 20)
        return f"pipeline {SCHEDULE_NAMES.get(schedule, schedule)} m {clean(p.get('microbatches'), 6)}"

    def subtitle(self) -> str:
        """The bottom border: which step the whole panel shows, and how often a step keeps its spans."""
        t = self.tracker
        if t is None or t.figures is None:
            return ""
        step = t.shown[0]
        if t.drawn is None:
            return f"step {step} (no spans yet)"
        return f"step {step} · spans every {t.every} steps" if t.every else f"step {step} · spans on log steps"

    def rank_label(self, pipeline_rank: int, stage: int | None = None) -> str:
        """``rank 4``: the global rank of pipeline rank ``pipeline_rank`` of rank 0's pipeline (``r4 s2`` for one of
        several stages of that rank; the pipeline rank itself where the layout is not known: an old run)."""
        return rank_name(pipeline_rank, self.run_layout.pipeline_ranks(), stage)

    def lines(self, width: int, height: int) -> list[Text]:
        """The bubble line, one busy/wait/idle bar per rank, then (when ``height`` allows) one Gantt row per rank
        or stage (F green, B yellow, W magenta, ~ receive wait, · idle); all of one step, :attr:`PipelineTracker.
        shown`."""
        t = self.tracker
        step, p = t.shown if t is not None else (None, None)
        if p is None:
            return [Text("waiting for pipeline figures", "dim", no_wrap=True, overflow="ellipsis")]
        head = Text(no_wrap=True, overflow="ellipsis", end="")
        head.append("bubble ")
        head.append(pct(p.get("bubble")), "bold")
        head.append(" · theory ")
        head.append(pct(p.get("bubble_theory")), "bold")
        lines = [head]
        ranks = [r for r in p.get("ranks") or [] if isinstance(r, dict)]
        labels = [self.rank_label(i) for i in range(len(ranks))]
        label_w = max(map(len, labels), default=6) + 1
        bar_w = max(4, width - label_w - 10)
        for label, r in zip(labels, ranks):
            parts = [float(r.get(k) or 0.0) for k in ("busy_s", "wait_s", "idle_s")]
            total = sum(parts) or 1.0
            line = Text(no_wrap=True, overflow="ellipsis", end="")
            line.append(f"{label:<{label_w}}", "bold")
            used, acc = 0, 0.0
            for part, char, style in zip(parts, ("█", RECV, IDLE), ("green", STYLES["recv"], STYLES["idle"])):
                acc += part
                end = round(acc / total * bar_w)
                line.append(char * (end - used), style)
                used = end
            line.append(f" {parts[0] / total:>4.0%} busy")
            lines.append(line)
        if has_timeline(p):
            rows = gantt_rows(p, max(8, width - label_w))
            if rows and len(lines) + len(rows) <= height:
                for row in rows:
                    line = Text(no_wrap=True, overflow="ellipsis", end="")
                    line.append(f"{self.rank_label(row.rank, row.stage):<{label_w}}", "bold")
                    for cell in row.cells:
                        line.append(cell.char, STYLES.get(cell.kind, ""))
                    lines.append(line)
        for line in lines:
            line.truncate(width, overflow="ellipsis")
        return lines[:max(1, height)]

    def render(self) -> Text:
        return Text("\n", no_wrap=True, overflow="ellipsis", end="").join(
            self.lines(max(20, self.size.width), max(1, self.size.height)))
