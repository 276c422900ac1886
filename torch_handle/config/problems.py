"""The validation walk: every problem of a composed preset mapping at once, in the order to fix them.

A preset is checked in two rounds, and every problem of both is reported:

1. Each table on its own (:func:`_section`): every unknown key, wrong type and out-of-range value, the missing
   keys, then the table's ``check()`` (a generator yields every problem; a plain ``check()`` raises its first).
2. The checks that span tables: the ``[parallel]`` layout's (:data:`torch_handle.config.layout.LAYOUT_CHECKS`)
   and each plugin's ``check_preset`` hook. They run on the preset *as far as it is valid*: a table with
   problems still takes part, but a key with a problem of its own (and every key of a table that could not be
   read, or whose plugin is unknown) raises :class:`Unavailable` when a check reads it, which ends that check
   only, keeping what it yielded before. So a check runs whenever its inputs are valid, and no check reports a
   consequence of a value that is already reported. A hook may ``yield`` each of its problems (every one is
   reported) or raise the first (:class:`~torch_handle.errors.InvalidValue`); a plugin may register a tuple of
   hooks, each run on its own.

:func:`structure_first` orders the problems for reading: :class:`Tier`
(the model's shape, then the layout, then the details), then the table (:data:`TABLE_ORDER`), then the line.

Standard library only (no torch, no plugin code beyond the plugins' config classes and checks).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal

from torch_handle.config.layout import LAYOUT_CHECKS
from torch_handle.config.schema import CORE_TABLES, DEFAULT_PLUGINS, PLUGIN_TABLES, TABLE_ORDER, PluginSection, Preset
from torch_handle.config.tp_impl import resolve_tp_impl
from torch_handle.errors import InvalidValue, PresetError
from torch_handle.registry import PluginRegistry, Registration, get_registry


# --------------------------------------------------------------------------------------------------------------
# The order: structure first.
# --------------------------------------------------------------------------------------------------------------


class Tier(enum.IntEnum):
    """How fundamental a problem is: fix the lower ones first (a detail may change once the structure does)."""

    FILE = 0
    """An unknown table (the file's own structure)."""
    MODEL = 1
    """The model's shape: ``[model]`` (its plugin, kind, widths, heads, layers)."""
    LAYOUT = 2
    """How the model is split over ranks: ``[parallel]`` (but ``pp_microbatches``), the world size
    (``launch.nproc_per_node``, ``launch.nnodes``) and which strategy (``strategy.name``)."""
    DETAIL = 3
    """The rest: data, training, strategy options, micro-batches, precision, the run, the profiler."""


_LAYOUT_KEYS = frozenset({"launch.nproc_per_node", "launch.nnodes", "strategy.name"})
_DETAIL_KEYS = frozenset({"parallel.pp_microbatches"})


def tier(key: str | None) -> Tier:
    """The :class:`Tier` of a problem of ``key`` (``table.key``, a table, or None for the file itself)."""
    table = (key or "").split(".")[0]
    if table not in TABLE_ORDER:
        return Tier.FILE
    if table == "model":
        return Tier.MODEL
    if key in _LAYOUT_KEYS or (table == "parallel" and key not in _DETAIL_KEYS):
        return Tier.LAYOUT
    return Tier.DETAIL


def structure_first(problems: Iterable[PresetError]) -> list[PresetError]:
    """``problems`` by :class:`Tier`, then table (:data:`TABLE_ORDER`; unknown tables first), then line; the
    walk's order among equals."""
    tables = {t: i for i, t in enumerate(TABLE_ORDER)}
    return sorted(problems, key=lambda e: (tier(e.key), tables.get((e.key or "").split(".")[0], -1),
                                           e.line or 10**9))


# --------------------------------------------------------------------------------------------------------------
# Values with a problem of their own, as the cross-table checks see them.
# --------------------------------------------------------------------------------------------------------------


class Unavailable(Exception):
    """Raised inside a cross-table check that reads a value with a problem of its own: that check ends there.
    Not an ``AttributeError``, so ``getattr(options, "x", default)`` does not turn it into the default."""


class _Missing:
    """A table that could not be read (not a table, or its plugin is unknown): every attribute is unavailable."""

    def __init__(self, table: str):
        object.__setattr__(self, "_table", table)

    def __getattribute__(self, name: str) -> Any:
        raise Unavailable(object.__getattribute__(self, "_table"))


@functools.cache
def _guarded_class(cls: type) -> type:
    """A subclass of dataclass ``cls`` whose instances raise :class:`Unavailable` for the fields named in their
    ``_unavailable`` (class attributes, methods and properties are ``cls``'s)."""

    def __getattribute__(self: Any, name: str) -> Any:
        if name in object.__getattribute__(self, "_unavailable"):
            raise Unavailable(name)
        return super(guarded, self).__getattribute__(name)

    guarded = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return guarded


def _partial(cls: type, values: dict[str, Any], unavailable: set[str]) -> Any:
    """An instance of ``cls`` (guarded) with ``values``, the defaults elsewhere, and the fields ``unavailable``
    (and the required ones without a value) raising :class:`Unavailable`; its ``__init__`` and ``check()`` are
    not run."""
    obj = object.__new__(_guarded_class(cls))
    missing = set(unavailable)
    for f in dataclasses.fields(cls):
        if f.name in values and f.name not in unavailable:
            object.__setattr__(obj, f.name, values[f.name])
        elif f.default is not dataclasses.MISSING:
            object.__setattr__(obj, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            object.__setattr__(obj, f.name, f.default_factory())
        else:
            missing.add(f.name)
    object.__setattr__(obj, "_unavailable", frozenset(missing))
    return obj


def collect(check: Callable[[], Any]) -> list[Any]:
    """Run one check: every problem it yields (a generator, or any iterable it returns) and the one it raises
    (``InvalidValue`` or ``PresetError``), in order. :class:`Unavailable` ends it quietly; anything else
    propagates (a bug of the check)."""
    found: list[Any] = []
    try:
        result = check()
        for problem in result if result is not None else ():
            found.append(problem)  # one at a time: what a generator yielded before it ends stays
    except (InvalidValue, PresetError) as e:
        found.append(e)
    except Unavailable:
        pass
    return found


def _keyed(problem: Any, table: str | None) -> PresetError:
    """A problem as a :class:`PresetError` keyed ``table.key`` (an ``InvalidValue`` of a bare key is the
    table's own; a dotted one names another table)."""
    if isinstance(problem, PresetError):
        return problem
    if isinstance(problem, InvalidValue):
        key = problem.key if "." in problem.key or table is None else f"{table}.{problem.key}"
        return PresetError(problem.message, key=key)
    raise TypeError(f"a check yielded {problem!r}, not an InvalidValue")


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
    """Check one table against dataclass ``cls``: ``(instance, [])`` when it is valid, else ``(partial,
    problems)``.

    The problems are every key-level one, in the table's order (an unknown key, a wrong type, an out-of-range
    value), then the missing required keys, then what the table's ``check()`` finds: every problem a generator
    ``check()`` yields, or the one a plain ``check()`` raises. With key-level problems ``check()`` runs on the
    partial table and ends where it reads a key that has one. Each is a :class:`PresetError` keyed
    ``table.key``, without a file (the caller locates it). ``allowed_extra`` keys (a plugin table's ``name``)
    are skipped. ``partial`` is what the cross-table checks read: the valid values, the defaults, and each key
    with a problem :class:`Unavailable`.

    Raises:
        Exception: whatever building ``cls`` or the ``check()`` of an otherwise valid table raises besides
            ``InvalidValue`` (a bug, not a preset problem; the walk names the plugin).
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
        if dataclasses.is_dataclass(hints[key]):  # a nested table, [table.key]
            if not isinstance(value, dict):
                problems.append(PresetError(f"expected a table [{table}.{key}], got {value!r}", key=f"{table}.{key}"))
                continue
            nested, found = _section(hints[key], f"{table}.{key}", value)
            problems += found
            if not found:
                kwargs[key] = nested
            continue
        try:
            coerced = _coerce(value, hints[key])
            _check_range(key, coerced, fields[key].metadata)
            kwargs[key] = coerced
        except InvalidValue as e:
            problems.append(PresetError(e.message, key=f"{table}.{key}"))
        except (TypeError, ValueError) as e:
            problems.append(PresetError(str(e), key=f"{table}.{key}"))
    bad = {n for n in fields if n in values and n not in kwargs}
    missing = [n for n, f in fields.items() if (n not in values or n in allowed_extra)
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        problems.append(PresetError(f"missing required key(s): {', '.join(missing)}", key=table))
    obj = _partial(cls, kwargs, bad | set(missing)) if problems else cls(**kwargs)
    check = getattr(obj, "check", None)
    try:
        found = collect(check) if check is not None else []
    except Exception:
        if not problems:
            raise
        found = []  # it read past a key with a problem of its own: reported when the table is fixed
    for problem in found:
        key = problem.key or ""
        if isinstance(problem, PresetError) and key.startswith(f"{table}."):
            key = key[len(table) + 1:]
        problems.append(PresetError(problem.message, key=f"{table}.{key}"))  # a table's check() names its own keys
        bad.add(key.split(".")[0] if key.split(".")[0] in fields else "")
    if not problems:
        return obj, []
    if "" in bad:  # a check() problem of no field: nothing of the table can be trusted
        bad = set(fields)
    return _partial(cls, kwargs, bad | set(missing)), problems


# --------------------------------------------------------------------------------------------------------------
# The walk.
# --------------------------------------------------------------------------------------------------------------


def _plugin_bug(table: str, registration: Registration, e: Exception) -> PresetError:
    """A plugin's check that raised something other than ``InvalidValue``: still one line, naming the plugin."""
    text = " ".join(str(e).split())
    return PresetError(f"the check of {registration.kind} {registration.name!r} (plugin {registration.plugin!r}) "
                       f"failed: {type(e).__name__}: {text}", key=f"{table}.name")


def walk(data: dict[str, Any], registry: PluginRegistry | None, source: str
         ) -> tuple[Preset | None, list[PresetError]]:
    """Validate a merged preset mapping: ``(preset, [])``, or ``(None, every problem)`` in the order found.

    The order found: unknown tables; the core tables (run, training, launch, parallel), then the plugin tables
    (model, data, strategy, profiler; the plugin ``name`` is looked up first), each table's problems as
    :func:`_section` gives them; then the layout checks and the plugins' ``check_preset`` hooks on the preset as
    far as it is valid (see the module's docstring). The problems carry no file
    yet; :func:`structure_first` orders them for reading. ``registry``: the process-wide one when None.

    A hook that raises something else than ``InvalidValue`` is one problem naming its plugin when the preset is
    otherwise valid; on a preset with problems it is skipped (it may have read a value a table's plain ``check()``
    never got to).
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
        sections[table] = _Missing(table)
        if not isinstance(values, dict):
            problems.append(PresetError("expected a table", key=table))
            continue
        if table in CORE_TABLES:
            sections[table], found = _section(CORE_TABLES[table], table, values)
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
                options, found = _Missing(table), [_plugin_bug(table, registration, e)]
            sections[table] = PluginSection(name=name, options=options)
        problems += found
    preset = Preset(**sections, source=source)
    tables_valid = not problems
    try:
        resolve_tp_impl(preset)  # "auto" becomes the implementation the layout runs, before every check of it
    except Unavailable:  # [parallel] or [strategy] has a problem of its own: auto stays auto
        pass
    checks: list[tuple[str | None, Callable[[], Any], Registration | None]] = [
        (None, functools.partial(check, preset, registry), None) for check in LAYOUT_CHECKS]
    for table, r in registrations.items():
        hooks = r.check_preset if isinstance(r.check_preset, tuple) else (r.check_preset,)
        checks += [(table, functools.partial(hook, sections[table].options, preset), r) for hook in hooks if hook]
    for table, check, registration in checks:
        try:
            problems += [_keyed(p, table) for p in collect(check)]
        except Exception as e:  # noqa: BLE001 - a bug in a plugin's check is still one line, naming the plugin
            if registration is None:
                raise
            if tables_valid:
                problems.append(_plugin_bug(table, registration, e))
    if problems:
        seen: set[tuple[str | None, str]] = set()
        return None, [p for p in problems if not ((p.key, p.message) in seen or seen.add((p.key, p.message)))]
    return preset, []
