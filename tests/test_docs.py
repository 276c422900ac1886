"""The ```bash blocks of README.md and docs/*.md (docs/learn.md aside: ``tests/test_learn_doc.py``) run here.

Only cheap commands may stand in such a block (``tests/unit/test_doc_commands.py`` holds them to
``tests.doc_pages.CHEAP``); the rest are fenced ```bash MARKER and only checked against the CLI. Each command runs
as ``python -m handle_cli ...`` in a scratch directory whose ``presets`` links to the repository's, with its
``NAME=value`` prefix in the environment; ``handle estimate`` gets a tiny model appended (its arithmetic is
``tests/test_estimate.py``'s to check). Each has to exit 0 and print something.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.doc_pages import LEARN, REPO, Command, pages, read_blocks, rel, resolve, tiny_args

TIMEOUT_S = 120


def runnable() -> list[tuple[str, Command]]:
    out = []
    for page in pages():
        if page == LEARN:
            continue
        for block in read_blocks(page.read_text(encoding="utf-8"), rel(page)):
            if block.info == "bash":
                out += [(rel(page), s) for s in block.steps if isinstance(s, Command)]
    return out


COMMANDS = runnable()


@pytest.mark.parametrize("page,cmd", COMMANDS, ids=[f"{p}:{c.line}" for p, c in COMMANDS])
def test_the_command_runs(page, cmd, tmp_path):
    (tmp_path / "presets").symlink_to(REPO / "presets", target_is_directory=True)
    path, _, _ = resolve(cmd.argv)
    argv = [sys.executable, "-m", "handle_cli", *cmd.argv[1:], *tiny_args(path, cmd.argv)]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=tmp_path, env={**os.environ, **cmd.env}, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    where = f"{page}:{cmd.line}: `{cmd.text}` ({time.perf_counter() - t0:.1f} s)"
    assert proc.returncode == 0, f"{where}: exit code {proc.returncode}\n{output[-4000:]}"
    assert proc.stdout.strip(), f"{where}: printed nothing\n{output[-4000:]}"
    if path == ("estimate",):
        assert re.search(r"[\d,]+ parameters", output) and "activations" in output, f"{where}: no table\n{output}"


def test_some_page_runs_commands():
    assert len(COMMANDS) >= 3, COMMANDS
