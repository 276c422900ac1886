"""``handle validate`` and ``handle presets``: check, show, list and create presets.

Presets come from ``./presets`` and from plugins (``handle_register_presets``). A bare NAME is looked up as
``./presets/NAME.toml`` first, then in the plugins' preset directories.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import textwrap
from pathlib import Path

import click

from handle_cli.common import fail

OVERRIDE = click.option("--set", "overrides", multiple=True, metavar="TABLE.KEY=VALUE",
                        help="Override a preset key, typed by its field (repeatable).")


def resolve_preset_spec(spec: str) -> str:
    """``spec`` unchanged when it is a path or a preset of ./presets; else the file of a plugin preset NAME."""
    p = Path(spec)
    if p.exists() or p.suffix == ".toml" or os.sep in spec or "/" in spec:
        return spec
    if (Path("presets") / f"{spec}.toml").exists():
        return spec
    for _, path, _ in plugin_presets():
        if path.stem == spec:
            return str(path)
    return spec


def plugin_presets() -> list[tuple[str, Path, str]]:
    """(plugin, file, description) of every preset a loaded plugin contributes."""
    from torch_handle.config.loader import preset_description
    from torch_handle.registry import get_registry

    out = []
    for plugin, directory in get_registry().preset_dirs:
        for path in sorted(directory.glob("*.toml")):
            out.append((plugin, path, preset_description(path)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# handle validate
# ---------------------------------------------------------------------------------------------------------------


TARGETS = ("hf",)
"""``handle validate --target``: what a run of the preset must also be able to do (``hf``: export with ``handle
export --format hf``)."""


@click.command()
@click.argument("preset")
@OVERRIDE
@click.option("--target", type=click.Choice(TARGETS), default=None,
              help="Also check that a run of PRESET will export: hf = handle export --format hf (every option a "
                   "Hugging Face class cannot express, with the value it needs).")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object on stdout: ok, layout, world_size, steps, architecture, problems.")
def validate(preset: str, overrides: tuple[str, ...], target: str | None, as_json: bool) -> None:
    """Check PRESET and every plugin section without starting anything.

    Every problem is reported at once, one line each, structure first (the model's shape, the layout, then the
    details): each table on its own, and every check that spans tables whose inputs are valid; then the dataset
    plugin's pre-flight check (paths exist, UTF-8). A valid preset prints its layout, world size and steps:
    `presets/3d.toml: ok: dp 2 × tp 2 × pp 2 (ddp; tp scratch + sp; pp 1F1B scratch), world size 8, 500 steps`.
    With --target hf, a preset whose run would not export to Hugging Face format is a problem too: every option
    the closest class (Llama, Qwen 3, Qwen 3 MoE, Mixtral) cannot express, with the value it needs.
    Exit code 2 when there is any problem.

    \b
    Examples:
      handle validate presets/pp.toml --set parallel.pp=4
      handle validate presets/moe.toml --target hf      # before training: will its run export?
      handle validate presets/llama.toml --target hf --json
    """
    from torch_handle.config.loader import load_preset, preset_problems
    from torch_handle.launch.run import check_inputs

    spec = resolve_preset_spec(preset)
    then = _target_check(target)
    if os.environ.get("HANDLE_DEBUG") and not as_json:
        p = load_preset(spec, overrides)  # the traceback of the first problem
        problems = list(then(p)) if then else []
    else:
        p, problems = preset_problems(spec, overrides, then=then)
    if problems:
        if as_json:
            click.echo(json.dumps({"preset": spec, "ok": False, "target": target, "problems": [
                {"file": str(e.file) if e.file else None, "line": e.line, "key": e.key, "message": e.message}
                for e in problems]}))
        for e in problems if not as_json else ():
            click.echo(f"error: {e}", err=True)
        sys.exit(2)
    check_inputs(p)  # DataError: one line, exit 2 (HandleGroup)
    from torch_handle.launch.base_tokenizer import resolve_base_tokenizer

    p, tokenizer_note = resolve_base_tokenizer(p)
    if tokenizer_note:
        click.echo(f"note: {tokenizer_note}")
    from torch_handle.common.run_layout import RunLayout

    layout = RunLayout.from_preset(p).label()
    architecture = _architecture(p) if target == "hf" else None
    if as_json:
        click.echo(json.dumps({"preset": p.source, "ok": True, "target": target, "layout": layout,
                               "world_size": p.world_size, "steps": p.training.steps, "architecture": architecture,
                               "problems": []}))
        return
    exports = f"; exports as {architecture} (handle export RUN --format hf OUT)" if architecture else ""
    click.echo(f"{p.source}: ok: {layout}, world size {p.world_size}, {p.training.steps} steps{exports}")


def _target_check(target: str | None):
    """The further check of a valid preset that ``--target`` names (None: none)."""
    if target != "hf":
        return None
    from torch_handle.infer.hf_export import export_preset_errors

    return export_preset_errors


def _architecture(preset) -> str | None:
    from torch_handle.infer.hf_export import export_problems

    return export_problems(preset)[0]


# ---------------------------------------------------------------------------------------------------------------
# handle presets
# ---------------------------------------------------------------------------------------------------------------


@click.group()
def presets() -> None:
    """List, show and create presets."""


@presets.command("show")
@click.argument("preset")
@OVERRIDE
def presets_show(preset: str, overrides: tuple[str, ...]) -> None:
    """Print the fully resolved PRESET (defaults + extends + overrides) as TOML, exactly as a run uses it; a
    ``training.precision = "auto"`` is kept, with a first comment line saying what a run here would train in; a
    ``parallel.tp_impl = "auto"`` (tp > 1) is the implementation it chose, with a comment line saying why."""
    from torch_handle.config.loader import dump_preset, load_preset

    loaded = load_preset(resolve_preset_spec(preset), overrides)
    for key, reason in loaded.resolved.items():
        click.echo(f"# {key}: {reason}")
    if loaded.training.precision == "auto":
        from torch_handle.launch.precision import resolve

        click.echo(f"# training.precision: {resolve(loaded).reason}")
    click.echo(dump_preset(loaded), nl=False)


@presets.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def presets_list(as_json: bool) -> None:
    """Presets in ./presets and those of plugins, each with its description (the preset file's leading comment,
    whole, wrapped to the terminal's width under the name column; --json: one string)."""
    from torch_handle.config.loader import preset_description

    local = [(None, p, preset_description(p)) for p in sorted(Path("presets").glob("*.toml"))]
    local_names = {p.stem for _, p, _ in local}
    rows = [*local, *plugin_presets()]
    if as_json:
        click.echo(json.dumps([{"name": p.stem, "path": str(p), "description": d, "plugin": plugin,
                                "shadowed": plugin is not None and p.stem in local_names}
                               for plugin, p, d in rows], indent=2))
        return
    width = max(40, shutil.get_terminal_size((100, 24)).columns - 1)
    for plugin, path, desc in rows:
        if plugin is not None:
            where = f"plugin {plugin}" if path.stem not in local_names else f"plugin {plugin}; use {path}"
            desc = f"({where}) {desc}".rstrip()  # first, so that it stays on the name's line
        click.echo(_described(path.stem, desc, width))


NAME_WIDTH = 16
"""The name column of ``handle presets list``; a longer name puts its description on the next line."""


def _described(name: str, description: str, width: int) -> str:
    """``name`` and its whole ``description`` wrapped to ``width`` columns, the description's lines indented past
    the name column (a word longer than a line is kept whole, never broken)."""
    indent = " " * (NAME_WIDTH + 1)
    head = f"{name:<{NAME_WIDTH}} " if len(name) <= NAME_WIDTH else f"{name}\n{indent}"
    if not description:
        return name
    lines = textwrap.wrap(description, width=max(width - len(indent), 20), break_long_words=False,
                          break_on_hyphens=False)
    return head + f"\n{indent}".join(lines)


def _first_sentence(text: str) -> str:
    """``text`` up to its first ". " (a sentence end), or all of it."""
    cut = text.find(". ")
    return text if cut < 0 else text[: cut + 1]


NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@presets.command("new")
@click.argument("name")
@click.option("--from", "base", default="zero2", show_default=True, metavar="PRESET",
              help="The preset to extend (a name in ./presets, a plugin preset or a path).")
@click.option("--dir", "directory", default="presets", show_default=True, type=click.Path(path_type=Path),
              help="Where to write NAME.toml.")
@click.option("--description", help="The one-line description (the first comment line).")
def presets_new(name: str, base: str, directory: Path, description: str | None) -> None:
    """Write presets/NAME.toml: `extends` PRESET and sets `[run] name = NAME`; never overwrites a file."""
    from torch_handle.config.loader import PresetError, load_preset, preset_description, resolve_preset_path

    if name.endswith(".toml"):
        name = name[: -len(".toml")]
    if not NAME_RE.fullmatch(name):
        fail(f"{name!r}: a preset name uses only letters, digits, '.', '_' and '-' and starts with a letter or digit")
    target = directory / f"{name}.toml"
    if target.exists():
        fail(f"{target}: already exists; refusing to overwrite it (choose another NAME or delete the file)")
    base_path = resolve_preset_path(resolve_preset_spec(base))
    load_preset(base_path)  # the base must be valid (PresetError: one line, exit 2)
    directory.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(base_path.resolve(), directory.resolve())
    # a relative path keeps the preset movable with its base; far away (another tree, a plugin) it is absolute
    extends = rel if not rel.startswith(os.pardir + os.sep + os.pardir) else str(base_path.resolve())
    base_desc = _first_sentence(preset_description(base_path)) or "no description"
    desc = description or f"{name}: based on {base_path.stem} ({base_desc})"
    text = (f"# {' '.join(desc.split())}\n"
            f"extends = {json.dumps(Path(extends).as_posix())}\n\n"
            f"[run]\n"
            f"name = {json.dumps(name)}\n")
    try:
        with open(target, "x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        fail(f"{target}: already exists; refusing to overwrite it")
    try:
        load_preset(target)
    except PresetError:
        target.unlink()
        raise
    click.echo(f"wrote {target} (extends {Path(extends).as_posix()}); change it, then: handle run {target}")
