"""docs/learn.md is the test: every command in its ```bash blocks runs here, on tiny settings, in page order.

How a command is run:

* ``handle ...`` runs as ``python -m handle_cli ...`` with this interpreter, in a scratch directory whose
  ``presets`` is a link to the repository's, so the page's relative paths (``presets/ddp.toml``,
  ``runs/learn/ddp``) work unchanged and everything the commands write lands under ``tmp_path``.
* Commands that train are made tiny by *appending* options (the last ``--set`` of a key wins, as does the last
  value of a click option): a d_model 32, 2-layer model, seq_len 32, vocabulary 512, 3 steps, no evaluations
  between the first and the last; ``bench comm`` gets two small sizes, ``bench scaling`` 3 steps.
* ``handle tui RUN`` goes through the real CLI command (argument checks included) in this process, with the
  dashboard driven headless by Textual's pilot: the test reads the panels the page tells the reader to look at.
* ``cmd &`` runs in the background until the next ``wait`` (or the end of the block); ``127.0.0.1:PORT`` gets a
  free port. Blocks fenced as ```bash learn-later hold commands of features still being built: they are parsed
  but not run (change the fence to ```bash to run them).

Before anything runs, every ``handle`` command of the page, in the blocks and in inline code in the prose, is
resolved against the click command tree: a subcommand or an option that does not exist fails the test with the
doc line. Each command then has to exit 0 and print what it exists to print. A ``handle run`` into a run directory
no other command reads, of a preset the page already ran or of one (or its ``extends``) another command of the page
launches (a sync mode, a schedule, an implementation, a ZeRO stage: ``Walk.variant``), is checked by ``handle
validate`` with its settings instead of a launch.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.doc_pages import (LEARN, REPO, WAIT, Block, Command, check_words, cli_root, parse_block, prose_commands,
                             resolve, tiny_args)
from tests.doc_pages import read_blocks as read_page_blocks
from tests.helpers import leftovers, tagged_env

DOC = LEARN
RUN_INFO = "bash"
LATER_INFO = "bash learn-later"
TIMEOUT_S = 300  # one command; the first DeepSpeed run of a fresh environment JIT-builds an op (~45 s here)


def read_blocks(text: str) -> list[Block]:
    """The page's fenced blocks, with the commands of its ```bash and ```bash learn-later blocks."""
    return read_page_blocks(text, "docs/learn.md", (RUN_INFO, LATER_INFO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------
# the dashboard, headless
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Shown:
    run_dir: Path
    header: str
    memory: list[str]
    time_panel: list[str]


def show_headless(shown: list[Shown]):
    """A stand-in for ``handle_cli.tui.run_app``: the real dashboard under Textual's pilot, read once the run's
    history is drawn."""

    def run_app(run_dir: Path, output_dir: Path | None = None) -> None:
        from handle_cli.tui.app import HandleDashboard

        async def drive() -> None:
            app = HandleDashboard(Path(run_dir), output_dir=output_dir)
            async with app.run_test(size=(120, 40)) as pilot:
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and not (app.batches_applied >= 1 and app.memory_bars.memory
                                                           and app.state.status == "finished"):
                    await pilot.pause(0.05)
                await pilot.pause(0.2)  # the throttled redraw
                shown.append(Shown(Path(run_dir), app.header_widget.plain, app.memory_bars.labels(),
                                   [t.plain for t in app.time_panel.lines(100, 7)]))

        asyncio.run(drive())

    return run_app


# ---------------------------------------------------------------------------------------------------------------
# running the page
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Walk:
    cwd: Path
    env: dict[str, str]
    runs: dict[Path, dict] = field(default_factory=dict)  # run dir (absolute) -> run.json
    timings: list[tuple[float, str]] = field(default_factory=list)
    ports: dict[str, str] = field(default_factory=dict)
    read: set[str] = field(default_factory=set)  # run directories a command of the page reads (tui, profile, ...)
    presets_run: set[str] = field(default_factory=set)
    launched: set[str] = field(default_factory=set)  # presets of the runs the page launches whatever comes before

    def fail(self, cmd: Command, why: str, output: str = "") -> None:
        pytest.fail(f"docs/learn.md:{cmd.line}: `{cmd.text}`: {why}\n{output[-4000:]}", pytrace=False)

    def argv(self, cmd: Command) -> list[str]:
        """The command as run: ports made free, tiny options appended, ``handle`` -> this interpreter; a node other
        than 0 of a multi-node ``handle env --check-dist`` answers in ``--json`` (:meth:`sanity` reads which rank
        reported)."""
        words = [re.sub(r"\b(127\.0\.0\.1|localhost):(\d+)\b", self._port, w) for w in cmd.argv]
        path, _, _ = resolve(words)
        return [sys.executable, "-m", "handle_cli", *words[1:], *tiny_args(path, words),
                *(["--json"] if check_dist_node(path, words) else [])]

    def _port(self, m: re.Match) -> str:
        return f"{m.group(1)}:{self.ports.setdefault(m.group(2), str(free_port()))}"

    def variant(self, cmd: Command) -> bool:
        """A foreground ``handle run`` into a run directory no command of the page reads, of a preset the page
        already ran, or of one whose preset (or the preset it ``extends``) another command of the page launches
        (:attr:`launched`): another setting of a layout the page trains (a sync mode, a schedule, an
        implementation, a ZeRO stage, the hand-written ZeRO-1 over the hand-written DDP). It is checked with
        ``handle validate`` (the same preset and ``--set`` values: exit 0, ``ok``) instead of trained again: a launch
        is ~9 CPU s of start-up, and the suite runs each setting end to end elsewhere (tests/test_scratch_ddp.py,
        test_distributed.py's ZeRO-1/2/3 and scratch ZeRO-1, test_tensor_parallel.py, test_pipeline_parallel.py)."""
        path, _, rest = resolve(cmd.argv)
        if path != ("run",) or cmd.background:
            return False
        run_dir = cmd.argv[cmd.argv.index("--run-dir") + 1] if "--run-dir" in cmd.argv else None
        preset = rest[0] if rest else None
        seen = preset in self.presets_run
        self.presets_run.add(preset)
        if run_dir is None or run_dir in self.read:
            return False
        return seen or bool(family(self.cwd, preset) & self.launched)

    def validate_args(self, cmd: Command) -> list[str]:
        words, out, skip = cmd.argv[2:], [], False
        for w in words:
            if skip:
                skip = False
            elif w == "--run-dir":
                skip = True
            else:
                out.append(w)
        return ["validate", *out]

    def start(self, cmd: Command, argv: list[str] | None = None) -> subprocess.Popen:
        """Output goes to a file, not a pipe: a background command must never block on a full pipe."""
        logs = self.cwd / "command-output"
        logs.mkdir(exist_ok=True)
        with open(logs / f"line{cmd.line}.txt", "w", encoding="utf-8") as out:
            return subprocess.Popen(argv or self.argv(cmd), cwd=self.cwd, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def finish(self, cmd: Command, proc: subprocess.Popen, t0: float) -> None:
        log = self.cwd / "command-output" / f"line{cmd.line}.txt"
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the launcher and its workers
            proc.wait()
            self.fail(cmd, f"still running after {TIMEOUT_S} s", log.read_text(encoding="utf-8", errors="replace"))
        output = log.read_text(encoding="utf-8", errors="replace")
        self.timings.append((time.perf_counter() - t0, cmd.text))
        if proc.returncode != 0:
            self.fail(cmd, f"exit code {proc.returncode}", output)
        self.sanity(cmd, output)

    def validated(self, cmd: Command) -> None:
        """:meth:`variant`'s check: ``handle validate`` of the command's preset and settings exits 0 with ``ok``, run
        through the click command tree in this process (whose working directory is :attr:`cwd`): a new interpreter's
        imports would cost more than the check."""
        from click.testing import CliRunner

        t0 = time.perf_counter()
        result = CliRunner().invoke(cli_root(), self.validate_args(cmd), prog_name="handle")
        self.timings.append((time.perf_counter() - t0, f"(validated) {cmd.text}"))
        if result.exit_code != 0 or ": ok: " not in result.stdout:
            self.fail(cmd, f"handle validate exit code {result.exit_code} {result.exception!r}",
                      result.stdout + result.stderr)

    def sanity(self, cmd: Command, output: str) -> None:
        """The command printed what it exists to print."""
        path, _, rest = resolve(cmd.argv)
        if path == ("run",):
            m = re.search(r"^run directory: (.+)$", output, re.MULTILINE)
            if not m or "finished: " not in output:
                self.fail(cmd, "no run directory / no `finished:` line", output)
            run_dir = (self.cwd / m.group(1).strip()).resolve()
            info = json.loads((run_dir / "run.json").read_text())
            if info.get("status") != "finished":
                self.fail(cmd, f"run.json says {info.get('status')}", output)
            ranks = re.findall(r"^  rank (\d+): params ", output, re.MULTILINE)
            if len(ranks) != info["world_size"]:
                self.fail(cmd, f"the summary shows {len(ranks)} ranks' memory, world size {info['world_size']}",
                          output)
            self.runs[run_dir] = info
        elif path == ("bench", "comm"):
            if not re.search(r"all_reduce .* ok", output) or "results: " not in output:
                self.fail(cmd, "no checked all_reduce row", output)
        elif path == ("bench", "scaling"):
            if "efficiency" not in output or "results: " not in output:
                self.fail(cmd, "no scaling table", output)
        elif path == ("estimate",):
            if not re.search(r"[\d,]+ parameters", output) or "activations" not in output:
                self.fail(cmd, "no estimate table", output)
        elif path == ("profile",) and "--pipeline" in rest:
            if "bubble measured" not in output or "rank 1" not in output:
                self.fail(cmd, "no pipeline chart", output)
        elif path == ("profile",) and "--routing" in rest:
            if "MoE layers" not in output or "aux loss" not in output:
                self.fail(cmd, "no routing summary", output)
        elif path == ("profile",):
            if "time split" not in output or "top operators" not in output:
                self.fail(cmd, "no profile summary", output)
        elif path == ("env",) and "--check-dist" in rest:
            self.check_dist(cmd, path, output)
        elif path == ("slurm",):
            m = re.search(r"^(\S+\.sbatch)$", output, re.MULTILINE)
            script = (self.cwd / m.group(1)) if m else None
            if script is None or not script.is_file() or "srun " not in script.read_text(encoding="utf-8"):
                self.fail(cmd, "no sbatch script with an srun line", output)
        elif path == ("runs",):
            where = (self.cwd / (rest[0] if rest and not rest[0].startswith("-") else "runs")).resolve()
            for run_dir in self.runs:
                if run_dir.parent == where and run_dir.name not in output:
                    self.fail(cmd, f"{run_dir.name} is not listed", output)
        elif not output.strip():
            self.fail(cmd, "printed nothing")

    def check_dist(self, cmd: Command, path: tuple[str, ...], output: str) -> None:
        """``handle env --check-dist N``: one all-reduce over every process, the right sum. On several nodes (what
        tests/test_multinode.py ran on its own): node 0's line names the world, the nodes and itself; another
        node's ``--json`` report is its own first rank's (global rank = node rank, one process a node)."""
        nnodes = int(cmd.argv[cmd.argv.index("--nnodes") + 1]) if "--nnodes" in cmd.argv else 1
        world = nnodes * int(cmd.argv[cmd.argv.index("--check-dist") + 1])
        total = world * (world + 1) // 2  # every rank adds rank + 1
        node = check_dist_node(path, cmd.argv)
        if node:
            try:
                check = json.loads(output)["check_dist"]
                report = (check["ok"], check["node_rank"], check["nnodes"], check["result"]["world_size"],
                          check["result"]["sum"], check["result"]["rank"])
            except (ValueError, KeyError, TypeError):
                report = None
            if report != (True, node, nnodes, world, total, node):
                self.fail(cmd, f"not node {node}'s own report of a {nnodes}-node all-reduce", output)
        elif nnodes > 1:
            if not re.search(rf"^check-dist: ok: {world} processes on {nnodes} nodes \(.*; this is node 0\), .* "
                             rf"all_reduce sum {total} == {total}$", output, re.MULTILINE):
                self.fail(cmd, f"no `check-dist: ok` line of node 0 of a {nnodes}-node all-reduce", output)
        elif "check-dist: ok" not in output:
            self.fail(cmd, "no `check-dist: ok`", output)

    def tui(self, cmd: Command, monkeypatch: pytest.MonkeyPatch) -> None:
        from click.testing import CliRunner

        import handle_cli.tui

        shown: list[Shown] = []
        monkeypatch.setattr(handle_cli.tui, "run_app", show_headless(shown))
        t0 = time.perf_counter()
        result = CliRunner().invoke(cli_root(), cmd.argv[1:], catch_exceptions=False)
        self.timings.append((time.perf_counter() - t0, cmd.text))
        if result.exit_code != 0 or len(shown) != 1:
            self.fail(cmd, f"exit code {result.exit_code}", result.output)
        s = shown[0]
        info = self.runs.get(s.run_dir.resolve())
        if info is None:
            self.fail(cmd, f"{s.run_dir} is not a run an earlier command of the page made")
        page = f"header:\n{s.header}\nmemory per rank:\n" + "\n".join(s.memory) + "\ntime per step:\n" + \
            "\n".join(s.time_panel)
        if "FINISHED" not in s.header:
            self.fail(cmd, "the header does not show the finished run", page)
        # the memory panel: one model-state bar per rank, with its params/grads/optim bytes
        ranks = [int(m.group(1)) for line in s.memory if (m := re.match(r"rank (\d+) +state ", line))]
        details = sum(bool(re.match(r" +(params|par) [\d.]+", line)) for line in s.memory)
        if ranks != list(range(info["world_size"])) or details != len(ranks):
            self.fail(cmd, f"the memory panel shows ranks {ranks}, world size {info['world_size']}", page)
        # the time panel: the step split (and the exposed communication in the header for scratch-ddp)
        if not s.time_panel or not s.time_panel[0].startswith("■ data"):
            self.fail(cmd, "the time panel shows no step split", page)
        if info.get("strategy") == "scratch-ddp" and not re.search(r"comm \d+ ms", s.header):
            self.fail(cmd, "a scratch-ddp run's header shows no `comm … ms`", page)

    def block(self, block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
        background: list[tuple[Command, subprocess.Popen, float]] = []

        def wait_all() -> None:
            while background:
                self.finish(*background.pop(0))

        try:
            for step in block.steps:
                if step == WAIT:
                    wait_all()
                    continue
                path, _, _ = resolve(step.argv)
                if path == ("tui",):
                    assert not step.background, f"docs/learn.md:{step.line}: the dashboard cannot run with &"
                    self.tui(step, monkeypatch)
                elif step.background:
                    background.append((step, self.start(step), time.perf_counter()))
                elif self.variant(step):
                    self.validated(step)
                else:
                    self.finish(step, self.start(step), time.perf_counter())
            wait_all()
        finally:
            for _, proc, _ in background:  # a foreground command failed while these ran
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def check_dist_node(path: tuple[str, ...], words: list[str]) -> int:
    """The node rank of a multi-node ``handle env --check-dist`` other than node 0, else 0."""
    if path != ("env",) or "--check-dist" not in words or "--nnodes" not in words or "--node-rank" not in words:
        return 0
    return int(words[words.index("--node-rank") + 1])


def family(cwd: Path, preset: str | None) -> set[str]:
    """``preset`` (a path relative to ``cwd``) and the preset it ``extends``, as the page would name them."""
    if preset is None or not (cwd / preset).is_file():
        return set()
    parent = re.search(r'^extends\s*=\s*"([^"]+)"', (cwd / preset).read_text(encoding="utf-8"), re.MULTILINE)
    return {preset, *([str(Path(preset).parent / parent.group(1))] if parent else [])}


def launched_presets(blocks: list[Block], read: set[str]) -> set[str]:
    """The presets of the page's ``handle run`` commands that launch whatever comes before them: in the background,
    or into a run directory a command of the page reads (``read``), or into none named."""
    found = set()
    for c in (c for b in blocks if b.info == RUN_INFO for c in b.steps if isinstance(c, Command)):
        path, _, rest = resolve(c.argv)
        run_dir = c.argv[c.argv.index("--run-dir") + 1] if "--run-dir" in c.argv else None
        if path == ("run",) and rest and (c.background or run_dir is None or run_dir in read):
            found.add(rest[0])
    return found


# ---------------------------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------------------------

def test_every_handle_command_of_the_page_exists():
    """Block commands and inline ``handle ...`` in the prose name existing subcommands and options; the fences are
    ```bash (run) or ```bash learn-later (parsed only): a misspelled fence would silently skip commands."""
    text = DOC.read_text(encoding="utf-8")
    blocks = read_blocks(text)
    problems = []
    for b in blocks:
        if b.info.startswith("bash") and b.info not in (RUN_INFO, LATER_INFO):
            problems.append(f"docs/learn.md:{b.line}: fence ```{b.info}: use ```{RUN_INFO} or ```{LATER_INFO}")
    later = {s.argv[1] for b in blocks if b.info == LATER_INFO for s in b.steps if isinstance(s, Command)
             and len(s.argv) > 1}
    runnable = [s for b in blocks if b.info == RUN_INFO for s in b.steps if isinstance(s, Command)]
    assert runnable, "docs/learn.md has no ```bash block"
    for s in runnable:
        if s.argv[0] != "handle":
            problems.append(f"docs/learn.md:{s.line}: `{s.text}`: only `handle` commands can be run by this test")
        elif (why := check_words(s.argv)) is not None:
            problems.append(f"docs/learn.md:{s.line}: `{s.text}`: {why}")
    for line, span in prose_commands(text):
        try:
            words = shlex.split(span)
        except ValueError:
            words = span.split()
        if len(words) > 1 and words[1] in later and words[1] not in cli_root().commands:
            continue  # announced by a learn-later block: checked once the feature lands
        if (why := check_words(words)) is not None:
            problems.append(f"docs/learn.md:{line}: `{span}`: {why}")
    assert not problems, "\n".join(problems)


def test_the_page_walks_the_whole_path():
    """The steps the page promises are there, in order: a deleted step fails here, not only in review."""
    text = DOC.read_text(encoding="utf-8")
    commands = [s.text for b in read_blocks(text) if b.info == RUN_INFO for s in b.steps if isinstance(s, Command)]
    joined = "\n".join(commands)
    expected = ["presets/single.toml", "handle bench comm", "presets/ddp.toml", "strategy.sync=naive",
                "strategy.sync=flat", "strategy.sync=overlap", "presets/scratch-zero1.toml", "presets/zero1.toml",
                "presets/zero2.toml", "presets/zero3.toml", "presets/fsdp.toml", "model.activation_checkpointing=true",
                "profiler.name=torch", "handle profile", "handle estimate", "handle bench scaling", "presets/tp.toml",
                "presets/pp.toml", "parallel.pp_schedule=gpipe", "--pipeline", "presets/moe.toml", "--routing"]
    at = 0
    for what in expected:  # each after the one before
        found = joined.find(what, at)
        assert found >= 0, f"docs/learn.md runs no command with {what!r} after the step before it ({at=})"
        at = found
    assert "handle tui" in joined
    everything = [s.text for b in read_blocks(text) if b.info in (RUN_INFO, LATER_INFO) for s in b.steps
                  if isinstance(s, Command)]
    assert any("launch.nnodes=2" in c for c in everything), "docs/learn.md has no two-node step"


def test_parse_block_background_wait_and_continuation():
    steps = parse_block("# a comment\nhandle run a.toml \\\n  --set x=1 &   # node 0\nhandle run b.toml &\nwait\n"
                        "handle runs runs/learn\n", 10)
    assert [(s.argv, s.line, s.background) if isinstance(s, Command) else s for s in steps] == [
        (["handle", "run", "a.toml", "--set", "x=1"], 11, True), (["handle", "run", "b.toml"], 13, True), WAIT,
        (["handle", "runs", "runs/learn"], 15, False)]
    assert check_words(["handle", "run", "p.toml", "--no-such-option"]).startswith("`handle run` has no option")
    assert check_words(["handle", "bench", "nope"]).startswith("no command `handle bench nope`")
    assert check_words(["handle", "bench", "scaling", "P", "[--weak|--strong", "--json]"]) is None


@pytest.mark.dist
def test_every_command_of_the_page_runs(tmp_path, monkeypatch):
    """Runs the page's ```bash blocks in order on tiny settings; each command exits 0 with the output it exists
    for, the dashboard shows the panels the page points at, and no process is left behind."""
    text = DOC.read_text(encoding="utf-8")
    (tmp_path / "presets").symlink_to(REPO / "presets", target_is_directory=True)
    env, tag = tagged_env()
    monkeypatch.chdir(tmp_path)  # the in-process `handle tui` resolves the page's relative paths here too
    walk = Walk(tmp_path, env)
    walk.read = {w for b in read_blocks(text) if b.info == RUN_INFO for c in b.steps if isinstance(c, Command)
                 and resolve(c.argv)[0] != ("run",) for w in c.argv if w.startswith("runs/")}
    walk.launched = launched_presets(read_blocks(text), walk.read)
    t0 = time.perf_counter()
    try:
        for block in read_blocks(text):
            if block.info == RUN_INFO:
                walk.block(block, monkeypatch)
    finally:
        report = "\n".join(f"{s:6.1f} s  {c}" for s, c in walk.timings)
        print(f"\ndocs/learn.md: {len(walk.timings)} commands, {time.perf_counter() - t0:.1f} s\n{report}")
    left = leftovers(tag)
    assert not left, f"processes outlived the page's commands: {left}"
