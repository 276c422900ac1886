"""Byte sizes, read and written one way everywhere. Standard library only.

The convention (IEC 80000-13): ``kB``/``KB``, ``MB``, ``GB``, ``TB`` are powers of 1000; ``KiB``, ``MiB``, ``GiB``,
``TiB`` powers of 1024; a bare ``K``, ``M``, ``G``, ``T`` is binary, as nccl-tests' ``-b``/``-e`` sizes are. Units
are case-insensitive, so ``1GB`` is 10^9 bytes and ``1GiB``/``1G`` 2^30 wherever a size is parsed
(``handle estimate --device-memory``, ``handle bench comm --sizes``).

Two ways of writing a size, for two purposes:

* :func:`fmt_bytes`, for people: rounded, in the largest binary unit it reaches (``"36.6 MiB"``);
* :func:`size_label`, for message sizes: exact and short (``"64M"``), the spelling ``--sizes`` takes back.
"""

from __future__ import annotations

import re

UNITS = {"": 1, "b": 1,
         "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
         "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
"""Bytes per unit, by lower-case name."""

_BINARY = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*")
_WHOLE = re.compile(r"\s*[0-9]+\s*[A-Za-z]*\s*")


def parse_bytes(text: str, *, whole: bool = False) -> int:
    """``"80GiB"`` -> 85899345920, ``"24GB"`` -> 24000000000, ``"64M"`` -> 67108864, ``"1e9"`` -> 1000000000.

    ``whole``: the number must be an integer (``"1.5M"`` and ``"1e6"`` are refused), as for message sizes.

    Raises:
        ValueError: not a size in the units of :data:`UNITS`, or not positive.
    """
    m = _SIZE.fullmatch(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in UNITS or (whole and not _WHOLE.fullmatch(str(text))):
        raise ValueError(f"{str(text).strip()!r} is not a size (examples: 4096, 64K, 80GiB, 24GB)")
    value = int(m.group(1)) * UNITS[unit] if whole else int(float(m.group(1)) * UNITS[unit])
    if value <= 0:
        raise ValueError(f"{str(text).strip()!r}: a size must be positive")
    return value


def fmt_bytes(n: float | None, *, precise: bool = False) -> str:
    """``n`` bytes in the largest binary unit it reaches: ``1536`` -> ``"1.5 KiB"``, ``None`` -> ``"-"``.

    One decimal by default, as the dashboard's fixed-width columns and the run summary show it. ``precise``:
    two decimals below 100 of the unit and none above (``"8.03 MiB"``, ``"103 MiB"``), for ``handle estimate``'s
    tables, whose rows are compared with each other and with the telemetry.
    """
    if n is None:
        return "-"
    n = float(n)
    for unit, size in _BINARY:
        if abs(n) >= size:
            value = n / size
            if not precise:
                return f"{value:.1f} {unit}"
            return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"
    return f"{n:.0f} B"


def size_label(n: int) -> str:
    """``1024`` -> ``"1K"``, ``3 << 20`` -> ``"3M"``, ``1000`` -> ``"1000"``: exact binary multiples only, so that
    :func:`parse_bytes` reads the label back to ``n`` (message sizes in ``handle bench comm``'s table and plot)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)
