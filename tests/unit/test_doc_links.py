"""The pages point at things that exist: every relative link of README.md and docs/*.md resolves (file and heading),
and every repository path and ``torch_handle`` name the pages quote in inline code is still there.

Static: reads the pages and the source, imports nothing of the project.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from tests.doc_pages import REPO, anchors, outside_fences, pages, rel, relative_links

PENDING: dict[str, str] = {}
"""Link targets another branch adds: a missing one is accepted, an existing one is checked like any other."""

CODE_SPAN = re.compile(r"`([^`]+)`")  # a span may wrap onto the next line
REPO_PATH = re.compile(r"^(?:torch_handle|handle_cli|plugins|tests|benchmarks|presets|docs)/[\w./-]*$")
DOTTED = re.compile(r"^torch_handle(?:\.\w+)+$")


def test_relative_links_resolve():
    problems = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        for line, target, anchor in relative_links(text):
            path = (page.parent / target).resolve() if target else page
            where = f"{rel(page)}:{line}: ({target}{'#' + anchor if anchor else ''})"
            if not path.exists():
                if str(path.relative_to(REPO)) not in PENDING:
                    problems.append(f"{where}: no file {path.relative_to(REPO)}")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text(encoding="utf-8")):
                problems.append(f"{where}: no heading #{anchor} in {path.relative_to(REPO)}")
    assert not problems, "\n".join(problems)


def code_spans(page: Path) -> list[tuple[int, str]]:
    text = outside_fences(page.read_text(encoding="utf-8"))
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())) for m in CODE_SPAN.finditer(text)]


def test_quoted_repository_paths_exist():
    """`torch_handle/model/`, `plugins/sinks.py`, `tests/test_estimate.py`, ... in the prose of the pages."""
    problems = [f"{rel(page)}:{line}: `{span}` does not exist"
                for page in pages() for line, span in code_spans(page)
                if REPO_PATH.match(span) and not (REPO / span).exists() and span not in PENDING]
    assert not problems, "\n".join(problems)


@cache
def top_level_names(path: Path) -> frozenset[str]:
    """Names a module defines or imports at its top level, plus the string constants it holds (the lazy names
    of a module with ``__getattr__``, as ``torch_handle.api`` has)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    names.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and n.value.isidentifier())
    return frozenset(names)


def name_problem(dotted: str) -> str | None:
    """None when ``torch_handle.a.b[.Name[.attr]]`` names a module, or a name defined at the top of one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):  # the longest prefix that is a module or package
        base = REPO.joinpath(*parts[:i])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                if i == len(parts) or parts[i] in top_level_names(path):
                    return None
                return f"{'.'.join(parts[:i])} defines no {parts[i]}"
    return "no such module"


def test_quoted_torch_handle_names_exist():
    """`torch_handle.checkpoint.convert`, `torch_handle.data.datasets.GlobalBatchSampler`, ... in the prose."""
    problems = [f"{rel(page)}:{line}: `{span}`: {why}"
                for page in pages() for line, span in code_spans(page)
                if DOTTED.match(span) and (why := name_problem(span))]
    assert not problems, "\n".join(problems)


def test_a_moved_name_is_found():
    assert name_problem("torch_handle.data.datasets.GlobalBatchSampler") is None
    assert name_problem("torch_handle.api.Strategy") is None  # lazy (PEP 562)
    assert name_problem("torch_handle.observe") is None
    assert name_problem("torch_handle.model_py") == "torch_handle defines no model_py"
    assert name_problem("torch_handle.data.datasets.NoSampler") == "torch_handle.data.datasets defines no NoSampler"
