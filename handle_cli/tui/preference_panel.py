"""The preference panel of a DPO run (issue 47): the rewards of the chosen and the rejected completions, their
margin and the share of pairs ranked right, each with its newest value, a sparkline of the recent steps and the
newest evaluation's value. Shown in the learning-rate chart's place once a step event carries the metrics."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from torch_handle.observe.state import RunState

SPARKS = "▁▂▃▄▅▆▇█"
ROWS = (("chosen", "rewards/chosen", "green"), ("rejected", "rewards/rejected", "red"),
        ("margin", "rewards/margins", "cyan"), ("accuracy", "rewards/accuracies", "yellow"))
"""(label, the event's field, colour): the panel's lines, top down."""
LOGPS = ("logps/chosen", "logps/rejected")


def value_text(name: str, value: float | None) -> str:
    """``value`` as the panel prints it: accuracies as a percentage, rewards (nats) signed to 3 decimals."""
    if value is None:
        return "–"
    return f"{value:.0%}" if name == "rewards/accuracies" else f"{value:+.3f}"


def sparkline(values: list[float | None], width: int) -> str:
    """``values`` in at most ``width`` cells, ``▁..█`` scaled from their minimum to their maximum (a flat series:
    ``▄``; a missing value: a space). A longer series is averaged over ``width`` equal runs of steps, so that the
    line spans the whole run and shows its trend rather than the newest steps' noise."""
    if width <= 0 or not values:
        return ""
    if len(values) > width:
        buckets = [values[len(values) * i // width:len(values) * (i + 1) // width] for i in range(width)]
        values = [sum(known) / len(known) if (known := [v for v in b if v is not None]) else None for b in buckets]
    known = [v for v in values if v is not None]
    if not known:
        return " " * len(values)
    low, high = min(known), max(known)
    if high - low <= 1e-12:
        return "".join("▄" if v is not None else " " for v in values)
    top = len(SPARKS) - 1
    return "".join(" " if v is None else SPARKS[round((v - low) / (high - low) * top)] for v in values)


class LinesPanel(Widget):
    """A panel drawn as the lines of its ``lines(width, height)`` (a header line first, which goes first when the
    height is short: :meth:`fit_height`)."""

    def lines(self, width: int, height: int) -> list[Text]:
        raise NotImplementedError

    @staticmethod
    def fit_height(out: list[Text], height: int) -> list[Text]:
        """``out`` (header first) in ``height`` lines: without the header when short, then the first lines."""
        if height < len(out):  # the header goes first
            out = out[1:]
        return out[:max(1, height)]

    def render(self) -> Text:
        return Text("\n", no_wrap=True, overflow="ellipsis", end="").join(
            self.lines(max(20, self.size.width), max(1, self.size.height)))


class PreferencePanel(LinesPanel):
    """A header line, then one line per metric of :data:`ROWS`: ``label  newest  sparkline  newest eval``, then,
    with room, the newest log-probabilities of both completions (nats, summed or averaged as the loss reads them).
    The sparklines span every step so far (:func:`sparkline`); the header names the steps and the eval's step."""

    DEFAULT_CSS = """
    PreferencePanel { height: 1fr; width: 1fr; padding: 0 1; }
    """
    LABEL, VALUE, VAL = 9, 8, 8
    """Cells of the label, newest value and eval columns (each value right-aligned, with a leading space)."""

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.state: RunState | None = None
        self.border_title = "preference"

    def set_state(self, state: RunState) -> None:
        self.state = state
        s = state
        self.border_title = f"preference · step {s.preference_steps[-1]}" if s.preference_steps else "preference"
        self.refresh()

    def lines(self, width: int, height: int) -> list[Text]:
        """The panel's lines at ``width`` × ``height`` cells (the metric lines first to go last)."""
        s = self.state
        if s is None or not s.preference_steps:
            return [Text("no preference metrics yet", style="dim")]
        evals = [(step, v) for step, v in zip(s.val_steps, s.val_preference) if v is not None]
        val_step, val = evals[-1] if evals else (None, None)
        spark = max(0, width - self.LABEL - self.VALUE - self.VAL - 2)  # two spaces around the sparkline
        steps = s.preference_steps
        head = Text(no_wrap=True, overflow="ellipsis", end="", style="dim")
        head.append(" " * self.LABEL + f"{'newest':>{self.VALUE}}  ")
        span = f"steps {steps[0]}–{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
        if len(span) > spark:
            span = span.split(" ")[1]
        head.append(f"{span[:spark]:<{spark}}" if spark else "")
        if val is not None:
            head.append(f"{'val@' + str(val_step):>{self.VAL}}")
        out = [head]
        for label, name, colour in ROWS:
            series = s.preference.get(name, [])
            line = Text(no_wrap=True, overflow="ellipsis", end="")
            line.append(f"{label:<{self.LABEL}}", style="bold")
            line.append(f"{value_text(name, series[-1] if series else None):>{self.VALUE}}", style=colour)
            line.append("  " + f"{sparkline(series, spark):<{spark}}" if spark else "", style=colour)
            if val is not None:
                line.append(f"{value_text(name, val.get(name)):>{self.VAL}}", style="dim")
            out.append(line)
        if height > len(out):
            chosen, rejected = (s.preference.get(k, [None])[-1] for k in LOGPS)
            line = Text(no_wrap=True, overflow="ellipsis", end="")
            line.append(f"{'logps':<{self.LABEL}}", style="bold")
            text = f"chosen {_number(chosen)}  rejected {_number(rejected)}"
            if self.LABEL + len(text) > width:
                text = f"ch {_number(chosen)}  rej {_number(rejected)}"
            line.append(text, style="dim")
            out.append(line)
        return self.fit_height(out, height)


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"
