"""Reading the project's Markdown pages: fenced blocks, the shell commands in them, inline ``handle ...`` spans, links
and heading anchors; and checking a ``handle`` command against the click command tree. Used by the doc tests
(``tests/test_learn_doc.py``, ``tests/test_docs.py``, ``tests/unit/test_doc_links.py``,
``tests/unit/test_doc_commands.py``).

Fences of shell blocks (```` ```bash INFO ````) say what the tests do with their commands:

* ``bash``: run by a test. docs/learn.md's blocks by ``tests/test_learn_doc.py`` (on tiny settings); every other
  page's by ``tests/test_docs.py``, which accepts only commands that take seconds (:data:`CHEAP`).
* ``bash MARKER`` with a marker of :data:`NOT_RUN`: parsed and checked against the CLI (the subcommands and
  options exist), not run. docs/learn.md has its own, ``learn-later`` (features still being built).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
LEARN = DOCS / "learn.md"

SHELL = ("bash", "sh", "shell", "console")
"""Fence languages whose commands the tests read."""
NOT_RUN = {
    "slow": "trains, benchmarks or builds an environment: minutes",
    "gpu": "needs a CUDA device",
    "cluster": "needs several machines or Slurm",
    "installs": "installs or removes packages in the environment",
    "synopsis": "shows a command's forms ([optional], A|B, placeholders) rather than one command to run",
}
"""Markers after the language of a shell fence whose commands are checked against the CLI but not run."""
CHEAP = {("presets", "list"), ("presets", "show"), ("validate",), ("estimate",), ("plugins", "list"), ("runs",),
         ("env",)}
"""Command paths a ```bash block outside docs/learn.md may run (seconds each); any command with ``--help`` too."""
NOT_CHEAP_OPTIONS = {"--check-dist", "--peak"}
"""Options that make a cheap command slow (they start processes or measure)."""
PLACEHOLDERS = ("...", "<")
"""A word starting like this ends a command's subcommand path in a synopsis (``HANDLE_DEBUG=1 handle ...``)."""

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`(handle [^`]+)`")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# ---------------------------------------------------------------------------------------------------------------
# blocks and commands
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Command:
    argv: list[str]
    line: int  # 1-based line of the page where the command starts
    background: bool = False
    env: dict[str, str] = field(default_factory=dict)  # `NAME=value handle ...`

    @property
    def text(self) -> str:
        return shlex.join(self.argv)


WAIT = "wait"


@dataclass
class Block:
    info: str
    line: int  # line of the opening fence
    body: str = ""
    steps: list[Command | str] = field(default_factory=list)  # Command, or WAIT

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info else ""

    @property
    def marker(self) -> str:
        """What follows the language in the fence's info string (``slow`` in ```` ```bash slow ````)."""
        return self.info.partition(" ")[2].strip()


def parse_block(body: str, first_line: int, page: str = "docs/learn.md") -> list[Command | str]:
    """The commands of a fenced block: ``\\`` continues a line, ``#`` starts a comment, a trailing ``&`` runs the
    command in the background, ``wait`` waits for those, leading ``NAME=value`` words set the environment."""
    steps: list[Command | str] = []
    pending, start = "", first_line
    for i, raw in enumerate(body.splitlines()):
        if not pending:
            start = first_line + i
        stripped = raw.rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        try:
            words = shlex.split(pending + stripped, comments=True)
        except ValueError:  # a script excerpt with unbalanced quotes: its words, roughly
            words = (pending + stripped).split("#")[0].split()
        pending = ""
        if not words:
            continue
        if words == [WAIT]:
            steps.append(WAIT)
            continue
        env = {}
        while words and ENV_ASSIGNMENT.match(words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if not words:
            continue
        background = words[-1] == "&"
        steps.append(Command(words[:-1] if background else words, start, background, env))
    assert not pending, f"{page}:{start}: a line continues (\\) into the end of its block"
    return steps


def read_blocks(text: str, page: str = "docs/learn.md", infos: tuple[str, ...] | None = None) -> list[Block]:
    """Every fenced block of a page; the steps of shell blocks (of those whose info is in ``infos``, when given)."""
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        block = Block(m.group(1).strip(), line, m.group(2))
        wanted = block.info in infos if infos is not None else block.language in SHELL
        if wanted:
            block.steps = parse_block(m.group(2), line + 1, page)
        out.append(block)
    return out


def outside_fences(text: str) -> str:
    """The page with every fenced block blanked (line numbers kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def prose_commands(text: str) -> list[tuple[int, str]]:
    """(line, text) of every inline ``handle ...`` span outside fenced blocks."""
    outside = outside_fences(text)
    return [(outside.count("\n", 0, m.start()) + 1, m.group(1)) for m in INLINE.finditer(outside)]


def shown_commands(block: Block) -> list[tuple[int, str]]:
    """(line, text) of the ``$ handle ...`` lines of a block that is not a shell block (output shown)."""
    return [(block.line + 1 + i, line[2:]) for i, line in enumerate(block.body.splitlines())
            if line.startswith("$ handle ")]


# ---------------------------------------------------------------------------------------------------------------
# checking a command against the CLI
# ---------------------------------------------------------------------------------------------------------------

def cli_root() -> click.Group:
    from handle_cli.main import cli

    return cli


def resolve(words: list[str]) -> tuple[tuple[str, ...], click.Command, list[str]]:
    """(subcommand path, click command, the remaining words) of ``handle w1 w2 ...``; raises LookupError."""
    assert words and words[0] == "handle", words
    cmd: click.Command = cli_root()
    path: list[str] = []
    rest = words[1:]
    while isinstance(cmd, click.Group):
        if not rest or rest[0].startswith("-") or rest[0].startswith(PLACEHOLDERS):
            break
        sub = cmd.commands.get(rest[0])
        if sub is None:
            raise LookupError(f"no command `{' '.join(['handle', *path, rest[0]])}` "
                              f"(valid: {', '.join(sorted(cmd.commands))})")
        path.append(rest[0])
        cmd, rest = sub, rest[1:]
    return tuple(path), cmd, rest


def option_names(cmd: click.Command) -> set[str]:
    names = {"--help", "-h"}
    for p in cmd.params:
        if isinstance(p, click.Option):
            names.update(p.opts)
            names.update(p.secondary_opts)
    return names


def check_words(words: list[str]) -> str | None:
    """None when ``words`` names an existing command and only its options, else what is wrong."""
    try:
        path, cmd, rest = resolve(words)
    except LookupError as e:
        return str(e)
    valid = option_names(cmd)
    for w in rest:
        for part in w.strip("[]()|.,").split("|"):  # `[--json]`, `--weak|--strong` as prose writes them
            if part.startswith("--"):
                opt = part.split("=", 1)[0]
                if opt not in valid:
                    return (f"`handle {' '.join(path)}` has no option {opt} "
                            f"(valid: {', '.join(sorted(o for o in valid if o.startswith('--')))})")
    return None


def commands(cmd: click.Command | None = None, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of every visible leaf command of the CLI (``("bench", "comm")``, ...)."""
    cmd = cmd or cli_root()
    if isinstance(cmd, click.Group):
        return [p for name, sub in sorted(cmd.commands.items()) if not sub.hidden for p in commands(sub, (*path, name))]
    return [path]


# ---------------------------------------------------------------------------------------------------------------
# making commands tiny
# ---------------------------------------------------------------------------------------------------------------

# appended to every `handle run PRESET` and `handle bench scaling PRESET` (and, minus the training keys that do
# not matter there, to `handle estimate`)
TINY_MODEL = {"model.d_model": "32", "model.n_heads": "2", "model.n_layers": "2", "model.d_ff": "64",
              "data.seq_len": "32", "data.vocab_size": "512"}
TINY_TRAINING = {"training.steps": "3", "training.micro_batch_size": "4", "training.eval_every": "0",
                 "training.eval_steps": "1", "training.checkpoint_every": "0", "training.log_every": "1"}
# a profiler schedule that records within 3 steps (the default needs wait 2 + warmup 2 + active 3)
TINY_PROFILER = {"profiler.wait": "0", "profiler.warmup": "1", "profiler.active": "2"}


def sets(pairs: dict[str, str]) -> list[str]:
    return [x for k, v in pairs.items() for x in ("--set", f"{k}={v}")]


def tiny_args(path: tuple[str, ...], argv: list[str]) -> list[str]:
    """What a doc test appends to the page's command (later options win)."""
    text = " ".join(argv)
    if path == ("run",) and "--resume" not in argv:
        extra = sets({**TINY_MODEL, **TINY_TRAINING})
        if "profiler.name=torch" in text:
            extra += sets(TINY_PROFILER)
        return extra
    if path == ("estimate",):
        return sets(TINY_MODEL)
    if path == ("bench", "scaling"):
        return sets({**TINY_MODEL, **TINY_TRAINING}) + ["--steps", "3", "--skip", "1"]
    if path == ("bench", "comm"):
        return ["--sizes", "1K,64K", "--iters", "2", "--warmup", "1"]
    return []


# ---------------------------------------------------------------------------------------------------------------
# links and anchors
# ---------------------------------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", outside_fences(markdown), re.MULTILINE)}


def relative_links(text: str) -> list[tuple[int, str, str]]:
    """(line, target, anchor) of every link outside fences that is not a URL; target "" for ``(#anchor)``."""
    outside = outside_fences(text)
    out = []
    for m in LINK.finditer(outside):
        href = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", href):  # https:, mailto:
            continue
        target, _, anchor = href.partition("#")
        out.append((outside.count("\n", 0, m.start()) + 1, target, anchor))
    return out
