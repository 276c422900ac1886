"""``handle plugins`` / ``handle presets`` / ``handle validate`` with real plugin distributions.

Plugins are installed with ``handle plugins install`` (pip, in a subprocess) into a throw-away virtual
environment layered over the test environment: it sees torch-handle and everything installed in the test venv
(a ``.pth`` file adds that site directory), but what is installed into it stays invisible to every other
process, so tests running at the same time in the same venv never see a half-installed or broken plugin. Every
plugin is uninstalled again in a ``finally``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
import venv
from pathlib import Path

import pytest

from tests.helpers import tiny_preset

REPO = Path(__file__).resolve().parents[1]
ZERO2 = REPO / "presets" / "zero2.toml"
SHAKESPEARE = REPO / "plugins" / "examples" / "handle-shakespeare"
HEAVY = ("torch", "textual", "deepspeed")

def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HANDLE_LOAD_PLUGINS", "HANDLE_DEBUG")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def handle(python: Path | str, *args: str, env: dict[str, str] | None = None, cwd: Path = REPO,
           timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "handle_cli", *map(str, args)], capture_output=True, text=True,
                          env=env or _env(), cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def py(tmp_path_factory) -> Path:
    """The python of a throw-away venv layered over the test venv."""
    root = tmp_path_factory.mktemp("overlay-venv")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    purelib.mkdir(parents=True, exist_ok=True)
    dirs = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (purelib / "_handle_test_overlay.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
    python = root / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import torch_handle, pip, sys; print(sys.prefix)"],
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0 and probe.stdout.strip() == str(root), probe.stderr
    return python


def install(python: Path, path: Path) -> subprocess.CompletedProcess:
    # offline and quick: the build backend (setuptools) and the dependencies are already in the test venv
    return handle(python, "plugins", "install", "--no-build-isolation", "--no-deps", path)


def uninstall(python: Path, dist: str) -> None:
    proc = handle(python, "plugins", "uninstall", "-y", dist)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def listing(python: Path, env: dict[str, str] | None = None) -> dict:
    return json.loads(ok(handle(python, "plugins", "list", "--json", env=env)).stdout)


def by_name(data: dict) -> dict[str, dict]:
    return {p["name"]: p for p in data["plugins"]}


def write_dist(root: Path, dist: str, module: str, entry: str, files: dict[str, str],
               package_data: str = "") -> Path:
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "0.0.1"

        [project.entry-points.handle]
        {entry} = "{module}"

        [tool.setuptools]
        packages = ["{module}"]
        """) + package_data)
    for name, text in files.items():
        f = root / module / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text))
    return root


# ---------------------------------------------------------------------------------------------------------------
# 1. a strategy plugin: install, list, train 2 processes with it (from a preset the plugin ships), uninstall
# ---------------------------------------------------------------------------------------------------------------

TMP_DDP = {
    "__init__.py": '''
        from dataclasses import dataclass
        from pathlib import Path

        import click

        from handle_plugins.strategies import DDPConfig
        from torch_handle.hookspecs import hookimpl


        @dataclass
        class TmpDDPConfig(DDPConfig):
            marker: str = "tmp"
            """Written to run.json, to prove this strategy ran."""


        def build(options, training, ctx, model):
            from handle_tmpddp.strategy import TmpDDPStrategy

            return TmpDDPStrategy(options, training, ctx, model)


        @hookimpl
        def handle_register_strategies(register):
            register("tmp-ddp", TmpDDPConfig, build, "DDP from a throw-away plugin")


        @hookimpl
        def handle_register_presets(register):
            register(Path(__file__).with_name("presets"))


        @click.command("tmp-hello")
        @click.argument("who", default="world")
        def hello(who):
            """Say hello (a plugin command)."""
            click.echo(f"hello {who} from tmp-ddp")


        @click.command("run")
        def not_run():
            """Tries to take over `handle run`."""
            click.echo("hijacked")


        @click.command("tmp-crash")
        def crash():
            """Raises."""
            raise RuntimeError("crashed on purpose")


        @hookimpl
        def handle_register_commands(register):
            register(hello)
            register(not_run)
            register(crash)
    ''',
    "strategy.py": '''
        from handle_plugins.strategies.ddp import DDPStrategy


        class TmpDDPStrategy(DDPStrategy):
            name = "tmp-ddp"

            def describe(self):
                return {**super().describe(), "marker": self.options.marker}
    ''',
    "presets/tmp-tiny.toml": "# A tiny 2-process run with the tmp-ddp strategy.\n" + tiny_preset(
        "unused", steps=3, strategy="tmp-ddp", log_every=1),
}


def test_strategy_plugin_install_list_run_uninstall(py, tmp_path):
    src = write_dist(tmp_path / "handle-tmpddp", "handle-tmpddp", "handle_tmpddp", "tmpddp", TMP_DDP,
                     '\n[tool.setuptools.package-data]\nhandle_tmpddp = ["presets/*.toml"]\n')
    try:
        proc = ok(install(py, src))
        assert "installed plugin 'tmpddp' (handle-tmpddp 0.0.1): strategy tmp-ddp" in proc.stdout, proc.stdout

        plugins = by_name(listing(py))
        p = plugins["tmpddp"]
        assert (p["status"], p["origin"], p["builtin"]) == ("loaded", "external", False)
        assert (p["distribution"], p["version"]) == ("handle-tmpddp", "0.0.1")
        assert p["kinds"] == ["strategy"] and p["registers"] == {"strategy": ["tmp-ddp"]}
        assert p["descriptions"]["strategy"]["tmp-ddp"] == "DDP from a throw-away plugin"
        assert p["commands"] == ["tmp-hello", "run", "tmp-crash"]
        assert any("'run' refused" in n for n in p["notes"]), p["notes"]
        assert plugins["strategies"]["origin"] == "built-in"
        text = ok(handle(py, "plugins", "list")).stdout
        assert "tmpddp" in text and "handle-tmpddp 0.0.1" in text and "refused" in text
        kind = ok(handle(py, "plugins", "list", "--kind", "strategy")).stdout
        assert "tmp-ddp" in kind and "transformer" not in kind
        assert "tmpddp" not in {q["name"] for q in listing(py)["plugins"] if "model" in q["kinds"]}

        # commands: the plugin's own works, a core one can never be shadowed, a crash is one line
        assert ok(handle(py, "tmp-hello", "you")).stdout == "hello you from tmp-ddp\n"
        helptext = ok(handle(py, "--help")).stdout
        assert "Plugin commands:" in helptext and "tmp-hello" in helptext
        assert "Validate PRESET, start torchrun workers" in ok(handle(py, "run", "--help")).stdout
        crash = handle(py, "tmp-crash")
        assert crash.returncode == 1 and crash.stderr.strip() == (
            "error: command 'tmp-crash' of plugin 'tmpddp' failed: RuntimeError: crashed on purpose")

        # presets: listed with the plugin, found by bare name
        assert "tmp-tiny" in ok(handle(py, "presets", "list", cwd=REPO)).stdout
        validated = ok(handle(py, "validate", "tmp-tiny", cwd=tmp_path)).stdout
        assert ": ok: dp 2 (tmp-ddp), world size 2, 3 steps" in validated

        # a real 2-process run with the plugin's strategy, from the plugin's preset
        out = tmp_path / "runs"
        t0 = time.monotonic()
        ok(handle(py, "run", "tmp-tiny", "--set", f"run.output_dir={out}", cwd=tmp_path, timeout=300))
        (run_dir,) = [d for d in out.iterdir() if not d.name.startswith(".")]
        info = json.loads((run_dir / "run.json").read_text())
        assert (info["status"], info["strategy"], info["world_size"]) == ("finished", "tmp-ddp", 2), info
        assert info.get("marker") == "tmp"
        steps = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        assert [e["step"] for e in steps if e["kind"] == "step"] == [1, 2, 3]
        print(f"2-process tmp-ddp run: {time.monotonic() - t0:.1f} s")
    finally:
        uninstall(py, "handle-tmpddp")
    assert "tmpddp" not in by_name(listing(py))


def test_uninstall_refuses_the_core(py):
    for name in ("torch-handle", "torch_handle", "Torch.Handle", "strategies"):
        proc = handle(py, "plugins", "uninstall", "-y", name)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "torch-handle" in proc.stderr and "pip" not in proc.stdout
    proc = handle(py, "plugins", "uninstall", "-y", "numpy")
    assert proc.returncode == 2 and "no installed distribution provides a handle plugin" in proc.stderr
    assert "strategies" in by_name(listing(py))


# ---------------------------------------------------------------------------------------------------------------
# 2. a plugin that raises on import: everything else keeps working
# ---------------------------------------------------------------------------------------------------------------

BROKEN = {"__init__.py": '''
    raise RuntimeError("boom: broken on purpose")
'''}


def test_broken_plugin_is_reported_and_contained(py, tmp_path):
    src = write_dist(tmp_path / "handle-brokenplug", "handle-brokenplug", "handle_brokenplug", "brokenplug", BROKEN)
    preset = tmp_path / "p.toml"
    preset.write_text(f'extends = "{ZERO2}"\n[strategy]\nname = "brokenplug"\n')
    try:
        proc = install(py, src)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "'brokenplug' (handle-brokenplug 0.0.1), but it failed to load: import failed: RuntimeError: boom" \
            in proc.stderr

        text = handle(py, "plugins", "list")
        assert text.returncode == 0, text.stderr
        row = next(line for line in text.stdout.splitlines() if line.startswith("brokenplug"))
        assert "failed" in row and "import failed: RuntimeError: boom: broken on purpose" in row
        p = by_name(listing(py))["brokenplug"]
        assert p["status"] == "failed" and p["error"] == "import failed: RuntimeError: boom: broken on purpose"
        assert ok(handle(py, "--help")).stdout.startswith("Usage:")
        assert "world size 2" in ok(handle(py, "validate", ZERO2)).stdout

        bad = handle(py, "validate", preset)
        assert bad.returncode == 2
        assert bad.stderr.strip() == (f"error: {preset}:3: strategy.name: strategy plugin 'brokenplug' failed to "
                                      f"load: import failed: RuntimeError: boom: broken on purpose")

        # HANDLE_LOAD_PLUGINS="" loads no external plugin: the broken one is not even imported
        env = _env(HANDLE_LOAD_PLUGINS="")
        data = listing(py, env)
        assert "brokenplug" not in by_name(data)
        assert [s["name"] for s in data["skipped"]] == ["brokenplug"] and data["handle_load_plugins"] == ""
        text = ok(handle(py, "plugins", "list", env=env)).stdout
        assert not any(line.startswith("brokenplug") for line in text.splitlines())
        hidden = handle(py, "validate", preset, env=env)
        assert hidden.returncode == 2 and "unknown strategy 'brokenplug'" in hidden.stderr
        assert "HANDLE_LOAD_PLUGINS: brokenplug" in hidden.stderr
        assert "HANDLE_LOAD_PLUGINS" in ok(handle(py, "plugins", "--help")).stdout
    finally:
        uninstall(py, "handle-brokenplug")
    assert "brokenplug" not in by_name(listing(py))


# ---------------------------------------------------------------------------------------------------------------
# the example plugin in plugins/examples installs and trains
# ---------------------------------------------------------------------------------------------------------------


def test_example_shakespeare_plugin(py, tmp_path):
    src = tmp_path / "handle-shakespeare"  # pip builds in the source tree: keep build/ out of the checkout
    shutil.copytree(SHAKESPEARE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    try:
        proc = ok(install(py, src))
        assert "installed plugin 'shakespeare' (handle-shakespeare 0.1.0): dataset shakespeare" in proc.stdout
        assert "command shakespeare-stats" in proc.stdout
        listed = ok(handle(py, "presets", "list")).stdout
        assert any(line.startswith("shakespeare-char") and "(plugin shakespeare)" in line
                   for line in listed.splitlines()), listed
        assert "char vocabulary: 56 characters + 4 special tokens = 60" in ok(handle(py, "shakespeare-stats")).stdout
        missing = handle(py, "validate", "shakespeare-char", "--set", "data.path=nope.txt", cwd=tmp_path)
        assert missing.returncode == 2 and missing.stderr.strip() == "error: nope.txt: no such file (data.path)"

        # with the plugin installed, `handle --help` still imports no torch
        imported = importtime(py, "--help")
        assert not imported & set(HEAVY), imported & set(HEAVY)

        out = tmp_path / "runs"
        ok(handle(py, "run", "shakespeare-char", "--set", f"run.output_dir={out}", "--set", "training.steps=3",
                  "--set", "training.eval_every=0", "--set", "model.n_layers=1", cwd=tmp_path, timeout=300))
        (run_dir,) = [d for d in out.iterdir() if not d.name.startswith(".")]
        assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
        tok = json.loads((run_dir / "tokenizer.json").read_text())
        assert len(tok["model"]["vocab"]) == 60  # one token per character (+ 4 specials)
    finally:
        uninstall(py, "handle-shakespeare")


# ---------------------------------------------------------------------------------------------------------------
# 3. presets show -> file -> validate -> the same resolved TOML; presets new; every problem at once
# ---------------------------------------------------------------------------------------------------------------


def test_presets_show_output_validates_and_round_trips(tmp_path):
    shown = ok(handle(sys.executable, "presets", "show", ZERO2, "--set", "training.lr=1e-3")).stdout
    f = tmp_path / "resolved.toml"
    f.write_text(shown)
    assert ok(handle(sys.executable, "validate", f)).stdout.strip() == \
        f"{f}: ok: dp 2 (deepspeed ZeRO-2), world size 2, {_steps(shown)} steps"
    assert ok(handle(sys.executable, "presets", "show", f)).stdout == shown
    assert "lr = 0.001" in shown


def _steps(toml_text: str) -> int:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    return tomllib.loads(toml_text)["training"]["steps"]


def test_presets_new_extends_and_refuses_to_overwrite(tmp_path):
    (tmp_path / "presets").mkdir()
    for name in ("zero2", "ddp", "single"):
        (tmp_path / "presets" / f"{name}.toml").write_text((REPO / "presets" / f"{name}.toml").read_text())
    proc = ok(handle(sys.executable, "presets", "new", "mine", "--from", "zero2", cwd=tmp_path))
    assert "wrote presets/mine.toml" in proc.stdout
    text = (tmp_path / "presets" / "mine.toml").read_text()
    assert 'extends = "zero2.toml"' in text and '[run]\nname = "mine"' in text and text.startswith("# ")
    shown = ok(handle(sys.executable, "presets", "show", "mine", cwd=tmp_path)).stdout
    assert 'name = "mine"' in shown and 'name = "deepspeed"' in shown
    assert "mine" in ok(handle(sys.executable, "presets", "list", cwd=tmp_path)).stdout
    again = handle(sys.executable, "presets", "new", "mine", "--from", "ddp", cwd=tmp_path)
    assert again.returncode == 2 and "already exists; refusing to overwrite" in again.stderr
    assert (tmp_path / "presets" / "mine.toml").read_text() == text
    bad = handle(sys.executable, "presets", "new", "x", "--from", "nope", cwd=tmp_path)
    assert bad.returncode == 2 and not (tmp_path / "presets" / "x.toml").exists()


def test_validate_reports_every_problem_at_once(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text(f'extends = "{ZERO2}"\n[training]\nstepz = 3\nlr = -1\n[model]\nd_model = "wide"\n'
                 f'[strategy]\nzero_stage = 7\n')
    proc = handle(sys.executable, "validate", p)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert [line.split(": ")[2] for line in lines] == ["model.d_model", "training.stepz", "training.lr",
                                                       "strategy.zero_stage"], lines
    assert all(line.startswith(f"error: {p}:") for line in lines)


# ---------------------------------------------------------------------------------------------------------------
# 4. the everyday commands are instant and import no torch
# ---------------------------------------------------------------------------------------------------------------


def importtime(python: Path | str, *args: str) -> set[str]:
    proc = subprocess.run([str(python), "-X", "importtime", "-m", "handle_cli", *args], capture_output=True,
                          text=True, env=_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in proc.stderr.splitlines()
            if line.startswith("import time:")}


@pytest.mark.parametrize("args", [["--help"], ["plugins", "list"], ["presets", "list"]], ids=" ".join)
def test_everyday_commands_are_instant_and_import_no_torch(args):
    script = Path(sys.executable).with_name("handle")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "handle_cli"]
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        proc = subprocess.run([*cmd, *args], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=60)
        times.append(time.perf_counter() - t0)
        assert proc.returncode == 0, proc.stderr
    print(f"handle {' '.join(args)}: best {min(times):.3f} s, worst {max(times):.3f} s")
    assert min(times) < 1.5, times
    imported = importtime(sys.executable, *args)
    assert "handle_cli" in imported
    assert not imported & set(HEAVY), imported & set(HEAVY)


# ---------------------------------------------------------------------------------------------------------------
# 5. optional extras: listed with the command that installs them while they are not installed
# ---------------------------------------------------------------------------------------------------------------


def test_plugins_list_shows_the_extras_that_are_not_installed(monkeypatch):
    from click.testing import CliRunner

    from handle_cli import plugins_cmd
    from handle_cli.main import cli

    installed = json.loads(ok_cli(CliRunner().invoke(cli, ["plugins", "list", "--json"])).output)["extras"]
    assert {e["name"]: (e["kind"], e["plugin"], e["installed"]) for e in installed} == {
        "hf": ("model", "hf", True), "wandb": ("sink", "wandb", True)}  # `make install-dev` installs both
    assert [e["requires"][0].split("<")[0].split(">")[0] for e in installed] == ["transformers", "wandb"]
    assert "available extras" not in ok_cli(CliRunner().invoke(cli, ["plugins", "list"])).output

    # as if transformers were not installed (pip uninstall would change the venv other tests run in)
    real = plugins_cmd.requirement_met
    monkeypatch.setattr(plugins_cmd, "requirement_met", lambda r: not r.startswith("transformers") and real(r))
    data = json.loads(ok_cli(CliRunner().invoke(cli, ["plugins", "list", "--json"])).output)
    hf = next(e for e in data["extras"] if e["name"] == "hf")
    assert not hf["installed"] and hf["install"].startswith("pip install ") and "[hf]'" in hf["install"]
    assert next(e for e in data["extras"] if e["name"] == "wandb")["installed"]
    lines = ok_cli(CliRunner().invoke(cli, ["plugins", "list"])).output.splitlines()
    at = lines.index("available extras (not installed):")
    assert len(lines) == at + 2, lines  # hf alone
    assert lines[at + 1].split()[:3] == ["hf", "model", "'hf':"] and lines[at + 1].endswith(f"-- {hf['install']}")
    model = ok_cli(CliRunner().invoke(cli, ["plugins", "list", "--kind", "model"])).output
    assert f"-- {hf['install']}" in model
    assert "available extras" not in ok_cli(CliRunner().invoke(cli, ["plugins", "list", "--kind", "sink"])).output


def ok_cli(result):
    assert result.exit_code == 0, result.output
    return result
