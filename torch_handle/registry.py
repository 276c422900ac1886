"""The plugin registry: loads the ``handle`` entry points with pluggy and resolves preset names to plugins.

Every plugin, built-in or not, is loaded inside its own error boundary: one that fails to import or declares a
misspelled hook is recorded as failed (with a one-line reason) and skipped, and every other plugin and command
keeps working. ``HANDLE_LOAD_PLUGINS`` (comma-separated entry-point names; empty = none) limits which external
plugins are loaded, so a user can always recover from a broken one. The built-ins always load.

Besides models, datasets, strategies and profilers, a plugin may contribute preset directories
(``handle_register_presets``), click commands (``handle_register_commands``) and telemetry sinks
(``handle_register_sinks``); all are collected inside the same error boundary. Whether a command may be used
(never in place of a core command) is the CLI's decision.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata as md
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pluggy

from torch_handle import hookspecs
from torch_handle.errors import PresetError
from torch_handle.common.text import one_line

ENTRY_POINT_GROUP = "handle"
CORE_DISTRIBUTION = "torch-handle"
KINDS = ("model", "dataset", "strategy", "profiler")
_HOOK_OF_KIND = {
    "model": "handle_register_models",
    "dataset": "handle_register_datasets",
    "strategy": "handle_register_strategies",
    "profiler": "handle_register_profilers",
}
_EXTRA_HOOKS = {"handle_register_presets": "_presets_fn", "handle_register_commands": "_commands_fn",
                "handle_register_sinks": "_sinks_fn"}
"""Hooks that contribute something other than a kind (preset directories, CLI commands, telemetry sinks) ->
the method that makes their ``register`` callback."""


@dataclass
class Registration:
    """One name a plugin registered for one kind."""

    kind: str
    name: str
    config_cls: type
    factory: Callable[..., Any]
    description: str = ""
    check_preset: Callable[[Any, Any], Any] | tuple[Callable[[Any, Any], Any], ...] | None = None
    """Optional ``check(options, preset)`` for settings that span tables, or a tuple of such checks, each run on its
    own: a check yields each ``InvalidValue`` (all are reported) or raises the first
    (:mod:`torch_handle.config.problems`)."""
    plugin: str = ""
    """Name of the plugin (entry point) that registered it."""
    preflight: Callable[..., None] | None = None
    """Optional pre-flight check run by ``handle run`` / ``handle validate`` in the ``handle`` process before
    anything starts: a dataset's ``preflight(options)`` (paths exist, text decodes: ``DataError``), a model's
    ``preflight(options, preset)`` (files it initialises from: ``CheckpointError``; not on a resume)."""
    prepare: Callable[..., Any] | None = None
    """Optional, datasets only: ``prepare(options, cache: Path, progress) -> DataIdentity | None``, run by the
    launcher (no torch) after the pre-flight and before any worker starts: it readies what the workers will only
    open (``text``, ``pydoc``: the prepared token shards) and returns the data's identity, which a resume compares
    with its checkpoint's (``progress``: called with :class:`torch_handle.data.prepare.Progress` while preparing)."""


@dataclass
class PluginInfo:
    """A loaded (or failed) plugin, as ``handle plugins list`` shows it."""

    name: str
    distribution: str
    version: str
    builtin: bool
    status: str = "loaded"
    """``loaded`` or ``failed``."""
    error: str = ""
    registered: dict[str, list[str]] = field(default_factory=dict)
    """kind -> names this plugin registered."""
    presets: list[str] = field(default_factory=list)
    """Preset directories this plugin contributed (``handle_register_presets``)."""
    commands: list[str] = field(default_factory=list)
    """CLI command names this plugin contributed (``handle_register_commands``)."""
    notes: list[str] = field(default_factory=list)
    """Problems that did not fail the plugin (for example a command refused because a core command has its name)."""


@dataclass
class SinkRegistration:
    """A telemetry sink a plugin registered (``handle_register_sinks``); no preset table selects it: every
    registered sink is opened on rank 0 of every run (see :class:`torch_handle.observe.telemetry.Sink`)."""

    name: str
    factory: Callable[..., Any]
    """``factory(run_dir: Path, preset) -> Sink | None``."""
    description: str = ""
    plugin: str = ""


class PluginRegistry:
    """Plugins by kind and name, plus the record of every plugin that was tried."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("handle")
        self.pm.add_hookspecs(hookspecs)
        self.registrations: dict[str, dict[str, Registration]] = {k: {} for k in KINDS}
        self.plugins: dict[str, PluginInfo] = {}
        self.lost: dict[tuple[str, str], str] = {}
        """(kind, name) -> plugin: names a plugin registered before it failed (so a preset gets the cause)."""
        self.preset_dirs: list[tuple[str, Path]] = []
        """(plugin, directory) of every preset directory a loaded plugin contributed, in load order."""
        self.commands: dict[str, tuple[str, Any]] = {}
        """command name -> (plugin, click command) contributed by loaded plugins."""
        self.skipped: dict[str, PluginInfo] = {}
        """External plugins not loaded (not imported) because ``HANDLE_LOAD_PLUGINS`` leaves them out."""
        self.sinks: dict[str, SinkRegistration] = {}
        """sink name -> registration, in load order (listed in the plugins' ``registered["sink"]``)."""

    # -- loading -------------------------------------------------------------------------------------------------
    def add_plugin(self, obj: Any, info: PluginInfo) -> None:
        """Register one plugin object and collect its registrations; failures are recorded, never raised."""
        self.plugins[info.name] = info
        try:
            self.pm.register(obj, name=info.name)
            self.pm.check_pending()  # a misspelled hook name is an error, not silence
        except Exception as e:  # noqa: BLE001 - the error boundary is the point
            self._fail(info, obj, f"bad hook: {one_line(e)}")
            return
        for kind, hook_name in _HOOK_OF_KIND.items():
            impls = [i for i in getattr(self.pm.hook, hook_name).get_hookimpls() if i.plugin is obj]
            for impl in impls:
                try:
                    impl.function(register=self._register_fn(kind, info))
                except Exception as e:  # noqa: BLE001
                    self._fail(info, obj, f"{hook_name} raised {one_line(e)}")
                    return
        for hook_name in _EXTRA_HOOKS:
            impls = [i for i in getattr(self.pm.hook, hook_name).get_hookimpls() if i.plugin is obj]
            make = getattr(self, _EXTRA_HOOKS[hook_name])
            for impl in impls:
                try:
                    impl.function(register=make(info))
                except Exception as e:  # noqa: BLE001
                    self._fail(info, obj, f"{hook_name} raised {one_line(e)}")
                    return
        for kind, names in info.registered.items():
            for name in names:
                self.lost.pop((kind, name), None)

    def _register_fn(self, kind: str, info: PluginInfo) -> Callable[..., None]:
        def register(name: str, config_cls: type, factory: Callable[..., Any], description: str = "",
                     check_preset: Any = None,
                     preflight: Callable[..., None] | None = None,
                     prepare: Callable[..., Any] | None = None) -> None:
            if not isinstance(name, str) or not name:
                raise TypeError(f"{kind} name must be a non-empty string, got {name!r}")
            self.lost[(kind, name)] = info.name  # until the plugin is done: if it fails, the name points at it
            if name in self.registrations[kind]:
                other = self.registrations[kind][name].plugin
                raise ValueError(f"{kind} {name!r} is already registered by plugin {other!r}")
            if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
                raise TypeError(f"{kind} {name!r}: config_cls must be a dataclass, got {config_cls!r}")
            typing.get_type_hints(config_cls)  # an annotation that cannot be resolved fails the plugin now
            if not callable(factory):
                raise TypeError(f"{kind} {name!r}: factory must be callable, got {factory!r}")
            if isinstance(check_preset, list):
                check_preset = tuple(check_preset)
            checks = check_preset if isinstance(check_preset, tuple) else (check_preset,)
            for hook_name, hook in (*(("check_preset", c) for c in checks), ("preflight", preflight),
                                    ("prepare", prepare)):
                if hook is not None and not callable(hook):
                    raise TypeError(f"{kind} {name!r}: {hook_name} must be callable, got {hook!r}")
            if preflight is not None and kind not in ("dataset", "model"):
                raise TypeError(f"{kind} {name!r}: preflight is only run for datasets and models")
            if prepare is not None and kind != "dataset":
                raise TypeError(f"{kind} {name!r}: prepare is only run for datasets")
            self.registrations[kind][name] = Registration(kind, name, config_cls, factory, description,
                                                          check_preset, info.name, preflight, prepare)
            info.registered.setdefault(kind, []).append(name)

        return register

    def _presets_fn(self, info: PluginInfo) -> Callable[..., None]:
        def register(directory: str | os.PathLike) -> None:
            if not isinstance(directory, (str, os.PathLike)):
                raise TypeError(f"presets directory must be a path, got {directory!r}")
            path = Path(directory).expanduser().resolve()
            if not path.is_dir():
                raise NotADirectoryError(f"presets directory {str(path)!r} does not exist")
            if str(path) not in info.presets:
                info.presets.append(str(path))
                self.preset_dirs.append((info.name, path))

        return register

    def _commands_fn(self, info: PluginInfo) -> Callable[..., None]:
        def register(command: Any) -> None:
            # duck-typed click.Command: this library does not import click
            name = getattr(command, "name", None)
            if not isinstance(name, str) or not name or not callable(getattr(command, "main", None)) \
                    or not callable(getattr(command, "invoke", None)):
                raise TypeError(f"expected a click command with a name, got {command!r}")
            if name in self.commands:
                raise ValueError(f"command {name!r} is already registered by plugin {self.commands[name][0]!r}")
            self.commands[name] = (info.name, command)
            info.commands.append(name)

        return register

    def _sinks_fn(self, info: PluginInfo) -> Callable[..., None]:
        def register(name: str, factory: Callable[..., Any], description: str = "") -> None:
            if not isinstance(name, str) or not name:
                raise TypeError(f"sink name must be a non-empty string, got {name!r}")
            if name in self.sinks:
                raise ValueError(f"sink {name!r} is already registered by plugin {self.sinks[name].plugin!r}")
            if not callable(factory):
                raise TypeError(f"sink {name!r}: factory must be callable, got {factory!r}")
            self.sinks[name] = SinkRegistration(name, factory, str(description), info.name)
            info.registered.setdefault("sink", []).append(name)

        return register

    def _fail(self, info: PluginInfo, obj: Any, reason: str) -> None:
        info.status, info.error = "failed", reason
        for name in info.registered.pop("sink", []):
            self.sinks.pop(name, None)
        for kind, names in info.registered.items():
            for name in names:
                self.registrations[kind].pop(name, None)
        info.registered = {}
        self.preset_dirs = [(p, d) for p, d in self.preset_dirs if p != info.name]
        for name in info.commands:
            if self.commands.get(name, ("",))[0] == info.name:
                del self.commands[name]
        info.presets, info.commands = [], []
        if obj is not None and self.pm.is_registered(obj):
            self.pm.unregister(obj)

    # -- lookup --------------------------------------------------------------------------------------------------
    def get(self, kind: str, name: str, *, key: str | None = None) -> Registration:
        """The registration of ``name`` for ``kind``.

        Raises:
            PresetError: naming the available plugins, or the cause when the plugin that provides it failed.
        """
        try:
            return self.registrations[kind][name]
        except KeyError:
            pass
        owner = self.plugins.get(self.lost.get((kind, name), ""))
        if owner is not None and owner.status == "failed":
            raise PresetError(f"{kind} {name!r} is provided by plugin {owner.name!r}, which failed to load: "
                              f"{owner.error}", key=key)
        for info in self.plugins.values():
            if info.status == "failed" and name in (info.name, *info.name.split(".")):
                raise PresetError(f"{kind} plugin {name!r} failed to load: {info.error}", key=key)
        known = sorted(self.registrations[kind])
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        failed = [i.name for i in self.plugins.values() if i.status == "failed"]
        also = f"; plugins that failed to load: {', '.join(failed)}" if failed else ""
        if self.skipped:
            also += f"; not loaded because of HANDLE_LOAD_PLUGINS: {', '.join(sorted(self.skipped))}"
        raise PresetError(f"unknown {kind} {name!r}{hint} (available: {', '.join(known) or 'none'}{also})", key=key)

    def names(self, kind: str) -> list[str]:
        return sorted(self.registrations[kind])


def _allowed_external() -> set[str] | None:
    raw = os.environ.get("HANDLE_LOAD_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def load_registry() -> PluginRegistry:
    """Build a registry from the ``handle`` entry-point group (built-in plugins included)."""
    registry = PluginRegistry()
    allowed = _allowed_external()
    for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = ep.dist.name if ep.dist is not None else "?"
        builtin = dist == CORE_DISTRIBUTION
        info = PluginInfo(name=ep.name, distribution=dist, version=ep.dist.version if ep.dist else "?",
                          builtin=builtin)
        if not builtin and allowed is not None and ep.name not in allowed:
            info.status, info.error = "skipped", "not in HANDLE_LOAD_PLUGINS"
            registry.skipped[info.name] = info
            continue
        try:
            obj = ep.load()
        except BaseException as e:  # noqa: BLE001 - SystemExit from a plugin must not end the CLI either
            if isinstance(e, KeyboardInterrupt):
                raise
            registry.plugins[info.name] = info
            registry._fail(info, None, f"import failed: {one_line(e)}")
            continue
        registry.add_plugin(obj, info)
    return registry


_REGISTRY: PluginRegistry | None = None


def get_registry() -> PluginRegistry:
    """The process-wide registry, loaded on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = load_registry()
    return _REGISTRY
