"""What a ``--resume`` may change, and how a changed preset takes effect only once the resumed run works.

A resumed run loads its newest checkpoint, so every setting the checkpoint or the data position depends on is
fixed for the life of the run. :func:`frozen_changes` compares the run's preset with the one ``--set`` asks for
(valid or not: :func:`resumed_mapping`) and gives one line for each setting that may not change, and why;
:func:`finished_problem` refuses a finished run without more steps. ``handle run --resume`` reports them, with the
preset's own problems, before anything is written or started (:func:`torch_handle.launch.run.prepare_resume`).

The rules, table by table, are docs/resume.md#what-may-change; :func:`rule` is their code. The plugin tables follow
one rule per table, which a plugin overrides for one of its options by declaring it
(``param(..., frozen_on_resume=...)``, :func:`torch_handle.config.schema.param`). ``[parallel]`` may change; a
resume onto another layout resets what only the old one used (:func:`layout_adjustments`,
docs/resume.md#parallel-on-resume).

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch_handle.config.loader import Preset, dump_preset, load_preset, preset_to_dict
from torch_handle.config.overrides import apply_overrides
from torch_handle.config.schema import PLUGIN_TABLES, resume_declaration
from torch_handle.config.tp_impl import REASON_FIELD
from torch_handle.errors import PresetError, RunDirError
from torch_handle.observe.fields import Status
from torch_handle.registry import get_registry
from torch_handle.common.fsio import write_text_atomic
from torch_handle.common.names import step_of
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
    **{f"finetune.{k}": "the checkpoint holds these adapters (only finetune.dropout may change)"
       for k in ("method", "rank", "alpha", "target_modules")},
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


def flat_keys(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Leaves by dotted key (``rope_parameters.rope_theta``); an empty table has none (``ds_config = {}`` and no ``ds_config`` are the same)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def diff(old: Preset, new: Preset | dict[str, Any]) -> dict[str, list[Any]]:
    """``{"table.key": [old, new]}`` for every resolved setting that differs (None: not set); ``new`` may be a
    mapping not validated yet (:func:`resumed_mapping`)."""
    a, b = flat_keys(preset_to_dict(old)), flat_keys(new if isinstance(new, dict) else preset_to_dict(new))
    return {k: [a.get(k), b.get(k)] for k in [*a, *[k for k in b if k not in a]] if a.get(k) != b.get(k)}


def check_changes(run_dir: Path, old: Preset, new: Preset) -> dict[str, list[Any]]:
    """The changes ``new`` makes to the run's preset ``old``; all of them allowed on a resume (:func:`rule`, with
    the plugins ``old`` selects). When a table's plugin changes (the strategy may), the options of the old one go
    and the new one's come: none of them is checked.

    Raises:
        RunDirError: one line per setting that may not change (a plugin's ``name`` first), naming it and why.
    """
    changes = diff(old, new)
    refused = frozen_changes(run_dir, old, changes, {t: getattr(new, t).name for t in PLUGIN_TABLES})
    if refused:
        raise RunDirError("\n".join(refused))
    return changes


def frozen_changes(run_dir: Path, old: Preset, changes: dict[str, list[Any]], plugins: dict[str, Any]) -> list[str]:
    """One line for each of ``changes`` (:func:`diff`) that may not change on a resume (:func:`rule`); ``plugins``:
    the plugin each table selects after the change (the options of a table whose plugin changes are not checked).
    """
    switched = {table for table in PLUGIN_TABLES if getattr(old, table).name != plugins.get(table)}
    refused = []
    for key in sorted(changes, key=lambda k: (not k.endswith(".name"), k)):
        table, _, option = key.partition(".")
        if table in switched and option != "name":
            continue
        why = rule(key, old)
        if why:
            was, now = changes[key]
            refused.append(f"{run_dir}: cannot change {key} on --resume ({was!r} -> {now!r}): {why}")
    return refused


def newest_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint of ``run_dir`` (``checkpoints/step-N`` with its manifest; read by
    name, not verified: :func:`torch_handle.checkpoint.store.newest_valid` is the workers'), or None."""
    root = Path(run_dir) / "checkpoints"
    steps = [step for p in (root.iterdir() if root.is_dir() else ())
             if (step := step_of(p.name)) is not None and (p / "manifest.json").is_file()]
    return max(steps, default=None)


def finished_problem(run_dir: Path, info: dict[str, Any], steps: Any) -> str | None:
    """Why a resume of a finished run would train nothing, or None: run.json says finished, and ``steps``
    (``training.steps`` of the resume) is not past the step of its newest checkpoint, where it would resume."""
    done = newest_checkpoint_step(run_dir) if info.get("status") == Status.FINISHED else None
    if done is None or not isinstance(steps, int) or steps > done:
        return None
    return (f"{run_dir}: nothing to train: the run finished at step {done} (training.steps = {steps}); to train "
            f"further add --set training.steps=M with M > {done}")


def resumed_mapping(run_dir: Path, old: Preset, overrides: Sequence[str]) -> dict[str, Any] | None:
    """The run's preset as a mapping with ``overrides`` applied, not validated (what a resume asks for even
    when it has problems), or None when an override is malformed (validation reports it)."""
    data = preset_to_dict(old)
    try:
        apply_overrides(data, overrides, None, Path(run_dir) / PRESET_FILE)
    except PresetError:
        return None
    return data


def layout_adjustments(old: Preset, new: dict[str, Any], overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(--set overrides to add, notes)`` for a resume onto another layout: a ``[parallel]`` setting of the run
    that only made sense for its old layout, and that the resume does not set, goes back to its neutral value
    (docs/resume.md#parallel-on-resume):

    - ``sequence_parallel = true`` -> false when tp becomes 1 (there is no TP group to split the sequence over);
    - ``pp_layers`` -> ``[]`` (balanced by ``pp_split``) when the number of stages (pp x pp_stages_per_rank)
      changes: it listed the old stages.

    and a note names the run's settings that a resume puts into effect for the first time (its ``tp_impl`` once
    tp > 1, its ``pp_impl`` and ``pp_schedule`` once pp > 1): they are kept, and said.
    """
    given = {o.partition("=")[0].strip() for o in overrides}
    par, was = new.get("parallel"), old.parallel
    if not isinstance(par, dict):
        return [], []
    tp, pp, v = par.get("tp"), par.get("pp"), par.get("pp_stages_per_rank")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (tp, pp, v)):
        return [], []
    extra, notes = [], []
    if tp == 1 and was.tp > 1 and par.get("sequence_parallel") is True and \
            "parallel.sequence_parallel" not in given:
        extra.append("parallel.sequence_parallel=false")
        notes.append(f"parallel.sequence_parallel: true -> false (it splits the sequence over the TP group; the "
                     f"run had tp {was.tp}, the resume has tp 1)")
    layers = par.get("pp_layers")
    if layers and pp * v != was.pp * was.pp_stages_per_rank and "parallel.pp_layers" not in given:
        extra.append("parallel.pp_layers=[]")
        notes.append(f"parallel.pp_layers: {layers} -> [] (it listed the run's {was.pp * was.pp_stages_per_rank} "
                     f"stages; the resume's {pp * v} are balanced by parallel.pp_split = {par.get('pp_split')!r})")
    newly = []
    if tp > 1 and was.tp == 1:
        newly.append("tp_impl")
    if pp > 1 and was.pp == 1:
        newly += ["pp_impl", "pp_schedule"]
    kept = [f"parallel.{k} = {par.get(k)!r}" for k in newly if f"parallel.{k}" not in given]
    if kept:
        notes.append(f"the run's {' and '.join(kept)} take effect (unused by its tp {was.tp} x pp {was.pp}; "
                     f"--set them to choose)")
    return extra, notes


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
