"""The import graph of the project, read from source with ``ast``: no cycles, no upward imports.

Every import counts, also one inside a function: a cycle hidden by a lazy import is still a cycle (it is what
made the registry ``Any``-typed before). The layers, top to bottom:

    handle_cli      click commands and the dashboard; nothing else imports it
    handle_plugins  the built-in plugins (plugins/); they depend on torch_handle, never the reverse
    torch_handle    the library: no click, no textual

Inside torch_handle, each part (a subpackage such as ``torch_handle/observe/``, or one of the few top-level
modules) may import only the parts its row of ``LAYERS`` names, so a new edge is a decision taken in review.
From the bottom:

    common < errors < hookspecs < registry < config < rundir < observe < parallel < model, data < checkpoint
           < launch, infer < train < plan;   api (the plugins' facade) on top

``launch`` sits below ``train``: the launcher starts workers by module name (``-m torch_handle.train.worker``) and
never imports them; both use the process helpers of ``common.procs`` (``die_with_parent``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_BASE = {"common", "errors"}
LAYERS: dict[str, set[str]] = {
    "common": set(),
    "errors": set(),
    "hookspecs": set(),
    "registry": _BASE | {"hookspecs"},
    "config": _BASE | {"registry"},
    "rundir": _BASE,
    "observe": _BASE | {"config", "rundir"},
    "parallel": _BASE | {"config", "observe"},  # the schedules' names; the heartbeat and saved-tensor counter
    "model": _BASE | {"config", "parallel"},  # config: the schema's field ranges (param) for TransformerArgs
    "data": _BASE,
    "finetune": _BASE | {"config", "parallel", "model"},  # LoRA/QLoRA wrap the model's linears
    # parallel: the TP dropout stream; model: hf_names, for the Hugging Face directory (hf_dir)
    "checkpoint": _BASE | {"registry", "config", "rundir", "observe", "parallel", "model"},
    "launch": _BASE | {"registry", "config", "rundir", "observe", "checkpoint", "data"},
    # infer: the in-loop downstream evaluation (train.eval_tasks scores lm-eval tasks through infer's HandleLM)
    "train": _BASE | {"registry", "config", "rundir", "observe", "parallel", "model", "data", "finetune", "checkpoint",
                      "launch", "infer"},
    "plan": _BASE | {"registry", "config", "rundir", "observe", "parallel", "model", "data", "finetune", "checkpoint",
                     "launch", "train"},
    "infer": _BASE | {"registry", "config", "rundir", "observe", "model", "data", "finetune", "checkpoint"},
    "api": _BASE | {"hookspecs", "registry", "config", "rundir", "observe", "parallel", "model", "data", "checkpoint",
                    "train"},
}
"""part of torch_handle -> the parts it may import (its own modules aside)."""
TOP_LEVEL_MAX = 6
"""Modules directly in torch_handle/, __init__.py included; everything else lives in a subpackage."""
LINES_MAX = 600
PACKAGES = {"torch_handle": ROOT / "torch_handle", "handle_cli": ROOT / "handle_cli",
            "handle_plugins": ROOT / "plugins"}


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for the three packages (the example plugin is a separate project)."""
    out = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root)
            if rel.parts[0] == "examples":
                continue
            parts = [package, *rel.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Project modules that ``module`` imports anywhere in its source (``from a import b`` names a.b when b
    is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `import torch_handle.x.y` where only torch_handle.x is ours
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(m, p, known) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _external(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_graph_is_read() -> None:
    graph = import_graph()
    # a few edges that exist: if the reader broke, the other tests would pass vacuously
    assert "torch_handle.errors" in graph["torch_handle.config.loader"]
    assert "torch_handle.registry" in graph["torch_handle.config.loader"]
    assert "torch_handle.api" in graph["handle_plugins.transformer"]
    assert "handle_cli.common" in graph["handle_cli.main"]
    assert "handle_plugins.strategies.single" in graph["handle_plugins.strategies.ddp"]


def test_no_import_cycles() -> None:
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_cycle_detection_finds_a_planted_cycle() -> None:
    graph = import_graph()
    graph["torch_handle.errors"] = {"torch_handle.config.loader"}
    assert any({"torch_handle.config.loader", "torch_handle.errors"} <= set(c) for c in _cycles(graph))


@pytest.mark.parametrize("lower", ["torch_handle", "handle_plugins"])
def test_no_upward_imports(lower: str) -> None:
    above = {"torch_handle": ("handle_cli", "handle_plugins"), "handle_plugins": ("handle_cli",)}[lower]
    bad = sorted(f"{m} -> {d}" for m, deps in import_graph().items() if m.split(".")[0] == lower
                 for d in deps if d.split(".")[0] in above)
    assert not bad, bad


def test_errors_is_a_leaf() -> None:
    assert import_graph()["torch_handle.errors"] == set()


def test_library_imports_neither_click_nor_textual() -> None:
    for module, path in sorted(_modules().items()):
        if module.split(".")[0] == "torch_handle":
            assert not _external(path) & {"click", "textual", "textual_plotext", "rich"}, module


def test_example_plugin_imports_only_the_public_module() -> None:
    """Third-party plugins get one import: ``torch_handle.api`` (the example plugin is what authors copy)."""
    example = ROOT / "plugins" / "examples" / "handle-shakespeare" / "handle_shakespeare"
    used = set()
    for path in example.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch_handle"):
                used.add(node.module)
            elif isinstance(node, ast.Import):
                used |= {a.name for a in node.names if a.name.startswith("torch_handle")}
    assert used == {"torch_handle.api"}, used



def _part(module: str) -> str | None:
    """``torch_handle.observe.tail`` -> ``observe``; ``torch_handle.errors`` -> ``errors``; None outside the library."""
    parts = module.split(".")
    return (parts[1] if len(parts) > 1 else "__init__") if parts[0] == "torch_handle" else None


def layering_breaches(graph: dict[str, set[str]], layers: dict[str, set[str]]) -> list[str]:
    out = []
    for module, deps in sorted(graph.items()):
        part = _part(module)
        if part in (None, "__init__"):
            continue
        if part not in layers:
            out.append(f"{module}: part {part!r} has no row in LAYERS")
            continue
        out += [f"{module} -> {d}" for d in sorted(deps)
                if (other := _part(d)) not in (None, "__init__", part) and other not in layers[part]]
    return out


def test_every_import_follows_the_layering_table() -> None:
    bad = layering_breaches(import_graph(), LAYERS)
    assert not bad, "imports that LAYERS does not allow:\n" + "\n".join(bad)


def test_layering_check_finds_a_planted_breach() -> None:
    graph = import_graph()
    graph["torch_handle.model.transformer"] = graph["torch_handle.model.transformer"] | {"torch_handle.train.trainer"}
    assert "torch_handle.model.transformer -> torch_handle.train.trainer" in layering_breaches(graph, LAYERS)


def test_the_layering_table_is_acyclic() -> None:
    assert not _cycles({p: set(deps) for p, deps in LAYERS.items()})


def test_top_level_holds_few_modules() -> None:
    top = sorted(p.name for p in PACKAGES["torch_handle"].glob("*.py"))
    assert len(top) <= TOP_LEVEL_MAX, top
    assert set(LAYERS) >= {p.removesuffix(".py") for p in top} - {"__init__"}


def test_no_module_over_600_lines() -> None:
    long = {str(path.relative_to(ROOT)): n for path in _modules().values()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > LINES_MAX}
    assert not long, long
