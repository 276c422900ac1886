"""A plugin declares which of its options a --resume may not change (``param(..., frozen_on_resume=...)``):
a third-party plugin's declaration is enforced like the built-ins', with the usual one-line refusal."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from handle_cli.main import cli
from tests.helpers import tiny_preset
from torch_handle.api import hookimpl, param
from torch_handle.checkpoint.resume import RESUME_PRESET, check_changes, rule
from torch_handle.config.loader import load_preset
from torch_handle.config.schema import resume_declaration
from torch_handle.errors import RunDirError
from torch_handle.launch.run import prepare_run
from torch_handle.registry import PluginInfo, load_registry

WHY = "the optimizer state of the checkpoint was built for this knob"


@dataclass
class KnobConfig:
    """``[strategy]`` of ``knob``: one option frozen on resume, one that may change (the table's rule)."""

    knob: int = param(1, ge=1, frozen_on_resume=WHY)
    """Frozen: a change would not match the checkpoint."""
    bucket_mb: int = param(25, ge=1)
    """May change (strategy options may, unless declared)."""


class KnobPlugin:
    @hookimpl
    def handle_register_strategies(self, register):
        register("knob", KnobConfig, lambda *args: None, "a third-party strategy")


@pytest.fixture
def registry(monkeypatch):
    import torch_handle.registry

    reg = load_registry()
    reg.add_plugin(KnobPlugin(), PluginInfo("knob-plugin", "knob-dist", "1.0", builtin=False))
    assert reg.plugins["knob-plugin"].status == "loaded", reg.plugins["knob-plugin"].error
    monkeypatch.setattr(torch_handle.registry, "_REGISTRY", reg)
    return reg


@pytest.fixture
def run(tmp_path, registry) -> Path:
    """A stopped run of the ``knob`` strategy, prepared (nothing launched)."""
    from torch_handle.rundir import update_run_info

    path = tmp_path / "tiny.toml"
    path.write_text(tiny_preset(tmp_path / "runs", strategy="knob"))
    _, run_dir = prepare_run(str(path), ("launch.nproc_per_node=1",), tmp_path / "r", None)
    update_run_info(run_dir, status="stopped")
    return run_dir


def test_the_declaration_is_read_from_the_field():
    assert resume_declaration(KnobConfig, "knob") == WHY
    assert resume_declaration(KnobConfig, "bucket_mb") is None
    assert resume_declaration(KnobConfig, "absent") is None
    with pytest.raises(TypeError, match="frozen_on_resume"):
        param(1, frozen_on_resume="")


def test_rule_asks_the_plugin(registry, run):
    assert rule("strategy.knob") == WHY
    assert rule("strategy.bucket_mb") is None
    preset = load_preset(run / "preset.toml")
    assert rule("strategy.knob", preset) == WHY
    assert rule("strategy.bucket_mb", preset) is None
    # the built-ins declare theirs the same way
    assert rule("model.attention") is None and rule("data.num_workers") is None and rule("strategy.ds_config.x")


def test_a_resume_that_changes_a_declared_frozen_option_is_refused_in_one_line(run, monkeypatch, no_launch):
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    monkeypatch.chdir(run.parent)
    monkeypatch.delenv("HANDLE_DEBUG", raising=False)
    result = CliRunner().invoke(cli, ["run", "--resume", "r", "--set", "strategy.knob=2"])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [f"error: r: cannot change strategy.knob on --resume (1 -> 2): {WHY}"]
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_an_undeclared_option_and_a_switch_of_plugin_may_change(run):
    loaded, _ = prepare_run(None, ("strategy.bucket_mb=50",), None, run)
    assert loaded.strategy.options.bucket_mb == 50 and "bucket_mb = 50" in (run / RESUME_PRESET).read_text()
    assert json.loads((run / "run.json").read_text())["status"] == "running"
    old = load_preset(run / "preset.toml")
    changes = check_changes(run, old, load_preset(run / "preset.toml", ["strategy.name=single"]))
    assert changes["strategy.name"] == ["knob", "single"]  # the knob goes with its plugin, unchecked
    with pytest.raises(RunDirError, match=r"cannot change strategy\.knob on --resume \(1 -> 3\)"):
        check_changes(run, old, load_preset(run / "preset.toml", ["strategy.knob=3"]))
