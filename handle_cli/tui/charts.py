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
