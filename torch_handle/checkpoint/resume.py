"""What a ``--resume`` may change, and how a changed preset takes effect only once the resumed run works.

A resumed run loads its newest checkpoint, so every setting the checkpoint or the data position depends on is
fixed for the life of the run. :func:`check_changes` compares the run's preset with the one ``--set`` makes and
raises one line naming the first setting that may not change, and why, before anything is written or started.

The rules, table by table, are docs/resume.md#what-may-change; :func:`rule` is their code. The plugin tables follow
one rule per table, which a plugin overrides for one of its options by declaring it
(``param(..., frozen_on_resume=...)``, :func:`torch_handle.config.schema.param`).

An accepted change is written to ``preset.resume.toml`` (:data:`RESUME_PRESET`), which the workers load instead
of ``preset.toml`` (:func:`active_preset_path`); the launcher replaces ``preset.toml`` with it once the resumed
run made its first step (:func:`promote`), and records the resume in run.json's ``resumes`` list. A resume that
fails before that leaves ``preset.toml`` as it was; the next ``--resume`` drops the stale side file.

No torch import here.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from torch_handle.config.loader import Preset, dump_preset, load_preset, preset_to_dict
from torch_handle.config.schema import PLUGIN_TABLES, resume_declaration
from torch_handle.config.tp_impl import REASON_FIELD
from torch_handle.errors import RunDirError
from torch_handle.registry import get_registry
from torch_handle.common.fsio import write_text_atomic
from torch_handle.common.run_layout import LAYOUT_KEY, RunLayout
from torch_handle.rundir import PRESET_FILE, modify_run_info

RESUME_PRESET = "preset.resume.toml"
"""The preset a resumed run with ``--set`` overrides uses until :func:`promote` makes it ``preset.toml``."""
PENDING = "resume_pending"
"""run.json key set by ``handle run --resume`` and cleared by :func:`promote`: ``{"time": t}``."""

_PLUGIN_TABLE_RULE: dict[str, str | None] = {
    "model": "the checkpoint's weights have the model's shape",
    "data": "the tokenizer, vocabulary and data position of the checkpoint depend on the data settings",
    "strategy": None,
    "profiler": None,
}
"""Why a plugin table's ``name`` and undeclared options are frozen (None: they may change)."""
_DECLARED_FROZEN = "its plugin declares it frozen on resume (the checkpoint depends on it)"
"""The reason of ``frozen_on_resume=True`` in a table whose options may change."""
_FROZEN = {
    "run.seed": "the data order and the initial weights come from it",
    "run.name": "it names the run directory, which does not move",
    "run.output_dir": "it names the run directory, which does not move",
    "training.precision": "the checkpoint's optimizer state and loss scaler depend on it",
    "training.beta1": "it is restored from the checkpoint's optimizer state (the change would be ignored)",
    "training.beta2": "it is restored from the checkpoint's optimizer state (the change would be ignored)",
    "training.weight_decay": "it is restored from the checkpoint's optimizer state (the change would be ignored)",
}


def rule(key: str, preset: Preset | None = None) -> str | None:
    """Why ``key`` (``table.key``, nested keys dotted) may not change on a resume, or None when it may.

    An option of a plugin table follows its plugin's declaration (:func:`torch_handle.config.schema.param`'s
    ``frozen_on_resume``), else the table's rule. The plugin is the one ``preset`` selects; without ``preset``,
    every registered plugin of that table with such an option is asked, and any one that freezes it wins.
    """
    table, _, rest = key.partition(".")
    if table not in PLUGIN_TABLES:
        return _FROZEN.get(key)
    option = rest.split(".")[0]
    default = _PLUGIN_TABLE_RULE[table]
    if option == "name":
        return default
    if preset is not None:
        classes = [type(getattr(preset, table).options)]
    else:
        classes = [r.config_cls for r in get_registry().registrations[PLUGIN_TABLES[table]].values()]
    classes = [c for c in classes if option in {f.name for f in dataclasses.fields(c)}]
    reasons = [_reason(resume_declaration(c, option), default) for c in classes] or [default]
    return next((why for why in reasons if why), None)


def _reason(declared: bool | str | None, default: str | None) -> str | None:
    """Why an option is frozen, from its plugin's declaration and the table's rule ``default``."""
    if declared is False:
        return None
    if isinstance(declared, str):
        return declared
    return (default or _DECLARED_FROZEN) if declared else default


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Leaves by dotted key; an empty table has none (``ds_config = {}`` and no ``ds_config`` are the same)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def diff(old: Preset, new: Preset) -> dict[str, list[Any]]:
    """``{"table.key": [old, new]}`` for every resolved setting that differs (None: not set)."""
    a, b = _flat(preset_to_dict(old)), _flat(preset_to_dict(new))
    return {k: [a.get(k), b.get(k)] for k in [*a, *[k for k in b if k not in a]] if a.get(k) != b.get(k)}


def check_changes(run_dir: Path, old: Preset, new: Preset) -> dict[str, list[Any]]:
    """The changes ``new`` makes to the run's preset ``old``; all of them allowed on a resume (:func:`rule`, with
    the plugins ``old`` selects). When a table's plugin changes (the strategy may), the options of the old one go
    and the new one's come: none of them is checked.

    Raises:
        RunDirError: one line naming the first setting that may not change (a plugin's ``name`` first) and why.
    """
    changes = diff(old, new)
    switched = {table for table in PLUGIN_TABLES if getattr(old, table).name != getattr(new, table).name}
    for key in sorted(changes, key=lambda k: (not k.endswith(".name"), k)):
        table, _, option = key.partition(".")
        if table in switched and option != "name":
            continue
        why = rule(key, old)
        if why:
            was, now = changes[key]
            raise RunDirError(f"{run_dir}: cannot change {key} on --resume ({was!r} -> {now!r}): {why}")
    return changes


def active_preset_path(run_dir: Path) -> Path:
    """The preset the workers of ``run_dir`` load: ``preset.resume.toml`` while a changed resume is pending."""
    side = Path(run_dir) / RESUME_PRESET
    return side if side.exists() else Path(run_dir) / PRESET_FILE


def write_side_preset(run_dir: Path, preset: Preset | None) -> None:
    """Write ``preset.resume.toml`` (atomically), or remove a stale one when ``preset`` is None."""
    side = Path(run_dir) / RESUME_PRESET
    if preset is None:
        side.unlink(missing_ok=True)
        return
    write_text_atomic(side, dump_preset(preset))


def promote(run_dir: Path, step: int) -> dict[str, Any] | None:
    """The resumed run works (it made a step, or finished): make ``preset.resume.toml`` the run's preset and
    append ``{"step", "time", "changed"}`` to run.json's ``resumes`` (``step``: the step it resumed at); run.json's
    ``layout`` becomes the resumed preset's, and ``tp_impl_reason`` the resume's where it chose one (``--set
    parallel.tp_impl=auto``; dropped where the resume set another implementation by hand).
    Returns the entry, or None when no resume was pending. Safe to call more than once.

    All of it under run.json's lock (:func:`torch_handle.rundir.modify_run_info`): rank 0 may write run.json
    meanwhile (its closing status), and neither update may undo the other.

    Raises:
        RunDirError: when ``run_dir`` is not a run directory.
        OSError: when run.json or preset.toml cannot be written.
    """
    run_dir = Path(run_dir)
    entry: dict[str, Any] | None = None

    def record(info: dict[str, Any]) -> dict[str, Any] | None:
        nonlocal entry
        pending = info.get(PENDING)
        if not isinstance(pending, dict):
            return None
        side = run_dir / RESUME_PRESET
        changed: dict[str, list[Any]] = {}
        if side.exists():
            try:
                new = load_preset(side)
                changed = diff(load_preset(run_dir / PRESET_FILE), new)
                info[LAYOUT_KEY] = RunLayout.from_preset(new).record()  # a resume may change the world size
            except Exception:  # noqa: BLE001 - the history line is best effort; the preset swap is what matters
                changed = {}
            os.replace(side, run_dir / PRESET_FILE)
        entry = {"step": int(step), "time": pending.get("time") or time.time(), "changed": changed}
        resumes = info.get("resumes") if isinstance(info.get("resumes"), list) else []
        info.pop(PENDING, None)
        info["resumes"] = [*resumes, entry]
        if "training.steps" in changed:
            info["steps"] = changed["training.steps"][1]
        if pending.get(REASON_FIELD):  # the resume chose (tp_impl = "auto"): its reason is the one that holds now
            info[REASON_FIELD] = pending[REASON_FIELD]
        elif "parallel.tp_impl" in changed:  # set by hand on the resume: no reason
            info.pop(REASON_FIELD, None)
        return info

    modify_run_info(run_dir, record)
    return entry
