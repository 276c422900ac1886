"""docs/plugins.md's table of hooks says what the code does: one row per hook of ``torch_handle/hookspecs.py``, each
``register(...)`` with the parameters and defaults of the callback the registry really passes, each factory
signature written as the hook's docstring in hookspecs.py writes it (the home of the hook signatures)."""

from __future__ import annotations

import ast
import inspect
import re
from types import SimpleNamespace

from torch_handle import hookspecs
from torch_handle.hookspecs import hookimpl
from torch_handle.registry import PluginInfo, PluginRegistry

from tests.doc_pages import DOCS

PAGE = DOCS / "plugins.md"
ONLY_FOR = {"preflight": {"handle_register_datasets", "handle_register_models"}, "prepare": {"handle_register_datasets"}}
"""Parameters the registry's callback accepts for every kind but honours for some hooks only."""


def table() -> dict[str, list[str]]:
    """hook name -> the code spans of each cell after the first, for each row of the hooks table."""
    rows = {}
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if cells and (m := re.fullmatch(r"`(handle_register_\w+)`", cells[0])):
            rows[m.group(1)] = cells[1:]
    return rows


def callbacks() -> dict[str, object]:
    """hook name -> the ``register`` callback the registry passes to it, captured by a plugin."""
    seen = {}

    def capture(hook):
        def impl(register):
            seen[hook] = register

        impl.__name__ = hook
        return hookimpl(impl)

    plugin = SimpleNamespace(**{name: capture(name) for name in hook_names()})
    registry = PluginRegistry()
    registry.add_plugin(plugin, PluginInfo("capture", "test", "0", builtin=False))
    return seen


def hook_names() -> list[str]:
    return [n for n, f in vars(hookspecs).items() if n.startswith("handle_register_") and callable(f)]


def documented(signature: str) -> list[tuple[str, object]]:
    """(name, default or inspect.Parameter.empty) of ``register(a, b=1)`` as the page writes it."""
    call = ast.parse(signature, mode="eval").body
    assert isinstance(call, ast.Call) and call.func.id == "register", signature
    return [(a.id, inspect.Parameter.empty) for a in call.args] + \
        [(k.arg, ast.literal_eval(k.value)) for k in call.keywords]


def test_one_row_per_hook():
    assert sorted(table()) == sorted(hook_names())


def test_register_signatures_are_the_registrys():
    real_callbacks = callbacks()
    problems = []
    for hook, cells in table().items():
        real = [(p.name, p.default) for p in inspect.signature(real_callbacks[hook]).parameters.values()
                if hook in ONLY_FOR.get(p.name, {hook})]
        shown = documented(re.search(r"`(register\(.*?\))`", cells[0]).group(1))
        if shown != real:
            problems.append(f"{hook}: the page says {shown}, the registry takes {real}")
    assert not problems, "\n".join(problems)


def test_factory_signatures_are_the_hookspecs():
    problems = []
    for hook, cells in table().items():
        m = re.search(r"`(factory\(.*?)`", cells[1])
        if m and m.group(1) not in inspect.getdoc(getattr(hookspecs, hook)):
            problems.append(f"{hook}: `{m.group(1)}` is not what torch_handle/hookspecs.py says")
    assert not problems, "\n".join(problems)
