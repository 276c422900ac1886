"""The commands the pages show exist, and each is either run by a test or marked as not run; the README stays a
README (its size, its command block, its quick start, its presets table).

In-process and static: the click command tree is read, nothing is run (``tests/test_docs.py`` runs the cheap
blocks, ``tests/test_learn_doc.py`` walks docs/learn.md, which is left out here: its test has its own rules).
"""

from __future__ import annotations

import dataclasses
import re
import shlex

from tests.doc_pages import (CHEAP, LEARN, NOT_CHEAP_OPTIONS, NOT_RUN, README, REPO, SHELL, Command, check_words,
                             commands, pages, prose_commands, read_blocks, rel, resolve, shown_commands)

README_MAX_BYTES = 12 * 1024
PLUGIN_EXAMPLE_COMMANDS = {"mydata-stats"}
"""Commands that a page's plugin example registers: not part of the CLI."""


def other_pages():
    return [p for p in pages() if p != LEARN]


def blocks(page):
    return read_blocks(page.read_text(encoding="utf-8"), rel(page))


def handle_commands(block) -> list[Command]:
    return [s for s in block.steps if isinstance(s, Command) and s.argv[0] == "handle"]


def test_shell_fences_say_whether_a_test_runs_them():
    """```bash: run by tests/test_docs.py; ```bash MARKER: checked, not run. A misspelled marker would silently
    make a block unchecked or run it."""
    problems = [f"{rel(page)}:{b.line}: fence ```{b.info}: use ```bash (run by a test) or ```bash MARKER, "
                f"MARKER one of {', '.join(sorted(NOT_RUN))}"
                for page in other_pages() for b in blocks(page)
                if b.language in SHELL and not (b.language == "bash" and (not b.marker or b.marker in NOT_RUN))]
    assert not problems, "\n".join(problems)


def test_blocks_that_are_run_are_cheap():
    """A ```bash block holds only `handle` commands that take seconds (else mark it `slow`, `gpu`, ...)."""
    problems = []
    for page in other_pages():
        for b in blocks(page):
            if b.info != "bash":
                continue
            for s in b.steps:
                if not isinstance(s, Command) or s.argv[0] != "handle" or s.background:
                    what = s.text if isinstance(s, Command) else s
                    problems.append(f"{rel(page)}:{b.line}: `{what}` cannot run in a ```bash block")
                    continue
                path, _, rest = resolve(s.argv)
                if not ("--help" in rest or (path in CHEAP and not NOT_CHEAP_OPTIONS & set(rest))):
                    problems.append(f"{rel(page)}:{s.line}: `{s.text}` is not cheap to run: mark the block")
    assert not problems, "\n".join(problems)


def test_every_handle_command_shown_exists():
    """In shell blocks (run or not), in `$ handle ...` lines of output shown, and in inline code in the prose:
    each names an existing subcommand and only its options."""
    problems = []
    for page in other_pages():
        text = page.read_text(encoding="utf-8")
        shown: list[tuple[int, list[str]]] = []
        for b in read_blocks(text, rel(page)):
            shown += [(s.line, s.argv) for s in handle_commands(b)]
            shown += [(line, shlex.split(cmd)) for line, cmd in shown_commands(b)]
        for line, span in prose_commands(text):
            try:
                shown.append((line, shlex.split(span)))
            except ValueError:
                shown.append((line, span.split()))
        for line, words in shown:
            if len(words) > 1 and words[1] in PLUGIN_EXAMPLE_COMMANDS:
                continue
            if (why := check_words(words)) is not None:
                problems.append(f"{rel(page)}:{line}: `{shlex.join(words)}`: {why}")
    assert not problems, "\n".join(problems)


def test_the_readme_fits_on_a_few_screens():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes (at most {README_MAX_BYTES:,}): move to docs/"


def test_the_readme_shows_every_command():
    """Its command block has a line for every command of the CLI."""
    shown = {resolve(s.argv)[0] for b in blocks(README) if b.language in SHELL for s in handle_commands(b)}
    missing = [" ".join(p) for p in commands() if p not in shown]
    assert not missing, f"README.md shows no example of: {', '.join(f'handle {m}' for m in missing)}"


def test_the_readme_quick_start_runs_make_targets():
    first = next(b for b in blocks(README) if b.language in SHELL)
    assert [s.argv for s in first.steps] == [["make", "demo"], ["make", "test"]]
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^demo:", makefile, re.MULTILINE) and re.search(r"^test:", makefile, re.MULTILINE)


def test_the_presets_table_lists_every_core_key():
    """The tables the core owns ([run], [training], [launch]) list every field of their dataclass."""
    from torch_handle.config.schema import LaunchConfig, RunConfig, TrainingConfig

    text = README.read_text(encoding="utf-8")
    problems = []
    for table, cls in (("run", RunConfig), ("training", TrainingConfig), ("launch", LaunchConfig)):
        row = re.search(rf"^\| `\[{table}\]` \|(.*)$", text, re.MULTILINE)
        assert row, f"README.md: no row for [{table}] in the presets table"
        listed = set(re.findall(r"`(\w+)`", row.group(1)))
        problems += [f"{table}.{f.name}" for f in dataclasses.fields(cls) if f.name not in listed]
    assert not problems, f"README.md's presets table leaves out: {', '.join(problems)}"


def test_the_readme_names_every_shipped_preset():
    """Its "Shipped presets:" sentence names each presets/*.toml (issue 29: `3d` was left out)."""
    text = README.read_text(encoding="utf-8")
    sentence = re.search(r"Shipped presets: (.*?)\.\n\n", text, re.DOTALL)
    assert sentence, "README.md: no \"Shipped presets: ...\" paragraph"
    named = set(re.findall(r"`([\w.-]+)`", sentence.group(1)))
    missing = sorted(p.stem for p in (REPO / "presets").glob("*.toml") if p.stem not in named)
    assert not missing, f"README.md's shipped presets leave out: {', '.join(missing)}"


def test_the_top_level_help_and_the_readme_name_the_same_kinds_of_parallelism():
    """`handle --help` and the README's opening paragraph both name the data-parallel strategies and tensor and
    pipeline parallelism (issue 29: the help named only DDP, ZeRO and FSDP2)."""
    from click.testing import CliRunner

    from handle_cli.main import cli

    help_text = " ".join(CliRunner().invoke(cli, ["--help"]).output.split())
    opening = " ".join(README.read_text(encoding="utf-8").split("\n\n")[1].split())
    for text, where in ((help_text, "handle --help"), (opening, "README.md's first paragraph")):
        missing = [w for w in ("DDP", "ZeRO", "FSDP2", "tensor", "pipeline") if w not in text]
        assert not missing, f"{where} does not name {', '.join(missing)}"
