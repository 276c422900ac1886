"""The memory per rank panel: every rank's model state (params | grads | optimizer, stacked), RSS and, on CUDA,
allocated / reserved / peak.

Up to :data:`DETAILED_RANKS` ranks get a block each (bars, byte counts); a larger world gets a fixed summary above
the list (:class:`MemorySummary`: min, median and max of each figure over the ranks, and the rank with the most)
and one line per rank (:class:`MemoryBars`), in a list that scrolls (focus it with Tab, or expand the panel with
``m``), so that every rank is reachable at 80×24. Ranks are named as every view names them
(:meth:`~torch_handle.common.run_layout.RunLayout.rank_name`).
"""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from handle_cli.tui.text_fit import fit, wrap_pieces
from torch_handle.common.run_layout import RunLayout
from torch_handle.common.units import fmt_bytes
from torch_handle.observe.fields import (CUDA_ALLOCATED_BYTES, CUDA_MAX_ALLOCATED_BYTES, CUDA_RESERVED_BYTES,
                                         FROZEN_PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES, PARAM_BYTES, RSS_BYTES)

DETAILED_RANKS = 2
"""Up to this many ranks, each gets a block of lines; more get the summary and one line each."""
STATE_PARTS = ((PARAM_BYTES, "green", "params"), (GRAD_BYTES, "yellow", "grads"), (OPTIMIZER_BYTES, "magenta", "optim"))
FROZEN_PART = ((FROZEN_PARAM_BYTES, "green", "frozen"),)
"""The share of params that no optimizer updates, named after them in a LoRA run's detail line."""


def state_bytes(m: dict[str, int]) -> int:
    """The model state of one rank's memory figures: params + grads + optimizer state (bytes)."""
    return sum(m.get(k, 0) for k, _, _ in STATE_PARTS)


def has_cuda(memory: dict[int, dict[str, int]]) -> bool:
    return any(CUDA_RESERVED_BYTES in m or CUDA_ALLOCATED_BYTES in m for m in memory.values())


def short_bytes(n: float | None) -> str:
    """``20.1M``, ``573.2M``, ``1.6G``: :func:`fmt_bytes` without the space and the ``iB`` (narrow columns)."""
    return fmt_bytes(n).replace(" ", "").replace("iB", "")


SUMMARY_FIGURES = (("state", state_bytes), ("rss", lambda m: m.get(RSS_BYTES)),
                   ("cuda peak", lambda m: m.get(CUDA_MAX_ALLOCATED_BYTES)))
"""The summary's rows: (name, the figure of one rank's memory, or None where it has none)."""


def memory_summary(memory: dict[int, dict[str, int]]) -> list[tuple[str, int, float, int, list[int]]]:
    """Per figure of :data:`SUMMARY_FIGURES` that some rank reports: ``(name, min, median, max, ranks at the
    max)`` over the ranks (bytes; the median of an even count is the mean of the middle two)."""
    out = []
    for name, figure in SUMMARY_FIGURES:
        values = {rank: v for rank, m in memory.items() if (v := figure(m)) is not None}
        if not values:
            continue
        xs = sorted(values.values())
        n = len(xs)
        median = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
        top = xs[-1]
        out.append((name, xs[0], median, top, sorted(r for r, v in values.items() if v == top)))
    return out


class MemorySummary(Widget):
    """Above the per-rank list of a world of more than :data:`DETAILED_RANKS` ranks: min, median and max of the
    model state, the RSS and the CUDA peak over the ranks, and the rank with the largest (``all`` when every rank
    has the same). Hidden for smaller worlds."""

    DEFAULT_CSS = """
    MemorySummary { height: auto; padding: 0 1; }
    """
    VALUE_W = 7

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.memory: dict[int, dict[str, int]] = {}
        self.run_layout = RunLayout()

    def set_memory(self, memory: dict[int, dict[str, int]], layout: RunLayout) -> None:
        self.memory, self.run_layout = memory, layout
        self.display = len(memory) > DETAILED_RANKS
        self.refresh(layout=True)

    def get_content_height(self, container, viewport, width: int) -> int:  # noqa: ANN001
        return len(self.lines(width))

    def lines(self, width: int) -> list[Text]:
        if len(self.memory) <= DETAILED_RANKS:
            return []
        rows = memory_summary(self.memory)
        name_w = max(len(f"{len(self.memory)} ranks"), *(len(name) + 1 for name, *_ in rows))
        w = self.VALUE_W
        head = Text(no_wrap=True, overflow="ellipsis", end="")
        head.append(f"{f'{len(self.memory)} ranks':<{name_w}}", "bold")
        head.append(f"{'min':>{w}}{'median':>{w}}{'max':>{w}}", "dim")
        head.append(" largest", "dim")
        lines = [head]
        for name, lo, med, hi, at in rows:
            figures = Text(f"{name:<{name_w}}" + "".join(f"{short_bytes(v):>{w}}" for v in (lo, med, hi)))
            if len(at) == len(self.memory):
                lines.append(fit([(0, figures), (0, Text(" all", "dim"))], width))
                continue
            # the rank with the most, named as every view names it where the width allows; "+3": three more
            lines.append(fit([(0, figures), [(3, Text(" " + self.run_layout.rank_name(at[0]), "bold")),
                                             (1, Text(f" rank {at[0]}", "bold"))],
                              *([(2, Text(f" +{len(at) - 1}", "dim"))] if len(at) > 1 else [])], width))
        head.truncate(width, overflow="ellipsis")
        return lines

    def render(self) -> Text:
        return Text("\n", no_wrap=True, overflow="ellipsis", end="").join(self.lines(max(20, self.size.width)))


class MemoryBars(Widget):
    """Per-rank memory: model state (params|grads|optimizer, stacked), RSS, and CUDA when reported; a block of
    lines per rank up to :data:`DETAILED_RANKS` ranks, else one line per rank (every rank, in rank order)."""

    DEFAULT_CSS = """
    MemoryBars { height: auto; padding: 0 1; }
    """
    PARTS = STATE_PARTS

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.memory: dict[int, dict[str, int]] = {}
        self.run_layout = RunLayout()

    def set_memory(self, memory: dict[int, dict[str, int]], layout: RunLayout | None = None) -> None:
        self.memory = {r: dict(m) for r, m in memory.items()}
        self.run_layout = layout or RunLayout()
        self.refresh(layout=True)

    @property
    def compact(self) -> bool:
        return len(self.memory) > DETAILED_RANKS

    def get_content_height(self, container, viewport, width: int) -> int:  # noqa: ANN001
        return len(self.lines(max(20, width)))

    def legend(self, cuda: bool, width: int) -> list[Text]:
        """What each colour is, on as many lines as ``width`` needs."""
        names = [(color, label) for _, color, label in self.PARTS] + [("cyan", "rss")]
        pieces = [Text.assemble(("■ ", color), f"{label} ") for color, label in names]
        if cuda:
            pieces += [Text.assemble(("■ ", "red"), "cuda alloc "), Text.assemble(("▒ ", "red"), "reserved "),
                       Text.assemble(("│", "bold white"), " peak")]
        return wrap_pieces(pieces, width)

    def _scales(self) -> tuple[int, int, int]:
        """The largest model state, RSS and CUDA figure over the ranks: every rank's bars share them."""
        ms = self.memory.values()
        return (max([state_bytes(m) for m in ms] + [1]), max([m.get(RSS_BYTES, 0) for m in ms] + [1]),
                max([max(m.get(CUDA_RESERVED_BYTES, 0), m.get(CUDA_MAX_ALLOCATED_BYTES, 0),
                         m.get(CUDA_ALLOCATED_BYTES, 0)) for m in ms] + [1]))

    def _state_bar(self, m: dict[str, int], scale: int, bar_w: int) -> Text:
        bars, used = Text(), 0
        for key, color, _ in self.PARTS:
            n = min(round(m.get(key, 0) / scale * bar_w), bar_w - used)
            bars.append("█" * n, color)
            used += n
        bars.append("·" * (bar_w - used), "grey30")
        return bars

    @staticmethod
    def _rss_bar(rss: int | None, scale: int, bar_w: int) -> Text:
        n = min(bar_w, round((rss or 0) / scale * bar_w))
        return Text.assemble(("█" * n, "cyan"), ("·" * (bar_w - n), "grey30"))

    @staticmethod
    def _cuda_bar(m: dict[str, int], scale: int, bar_w: int) -> Text:
        alloc, peak = m.get(CUDA_ALLOCATED_BYTES, 0), m.get(CUDA_MAX_ALLOCATED_BYTES, 0)
        a = min(bar_w, round(alloc / scale * bar_w))
        r = min(bar_w, max(a, round(m.get(CUDA_RESERVED_BYTES, 0) / scale * bar_w)))
        p = min(bar_w - 1, round(peak / scale * bar_w)) if peak else -1
        cells = ["█"] * a + ["▒"] * (r - a) + ["·"] * (bar_w - r)
        styles = ["red"] * r + ["grey30"] * (bar_w - r)
        if p >= 0:
            cells[p], styles[p] = "│", "bold white"
        bar = Text()
        for c, style in zip(cells, styles):
            bar.append(c, style)
        return bar

    def lines(self, width: int) -> list[Text]:
        if not self.memory:
            return [Text("waiting for memory figures", "dim", no_wrap=True, overflow="ellipsis", end="")]
        cuda = has_cuda(self.memory)
        lines = self.legend(cuda, width)
        lines += self._compact_lines(width, cuda) if self.compact else self._detailed_lines(width, cuda)
        for line in lines:
            line.truncate(width, overflow="ellipsis")
        return lines

    def _compact_lines(self, width: int, cuda: bool) -> list[Text]:
        """One line per rank: ``rank 4 dp0 tp0 pp1 ████ 20.1M ████ 573.2M`` (the coordinates where they fit), the
        bars as wide as the width allows."""
        max_state, max_rss, max_cuda = self._scales()
        ranks = sorted(self.memory)
        label_w = len(f"rank {ranks[-1]}")
        coords = {r: self.run_layout.coordinate_text(r) for r in ranks}
        coord_w = max(len(c) for c in coords.values())
        value_w = 7  # " 573.2M"
        n_bars = 3 if cuda else 2
        with_coords = coord_w and width - label_w - coord_w - 1 - n_bars * (1 + value_w) >= n_bars * 6
        head_w = label_w + (coord_w + 1 if with_coords else 0)
        bar_w = max(2, (width - head_w - n_bars * (1 + value_w)) // n_bars)
        out = []
        for rank in ranks:
            m = self.memory[rank]
            line = Text(no_wrap=True, overflow="ellipsis", end="")
            line.append(f"{f'rank {rank}':<{label_w}}", "bold")
            if with_coords:
                line.append(f" {coords[rank]:<{coord_w}}", "dim")
            line.append(" ")
            line.append_text(self._state_bar(m, max_state, bar_w))
            line.append(f"{short_bytes(state_bytes(m)):>{value_w}}")
            line.append(" ")
            line.append_text(self._rss_bar(m.get(RSS_BYTES), max_rss, bar_w))
            line.append(f"{short_bytes(m.get(RSS_BYTES)):>{value_w}}")
            if cuda:
                line.append(" ")
                line.append_text(self._cuda_bar(m, max_cuda, bar_w))
                line.append(f"{short_bytes(m.get(CUDA_ALLOCATED_BYTES, 0)):>{value_w}}")
            out.append(line)
        return out

    def _detailed_lines(self, width: int, cuda: bool) -> list[Text]:
        """Per rank: the stacked state bar, its three byte counts, the RSS bar and, on CUDA, allocated / reserved
        / peak."""
        max_state, max_rss, max_cuda = self._scales()
        value_w = 10  # " 682.2 MiB"
        head_w = 14  # "rank 0 " + " state "
        bar_w = max(4, width - head_w - value_w)
        lines = []
        for rank in sorted(self.memory):
            m = self.memory[rank]
            line = Text(no_wrap=True, overflow="ellipsis", end="")
            line.append(f"rank {rank:<2}"[:7], "bold")
            line.append(" state ")
            line.append_text(self._state_bar(m, max_state, bar_w))
            line.append(f"{fmt_bytes(state_bytes(m)):>{value_w}}")
            lines.append(line)

            # a LoRA run: how much of params is the frozen base (at its storage bytes: NF4 under QLoRA)
            parts = [*self.PARTS[:1], *FROZEN_PART[:1 if m.get(FROZEN_PARAM_BYTES) else 0], *self.PARTS[1:]]
            detail = " · ".join(f"{label} {fmt_bytes(m[key])}" for key, _, label in parts if key in m)
            if 14 + len(detail) > width:
                detail = " ".join(f"{label[:3]} {fmt_bytes(m[key]).replace(' ', '')[:-2]}"
                                  for key, _, label in parts if key in m)
            lines.append(Text(" " * max(1, min(14, width - len(detail))) + detail, "dim", no_wrap=True,
                              overflow="ellipsis", end=""))

            line = Text(" " * 7 + " rss   ", no_wrap=True, overflow="ellipsis", end="")
            line.append_text(self._rss_bar(m.get(RSS_BYTES), max_rss, bar_w))
            line.append(f"{fmt_bytes(m.get(RSS_BYTES)):>{value_w}}")
            lines.append(line)

            if cuda:
                line = Text(" " * 7 + " cuda  ", no_wrap=True, overflow="ellipsis", end="")
                line.append_text(self._cuda_bar(m, max_cuda, bar_w))
                line.append(f"{fmt_bytes(m.get(CUDA_ALLOCATED_BYTES, 0)):>{value_w}}")
                lines.append(line)
        return lines

    def render(self) -> Text:
        return Text("\n", no_wrap=True, overflow="ellipsis", end="").join(self.lines(max(20, self.size.width)))

    def labels(self) -> list[str]:
        """The plain text of each line (for tests)."""
        return self.render().plain.splitlines()
