"""Presets: TOML files composed into the typed, validated dataclasses of :mod:`torch_handle.config.schema`.

This module is the loader: TOML, ``extends``, the validation walk and line finding. The schema (one dataclass per
table, defaults, field docs) is :mod:`torch_handle.config.schema`, whose names are re-exported here; ``--set`` is
:mod:`torch_handle.config.overrides`.

Precedence: ``--set`` overrides > the preset file > the presets it ``extends`` > dataclass defaults.
A layer (a file or ``--set``) that switches a plugin table to another plugin ``name`` starts that table afresh:
the options inherited for the previous plugin are dropped (``--set strategy.name=ddp`` on a ZeRO preset works).
``--set`` values are typed by the field they set: a bare word is a string, and a field that takes a string
keeps the text as written (``--set run.name=2024`` is the name "2024").

Loading is two steps, each written once:

1. Compose (:func:`_compose`): read the file and its ``extends`` chain (each file once), merge them and apply
   ``--set``. A problem here (a missing file, TOML syntax, ``extends``, a malformed ``--set``) stops everything
   and is reported alone.
2. Walk (:func:`_walk`) the merged mapping, collecting every problem: unknown tables; then each core table
   (run, training, launch) and each plugin table (model, data, strategy, profiler; its ``name`` looked up in
   the registry first) through :func:`_section`, which lists every unknown key, wrong type and out-of-range
   value, then the missing keys, and only for a table without any of those builds the dataclass and runs its
   ``check()``; last, only when every table is valid, the plugins' cross-table ``check_preset`` hooks (the
   first problem there is the only one).

:func:`load_preset` raises the first problem of the walk, :func:`preset_problems` (``handle validate``) returns
them all, sorted by table and line, and :func:`preset_from_dict` walks a mapping that is already composed.
Every problem is a :class:`PresetError`, whose ``str()`` is one line naming the file, the line where it could
be found (:func:`_locate`: the ``--set`` or the most derived file that set the key), the ``table.key`` and what
would be valid.

This module imports neither torch nor any plugin code, so validating a preset is instant.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from torch_handle.errors import InvalidValue, PresetError
from torch_handle.registry import PluginRegistry, Registration, get_registry
from torch_handle.config.layout import check_parallel
from torch_handle.config.overrides import Overrides, apply_overrides
from torch_handle.config.schema import (CORE_TABLES, DEFAULT_PLUGINS, PLUGIN_TABLES, TABLE_ORDER, LaunchConfig,
                                        PluginSection, Preset, RunConfig, TrainingConfig, field_docs, param,
                                        plugin_name)
from torch_handle.config.tp_impl import resolve_tp_impl

__all__ = [
    "PresetError",
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
# Typed coercion of TOML values against dataclass annotations.
# --------------------------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return getattr(origin, "__name__", str(tp))
    return {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
            "dict": "a table", "list": "a list", "NoneType": "none"}.get(getattr(tp, "__name__", ""), str(tp))


def _coerce(value: Any, tp: Any) -> Any:
    """Return ``value`` converted to annotation ``tp`` or raise ``TypeError``/``ValueError`` saying what is valid."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices and type(value) is type(choices[0]):
            return value
        raise ValueError(f"{value!r} is not one of {', '.join(repr(c) for c in choices)}")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        raise TypeError(f"expected {_type_name(tp)}, got {value!r}")
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"{value!r} is not a finite number")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is dict or tp is dict:
        if isinstance(value, dict):
            return dict(value)
    elif origin is list or tp is list:
        if isinstance(value, list):
            (item_tp,) = typing.get_args(tp) or (Any,)
            return [_coerce(v, item_tp) for v in value]
    else:  # pragma: no cover - a plugin used an annotation we do not support
        raise TypeError(f"unsupported field type {tp!r}")
    raise TypeError(f"expected {_type_name(tp)}, got {value!r}")


def _check_range(name: str, value: Any, metadata: typing.Mapping[str, Any]) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if "ge" in metadata and value < metadata["ge"]:
        raise InvalidValue(name, f"{value!r} must be >= {metadata['ge']}")
    if "gt" in metadata and value <= metadata["gt"]:
        raise InvalidValue(name, f"{value!r} must be > {metadata['gt']}")
    if "le" in metadata and value > metadata["le"]:
        raise InvalidValue(name, f"{value!r} must be <= {metadata['le']}")
    if "lt" in metadata and value >= metadata["lt"]:
        raise InvalidValue(name, f"{value!r} must be < {metadata['lt']}")


def _suggest(key: str, valid: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _section(cls: type, table: str, values: dict[str, Any], allowed_extra: tuple[str, ...] = ()
             ) -> tuple[Any, list[PresetError]]:
    """Check one table against dataclass ``cls``: ``(instance, [])`` when it is valid, else ``(None, problems)``.

    The problems are every key-level one, in the table's order (an unknown key, a wrong type, an out-of-range
    value), then the missing required keys; only a table without any of those is built and its ``check()`` run,
    whose ``InvalidValue`` is then the one problem. Each is a :class:`PresetError` keyed ``table.key``, without a
    file (the caller locates it). ``allowed_extra`` keys (a plugin table's ``name``) are skipped.

    Raises:
        Exception: whatever building ``cls`` or its ``check()`` raises besides ``InvalidValue`` (a bug, not a
            preset problem; the walk names the plugin).
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    problems: list[PresetError] = []
    for key, value in values.items():
        if key in allowed_extra:
            continue
        if key not in fields:
            valid = sorted({*fields, *allowed_extra})
            problems.append(PresetError(f"unknown key{_suggest(key, valid)} (valid: {', '.join(valid)})",
                                        key=f"{table}.{key}"))
            continue
        try:
            kwargs[key] = _coerce(value, hints[key])
            _check_range(key, kwargs[key], fields[key].metadata)
        except InvalidValue as e:
            problems.append(PresetError(e.message, key=f"{table}.{key}"))
        except (TypeError, ValueError) as e:
            problems.append(PresetError(str(e), key=f"{table}.{key}"))
    missing = [n for n, f in fields.items() if (n not in values or n in allowed_extra)
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        problems.append(PresetError(f"missing required key(s): {', '.join(missing)}", key=table))
    if problems:
        return None, problems
    try:
        obj = cls(**kwargs)
        check = getattr(obj, "check", None)
        if check is not None:
            check()
    except InvalidValue as e:
        return None, [PresetError(e.message, key=f"{table}.{e.key}")]
    return obj, []


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


def _plugin_bug(table: str, registration: Registration, e: Exception) -> PresetError:
    """A plugin's check that raised something other than ``InvalidValue``: still one line, naming the plugin."""
    text = " ".join(str(e).split())
    return PresetError(f"the check of {registration.kind} {registration.name!r} (plugin {registration.plugin!r}) "
                       f"failed: {type(e).__name__}: {text}", key=f"{table}.name")


def _walk(data: dict[str, Any], registry: PluginRegistry | None, source: str
          ) -> tuple[Preset | None, list[PresetError]]:
    """Validate a merged preset mapping: ``(preset, [])``, or ``(None, every problem)`` in the order found.

    The order is that of the first problem :func:`load_preset` reports: unknown tables; the core tables (run,
    training, launch), then the plugin tables (model, data, strategy, profiler; the plugin ``name`` is looked up
    first), each table's problems as :func:`_section` gives them; last, only when every table is valid, the
    cross-table ``check_preset`` hooks, of which the first problem is the only one (later hooks may rely on
    what earlier ones check). The problems carry no file yet. ``registry``: the process-wide one when None.
    """
    if registry is None:
        registry = get_registry()
    valid_tables = list(TABLE_ORDER)
    problems = [PresetError(f"unknown table{_suggest(key, valid_tables)} (valid: {', '.join(valid_tables)}, extends)",
                            key=key) for key in data if key not in CORE_TABLES and key not in PLUGIN_TABLES]
    sections: dict[str, Any] = {}
    registrations: dict[str, Registration] = {}
    for table in (*CORE_TABLES, *PLUGIN_TABLES):
        values = data.get(table, {})
        if not isinstance(values, dict):
            problems.append(PresetError("expected a table", key=table))
            continue
        if table in CORE_TABLES:
            section, found = _section(CORE_TABLES[table], table, values)
        else:
            name = values.get("name", DEFAULT_PLUGINS[table])
            if not isinstance(name, str):
                problems.append(PresetError(f"expected a plugin name, got {name!r}", key=f"{table}.name"))
                continue
            try:
                registrations[table] = registration = registry.get(PLUGIN_TABLES[table], name, key=f"{table}.name")
            except PresetError as e:
                problems.append(e)
                continue
            try:
                options, found = _section(registration.config_cls, table, values, ("name",))
            except Exception as e:  # noqa: BLE001 - a bug in a plugin's config is one problem, naming the plugin
                options, found = None, [_plugin_bug(table, registration, e)]
            section = None if options is None else PluginSection(name=name, options=options)
        problems += found
        if section is not None:
            sections[table] = section
    if problems:
        return None, problems
    preset = Preset(**sections, source=source)
    resolve_tp_impl(preset)  # "auto" becomes the implementation the layout runs, before every check of it
    layout_problem = check_parallel(preset, registry)
    if layout_problem is not None:
        return None, [layout_problem]
    for table, registration in registrations.items():
        if registration.check_preset is None:
            continue
        try:
            registration.check_preset(sections[table].options, preset)
        except InvalidValue as e:
            return None, [PresetError(e.message, key=e.key if "." in e.key else f"{table}.{e.key}")]
        except Exception as e:  # noqa: BLE001 - a bug in a plugin's check is still one line, naming the plugin
            return None, [_plugin_bug(table, registration, e)]
    return preset, []


def preset_from_dict(data: dict[str, Any], registry: PluginRegistry | None = None, *, source: str = "<preset>"
                     ) -> Preset:
    """Validate a merged preset mapping into a :class:`Preset` (the walk of :func:`load_preset`, without files).

    ``registry`` is the plugin registry (the process-wide one when None); plugin tables are validated against
    the dataclass of the plugin their ``name`` picks.

    Raises:
        PresetError: the first problem found, without file or line (:func:`load_preset` adds those).
    """
    preset, problems = _walk(data, registry, source)
    if problems:
        raise problems[0]
    return preset


def load_preset(path: str | Path, overrides: typing.Sequence[str] = (), registry: PluginRegistry | None = None
                ) -> Preset:
    """Load a preset file, apply ``extends`` and ``--set`` overrides, and validate it.

    Raises:
        PresetError: the first problem (see :func:`_walk` for the order), one line naming the file, the line
            (when it can be found), the key and what is valid.
    """
    composed = _compose(path, overrides, registry)
    preset, problems = _walk(composed.data, registry, str(composed.path))
    if problems:
        raise composed.locate(problems[0])
    return preset


def preset_problems(path: str | Path, overrides: typing.Sequence[str] = (), registry: PluginRegistry | None = None
                    ) -> tuple[Preset | None, list[PresetError]]:
    """:func:`load_preset`, but reporting every problem at once: ``(preset, [])`` when it is valid, else
    ``(None, problems)`` sorted by table (in :data:`TABLE_ORDER`, unknown tables first), then by line.

    The file is read once. A problem of the file itself (missing, TOML syntax, ``extends``, a malformed
    ``--set``) is reported alone, and so is that of a check that spans tables (those run only once every table
    is valid). The first problem :func:`load_preset` raises is always in the list, not always first.
    Raises nothing for a preset problem.
    """
    try:
        composed = _compose(path, overrides, registry)
    except PresetError as e:
        return None, [e]
    preset, problems = _walk(composed.data, registry, str(composed.path))
    tables = {t: i for i, t in enumerate(TABLE_ORDER)}
    located = [composed.locate(e) for e in problems]
    return preset, sorted(located, key=lambda e: (tables.get((e.key or "").split(".")[0], -1), e.line or 10**9))


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
