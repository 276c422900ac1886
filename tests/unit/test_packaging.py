"""Every package in the tree is in pyproject.toml's package list, so a non-editable install ships it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_is_listed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    dirs = {name: ROOT / path for name, path in setuptools.get("package-dir", {}).items()}
    found = set()
    for top in ("torch_handle", "handle_cli", "handle_plugins"):
        base = dirs.get(top, ROOT / top)
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if "examples" in rel.parts:  # the example plugin is its own project
                continue
            found.add(".".join((top, *rel.parts)))
    assert "torch_handle.model" in found
    assert found == listed, {"missing from pyproject.toml": sorted(found - listed), "not found": sorted(listed - found)}
