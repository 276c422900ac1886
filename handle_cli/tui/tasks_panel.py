"""The downstream tasks panel (issue 50): the scores of a run's in-loop lm-evaluation-harness tasks (``[eval]``) over
its steps, one line per task and metric: the newest score, a sparkline of every evaluation so far and the first
evaluation's score. Shown in the learning-rate chart's place once a ``tasks`` event arrives (a DPO run keeps its
preference panel there)."""

from __future__ import annotations

from rich.text import Text
from handle_cli.tui.preference_panel import LinesPanel, sparkline
from torch_handle.observe.state import RunState

SHARES = ("acc", "acc_norm", "exact_match", "f1", "mcc", "brier_score")
"""Metrics in 0..1 (the part before a ``,filter``): printed as percentages."""


def score_text(metric: str, value: float | None) -> str:
    """``value`` as the panel prints it: a share (:data:`SHARES`) as a percentage to one decimal, a perplexity or
    another figure to 4 significant digits."""
    if value is None:
        return "–"
    if metric.split(",")[0] in SHARES:
        return f"{value:.1%}"
    return f"{value:.4g}"


def short_names(names: list[str]) -> list[str]:
    """``"<task> <metric>"`` names without the ``prefix_`` every task shares (``handle_wikitext_cloze acc`` and
    ``handle_seed_answers exact_match`` -> ``wikitext_cloze acc``, ``seed_answers exact_match``)."""
    tasks = {n.split(" ")[0] for n in names}
    if len(tasks) < 2:
        return list(names)
    first, *rest = sorted(tasks)
    cut = 0
    for i, ch in enumerate(first):
        if any(i >= len(t) or t[i] != ch for t in rest):
            break
        if ch == "_":
            cut = i + 1
    return [n[cut:] for n in names]


ABBREVIATIONS = {"word_perplexity": "word_ppl", "byte_perplexity": "byte_ppl", "bits_per_byte": "bpb"}
"""Shorter metric names for a narrow panel."""


def fit(name: str, width: int, *, whole: bool = False) -> str:
    """``"<task> <metric>"`` in ``width`` cells: the metric's ``,filter`` left out first and the metric abbreviated
    (:data:`ABBREVIATIONS`), then the task's end cut (``wikitext_c… acc``); ``whole``: only the first two."""
    if len(name) <= width and not whole:
        return name
    task, _, metric = name.rpartition(" ")
    metric = metric.split(",")[0]
    metric = ABBREVIATIONS.get(metric, metric)
    short = f"{task} {metric}"
    if whole or len(short) <= width:
        return short
    keep = width - len(metric) - 2
    if keep >= 3:
        return f"{task[:keep]}… {metric}"
    return name[:max(0, width - 1)] + "…"


class TasksPanel(LinesPanel):
    """A header line, then one line per ``task metric`` of :attr:`RunState.task_scores`: ``name  newest
    sparkline  first``; the names are cut on the left when narrow (the metric stays), the lines past the height
    left out (the header first)."""

    DEFAULT_CSS = """
    TasksPanel { height: 1fr; width: 1fr; padding: 0 1; }
    """
    VALUE, FIRST, SPARK, LABEL = 7, 7, 4, 12
    """Cells of the newest and the first score (right-aligned, a leading space each; the first left out when the
    names need its room), the least sparkline (one cell per evaluation up to 3 times this) and the least name."""

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.state: RunState | None = None
        self.border_title = "tasks"

    def set_state(self, state: RunState) -> None:
        self.state = state
        steps = state.task_steps
        self.border_title = f"tasks · step {steps[-1]}" if steps else "tasks"
        self.refresh()

    def lines(self, width: int, height: int) -> list[Text]:
        """The panel's lines at ``width`` × ``height`` cells."""
        s = self.state
        if s is None or not s.task_steps:
            return [Text("no task scores yet", style="dim")]
        names = list(s.task_scores)
        shown = short_names(names)
        steps = s.task_steps
        spark = min(max(len(steps), self.SPARK), 3 * self.SPARK)  # a cell per evaluation, 4 to 12
        need = max(len(fit(n, 0, whole=True)) for n in shown)  # the longest name, its metric abbreviated
        first = self.FIRST if width - self.VALUE - self.FIRST - 2 - spark >= need else 0  # names first
        label = max(self.LABEL, min(need, width - self.VALUE - first - 2 - spark))
        spark = max(0, width - label - self.VALUE - first - 2)
        head = Text(no_wrap=True, overflow="ellipsis", end="", style="dim")
        spans = (f"steps {steps[0]}–{steps[-1]}", f"{steps[0]}–{steps[-1]}")
        span = next((t for t in spans if len(t) <= spark), "")
        head.append(" " * label + f"{'newest':>{self.VALUE}}  " + f"{span:<{spark}}"
                    + (f"{'@' + str(steps[0]):>{first}}" if first else ""))
        out = [head]
        for name, text in zip(names, shown):
            series = s.task_scores[name]
            metric = name.rsplit(" ", 1)[-1]
            newest = next((v for v in reversed(series) if v is not None), None)
            series_first = next((v for v in series if v is not None), None)
            line = Text(no_wrap=True, overflow="ellipsis", end="")
            line.append(f"{fit(text, label):<{label}}", style="bold")
            line.append(f"{score_text(metric, newest):>{self.VALUE}}", style="cyan")
            line.append("  " + f"{sparkline(series, spark):<{spark}}" if spark else "", style="cyan")
            if first:
                line.append(f"{score_text(metric, series_first):>{first}}", style="dim")
            out.append(line)
        return self.fit_height(out, height)
