"""``handle plugins``: list, install and uninstall plugins (the ``handle`` entry-point group).

Only click and the standard library at import time: the registry (pluggy, the plugin modules) is loaded inside
the commands, and pip runs in a subprocess of the same interpreter, so a plugin lands in the environment that
``handle`` itself runs from.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from handle_cli.common import fail

if TYPE_CHECKING:  # the registry (pluggy, every plugin module) is loaded inside the commands
    from torch_handle.registry import PluginInfo, PluginRegistry

KINDS = ("model", "dataset", "strategy", "profiler", "sink")
"""What a plugin can register by name; a sink is not selected by a preset: every registered one runs."""
CORE_DISTRIBUTION = "torch-handle"

LOAD_PLUGINS_HELP = """\b
HANDLE_LOAD_PLUGINS limits which external plugins are imported at all:
  unset                      every installed plugin loads
  HANDLE_LOAD_PLUGINS=a,b    only the plugins (entry-point names) a and b
  HANDLE_LOAD_PLUGINS=       (empty) none: the way out of a broken plugin
The built-in plugins (distribution torch-handle) always load. A plugin
that fails to import or to register is listed as failed with the reason;
every other plugin and command keeps working. Writing plugins:
docs/plugins.md."""


def canonical(name: str) -> str:
    """A distribution name normalised as pip does (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


# ---------------------------------------------------------------------------------------------------------------
# Optional extras of torch-handle: what a built-in plugin needs beyond the core install
# ---------------------------------------------------------------------------------------------------------------

EXTRAS: dict[str, tuple[str, str, str]] = {
    "hf": ("model", "hf", "Hugging Face causal LMs: OPT, GPT-2, Llama, or local config/weights"),
    "wandb": ("sink", "wandb", "Weights & Biases tracking (HANDLE_WANDB=1; offline unless configured)"),
}
"""extra -> (kind, name, what it enables): the built-in plugins that need an extra. Extras not named here
(``dev``: the test tools) are not listed."""


def requirement_met(requirement: str) -> bool:
    """Whether a requirement (``"transformers>=5.0,<6"``) is satisfied by an installed distribution."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    req = Requirement(requirement)
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        return False
    return req.specifier.contains(version, prereleases=True)


def _install_command(extra: str) -> str:
    """The pip command that installs ``extra``: from the checkout for an editable install (``pip install -e``),
    else from the package index."""
    import importlib.metadata as md
    from urllib.parse import unquote, urlparse

    direct: dict[str, Any] = {}
    # every copy of the metadata on sys.path: a checkout's own torch_handle.egg-info (setuptools writes it there
    # on `pip install -e`) may come first, and only the installed dist-info has direct_url.json
    for dist in md.distributions(name=CORE_DISTRIBUTION):
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        if direct:
            break
    url = direct.get("url", "")
    if direct.get("dir_info", {}).get("editable") and url.startswith("file://"):
        return f"pip install -e '{unquote(urlparse(url).path)}[{extra}]'"
    return f"pip install '{CORE_DISTRIBUTION}[{extra}]'"


def extras() -> list[dict[str, Any]]:
    """The optional extras of torch-handle's installed metadata that enable a built-in plugin, each with
    ``name``, ``kind``, ``plugin`` (what it registers), ``description``, ``requires`` (requirement strings),
    ``installed`` (every requirement met) and ``install`` (the command); [] when the metadata is unreadable."""
    import importlib.metadata as md

    from packaging.requirements import InvalidRequirement, Requirement

    try:
        dist = md.distribution(CORE_DISTRIBUTION)
    except md.PackageNotFoundError:
        return []
    out = []
    for extra in dist.metadata.get_all("Provides-Extra") or []:
        if extra not in EXTRAS:
            continue
        requires = []
        for line in dist.requires or []:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is not None and req.marker.evaluate({"extra": extra}):
                requires.append(str(req).split(";")[0].strip())
        kind, name, description = EXTRAS[extra]
        out.append({"name": extra, "kind": kind, "plugin": name, "description": description, "requires": requires,
                    "installed": all(requirement_met(r) for r in requires),
                    "install": _install_command(extra)})
    return out


# ---------------------------------------------------------------------------------------------------------------
# Plugin commands: never in place of a core command
# ---------------------------------------------------------------------------------------------------------------


def accepted_commands(registry: PluginRegistry, core: set[str]) -> dict[str, tuple[str, Any]]:
    """The plugin commands that may be added to ``handle``: name -> (plugin, click command).

    A command named like a core command is refused; the refusal is recorded in the plugin's ``notes`` (shown by
    ``handle plugins list``), and the rest of the plugin keeps working.
    """
    out: dict[str, tuple[str, Any]] = {}
    for name, (plugin, command) in sorted(registry.commands.items()):
        if name in core:
            info = registry.plugins.get(plugin)
            note = f"command {name!r} refused: it would shadow the core command 'handle {name}'"
            if info is not None and note not in info.notes:
                info.notes.append(note)
            continue
        out[name] = (plugin, command)
    return out


def _core_commands(ctx: click.Context) -> set[str]:
    root = ctx.find_root().command
    return set(getattr(root, "commands", {}))


# ---------------------------------------------------------------------------------------------------------------
# handle plugins
# ---------------------------------------------------------------------------------------------------------------


@click.group("plugins", epilog=LOAD_PLUGINS_HELP)
def plugins() -> None:
    """List, install and uninstall plugins.

    A plugin is a module registered under the `handle` entry-point group of a Python distribution; it can add
    models, datasets, strategies, profilers, telemetry sinks, presets and commands (see docs/plugins.md).
    """


def plugin_record(info: PluginInfo, registry: PluginRegistry) -> dict[str, Any]:
    """One plugin as ``handle plugins list --json`` shows it."""
    regs = {**registry.registrations, "sink": registry.sinks}
    registers = {k: list(info.registered[k]) for k in KINDS if info.registered.get(k)}
    return {
        "name": info.name,
        "kinds": list(registers),
        "registers": registers,
        "descriptions": {k: {n: regs[k][n].description for n in names if n in regs[k]}
                         for k, names in registers.items()},
        "presets": list(info.presets),
        "commands": list(info.commands),
        "distribution": info.distribution,
        "version": info.version,
        "builtin": info.builtin,
        "origin": "built-in" if info.builtin else "external",
        "status": info.status,
        "error": info.error,
        "notes": list(info.notes),
    }


def listing(registry: PluginRegistry, core: set[str]) -> dict[str, Any]:
    accepted_commands(registry, core)  # records refusals in the plugins' notes
    env = os.environ.get("HANDLE_LOAD_PLUGINS")
    return {
        "plugins": [plugin_record(i, registry) for i in sorted(registry.plugins.values(), key=lambda i: i.name)],
        "skipped": [{"name": i.name, "distribution": i.distribution, "version": i.version, "status": i.status,
                     "error": i.error} for i in sorted(registry.skipped.values(), key=lambda i: i.name)],
        "handle_load_plugins": env,
        "extras": extras(),
    }


def _registers_text(p: dict[str, Any]) -> str:
    if p["status"] != "loaded":
        return p["error"]
    parts = [f"{k}: {', '.join(names)}" for k, names in p["registers"].items()]
    if p["commands"]:
        parts.append(f"command: {', '.join(p['commands'])}")
    if p["presets"]:
        parts.append(f"presets: {', '.join(p['presets'])}")
    return "; ".join(parts) or "(nothing)"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip() for r in rows]


@plugins.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--kind", type=click.Choice(KINDS),
              help="Only the plugins that provide this kind, with descriptions (and those that failed to load).")
@click.pass_context
def plugins_list(ctx: click.Context, as_json: bool, kind: str | None) -> None:
    """Every plugin: what it registers, its distribution and version, built-in or external, loaded or failed;
    then the optional extras of torch-handle that are not installed, with the command that installs each.

    Exits 0 even when some plugins failed to load (their reason is shown).

    \b
    Examples:
      handle plugins list
      handle plugins list --kind model
      handle plugins list --json | jq '.extras[] | select(.installed | not) | .install'
    """
    from torch_handle.registry import get_registry

    registry = get_registry()
    data = listing(registry, _core_commands(ctx))
    if kind is not None:
        data["plugins"] = [p for p in data["plugins"] if kind in p["kinds"] or p["status"] == "failed"]
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    if kind is not None:
        _print_kind(data, kind, registry)
        return
    rows = [["PLUGIN", "DISTRIBUTION", "ORIGIN", "STATUS", "REGISTERS"]]
    for p in data["plugins"]:
        rows.append([p["name"], f"{p['distribution']} {p['version']}", p["origin"], p["status"],
                     _registers_text(p)])
    lines = _table(rows)
    for line in lines[:1]:
        click.echo(line)
    for line, p in zip(lines[1:], data["plugins"]):
        click.echo(line)
        for note in p["notes"]:
            click.echo(f"    note: {note}")
    loaded = sum(p["status"] == "loaded" for p in data["plugins"])
    failed = len(data["plugins"]) - loaded
    summary = f"{loaded} loaded, {failed} failed"
    if data["skipped"]:
        names = ", ".join(f"{s['name']} ({s['distribution']})" for s in data["skipped"])
        summary += f"; not loaded because HANDLE_LOAD_PLUGINS={data['handle_load_plugins']!r}: {names}"
    click.echo(summary)
    _print_missing_extras(data["extras"])


def _print_missing_extras(found: list[dict[str, Any]], kind: str | None = None) -> None:
    """The extras that are not installed, each with what it enables and the command that installs it."""
    missing = [e for e in found if not e["installed"] and kind in (None, e["kind"])]
    if not missing:
        return
    click.echo("available extras (not installed):")
    rows = [[e["name"], f"{e['kind']} '{e['plugin']}': {e['description']}", f"-- {e['install']}"] for e in missing]
    for line in _table(rows):
        click.echo(f"  {line}")


def _print_kind(data: dict[str, Any], kind: str, registry: PluginRegistry) -> None:
    rows = [[kind.upper(), "PLUGIN", "DISTRIBUTION", "DESCRIPTION"]]
    for p in data["plugins"]:
        for name in p["registers"].get(kind, []):
            rows.append([name, p["name"], f"{p['distribution']} {p['version']} ({p['origin']})",
                         p["descriptions"][kind].get(name, "")])
    for line in _table(rows):
        click.echo(line)
    for p in data["plugins"]:
        if p["status"] == "failed":
            click.echo(f"failed plugin {p['name']} ({p['distribution']} {p['version']}): {p['error']}")
    if data["skipped"]:
        click.echo(f"not loaded because HANDLE_LOAD_PLUGINS={data['handle_load_plugins']!r}: "
                   f"{', '.join(s['name'] for s in data['skipped'])}")
    _print_missing_extras(data["extras"], kind)


# ---------------------------------------------------------------------------------------------------------------
# install / uninstall
# ---------------------------------------------------------------------------------------------------------------


def _entry_points() -> dict[str, tuple[str, str]]:
    """Plugin (entry-point) name -> (distribution, version), without importing any plugin."""
    import importlib.metadata as md

    out = {}
    for ep in md.entry_points(group="handle"):
        out[ep.name] = (ep.dist.name if ep.dist else "?", ep.dist.version if ep.dist else "?")
    return out


def _fresh_listing() -> dict[str, Any]:
    """``handle plugins list --json`` in a new interpreter: entry points and imports are cached per process."""
    proc = subprocess.run([sys.executable, "-m", "handle_cli", "plugins", "list", "--json"], capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout).split())[-500:]
        raise click.ClickException(f"listing the plugins after the install failed (exit {proc.returncode}): {tail}")
    return json.loads(proc.stdout)


def _describe(p: dict[str, Any]) -> str:
    parts = [f"{k} {', '.join(names)}" for k, names in p.get("registers", {}).items()]
    if p.get("commands"):
        parts.append(f"command {', '.join(p['commands'])}")
    if p.get("presets"):
        parts.append(f"presets in {', '.join(p['presets'])}")
    return "; ".join(parts) or "nothing"


@plugins.command("install", context_settings={"ignore_unknown_options": True})
@click.argument("specs", nargs=-1, required=True, type=click.UNPROCESSED, metavar="SPEC...")
def plugins_install(specs: tuple[str, ...]) -> None:
    """Install plugin distributions with pip into the environment handle runs from, then show what they add.

    SPEC is anything `pip install` takes: a package name, a local path, `-e PATH`, `-U NAME`; other pip options
    pass through (e.g. --no-deps, --no-build-isolation, --index-url URL).

    \b
    Examples:
      handle plugins install ./plugins/examples/handle-shakespeare
      handle plugins install -e ./my-plugin
      handle plugins install -U handle-something
    """
    import tempfile

    before = _entry_points()
    with tempfile.TemporaryDirectory(prefix="handle-install-") as tmp:
        report = Path(tmp) / "report.json"
        # --report: exactly which distributions pip installed (pip >= 22.2)
        cmd = [sys.executable, "-m", "pip", "install", "--report", str(report), *specs]
        click.echo(f"$ {' '.join(cmd)}", err=True)
        rc = subprocess.call(cmd)
        installed = _installed_from_report(report)
    if rc != 0:
        click.echo(f"error: pip install failed (exit {rc})", err=True)
        sys.exit(1)
    after = _fresh_listing()
    everything = after["plugins"] + after["skipped"]
    if installed is None:  # no report: what changed in the entry-point group
        touched = [p for p in everything if before.get(p["name"]) != (p["distribution"], p["version"])]
    else:
        touched = [p for p in everything if canonical(p["distribution"]) in installed]
    if not touched:
        if installed == {}:
            click.echo("nothing was installed (already satisfied; -U upgrades, --force-reinstall reinstalls)")
        else:
            names = ", ".join(sorted(installed or {})) or "nothing new"
            click.echo(f"warning: installed {names}, but no new plugin appeared in the 'handle' entry-point group",
                       err=True)
        return
    bad = False
    for p in touched:
        what = f"plugin {p['name']!r} ({p['distribution']} {p['version']})"
        if p["status"] == "loaded":
            click.echo(f"installed {what}: {_describe(p)}")
            for note in p.get("notes", []):
                click.echo(f"  note: {note}")
        elif p["status"] == "skipped":
            click.echo(f"installed {what}, but it is not loaded: HANDLE_LOAD_PLUGINS="
                       f"{after['handle_load_plugins']!r} leaves it out")
        else:
            bad = True
            click.echo(f"error: installed {what}, but it failed to load: {p['error']} "
                       f"(remove it with: handle plugins uninstall -y {p['distribution']})", err=True)
    if bad:
        sys.exit(1)


def _installed_from_report(report: Path) -> dict[str, str] | None:
    """canonical name -> version of what pip installed, from its ``--report`` (None when there is none)."""
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
        return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in data.get("install", [])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


@plugins.command("uninstall")
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
def plugins_uninstall(names: tuple[str, ...], yes: bool) -> None:
    """Uninstall plugin distributions with pip. NAME is a distribution or a plugin (entry-point) name.

    Only distributions that provide a `handle` plugin are removed, and never torch-handle itself (its built-in
    plugins cannot be uninstalled; HANDLE_LOAD_PLUGINS only limits external ones).
    """
    eps = _entry_points()
    by_dist: dict[str, list[str]] = {}
    for plugin, (dist, _) in eps.items():
        by_dist.setdefault(canonical(dist), []).append(plugin)
    dists: dict[str, str] = {}
    for name in names:
        if canonical(name) == CORE_DISTRIBUTION:
            fail(f"{name}: refusing to uninstall the core distribution {CORE_DISTRIBUTION} (use pip if you mean it)")
        if canonical(name) in by_dist:
            dist = next(d for d, _ in eps.values() if canonical(d) == canonical(name))
        elif name in eps:
            dist = eps[name][0]
            if canonical(dist) == CORE_DISTRIBUTION:
                fail(f"{name}: is a built-in plugin of {CORE_DISTRIBUTION} and cannot be uninstalled")
        else:
            external = ", ".join(sorted(f"{p} ({d})" for p, (d, _) in eps.items()
                                        if canonical(d) != CORE_DISTRIBUTION))
            fail(f"{name}: no installed distribution provides a handle plugin of that name "
                 f"(external plugins: {external or 'none'})")
        dists[canonical(dist)] = dist
    if not yes:
        for key, dist in dists.items():
            click.echo(f"{dist}: plugin(s) {', '.join(sorted(by_dist[key]))}")
        if not click.confirm(f"Uninstall {', '.join(dists.values())}?", default=False):
            click.echo("nothing uninstalled")
            sys.exit(1)
    cmd = [sys.executable, "-m", "pip", "uninstall", "-y", *dists.values()]
    click.echo(f"$ {' '.join(cmd)}", err=True)
    rc = subprocess.call(cmd)
    if rc != 0:
        click.echo(f"error: pip uninstall failed (exit {rc})", err=True)
        sys.exit(1)
    for key, dist in dists.items():
        click.echo(f"uninstalled {dist}: plugin(s) {', '.join(sorted(by_dist[key]))} removed")
