"""``--set TABLE.KEY=VALUE`` overrides: parsed, typed by the field they set, and applied to a composed preset
mapping (step 1 of :mod:`torch_handle.config.loader`).

The value is TOML (``training.lr=3e-4``, ``model.dims=[1, 2]``); a bare word is a string (``strategy.name=ddp``).
A field that takes a string keeps the text as written (``run.name=2024`` is the name "2024"), a float field takes
Python's float syntax (``.001``), a bool field any case of true/false. A plugin switch (``strategy.name=...``) is
applied first and starts its table afresh: the options in it belonged to the other plugin.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from torch_handle.config.schema import CORE_TABLES, PLUGIN_TABLES, plugin_name
from torch_handle.errors import PresetError
from torch_handle.registry import PluginRegistry, get_registry

Overrides = list[tuple[list[str], Any]]
"""The ``--set`` overrides as applied: ``(["table", "key", ...], typed value)``, in the order applied."""

_OVERRIDE_HELP = "expected TABLE.KEY=VALUE, for example training.steps=50"


def _split_override(text: str) -> tuple[list[str], str]:
    if "=" not in text:
        raise PresetError(f"--set {text!r}: {_OVERRIDE_HELP}")
    dotted, raw = text.split("=", 1)
    keys = [k.strip() for k in dotted.split(".")]
    if len(keys) < 2 or not all(keys):
        raise PresetError(f"--set {text!r}: {_OVERRIDE_HELP}")
    return keys, raw.strip()


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word such as `zero2` or `cpu`


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``table.key=value`` (value in TOML syntax, bare words taken as strings).

    Raises:
        PresetError: when there is no ``=`` or no ``table.key``.
    """
    keys, raw = _split_override(text)
    return keys, _parse_value(raw)


def _takes_string(tp: Any) -> bool:
    origin = get_origin(tp)
    if tp is str:
        return True
    if origin is Literal:
        return any(isinstance(a, str) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return any(_takes_string(a) for a in get_args(tp))
    return False


def _field_type(data: dict[str, Any], keys: list[str], registry: PluginRegistry) -> Any:
    """The annotation of the field ``keys`` sets (``table.key``), or None when it is not known (yet)."""
    if len(keys) == 3 and keys[0] in CORE_TABLES:  # a nested table's key: [finetune.preference] beta
        outer = get_type_hints(CORE_TABLES[keys[0]]).get(keys[1])
        return get_type_hints(outer).get(keys[2]) if dataclasses.is_dataclass(outer) else None
    if len(keys) != 2:
        return None
    table, key = keys
    if table in PLUGIN_TABLES:
        if key == "name":
            return str
        name = plugin_name(table, data.get(table))
        regs = getattr(registry, "registrations", {}).get(PLUGIN_TABLES[table], {})
        reg = regs.get(name) if isinstance(name, str) else None
        cls = getattr(reg, "config_cls", None)
    else:
        cls = CORE_TABLES.get(table)
    if cls is None or not dataclasses.is_dataclass(cls):
        return None
    try:
        return get_type_hints(cls).get(key)
    except Exception:  # noqa: BLE001 - a broken plugin annotation is reported by validation
        return None


def _typed_value(raw: str, value: Any, tp: Any) -> Any:
    """A bare ``--set`` value read as the field's type: the text as written for a string field (``123``,
    ``true``, ``2024-01-01``), Python's float syntax for a number (``.001``), any case of true/false for a bool."""
    if tp is None:
        return value
    if not isinstance(value, (str, list, dict)) and _takes_string(tp):
        return raw
    if isinstance(value, str) and value == raw:  # a bare word TOML could not read
        if tp is float:
            try:
                return float(raw)
            except ValueError:
                pass
        if tp is bool and raw.lower() in ("true", "false"):
            return raw.lower() == "true"
    return value


def _apply_override(data: dict[str, Any], keys: list[str], value: Any) -> None:
    node = data
    for i, k in enumerate(keys[:-1]):
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise PresetError(f"{'.'.join(keys[: i + 1])} is a value, not a table", file="--set",
                              key=".".join(keys))
        node = child
    node[keys[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str], registry: PluginRegistry | None, path: Path
                    ) -> Overrides:
    """Apply ``--set`` overrides to the merged preset mapping, each typed by its field; returns them parsed.

    Plugin switches (``table.name=...``) go first, because they reset their table: the options in it belonged
    to the other plugin.
    """
    split = [_split_override(o) for o in overrides]
    if not split:
        return []
    if registry is None:
        registry = get_registry()
    ordered = sorted(split, key=lambda kr: not (len(kr[0]) == 2 and kr[0][0] in PLUGIN_TABLES
                                               and kr[0][1] == "name"))
    parsed: Overrides = []
    for keys, raw in ordered:
        value = _typed_value(raw, _parse_value(raw), _field_type(data, keys, registry))
        table = keys[0]
        if (len(keys) == 2 and table in PLUGIN_TABLES and keys[1] == "name" and isinstance(data.get(table), dict)
                and value != plugin_name(table, data[table])):
            data[table] = {}
        try:
            _apply_override(data, keys, value)
        except PresetError as e:
            e.file = f"{path} (--set)"
            raise
        parsed.append((keys, value))
    return parsed
