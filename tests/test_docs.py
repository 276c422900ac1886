"""The ```bash blocks of README.md and docs/*.md (docs/learn.md aside: ``tests/test_learn_doc.py``) run here.

Only cheap commands may stand in such a block (``tests/unit/test_doc_commands.py`` holds them to
``tests.doc_pages.CHEAP``); the rest are fenced ```bash MARKER and only checked against the CLI. Each command runs
through ``handle``'s click command tree in this process (``handle`` is ``handle_cli.main:cli``; a new interpreter
would spend more CPU on its imports than a cheap command on its work), in a scratch directory whose ``presets`` links
to the repository's, with its ``NAME=value`` prefix in the environment; ``handle estimate`` gets a tiny model
appended (its arithmetic is ``tests/test_estimate.py``'s to check). Each has to exit 0 and print something.
"""

from __future__ import annotations

import re
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
def test_the_command_runs(page, cmd, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from handle_cli.main import cli

    (tmp_path / "presets").symlink_to(REPO / "presets", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    path, _, _ = resolve(cmd.argv)
    t0 = time.perf_counter()
    result = CliRunner().invoke(cli, [*cmd.argv[1:], *tiny_args(path, cmd.argv)], env=cmd.env, prog_name="handle")
    output = result.stdout + result.stderr
    where = f"{page}:{cmd.line}: `{cmd.text}` ({time.perf_counter() - t0:.1f} s)"
    assert result.exit_code == 0, f"{where}: exit code {result.exit_code} {result.exception!r}\n{output[-4000:]}"
    assert result.stdout.strip(), f"{where}: printed nothing\n{output[-4000:]}"
    if path == ("estimate",):
        assert re.search(r"[\d,]+ parameters", output) and "activations" in output, f"{where}: no table\n{output}"


def test_some_page_runs_commands():
    assert len(COMMANDS) >= 3, COMMANDS
