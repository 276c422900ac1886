"""`handle run` on bad presets and bad input: exit code 2, one line on stderr naming the problem, no traceback,
no run directory, nothing launched.

Each case writes its files into a fresh directory (the working directory of the command). ``{tmp}`` in file
contents and arguments is that directory; every preset writes its runs to ``{tmp}/out`` unless the case is about
the output directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from handle_cli.main import cli
from torch_handle.hookspecs import hookimpl

HEAD = '[run]\noutput_dir = "{tmp}/out"\n'
"""Two lines: a key on the first line after HEAD is on line 3."""
ED = '[model]\nkind = "encoder-decoder"\n'
PAIRS = {"pairs/train.en": "a b\nc d\n", "pairs/train.de": "x y\nz w\n", "pairs/valid.en": "e\n", "pairs/valid.de": "v\n"}


@dataclass
class Case:
    id: str
    files: dict[str, str | bytes]
    args: list[str]
    expect: list[str]
    """Substrings of the one stderr line (after ``{tmp}`` is filled in)."""
    untouched: list[str] = field(default_factory=list)
    """Directories (relative) that must be left exactly as they were."""
    also: list[list[str]] = field(default_factory=list)
    """Substrings of each further stderr line: every problem of the preset is reported, one a line, structure
    first (``expect`` is the first)."""


def preset(body: str, name: str = "p.toml", **more: str | bytes) -> dict[str, str | bytes]:
    return {name: HEAD + body, **more}


CASES = [
    # --- TOML and the preset file itself
    Case("toml-syntax", preset("[training]\nsteps = = 3\n"), ["p.toml"],
         ["error: p.toml:4: ", "TOML syntax error", "column 9"]),
    Case("toml-duplicate-table", preset("[training]\nsteps = 3\n[training]\nlr = 1.0\n"), ["p.toml"],
         ["p.toml:5:", "TOML syntax error"]),
    Case("preset-not-utf8", {"p.toml": b"[run]\nname = \"caf\xe9\"\n"}, ["p.toml"],
         ["p.toml:", "undecodable byte at offset 17"]),
    Case("missing-preset", {}, ["nope.toml"], ["nope.toml: no such preset file"]),
    Case("preset-is-directory", {"dir/x": ""}, ["dir"], ["dir: not a preset file"]),
    Case("unknown-table", preset("[trainig]\nsteps = 3\n"), ["p.toml"],
         ["p.toml:3: trainig: unknown table", "did you mean 'training'?"]),
    Case("unknown-key", preset("[training]\nsteps = 5\nstepz = 3\n"), ["p.toml"],
         ["p.toml:5: training.stepz: unknown key", "did you mean 'steps'?", "valid: beta1"]),
    Case("unknown-key-in-parent", {"base.toml": "[training]\nlr_rate = 0.1\n",
                                   "p.toml": 'extends = "base.toml"\n' + HEAD},
         ["p.toml"], ["error: base.toml:2: training.lr_rate: unknown key", "did you mean"]),
    # --- types
    Case("string-for-int", preset('[training]\nsteps = "100"\n'), ["p.toml"],
         ["p.toml:4: training.steps", "expected an integer, got '100'"]),
    Case("float-for-int", preset("[training]\nmicro_batch_size = 2.5\n"), ["p.toml"],
         ["p.toml:4: training.micro_batch_size", "expected an integer, got 2.5"]),
    Case("int-for-bool", preset("[model]\nnorm_first = 1\n"), ["p.toml"],
         ["p.toml:4: model.norm_first", "expected true or false, got 1"]),
    Case("bad-choice", preset('[training]\nprecision = "fp8"\n'), ["p.toml"],
         ["training.precision", "'fp32', 'bf16', 'fp16'"]),
    # --- ranges
    Case("negative-steps", preset("[training]\nsteps = -5\n"), ["p.toml"], ["p.toml:4: training.steps", "-5 must be >= 1"]),
    Case("micro-batch-0", preset("[training]\nmicro_batch_size = 0\n"), ["p.toml"],
         ["training.micro_batch_size", "0 must be >= 1"]),
    Case("tui-with-two-nodes",
         preset('[strategy]\nname = "ddp"\n[launch]\nnnodes = 2\nrdzv_endpoint = "127.0.0.1:29400"\n'),
         ["p.toml", "--tui"], ["--tui runs one node", "launch.nnodes = 2", "handle tui RUN_DIR"]),
    Case("zero-stage-4", preset('[strategy]\nname = "deepspeed"\nzero_stage = 4\n'), ["p.toml"],
         ["p.toml:5: strategy.zero_stage", "4 must be <= 3"]),
    Case("lr-0", preset("[training]\nlr = 0.0\n"), ["p.toml"], ["training.lr", "must be > 0"]),
    Case("dropout-1.5", preset("[model]\ndropout = 1.5\n"), ["p.toml"], ["model.dropout", "1.5 must be <= 0.9"]),
    Case("lr-nan", preset("[training]\nlr = nan\n"), ["p.toml"], ["training.lr", "not a finite number"]),
    Case("heads-do-not-divide", preset("[model]\nd_model = 130\nn_heads = 4\n"), ["p.toml"],
         ["p.toml:5: model.n_heads", "4 does not divide d_model=130"]),
    # --- plugins
    Case("unknown-model-plugin", preset('[model]\nname = "gpt2"\n'), ["p.toml"],
         ["p.toml:4: model.name", "unknown model 'gpt2'", "available: hf, transformer"]),
    Case("unknown-dataset-plugin", preset('[data]\nname = "wiki"\n'), ["p.toml"],
         ["data.name", "unknown dataset 'wiki'", "available: parallel, pydoc, text"]),
    Case("unknown-strategy", preset('[strategy]\nname = "zero2"\n'), ["p.toml"],
         ["strategy.name", "unknown strategy 'zero2'", "available: ddp, deepspeed, fsdp, scratch-ddp, scratch-fsdp, single"]),
    Case("offload-param-stage-2", preset('[strategy]\nname = "deepspeed"\nzero_stage = 2\noffload_param = "cpu"\n'),
         ["p.toml"], ["p.toml:6: strategy.offload_param", "needs zero_stage = 3 (got 2)"]),
    Case("nvme-without-path", preset('[strategy]\nname = "deepspeed"\nzero_stage = 3\noffload_optimizer = "nvme"\n'),
         ["p.toml"], ["strategy.nvme_path", "required for nvme offload"]),
    Case("fp16-in-ds-config-with-auto", preset('[strategy]\nname = "deepspeed"\n[strategy.ds_config.fp16]\nenabled = true\n'),
         ["p.toml"], ["p.toml:5: strategy.ds_config", "fp16.enabled contradicts training.precision = 'auto'"]),
    Case("ds-config-fp16-not-a-table", preset('[strategy]\nname = "deepspeed"\n'),
         ["p.toml", "--set", "strategy.ds_config.fp16=true"], ["strategy.ds_config", "fp16 must be a table"]),
    Case("decoder-with-parallel", preset('[data]\nname = "parallel"\npath = "pairs"\n', **PAIRS), ["p.toml"],
         ["model.kind", "'decoder' cannot train on data 'parallel'", "kind = 'encoder-decoder'"]),
    # --- extends
    Case("extends-cycle", {"a.toml": 'extends = "b.toml"\n' + HEAD, "b.toml": 'extends = "a.toml"\n'}, ["a.toml"],
         ["error: b.toml:1: extends", "extends cycle: a.toml -> b.toml -> a.toml"]),
    Case("extends-missing", {"p.toml": 'extends = "base-gone.toml"\n' + HEAD}, ["p.toml"],
         ["p.toml:1: extends", "'base-gone.toml' does not exist"]),
    # --- --set
    Case("set-without-equals", preset(""), ["p.toml", "--set", "training.steps"],
         ["--set 'training.steps'", "TABLE.KEY=VALUE"]),
    Case("set-without-table", preset(""), ["p.toml", "--set", "steps=3"], ["--set 'steps=3'", "TABLE.KEY=VALUE"]),
    Case("set-unknown-key", preset(""), ["p.toml", "--set", "training.setps=3"],
         ["p.toml (--set): training.setps: unknown key", "did you mean 'steps'?"]),
    Case("set-unknown-table", preset(""), ["p.toml", "--set", "optimizer.lr=3"],
         ["p.toml (--set): optimizer: unknown table"]),
    Case("set-wrong-type", preset(""), ["p.toml", "--set", "training.steps=many"],
         ["p.toml (--set): training.steps", "expected an integer, got 'many'"]),
    Case("set-into-a-value", preset("[training]\nsteps = 3\n"), ["p.toml", "--set", "training.steps.max=3"],
         ["training.steps.max", "training.steps is a value, not a table"]),
    # --- launch
    Case("single-with-2-procs", preset("[launch]\nnproc_per_node = 2\n"), ["p.toml"],
         ["p.toml:4: launch.nproc_per_node", "strategy 'single' runs one process (world size 2)"]),
    Case("node-rank-too-big", preset('[strategy]\nname = "ddp"\n[launch]\nnnodes = 2\nnode_rank = 2\n'
                                     'rdzv_endpoint = "node0:29400"\n'), ["p.toml"],
         ["p.toml:7: launch.node_rank", "2 must be below nnodes (2)"]),
    Case("nnodes-without-rdzv", preset('[strategy]\nname = "ddp"\n[launch]\nnnodes = 2\n'), ["p.toml"],
         ["launch.rdzv_endpoint", "required when nnodes > 1"]),
    Case("bad-rdzv-endpoint", preset('[launch]\nrdzv_endpoint = "node0"\n'), ["p.toml"],
         ["p.toml:4: launch.rdzv_endpoint", "'node0' must look like 'host:port'"]),
    # --- run
    Case("name-with-slash", preset('name = "a/b"\n'), ["p.toml"], ["p.toml:3: run.name", "'a/b'"]),
    Case("output-dir-under-a-file", {"p.toml": '[run]\noutput_dir = "{tmp}/blocker/out"\n', "blocker": "x"}, ["p.toml"],
         ["{tmp}/blocker/out", "cannot create output directory"]),
    Case("output-dir-is-a-file", {"p.toml": '[run]\noutput_dir = "{tmp}/blocker"\n', "blocker": "x"}, ["p.toml"],
         ["{tmp}/blocker: output directory is a file"]),
    Case("resume-not-a-run", {"notarun/notes.txt": "hi"}, ["--resume", "notarun"],
         ["notarun: not a run directory (no run.json)"], untouched=["notarun"]),
    Case("resume-missing-dir", {}, ["--resume", "gone"], ["gone: not a run directory"]),
    Case("resume-bad-run-json", {"r/run.json": "[1, 2]", "r/preset.toml": HEAD}, ["--resume", "r"],
         ["r/run.json: unreadable (expected a JSON object"], untouched=["r"]),
    Case("resume-bad-preset", {"r/run.json": '{"status": "failed"}', "r/preset.toml": HEAD + "[training]\nsteps = 0\n"},
         ["--resume", "r"], ["r/preset.toml:4: training.steps", "must be >= 1"], untouched=["r"]),
    Case("preset-and-resume", preset("", **{"r/run.json": "{}"}), ["p.toml", "--resume", "r"],
         ["either PRESET or --resume RUN_DIR, not both"], untouched=["r"]),
    Case("no-preset", {}, [], ["missing PRESET"]),
    # --- data (pre-flight, before anything starts)
    Case("text-without-path", preset('[data]\nname = "text"\n'), ["p.toml"], ["p.toml:3: data.path", "is required"]),
    Case("text-path-matches-nothing", preset('[data]\nname = "text"\npath = "corpus/*.txt"\n', **{"corpus/a.md": "x"}),
         ["p.toml"], ["corpus/*.txt: no such file, or no files match"]),
    Case("text-undecodable", preset('[data]\nname = "text"\npath = "corpus"\n',
                                    **{"corpus/a.txt": "fine\n", "corpus/b.txt": b"good line\n\xff\xfe"}),
         ["p.toml"], ["corpus/b.txt: not UTF-8 text", "offset 10"]),
    Case("text-empty", preset('[data]\nname = "text"\npath = "corpus"\n', **{"corpus/a.txt": "\n \n"}), ["p.toml"],
         ["corpus: empty corpus"]),
    Case("text-too-small-for-seq-len", preset('[data]\nname = "text"\npath = "corpus"\nseq_len = 64\n',
                                              **{"corpus/a.txt": "a few words\n" * 20}), ["p.toml"],
         ["corpus (validation split): ", "bytes is too small for one sample of seq_len=64"]),
    Case("text-too-small-train", preset('[data]\nname = "text"\npath = "a.txt"\nvalid_path = "b.txt"\nseq_len = 512\n',
                                        **{"a.txt": "tiny\n", "b.txt": "x" * 600 + "\n"}), ["p.toml"],
         ["a.txt (train split): 5 bytes is too small for one sample of seq_len=512"]),
    Case("parallel-dir-missing", preset(ED + '[data]\nname = "parallel"\npath = "nowhere"\n'), ["p.toml"],
         ["nowhere: no such directory"]),
    Case("parallel-line-counts", preset(ED + '[data]\nname = "parallel"\npath = "pairs"\n',
                                        **{**PAIRS, "pairs/valid.de": "v\nw\nu\n"}), ["p.toml"],
         ["pairs/valid.en has 1 lines but pairs/valid.de has 3"]),
    Case("parallel-file-missing", preset(ED + '[data]\nname = "parallel"\npath = "pairs"\ntgt_lang = "fr"\n', **PAIRS),
         ["p.toml"], ["pairs/train.fr: no such file"]),
    Case("parallel-undecodable", preset(ED + '[data]\nname = "parallel"\npath = "pairs"\n',
                                        **{**PAIRS, "pairs/train.de": b"x y\n\xc3z w\n"}), ["p.toml"],
         ["pairs/train.de: not UTF-8 text", "offset 4"]),
]


def fill(text, tmp: Path):
    return text.replace("{tmp}", str(tmp)) if isinstance(text, str) else text


def make(tmp: Path, case: Case) -> None:
    for name, content in case.files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        content = fill(content, tmp)
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


@pytest.fixture
def runner(tmp_path, monkeypatch, no_launch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HANDLE_DEBUG", raising=False)
    return CliRunner()


def check_error_lines(code: int, stdout: str, stderr: str, expect: list[list[str]], tmp: Path) -> list[str]:
    """Exit code 2, nothing on stdout, no traceback, and one ``error:`` line on stderr per item of ``expect``
    (each holding every substring of its item), in that order."""
    assert code == 2, (code, stdout, stderr)
    assert "Traceback" not in stderr and "Traceback" not in stdout
    lines = stderr.splitlines()
    assert len(lines) == len(expect), stderr
    for line, parts in zip(lines, expect):
        assert line.startswith("error: "), line
        for part in parts:
            assert fill(part, tmp) in line, (part, line)
    assert stdout == "", stdout
    return lines


def check_one_line_error(code: int, stdout: str, stderr: str, expect: list[str], tmp: Path) -> str:
    return check_error_lines(code, stdout, stderr, [expect], tmp)[0]


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_handle_run_rejects(runner, tmp_path, case):
    make(tmp_path, case)
    before = {d: snapshot(tmp_path / d) for d in case.untouched}
    result = runner.invoke(cli, ["run", *[fill(a, tmp_path) for a in case.args]])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    check_error_lines(result.exit_code, result.stdout, result.stderr, [case.expect, *case.also], tmp_path)
    out = tmp_path / "out"
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())
    assert not (tmp_path / "runs").exists()
    for d, snap in before.items():
        assert snapshot(tmp_path / d) == snap, f"{d} was modified"


@pytest.mark.parametrize("command", [["validate"], ["presets", "show"]])
def test_validate_and_show_share_the_errors(runner, tmp_path, command):
    make(tmp_path, Case("x", preset("[training]\nstepz = 3\n"), [], []))
    result = runner.invoke(cli, [*command, "p.toml"])
    check_one_line_error(result.exit_code, result.stdout, result.stderr,
                         ["p.toml:4: training.stepz: unknown key", "did you mean 'steps'?"], tmp_path)


def test_a_good_preset_gets_as_far_as_the_launch(runner, tmp_path):
    """The harness is not vacuous: without a problem, `handle run` creates the run and reaches Launch.start."""
    make(tmp_path, Case("ok", preset("[training]\nsteps = 1\n"), [], []))
    result = runner.invoke(cli, ["run", "p.toml"])
    assert isinstance(result.exception, AssertionError) and "a run was launched" in str(result.exception)
    runs = list((tmp_path / "out").iterdir())
    assert len(runs) == 1 and (runs[0] / "run.json").exists() and (runs[0] / "preset.toml").exists()


def test_good_data_passes_the_preflight(runner, tmp_path):
    make(tmp_path, Case("ok", preset(ED + '[data]\nname = "parallel"\npath = "pairs"\n', **PAIRS), [], []))
    result = runner.invoke(cli, ["validate", "p.toml"])
    assert result.exit_code == 0, result.stderr
    result = runner.invoke(cli, ["run", "p.toml"])
    assert "a run was launched" in str(result.exception)


class BrokenStrategies:
    @hookimpl
    def handle_register_strategies(self, register):
        register("turbo", dict, None)


def test_run_with_a_strategy_of_a_failed_plugin(runner, tmp_path, monkeypatch):
    import torch_handle.registry as plugins
    from torch_handle.registry import PluginInfo, load_registry

    registry = load_registry()
    registry.add_plugin(BrokenStrategies(), PluginInfo("turbo-plugin", "turbo-dist", "1.0", builtin=False))
    monkeypatch.setattr(plugins, "_REGISTRY", registry)
    make(tmp_path, Case("x", preset('[strategy]\nname = "turbo"\n'), [], []))
    result = runner.invoke(cli, ["run", "p.toml"])
    check_one_line_error(result.exit_code, result.stdout, result.stderr,
                         ["p.toml:4: strategy.name", "'turbo' is provided by plugin 'turbo-plugin'",
                          "failed to load", "config_cls must be a dataclass"], tmp_path)


SUBPROCESS_CASES = ["toml-syntax", "unknown-key", "set-without-equals", "parallel-line-counts", "no-preset",
                    "output-dir-under-a-file"]


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_handle_run_rejects_in_a_real_process(tmp_path, case_id):
    """The same through the installed entry point: nothing but the one line reaches the terminal."""
    case = next(c for c in CASES if c.id == case_id)
    make(tmp_path, case)
    env = {k: v for k, v in os.environ.items() if k != "HANDLE_DEBUG"}
    proc = subprocess.run([sys.executable, "-m", "handle_cli", "run", *[fill(a, tmp_path) for a in case.args]],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    check_one_line_error(proc.returncode, proc.stdout, proc.stderr, case.expect, tmp_path)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_handle_debug_shows_the_traceback_instead(tmp_path):
    make(tmp_path, Case("x", preset("[training]\nstepz = 3\n"), [], []))
    proc = subprocess.run([sys.executable, "-m", "handle_cli", "run", "p.toml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "HANDLE_DEBUG": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "PresetError" in proc.stderr


def test_resume_with_set_rewrites_nothing_on_error(runner, tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"status": "stopped"}))
    (run / "preset.toml").write_text(fill(HEAD, tmp_path))
    before = snapshot(run)
    result = runner.invoke(cli, ["run", "--resume", "r", "--set", "training.steps=0"])
    check_one_line_error(result.exit_code, result.stdout, result.stderr,
                         ["r/preset.toml (--set): training.steps", "must be >= 1"], tmp_path)
    assert snapshot(run) == before
