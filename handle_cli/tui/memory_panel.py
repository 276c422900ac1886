"""The memory per rank panel."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from torch_handle.common.units import fmt_bytes
from torch_handle.observe.fields import (CUDA_ALLOCATED_BYTES, CUDA_MAX_ALLOCATED_BYTES, CUDA_RESERVED_BYTES,
                                         GRAD_BYTES, OPTIMIZER_BYTES, PARAM_BYTES, RSS_BYTES)


class MemoryBars(Widget):
    """Per-rank memory: model state (params|grads|optimizer, stacked), RSS, and CUDA when reported."""

    DEFAULT_CSS = """
    MemoryBars { height: auto; padding: 0 1; }
    """
    PARTS = ((PARAM_BYTES, "green", "params"), (GRAD_BYTES, "yellow", "grads"),
             (OPTIMIZER_BYTES, "magenta", "optim"))

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.memory: dict[int, dict[str, int]] = {}

    def set_memory(self, memory: dict[int, dict[str, int]]) -> None:
        self.memory = {r: dict(m) for r, m in memory.items()}
        self.refresh(layout=True)

    def _has_cuda(self) -> bool:
        return any(CUDA_RESERVED_BYTES in m or CUDA_ALLOCATED_BYTES in m for m in self.memory.values())

    def get_content_height(self, container, viewport, width: int) -> int:  # noqa: ANN001
        if not self.memory:
            return 1
        return 1 + len(self.memory) * (4 if self._has_cuda() else 3)

    def render(self) -> Text:
        if not self.memory:
            return Text("waiting for memory figures", "dim", no_wrap=True, overflow="ellipsis")
        width = max(20, self.size.width)
        cuda = self._has_cuda()
        legend = Text(no_wrap=True, overflow="ellipsis")
        for _, color, label in self.PARTS:
            legend.append("■ ", color)
            legend.append(label + " ")
        legend.append("■ ", "cyan")
        legend.append("rss ")
        if cuda:
            legend.append("■ ", "red")
            legend.append("cuda alloc ")
            legend.append("▒ ", "red")
            legend.append("reserved ")
            legend.append("│", "bold white")
            legend.append(" peak")
        value_w = 10  # " 682.2 MiB"
        head_w = 14  # "rank 0 " + " state "
        bar_w = max(4, width - head_w - value_w)

        def state_total(m: dict[str, int]) -> int:
            return sum(m.get(k, 0) for k, _, _ in self.PARTS)

        max_state = max([state_total(m) for m in self.memory.values()] + [1])
        max_rss = max([m.get(RSS_BYTES, 0) for m in self.memory.values()] + [1])
        max_cuda = max([max(m.get(CUDA_RESERVED_BYTES, 0), m.get(CUDA_MAX_ALLOCATED_BYTES, 0),
                            m.get(CUDA_ALLOCATED_BYTES, 0)) for m in self.memory.values()] + [1])
        lines = [legend]
        for rank in sorted(self.memory):
            m = self.memory[rank]
            # model state: stacked
            line = Text(no_wrap=True, overflow="ellipsis")
            line.append(f"rank {rank:<2}"[:7], "bold")
            line.append(" state ")
            used = 0
            bars = Text()
            for key, color, _ in self.PARTS:
                n = int(round(m.get(key, 0) / max_state * bar_w))
                n = min(n, bar_w - used)
                bars.append("█" * n, color)
                used += n
            bars.append("·" * (bar_w - used), "grey30")
            line.append_text(bars)
            line.append(f"{fmt_bytes(state_total(m)):>{value_w}}")
            lines.append(line)

            detail = " · ".join(f"{label} {fmt_bytes(m[key])}" for key, _, label in self.PARTS if key in m)
            if 14 + len(detail) > width:
                detail = " ".join(f"{label[:3]} {fmt_bytes(m[key]).replace(' ', '')[:-2]}"
                                  for key, _, label in self.PARTS if key in m)
            line = Text(" " * max(1, min(14, width - len(detail))) + detail, "dim", no_wrap=True, overflow="ellipsis")
            lines.append(line)

            rss = m.get(RSS_BYTES)
            line = Text(no_wrap=True, overflow="ellipsis")
            line.append(" " * 7)
            line.append(" rss   ")
            n = int(round((rss or 0) / max_rss * bar_w))
            line.append("█" * n, "cyan")
            line.append("·" * (bar_w - n), "grey30")
            line.append(f"{fmt_bytes(rss):>{value_w}}")
            lines.append(line)

            if cuda:
                alloc = m.get(CUDA_ALLOCATED_BYTES, 0)
                peak = m.get(CUDA_MAX_ALLOCATED_BYTES, 0)
                reserved = m.get(CUDA_RESERVED_BYTES, 0)
                a = min(bar_w, int(round(alloc / max_cuda * bar_w)))
                r = min(bar_w, max(a, int(round(reserved / max_cuda * bar_w))))
                p = min(bar_w - 1, int(round(peak / max_cuda * bar_w))) if peak else -1
                cells = ["█"] * a + ["▒"] * (r - a) + ["·"] * (bar_w - r)
                styles = ["red"] * r + ["grey30"] * (bar_w - r)
                if p >= 0:
                    cells[p], styles[p] = "│", "bold white"
                line = Text(no_wrap=True, overflow="ellipsis")
                line.append(" " * 7)
                line.append(" cuda  ")
                for c, s in zip(cells, styles):
                    line.append(c, s)
                line.append(f"{fmt_bytes(alloc):>{value_w}}")
                lines.append(line)
        return Text("\n", no_wrap=True, overflow="ellipsis", end="").join(lines)

    def labels(self) -> list[str]:
        """The plain text of each line (for tests)."""
        return self.render().plain.splitlines()
