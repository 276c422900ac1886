"""Text that reaches a terminal: sanitising untrusted strings and formatting figures. Standard library only.

Event messages, log lines and run names come from files a run (or anyone) wrote; :func:`clean` is applied to all
of them before they are shown, by ``handle run``'s progress line and summary and by the dashboard alike.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from typing import Any


_ANSI = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI (colours, cursor moves, ...)
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC (titles, hyperlinks)
    r"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"  # DCS, SOS, PM, APC strings
    r"|\x1b[@-Z\\-_]?"  # any other escape (and a lone ESC)
    r"|\x9b[0-?]*[ -/]*[@-~]"  # 8-bit CSI
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(text: Any, limit: int = 2000) -> str:
    """``text`` made safe to show: no escape sequences or control characters, one line, at most ``limit`` chars.

    A carriage return keeps what a terminal would show (the text after the last one), tabs become spaces.
    The result still has to be shown as plain text (``rich.text.Text``), never parsed as markup.
    """
    s = text if isinstance(text, str) else str(text)
    s = _ANSI.sub("", s)
    if "\r" in s:
        parts = [p for p in s.split("\r") if p.strip()]
        s = parts[-1] if parts else ""
    s = s.replace("\t", "    ").replace("\n", " ")
    s = _CONTROL.sub("", s)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def one_line(e: BaseException) -> str:
    """An exception as ``Type: message`` on one line (whitespace collapsed); just ``Type`` without a message."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "--:--"
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def fmt_float(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}f}"


def fmt_time(t: Any) -> str:
    """A unix time as ``YYYY-MM-DD HH:MM`` in UTC (the zone run directory names use; deterministic in tests)."""
    try:
        return datetime.fromtimestamp(float(t), timezone.utc).strftime("%Y-%m-%d %H:%M")
    except (TypeError, ValueError, OverflowError, OSError):
        return "-"


def strategy_label(strategy: Any, zero_stage: Any) -> str:
    """``deepspeed ZeRO-2`` (``zero_stage`` None or empty: the name alone; no ``strategy``: ``-``), both cleaned."""
    if not strategy:
        return "-"
    label = clean(strategy, 40)
    if zero_stage is not None and zero_stage != "":
        label += f" ZeRO-{clean(zero_stage, 8)}"
    return label



FINETUNE_NAMES = {"lora": "LoRA", "qlora": "QLoRA"}
"""How a ``finetune.method`` reads in every view (the method's own name: QLoRA is LoRA on an NF4 base)."""


def finetune_label(table: Any) -> str | None:
    """``QLoRA r8 (NF4 base)``, ``LoRA r8``: a ``[finetune]`` table (a mapping: preset.toml's, or run.json's
    ``finetune`` record) as the summary and the dashboard name it; None for ``method = "none"``, no table, or
    values that are not a method's."""
    if not isinstance(table, dict) or table.get("method") not in FINETUNE_NAMES:
        return None
    rank = table.get("rank")
    label = FINETUNE_NAMES[table["method"]]
    if isinstance(rank, int) and not isinstance(rank, bool):
        label += f" r{rank}"
    return label + (" (NF4 base)" if table["method"] == "qlora" else "")
