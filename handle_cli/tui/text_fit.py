"""Lines of a known width from pieces of styled text: :func:`fit` leaves out (or shortens) the least important
pieces of one line, :func:`wrap_pieces` breaks between pieces so that a panel knows how many lines it draws."""

from __future__ import annotations

from rich.text import Text

Piece = tuple[int, Text] | list[tuple[int, Text]]
"""A part of a line: ``(priority, text)``, or its forms from the widest down, each with the priority at
which it gives way to the next (the last form's: at which the part is left out)."""


def fit(pieces: list[Piece], width: int) -> Text:
    """Join the pieces in order; while the line is wider than ``width``, the piece whose current form has the
    highest priority number (the later one on a tie) gives way: to its next form, or, the last form, out of the
    line (priority 0: never). Whatever still overflows ends in an ellipsis."""
    kept = [list(p) if isinstance(p, list) else [p] for p in pieces]
    while len(kept) > 1 and sum(forms[0][1].cell_len for forms in kept) > width:
        worst = max(range(len(kept)), key=lambda i: (kept[i][0][0], i))
        if kept[worst][0][0] == 0:
            break
        if len(kept[worst]) > 1:
            kept[worst].pop(0)
        else:
            del kept[worst]
    line = Text(no_wrap=True, overflow="ellipsis", end="")
    for forms in kept:
        line.append_text(forms[0][1])
    line.truncate(width, overflow="ellipsis")
    return line


def wrap_pieces(pieces: list[Text], width: int) -> list[Text]:
    """``pieces`` joined into lines of at most ``width`` cells, breaking only between pieces (a piece wider than
    ``width`` gets a line of its own), so that the caller knows how many lines it draws."""
    lines: list[Text] = []
    for piece in pieces:
        if lines and lines[-1].cell_len + piece.cell_len <= width:
            lines[-1].append_text(piece)
        else:
            lines.append(Text(no_wrap=True, overflow="ellipsis", end="").append_text(piece))
    return lines
