"""The pipeline of one step as it actually ran, drawn as a terminal Gantt chart (plain text, no terminal library).

Input: a step event's ``pipeline`` dict (written by :func:`torch_handle.parallel.pipeline.timeline.summarize`):
``schedule, pp, v, microbatches, window_s, bubble, bubble_theory, ranks: [{busy_s, wait_s, idle_s}],
timeline: [[rank, kind, microbatch, stage, start_s, end_s], ...]`` with ``kind`` one of F, B, W (compute) or
recv (blocked in a receive), times in seconds from each rank's start of the step.

One row per pipeline rank (per (rank, stage) when a rank runs several stages, v > 1); the x axis is the step's
window scaled to the width. A compute span is its label (``F3``: forward of micro-batch 3; ``B``: backward; ``W``:
weight gradient) followed by its fill; ``~`` is a receive wait, ``·`` idle. torch's pipelining draws the planned
schedule (``_PipelineSchedule`` ``_dump_csv``/``visualizer``); this draws the measured one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

COMPUTE_FILL = {"F": "█", "B": "▓", "W": "▒"}
RECV, IDLE = "~", "·"
LEGEND = "F forward  B backward  W weight grad  ~ recv wait  · idle"
LABEL_W = 8
"""Row labels (``rank 0``, ``r0 s2``) and their padding."""


@dataclass(frozen=True)
class Cell:
    """One column of a row: its character and what it shows (``F``, ``B``, ``W``, ``recv`` or ``idle``)."""

    char: str
    kind: str


@dataclass(frozen=True)
class GanttRow:
    rank: int
    stage: int | None
    """None when every rank runs one stage (the row is the rank)."""
    cells: tuple[Cell, ...]

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.stage is None else f"r{self.rank} s{self.stage}"

    @property
    def text(self) -> str:
        return "".join(c.char for c in self.cells)


def has_timeline(pipeline: Any) -> bool:
    return isinstance(pipeline, dict) and bool(pipeline.get("timeline"))


def pipeline_steps(events: Iterable[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """``(step, pipeline)`` of every step event that carries a ``pipeline`` dict, in file order (a step run
    twice, after a restart, appears twice; the later one is the one that counted)."""
    out = []
    for e in events:
        p = e.get("pipeline")
        if e.get("kind") == "step" and isinstance(p, dict) and isinstance(e.get("step"), int):
            out.append((e["step"], p))
    return out


def nearest_drawn(drawn: list[tuple[int, dict[str, Any]]], step: int) -> tuple[int, dict[str, Any]]:
    """The item of ``drawn`` (``(step, pipeline)`` of the steps with a timeline, in file order) whose step is
    nearest ``step``: the earlier one on a tie, the later copy of a step run twice."""
    return min(reversed(drawn), key=lambda item: (abs(item[0] - step), item[0]))


def steps_text(steps: Iterable[int], limit: int = 8) -> str:
    """``4, 8, 12``; past ``limit`` steps ``4, 8, 12, …, 96, 100 (25 steps)`` (ascending, each once; ``none``
    when empty)."""
    ordered = sorted(set(steps))
    if len(ordered) <= limit:
        return ", ".join(map(str, ordered)) or "none"
    return ", ".join(map(str, ordered[:3])) + f", …, {ordered[-2]}, {ordered[-1]} ({len(ordered)} steps)"


def _spans(pipeline: dict[str, Any]) -> list[tuple[int, str, int, int, float, float]]:
    out = []
    for item in pipeline.get("timeline") or []:
        try:
            rank, kind, mb, stage, start, end = item
            out.append((int(rank), str(kind), int(mb), int(stage), float(start), float(end)))
        except (TypeError, ValueError):
            continue
    return out


def gantt_rows(pipeline: dict[str, Any], width: int) -> list[GanttRow]:
    """The chart's rows, ``width`` columns each (the window of the step, ``window_s`` or the last span's end).

    Every compute span keeps its order on the row even when it is shorter than a column, and gets at least as many
    columns as its label (``F3``: kind and micro-batch) when the row has room for every label, else at least one
    (its kind letter; the whole label only where it fits); so on a narrow screen the spans are moved right of their
    time rather than their labels cut. Receive waits fill only the columns no compute span took."""
    spans = _spans(pipeline)
    width = max(1, width)
    window = max([float(pipeline.get("window_s") or 0.0)] + [end for *_, end in spans])
    if window <= 0:
        return []
    dt = window / width
    n_ranks = max([int(pipeline.get("pp") or 0), len(pipeline.get("ranks") or [])] + [s[0] + 1 for s in spans])
    stages: dict[int, set[int]] = {r: set() for r in range(n_ranks)}
    for rank, _, _, stage, _, _ in spans:
        stages[rank].add(stage)
    per_stage = any(len(s) > 1 for s in stages.values())
    keys = [(r, s) for r in range(n_ranks) for s in sorted(stages[r])] if per_stage else \
        [(r, None) for r in range(n_ranks)]
    rows = []
    for rank, stage in keys:
        mine = [s for s in spans if s[0] == rank and (stage is None or s[3] == stage)]
        cells = [Cell(IDLE, "idle")] * width
        for _, kind, _, _, start, end in mine:
            if kind in COMPUTE_FILL:
                continue
            for c in range(int(start / dt), min(width, max(int(start / dt) + 1, round(end / dt)))):
                cells[c] = Cell(RECV, "recv")
        taken = 0
        compute = sorted((s for s in mine if s[1] in COMPUTE_FILL), key=lambda s: s[4])
        labels = [f"{kind}{mb}" for _, kind, mb, *_ in compute]
        least = [len(x) for x in labels] if sum(map(len, labels)) <= width else [1] * len(labels)
        after = [sum(least[n + 1:]) for n in range(len(compute))]  # the columns the spans after each one need
        for n, (_, kind, mb, _, start, end) in enumerate(compute):
            last = width - after[n]
            c0 = max(taken, min(round(start / dt), last - least[n]))
            c1 = min(last, max(c0 + least[n], round(end / dt)))
            label = labels[n] if c1 - c0 >= len(labels[n]) else kind
            for i, c in enumerate(range(c0, c1)):
                cells[c] = Cell(label[i] if i < len(label) else COMPUTE_FILL[kind], kind)
            taken = max(taken, c1)
        rows.append(GanttRow(rank, stage, tuple(cells)))
    return rows


def _ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.2f}"


def axis(window_s: float, width: int) -> str:
    """A time axis of ``width`` columns: ticks in milliseconds at about every 16 columns, the window's end last."""
    line = [" "] * width
    n = max(1, width // 16)
    for i in range(n + 1):
        text = (_ms(window_s * i / n) if i else "0") + (" ms" if i == n else "")
        col = round(i * width / n)
        col = min(col, width - len(text)) if i else 0
        if all(ch == " " for ch in line[max(0, col - 1):col + len(text)]):
            line[col:col + len(text)] = text
    return "".join(line)


def pct(x: Any) -> str:
    """A fraction as a percentage with one decimal; "-" for a missing or non-finite value."""
    return f"{x:.1%}" if isinstance(x, (int, float)) and math.isfinite(x) else "-"


def bubble_line(pipeline: dict[str, Any]) -> str:
    """``bubble measured 41.2%  theory 33.3% = (p-1)/(m+p-1), p 2 m 4``."""
    p, m, v = pipeline.get("pp"), pipeline.get("microbatches"), pipeline.get("v") or 1
    formula = f"(p-1)/(m+p-1), p {p} m {m}" if v == 1 else f"(p-1)/(v·m+p-1), p {p} v {v} m {m}"
    return f"bubble measured {pct(pipeline.get('bubble'))}  theory {pct(pipeline.get('bubble_theory'))} = {formula}"


def rank_name(pipeline_rank: int, ranks: Sequence[int] | None = None, stage: int | None = None) -> str:
    """``rank 4``: the global rank ``ranks[pipeline_rank]`` (rank 0's pipeline, whose ranks a step event's
    ``pipeline`` describes, is ranks 0 and 4 of dp 2 × tp 2 × pp 2:
    :meth:`~torch_handle.common.run_layout.RunLayout.global_rank`), or the pipeline rank itself without
    ``ranks``; ``r4 s2`` for stage 2 of a rank that runs several."""
    rank = ranks[pipeline_rank] if ranks is not None and 0 <= pipeline_rank < len(ranks) else pipeline_rank
    return f"rank {rank}" if stage is None else f"r{rank} s{stage}"


def rank_lines(pipeline: dict[str, Any], width: int, ranks: Sequence[int] | None = None) -> list[str]:
    """Per rank: busy / recv wait / idle in ms and a bar of the three (█ busy, ~ wait, · idle) in what is left;
    rows named by :func:`rank_name`."""
    rows = [r for r in pipeline.get("ranks") or [] if isinstance(r, dict)]
    head = f"{'':<{LABEL_W}}{'busy':>7}{'wait':>7}{'idle':>7}  ms"
    bar_w = max(4, width - len(head) - 1)
    lines = [head]
    for rank, r in enumerate(rows):
        parts = [float(r.get(k) or 0.0) for k in ("busy_s", "wait_s", "idle_s")]
        total = sum(parts) or 1.0
        bar, acc = "", 0.0
        for part, ch in zip(parts, ("█", RECV, IDLE)):
            acc += part
            bar += ch * (round(acc / total * bar_w) - len(bar))
        lines.append(f"{rank_name(rank, ranks):<{LABEL_W}}" + "".join(f"{_ms(x):>7}" for x in parts) + "     " + bar)
    return lines


def title(pipeline: dict[str, Any], step: int | None = None) -> str:
    at = f"step {step} · " if step is not None else ""
    impl = f" ({pipeline['impl']})" if pipeline.get("impl") else ""
    return (f"{at}{pipeline.get('schedule', '?')}{impl} · pp {pipeline.get('pp')} · m {pipeline.get('microbatches')}"
            + (f" · v {pipeline['v']}" if (pipeline.get("v") or 1) > 1 else "")
            + f" · window {_ms(float(pipeline.get('window_s') or 0.0))} ms")


def format_pipeline(pipeline: dict[str, Any], *, width: int = 80, step: int | None = None,
                    ranks: Sequence[int] | None = None) -> str:
    """The whole view as text at most ``width`` columns wide: title, axis, one chart row per rank (or stage),
    legend, per-rank busy/wait/idle and the bubble line. Without a timeline only the figures are shown. ``ranks``:
    the global rank of each pipeline rank (:func:`rank_name`), so that the rows read as every view names ranks."""
    chart_w = max(8, width - LABEL_W)
    lines = [title(pipeline, step)]
    rows = gantt_rows(pipeline, chart_w) if has_timeline(pipeline) else []
    if rows:
        window = max([float(pipeline.get("window_s") or 0.0)] + [s[5] for s in _spans(pipeline)])
        lines.append(" " * LABEL_W + axis(window, chart_w))
        lines += [f"{rank_name(row.rank, ranks, row.stage):<{LABEL_W}}{row.text}" for row in rows]
        lines.append(" " * LABEL_W + LEGEND[:chart_w])
    lines += rank_lines(pipeline, width, ranks)
    lines.append(bubble_line(pipeline)[:width])
    return "\n".join(lines)
