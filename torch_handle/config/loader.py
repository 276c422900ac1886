"""Presets: TOML files composed into the typed, validated dataclasses of :mod:`torch_handle.config.schema`.

This module is the loader: TOML, ``extends``, line finding and the two entry points. The schema (one dataclass
per table, defaults, field docs) is :mod:`torch_handle.config.schema`, whose names are re-exported here; ``--set``
is :mod:`torch_handle.config.overrides`; the validation walk is :mod:`torch_handle.config.problems`.

Precedence: ``--set`` overrides > the preset file > the presets it ``extends`` > dataclass defaults.
A layer (a file or ``--set``) that switches a plugin table to another plugin ``name`` starts that table afresh:
the options inherited for the previous plugin are dropped (``--set strategy.name=ddp`` on a ZeRO preset works).
``--set`` values are typed by the field they set: a bare word is a string, and a field that takes a string
keeps the text as written (``--set run.name=2024`` is the name "2024").

Loading is two steps, each written once:

1. Compose (:func:`_compose`): read the file and its ``extends`` chain (each file once), merge them and apply
   ``--set``. A problem here (a missing file, TOML syntax, ``extends``, a malformed ``--set``) stops everything
   and is reported alone.
2. Walk (:func:`torch_handle.config.problems.walk`) the merged mapping, collecting every problem: each table
   on its own, then every check that spans tables and whose inputs are valid (the layout's, the plugins'
   ``check_preset``); one problem per key.

:func:`load_preset` raises them all (one :class:`PresetError`, or :class:`PresetErrors` for several),
:func:`preset_problems` (``handle validate``) returns them, both ordered structure first
(:func:`torch_handle.config.problems.structure_first`: the model's shape, the layout, then the details), and
:func:`preset_from_dict` walks a mapping that is already composed. Every problem's ``str()`` is one line naming
the file, the line where it could be found (:func:`_locate`: the ``--set`` or the most derived file that set the
key), the ``table.key`` and what would be valid.

This module imports neither torch nor any plugin code, so validating a preset is instant.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import sys
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from torch_handle.errors import InvalidValue, PresetError, PresetErrors
from torch_handle.registry import PluginRegistry
from torch_handle.config.overrides import Overrides, apply_overrides
from torch_handle.config.problems import structure_first, walk
from torch_handle.config.schema import (CORE_TABLES, PLUGIN_TABLES, TABLE_ORDER, LaunchConfig, PluginSection, Preset,
                                        RunConfig, TrainingConfig, field_docs, param, plugin_name)

__all__ = [
    "CORE_TABLES",
    "PLUGIN_TABLES",
    "PresetError",
    "PresetErrors",
    "InvalidValue",
    "RunConfig",
    "TrainingConfig",
    "LaunchConfig",
    "PluginSection",
    "Preset",
    "load_preset",
    "preset_problems",
    "preset_from_dict",
    "preset_to_dict",
    "dump_preset",
    "deep_merge",
    "field_docs",
    "param",
]


# --------------------------------------------------------------------------------------------------------------
# Files: TOML and extends (the ``--set`` overrides: :mod:`torch_handle.config.overrides`).
# --------------------------------------------------------------------------------------------------------------


_Layers = list[tuple[Path, dict[str, Any]]]
"""``(file, the tables that file itself sets)`` for every preset file of an ``extends`` chain, base first."""


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PresetError("no such preset file", file=path) from None
    except UnicodeDecodeError as e:
        raise PresetError(f"not UTF-8 text (undecodable byte at offset {e.start})", file=path) from None
    except OSError as e:
        raise PresetError(f"cannot read preset: {e.strerror or e}", file=path) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # tomllib's message ends with "(at line L, column C)"
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(e))
        if m:
            msg += f" (column {m.group(2)})"
        raise PresetError(f"TOML syntax error: {msg}", file=path, line=int(m.group(1)) if m else None) from None


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """A new mapping: ``base`` with ``over`` merged in, tables (dicts) merged key by key and ``over`` winning
    everywhere else. It shares no table or list with either argument, so changing it changes neither."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _merge_layer(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """:func:`deep_merge` of one preset layer over another, except that a plugin table whose ``name`` switches to
    a different plugin replaces the inherited table (its options belonged to the other plugin)."""
    switched = {table for table in PLUGIN_TABLES if isinstance(over.get(table), dict) and "name" in over[table]
                and over[table]["name"] != plugin_name(table, base.get(table))}
    return deep_merge({k: v for k, v in base.items() if k not in switched}, over)


def _available_presets() -> str:
    names = sorted(p.stem for p in Path("presets").glob("*.toml")) if Path("presets").is_dir() else []
    return f" (presets in ./presets: {', '.join(names)})" if names else ""


def resolve_preset_path(spec: str | Path, *, relative_to: Path | None = None) -> Path:
    """A preset given as a path, or as a bare name (``zero2``) looked up in ``./presets``."""
    p = Path(spec)
    if relative_to is not None and not p.is_absolute():
        p = relative_to / p
    if p.exists() or p.suffix == ".toml":
        return p
    if relative_to is None:
        candidate = Path("presets") / f"{spec}.toml"
        if candidate.exists():
            return candidate
    return p


def _top_line(path: Path, key: str) -> int | None:
    """Line of a top-level ``key = ...`` (before the first table header)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for i, line in enumerate(lines, 1):
        s = line.strip()
        if s.startswith("["):
            return None
        if re.match(rf"^{re.escape(key)}\s*=", s):
            return i
    return None


def _load_layers(path: Path, layers: _Layers, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read ``path`` and merge it over the preset it ``extends`` (recursively); ``layers`` receives
    ``(file, its own tables)`` for every file read, base first.

    Raises:
        PresetError: with the file (and the line of ``extends``): unreadable, not TOML, or a bad ``extends``.
    """
    resolved = path.resolve()
    chain = (*chain, resolved)
    data = _read_toml(path)
    parent = data.pop("extends", None)
    merged = data
    if parent is not None:
        if not isinstance(parent, str):
            raise PresetError(f"expected a file name, got {parent!r}", file=path, key="extends",
                              line=_top_line(path, "extends"))
        parent_path = resolve_preset_path(parent, relative_to=path.parent)
        tidy = Path(os.path.normpath(parent_path))
        if tidy != parent_path and tidy.resolve() == parent_path.resolve():
            parent_path = tidy  # `sub/../base.toml` reads as `base.toml` in messages
        if parent_path.resolve() in chain:
            cycle = " -> ".join(p.name for p in (*chain, parent_path.resolve()))
            raise PresetError(f"extends cycle: {cycle}", file=path, key="extends", line=_top_line(path, "extends"))
        if not parent_path.is_file():
            what = "is not a file" if parent_path.exists() else "does not exist"
            raise PresetError(f"extends target {parent!r} {what} (looked for {parent_path}, relative to this file)",
                              file=path, key="extends", line=_top_line(path, "extends"))
        merged = _merge_layer(_load_layers(parent_path, layers, chain), data)
    layers.append((path, data))
    return merged


def _key_pattern(key: str) -> str:
    return rf"""^(?:{re.escape(key)}|"{re.escape(key)}"|'{re.escape(key)}')\s*[=.]"""


def _find_line(path: Path, table: str, key: str | None) -> int | None:
    """Best-effort line number of ``[table] key`` in a TOML file (tomllib does not keep positions); the line of
    the ``[table]`` header when the key is not there."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    current = ""
    table_line = None
    for i, line in enumerate(lines, 1):
        s = line.strip()
        m = re.match(r"^\[\s*([^\]]+?)\s*\]", s)
        if m:
            current = re.sub(r"\s*\.\s*", ".", m.group(1))
            if current == table and table_line is None:
                table_line = i
            if key and (current == f"{table}.{key}" or current.startswith(f"{table}.{key}.")):
                return i
            continue
        if key and current == table and re.match(_key_pattern(key), s):
            return i
        if not current and re.match(_key_pattern(f"{table}.{key}" if key else table), s):
            return i
    return table_line


def _has_key(data: dict[str, Any], dotted: str) -> bool:
    node: Any = data
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return False
        node = node[k]
    return True


def _locate(err: PresetError, layers: _Layers, overrides: Overrides) -> None:
    """Fill in the file (and line) of an error raised without one: the ``--set`` that gave the value, else the
    most derived preset file that holds the key, else the preset that was loaded."""
    top = layers[-1][0]
    if not err.key:
        err.file = top
        return
    for keys, _ in overrides:
        dotted = ".".join(keys)
        if dotted == err.key or dotted.startswith(err.key + ".") or err.key.startswith(dotted + "."):
            err.file = f"{top} (--set)"
            return
    table, _, key = err.key.partition(".")
    for path, data in reversed(layers):
        if _has_key(data, err.key):
            err.file, err.line = path, _find_line(path, table, key.split(".")[0] or None)
            return
    err.file, err.line = top, _find_line(top, table, None)


# --------------------------------------------------------------------------------------------------------------
# The walk: compose once, validate every table, collect every problem.
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Composed:
    """A preset file with its ``extends`` chain merged and its ``--set`` overrides applied: what the walk checks."""

    path: Path
    data: dict[str, Any]
    """The merged mapping."""
    layers: _Layers
    overrides: Overrides

    def locate(self, err: PresetError) -> PresetError:
        """``err``, given the file and line that set its key when it has no file yet (see :func:`_locate`)."""
        if err.file is None:
            _locate(err, self.layers, self.overrides)
        return err


def _compose(path: str | Path, overrides: typing.Sequence[str], registry: PluginRegistry | None) -> _Composed:
    """Read a preset file (a path, or a name in ``./presets``) and its ``extends`` chain, and apply ``--set``.

    Raises:
        PresetError: a problem of the file itself (missing, unreadable, TOML syntax, ``extends``) or a malformed
            ``--set``: nothing can be validated past it, so it is always reported alone.
    """
    path = resolve_preset_path(path)
    if not path.exists():
        hint = _available_presets() if path.parent in (Path("."), Path("presets")) else ""
        raise PresetError(f"no such preset file{hint}", file=path)
    if not path.is_file():
        raise PresetError("not a preset file (a directory?)", file=path)
    layers: _Layers = []
    data = _load_layers(path, layers)
    return _Composed(path, data, layers, apply_overrides(data, overrides, registry, path))


def _raise_all(problems: list[PresetError]) -> None:
    if len(problems) == 1:
        raise problems[0]
    raise PresetErrors(problems)


def preset_from_dict(data: dict[str, Any], registry: PluginRegistry | None = None, *, source: str = "<preset>"
                     ) -> Preset:
    """Validate a merged preset mapping into a :class:`Preset` (the walk of :func:`load_preset`, without files).

    ``registry`` is the plugin registry (the process-wide one when None); plugin tables are validated against
    the dataclass of the plugin their ``name`` picks.

    Raises:
        PresetError: every problem found, structure first (:class:`PresetErrors` for several), without file or
            line (:func:`load_preset` adds those).
    """
    preset, problems = walk(data, registry, source)
    if problems:
        _raise_all(structure_first(problems))
    return preset


def load_preset(path: str | Path, overrides: typing.Sequence[str] = (), registry: PluginRegistry | None = None
                ) -> Preset:
    """Load a preset file, apply ``extends`` and ``--set`` overrides, and validate it.

    Raises:
        PresetError: the one problem, or :class:`PresetErrors` with every problem, structure first (see
            :func:`preset_problems`), each one line naming the file, the line (when it can be found), the key and
            what is valid. A problem of the file itself is always alone.
    """
    preset, problems = preset_problems(path, overrides, registry)
    if problems:
        _raise_all(problems)
    return preset


def preset_problems(path: str | Path, overrides: typing.Sequence[str] = (), registry: PluginRegistry | None = None,
                    *, then: Callable[[Preset], Iterable[PresetError]] | None = None
                    ) -> tuple[Preset | None, list[PresetError]]:
    """:func:`load_preset`, returning every problem instead of raising: ``(preset, [])`` when it is valid, else
    ``(None, problems)`` ordered structure first (:func:`torch_handle.config.problems.structure_first`: level,
    table, line).

    The file is read once. A problem of the file itself (missing, TOML syntax, ``extends``, a malformed
    ``--set``) is reported alone. Raises nothing for a preset problem. ``then``: a further check of a valid
    preset (``handle validate --target hf``'s), whose problems (keyed ``table.key``) are located and ordered the
    same way.
    """
    try:
        composed = _compose(path, overrides, registry)
    except PresetError as e:
        return None, [e]
    preset, problems = walk(composed.data, registry, str(composed.path))
    if preset is not None and then is not None:
        problems = list(then(preset))
        preset = None if problems else preset
    return preset, structure_first(composed.locate(e) for e in problems)


# --------------------------------------------------------------------------------------------------------------
# Output: the resolved preset as TOML.
# --------------------------------------------------------------------------------------------------------------


def preset_to_dict(preset: Preset) -> dict[str, Any]:
    """The fully resolved preset as a TOML-ready mapping (every key, defaults included)."""
    out: dict[str, Any] = {}
    for table in TABLE_ORDER:
        section = getattr(preset, table)
        if isinstance(section, PluginSection):
            out[table] = {"name": section.name, **_drop_none(dataclasses.asdict(section.options))}
        else:
            out[table] = _drop_none(dataclasses.asdict(section))
    return out


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    # TOML has no null: an unset optional is simply left out, and reads back as its default (None).
    return {k: (_drop_none(v) if isinstance(v, dict) else v) for k, v in d.items() if v is not None}


def dump_preset(preset: Preset) -> str:
    """The fully resolved preset as TOML text; ``load_preset`` of this text gives back an equal preset."""
    import tomli_w

    return tomli_w.dumps(preset_to_dict(preset))


def preset_description(path: Path) -> str:
    """The description of a preset file: its leading comment block (the comment lines before anything else, blank
    lines before it skipped), joined into one paragraph; "" when the file has none or cannot be read."""
    lines: list[str] = []
    try:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.startswith("#"):
                lines.append(line.lstrip("#").strip())
            elif line.strip() or lines:
                break
    except OSError:
        return ""
    return " ".join(" ".join(lines).split())
