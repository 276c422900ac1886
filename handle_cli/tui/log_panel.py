"""The log panel: rank 0's log, failing ranks' logs and the events' notices."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.widgets import RichLog

from torch_handle.common.text import clean
from torch_handle.observe.fields import Level
from torch_handle.observe.state import Notice

LEVEL_STYLES = {Level.ERROR: "bold red", Level.WARNING: "yellow", Level.INFO: "cyan"}
SOURCE_STYLES = ["green", "cyan", "magenta", "yellow", "blue", "bright_green", "bright_cyan", "bright_magenta"]


def source_tag(source: str) -> tuple[str, str]:
    if source.startswith("rank"):
        n = int(source[4:]) if source[4:].isdigit() else 0
        return f"r{n}", SOURCE_STYLES[n % len(SOURCE_STYLES)]
    if source == "launcher":
        return "ln", "blue"
    return source[:3], "white"


class LogPanel(RichLog):
    """Rank 0's log, failing ranks' logs, warnings from the events and skipped bad lines, newest last.

    Lines are kept as records and wrapped (with a hanging indent under the source tag) at the panel's width;
    when the width changes (terminal resized, ``l`` expands the panel) the kept records are wrapped again.
    Nothing is written before the width is known, so what shows never depends on timing.
    """

    DEFAULT_CSS = """
    LogPanel { border: round $primary 50%; border-title-color: $text; border-title-style: bold;
               scrollbar-gutter: stable; overflow-x: hidden; }
    LogPanel:focus { border: round $accent; }
    """
    KEEP = 500

    def __init__(self, *, id: str | None = None):
        super().__init__(max_lines=4 * self.KEEP, wrap=True, markup=False, highlight=False, min_width=20, id=id)
        self.border_title = "logs"
        self.records: deque[tuple[str, str, str, str]] = deque(maxlen=self.KEEP)
        """(tag, tag style, text, text style) of the newest lines."""
        self._rendered_width = 0

    @property
    def plain_lines(self) -> list[str]:
        """The kept lines as plain text, newest last (for tests)."""
        return [f"{tag:>2} {text}" for tag, _, text, _ in self.records]

    def reset(self) -> None:
        self.records.clear()
        self.clear()

    def _width(self) -> int:
        return self.scrollable_content_region.width if self._size_known else 0

    def _render_record(self, record: tuple[str, str, str, str], width: int) -> None:
        tag, tag_style, text, style = record
        body = Text(text, style).wrap(self.app.console, max(8, width - 3), overflow="fold")
        lines = [Text.assemble((f"{tag:>2}" if i == 0 else "  ", tag_style), " ", line) for i, line in enumerate(body)]
        self.write(Text("\n", end="").join(lines or [Text(f"{tag:>2}", tag_style)]), width=width)

    def on_resize(self, event) -> None:  # noqa: ANN001 - runs before RichLog's own handler
        if event.size.width:
            self._size_known = True
        width = self._width()
        if width and width != self._rendered_width:
            self._rendered_width = width
            self.clear()
            for record in self.records:
                self._render_record(record, width)

    def add(self, tag: str, tag_style: str, text: str, style: str = "") -> None:
        record = (tag, tag_style, clean(text), style)
        self.records.append(record)
        width = self._width()
        if width:
            if width != self._rendered_width:  # pragma: no cover - resized without a Resize event yet
                self._rendered_width = width
                self.clear()
                for r in self.records:
                    self._render_record(r, width)
            else:
                self._render_record(record, width)

    def add_log(self, source: str, text: str, error: bool) -> None:
        tag, style = source_tag(source)
        self.add(tag, style, text, "red" if error else "")

    def add_notice(self, notice: Notice) -> None:
        self.add("ev", LEVEL_STYLES.get(notice.level, ""), notice.text, LEVEL_STYLES.get(notice.level, ""))
