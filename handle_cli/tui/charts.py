"""The line charts (loss, throughput, learning rate): plotext plots with round tick values."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from textual.app import RenderResult
from textual_plotext import PlotextPlot


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
    """The most round tick values (1, 2, 2.5, 5 times a power of ten) within ``[lo, hi]``, at most ``n`` and at
    least two where ``n`` allows: when the roundest step leaves one tick (a short chart over a range like 6.3..9.3
    gets only 8), the first and last multiple of the finest step that has two or more (7 and 9)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    n = max(2, n)

    def span(step: float) -> tuple[int, int]:
        return math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)

    mag = 10 ** (math.floor(math.log10((hi - lo) / n)) - 1)
    step, several = mag, None  # several: the last step tried that gives two ticks or more
    for _ in range(40):
        for m in (1, 2, 2.5, 5):
            step = m * mag
            if integer and (step < 1 or m == 2.5):
                continue
            first, last = span(step)
            if last - first + 1 <= n:
                break
            several = step
        else:
            mag *= 10
            continue
        break
    first, last = span(step)
    if last - first + 1 < 2 and several is not None:
        (first, last), step = span(several), several
        return [round(first * step, 12), round(last * step, 12)]
    return [round(i * step, 12) for i in range(first, last + 1)]


def tick_labels(ticks: list[float]) -> list[str]:
    """Short labels with a shared format: 12k / 1.5M for large values, 2.5e-04 for small, else fixed decimals (as
    many as the finer of the step between ticks and the ticks themselves need: 2.5, 5.0, 7.5)."""
    if not ticks:
        return []
    step = ticks[1] - ticks[0] if len(ticks) > 1 else (abs(ticks[0]) or 1.0)
    big = max(abs(t) for t in ticks)
    if big >= 1e6:
        return [f"{t / 1e6:.{_decimals(step / 1e6, [t / 1e6 for t in ticks])}f}M" for t in ticks]
    if big >= 1e4:
        return [f"{t / 1e3:.{_decimals(step / 1e3, [t / 1e3 for t in ticks])}f}k" for t in ticks]
    if big < 1e-2:
        for digits in range(1, 6):
            labels = [f"{t:.{digits}e}" if t else "0" for t in ticks]
            if all(abs(float(lab) - t) <= step * 1e-3 for lab, t in zip(labels, ticks)):
                break
        return labels
    return [f"{t:.{_decimals(step, ticks)}f}" for t in ticks]


def _decimals(step: float, values: list[float] = ()) -> int:
    if step >= 1 or step <= 0:
        d = 0
    else:
        d = -math.floor(math.log10(step) + 1e-9)
        d += 0 if round(step * 10 ** d, 6) in (1.0, 2.0, 5.0) else 1
    while d < 6 and any(abs(round(v, d) - v) > 1e-9 * max(1.0, abs(v)) for v in values):
        d += 1
    return d


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
        self.y_labels: dict[str, list[str]] = {}
        """y side ("left", "right") -> the tick labels of the newest drawing (for tests)."""

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
        self.y_labels = {}
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
            self.y_labels[side] = tick_labels(yt)
            plt.yticks(yt, self.y_labels[side], yside=side)
        return super().render()
