"""``parallel.tp_impl = "auto"`` (the default): DTensor where it runs, by hand where it does not, chosen once when the
preset loads and recorded with its reason (preset.toml, run.json); an explicit ``native`` where it cannot run is one
line naming the valid values; a resume keeps its run's implementation unless the new layout cannot run it."""

from __future__ import annotations

import json
import tomllib

import pytest

from torch_handle.config.loader import dump_preset, load_preset
from torch_handle.errors import PresetError
from tests.helpers import tiny_preset

TP2 = ("parallel.tp=2",)
PP = ("parallel.pp=2", "launch.nproc_per_node=4", "training.grad_accum=2")


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(tiny_preset(tmp_path / "runs", steps=4, strategy="single"))
    return path


@pytest.mark.parametrize("sets, impl, why", [
    (("strategy.name=single",), "native", "auto → native: DTensor runs single with pp = 1"),
    (("strategy.name=fsdp", "launch.nproc_per_node=4"), "native", "auto → native: DTensor runs fsdp with pp = 1"),
    (("strategy.name=ddp", "launch.nproc_per_node=4"), "scratch",
     "auto → scratch: ddp does not wrap DTensor parameters (fsdp and single do)"),
    (("strategy.name=single", *PP), "scratch", "auto → scratch: tensor parallelism inside pipeline stages is "
                                               "hand-written only"),
    (("strategy.name=fsdp", *PP, "launch.nproc_per_node=8"), "scratch", "auto → scratch: tensor parallelism inside"),
])
def test_auto_runs_dtensor_where_it_can_and_says_why(tiny, sets, impl, why):
    preset = load_preset(tiny, (*TP2, *sets))
    assert preset.parallel.tp_impl == impl
    assert preset.resolved["parallel.tp_impl"].startswith(why)
    assert tomllib.loads(dump_preset(preset))["parallel"]["tp_impl"] == impl  # what a run's preset.toml holds
    dp2 = load_preset(tiny, ("strategy.name=ddp",))
    assert dp2.parallel.tp_impl == "auto" and dp2.resolved == {}  # tp 1: nothing to choose


@pytest.mark.parametrize("sets, problem", [
    (("strategy.name=ddp", "launch.nproc_per_node=4"), "ddp does not wrap DTensor parameters"),
    (("strategy.name=single", *PP), "tensor parallelism inside pipeline stages is hand-written only"),
])
def test_an_explicit_native_where_it_cannot_run_names_scratch_and_auto(tiny, sets, problem):
    with pytest.raises(PresetError) as e:
        load_preset(tiny, (*TP2, *sets, "parallel.tp_impl=native"))
    text = str(e.value)
    assert "parallel.tp_impl: " + problem in text and "\n" not in text
    assert 'set parallel.tp_impl = "scratch" (by hand) or "auto"' in text
    assert load_preset(tiny, (*TP2, *sets, "parallel.tp_impl=scratch")).parallel.tp_impl == "scratch"


def test_a_new_run_records_the_choice_and_its_reason(tiny, no_launch):
    from torch_handle.launch.run import prepare_run

    loaded, run_dir = prepare_run(str(tiny), (*TP2, "strategy.name=ddp", "launch.nproc_per_node=4"), None, None)
    info = json.loads((run_dir / "run.json").read_text())
    assert info["layout"]["tp_impl"] == "scratch" and info["layout"]["label"] == "dp 2 × tp 2 (ddp; tp scratch)"
    assert info["tp_impl_reason"] == "auto → scratch: ddp does not wrap DTensor parameters (fsdp and single do)"
    assert 'tp_impl = "scratch"' in (run_dir / "preset.toml").read_text()
    _, plain = prepare_run(str(tiny), (*TP2, "parallel.tp_impl=scratch"), None, None)
    assert "tp_impl_reason" not in json.loads((plain / "run.json").read_text())  # set by hand: nothing chosen


def test_a_resume_keeps_its_implementation_and_never_switches_it_silently(tiny, no_launch):
    from torch_handle.checkpoint.resume import RESUME_PRESET, promote
    from torch_handle.launch.run import prepare_run
    from torch_handle.rundir import update_run_info

    native, run_dir = prepare_run(str(tiny), TP2, None, None)  # single: auto → native
    assert native.parallel.tp_impl == "native"
    update_run_info(run_dir, status="stopped")
    ddp = ("strategy.name=ddp", "launch.nproc_per_node=4")
    with pytest.raises(PresetError, match='parallel.tp_impl: ddp does not wrap DTensor .* or "auto"'):
        prepare_run(None, ddp, None, run_dir)  # the run's preset.toml says native: refused, not switched
    assert not (run_dir / RESUME_PRESET).exists()
    switched, _ = prepare_run(None, (*ddp, "parallel.tp_impl=auto"), None, run_dir)  # asked for: switched, said why
    assert switched.parallel.tp_impl == "scratch" and "ddp does not wrap" in switched.resolved["parallel.tp_impl"]
    promote(run_dir, 2)
    info = json.loads((run_dir / "run.json").read_text())
    assert info["resumes"][-1]["changed"]["parallel.tp_impl"] == ["native", "scratch"]
    assert info["tp_impl_reason"].startswith("auto → scratch: ddp") and info["layout"]["tp_impl"] == "scratch"
    update_run_info(run_dir, status="stopped")
    # back on fsdp, where auto alone would pick native: the run keeps its scratch
    kept, _ = prepare_run(None, ("strategy.name=fsdp", "parallel.tp_impl=auto"), None, run_dir)
    assert kept.parallel.tp_impl == "scratch"
    assert kept.resolved["parallel.tp_impl"] == "auto → scratch: the resumed run's own implementation, which runs " \
                                                "this layout"
    assert 'tp_impl = "scratch"' in (run_dir / RESUME_PRESET).read_text()
    promote(run_dir, 4)  # the implementation stayed; the reason is the resume's
    assert json.loads((run_dir / "run.json").read_text())["tp_impl_reason"] == kept.resolved["parallel.tp_impl"]


def test_the_planner_asks_auto_again_only_where_the_preset_left_it_to_auto(tiny):
    from torch_handle.config.tp_impl import requested_tp_impl

    assert requested_tp_impl(load_preset(tiny, (*TP2, "strategy.name=ddp"))) == "auto"
    assert requested_tp_impl(load_preset(tiny, (*TP2, "parallel.tp_impl=scratch"))) == "scratch"
    assert requested_tp_impl(load_preset(tiny, ("strategy.name=ddp",))) == "auto"
