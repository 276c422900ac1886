"""What a --resume may change (torch_handle.checkpoint.resume), and how a lost run is told from a live one (rundir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import tiny_preset
from torch_handle.config.loader import load_preset
from torch_handle.errors import RunDirError
from torch_handle.observe.fields import Status
from torch_handle.observe.state import RunState
from torch_handle.checkpoint.resume import (PENDING, RESUME_PRESET, check_changes, diff, layout_adjustments,
                                            promote, resumed_mapping, rule)
from torch_handle.rundir import HEARTBEAT_FILE, is_lost, read_run_status

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def preset_path(tmp_path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(tiny_preset(tmp_path / "runs"))
    return path


@pytest.mark.parametrize("key", ["model.d_model", "model.n_layers", "model.fused_qkv", "model.name", "data.seq_len",
                                 "data.vocab_size", "data.name", "strategy.ds_config.x", "training.precision",
                                 "training.beta1", "run.seed"])
def test_frozen_keys_have_a_reason(key):
    assert rule(key)


@pytest.mark.parametrize("key", ["training.steps", "training.lr", "training.warmup_steps", "training.schedule",
                                 "training.min_lr_ratio", "training.eval_every", "training.checkpoint_every",
                                 "training.log_every", "launch.timeout_s", "launch.max_restarts", "profiler.name",
                                 "model.dropout", "model.activation_checkpointing", "strategy.bucket_cap_mb",
                                 # cross-strategy / cross-world-size resume (checkpoint.convert, GlobalBatchSampler)
                                 "strategy.name", "strategy.zero_stage", "strategy.shard_optimizer",
                                 "strategy.offload_optimizer", "launch.nproc_per_node", "launch.nnodes",
                                 "training.micro_batch_size", "training.grad_accum",
                                 # cross-layout resume: checkpoints are portable (docs/resume.md#on-another-layout)
                                 "parallel.tp", "parallel.tp_impl", "parallel.sequence_parallel", "parallel.pp",
                                 "parallel.pp_impl", "parallel.pp_schedule", "parallel.pp_microbatches",
                                 "parallel.pp_stages_per_rank", "parallel.pp_layers", "parallel.pp_split"])
def test_allowed_keys(key):
    assert rule(key) is None


def test_a_tp_run_may_resume_as_pp_or_dp_as_docs_resume_shows():
    """docs/resume.md's "On another layout" commands: accepted (sequence_parallel goes by itself with tp 1), each
    change named."""
    old = load_preset(REPO / "presets/tp.toml")

    def resumed(*sets: str):
        extra, _ = layout_adjustments(old, resumed_mapping(Path("r"), old, sets), sets)
        assert extra == ["parallel.sequence_parallel=false"]
        return load_preset(REPO / "presets/tp.toml", [*sets, *extra])

    as_pp = resumed("parallel.tp=1", "parallel.pp=2", "parallel.pp_microbatches=2")
    as_dp = resumed("parallel.tp=1", "strategy.name=ddp", "training.micro_batch_size=8")
    assert check_changes(Path("r"), old, as_pp) == {"parallel.tp": [2, 1], "parallel.sequence_parallel": [True, False],
                                                    "parallel.pp": [1, 2], "parallel.pp_microbatches": [0, 2]}
    assert {"parallel.tp", "strategy.name", "training.micro_batch_size"} <= set(check_changes(Path("r"), old, as_dp))


@pytest.mark.parametrize("sets, key", [(["model.d_model=128"], "model.d_model"),
                                       (["run.seed=7"], "run.seed"),
                                       (["training.precision=bf16"], "training.precision"),
                                       (["data.seq_len=64"], "data.seq_len")])
def test_check_changes_refuses_naming_the_key(preset_path, sets, key):
    old = load_preset(preset_path)
    with pytest.raises(RunDirError, match=key.replace(".", r"\.")):
        check_changes(Path("r"), old, load_preset(preset_path, sets))


def test_strategy_and_world_size_may_change_ds_config_may_not_on_deepspeed(preset_path):
    zero2 = load_preset(preset_path, ["strategy.name=deepspeed", "strategy.zero_stage=2"])
    changes = check_changes(Path("r"), zero2, load_preset(preset_path, ["strategy.name=deepspeed",
                                                                        "strategy.zero_stage=3"]))
    assert changes == {"strategy.zero_stage": [2, 3]}
    single = load_preset(preset_path, ["strategy.name=single", "launch.nproc_per_node=1", "training.grad_accum=2"])
    changes = check_changes(Path("r"), zero2, single)  # the options of deepspeed go, unchecked
    assert changes["strategy.name"] == ["deepspeed", "single"] and changes["launch.nproc_per_node"] == [2, 1]
    assert changes["training.grad_accum"] == [1, 2] and "strategy.zero_stage" in changes
    tuned = load_preset(preset_path, ["strategy.name=deepspeed", "strategy.zero_stage=2",
                                      "strategy.ds_config.zero_optimization.round_robin_gradients=true"])
    with pytest.raises(RunDirError, match=r"cannot change strategy\.ds_config\.zero_optimization\."
                                          r"round_robin_gradients on --resume \(None -> True\): it is merged"):
        check_changes(Path("r"), zero2, tuned)
    # switching to deepspeed brings its own ds_config along
    assert check_changes(Path("r"), single, tuned)["strategy.name"] == ["single", "deepspeed"]


def test_allowed_changes_are_listed(preset_path):
    old = load_preset(preset_path)
    new = load_preset(preset_path, ["training.steps=50", "training.lr=0.01", "training.log_every=5"])
    assert check_changes(Path("r"), old, new) == {"training.steps": [10, 50], "training.lr": [0.001, 0.01]}
    assert diff(old, old) == {}


def test_promote_swaps_the_preset_and_records_the_resume(tmp_path, preset_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "preset.toml").write_text(preset_path.read_text())
    (run / RESUME_PRESET).write_text(preset_path.read_text().replace("steps = 10", "steps = 30")
                                     .replace("nproc_per_node = 2", "nproc_per_node = 4"))
    (run / "run.json").write_text(json.dumps({"status": "running", PENDING: {"time": 5.0},
                                              "layout": {"world_size": 2, "dp": 2, "tp": 1, "pp": 1}}))
    entry = promote(run, 10)
    assert entry == {"step": 10, "time": 5.0, "changed": {"training.steps": [10, 30],
                                                          "launch.nproc_per_node": [2, 4]}}
    info = json.loads((run / "run.json").read_text())
    assert info["resumes"] == [entry] and PENDING not in info and info["steps"] == 30
    assert info["layout"]["label"] == "dp 4 (ddp)"  # the resumed preset's layout: another world size
    assert not (run / RESUME_PRESET).exists() and "steps = 30" in (run / "preset.toml").read_text()
    assert promote(run, 11) is None  # nothing pending any more


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_run_whose_launcher_is_gone_and_heartbeat_stale_is_lost(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    info = {"status": "running", "launcher_pid": _dead_pid(), "launcher_create_time": 1.0}
    (run / "run.json").write_text(json.dumps(info))
    (run / HEARTBEAT_FILE).touch()
    assert not is_lost(run, info)  # fresh heartbeat: not yet
    old = time.time() - 30
    for name in ("run.json", HEARTBEAT_FILE):
        os.utime(run / name, (old, old))
    assert is_lost(run, info)
    assert read_run_status(run)["status"] == Status.LOST
    assert RunState(run, info=info).status == Status.LOST
    assert RunState(run, info=info).eta_s() is None
    alive = {**info, "launcher_pid": os.getpid(), "launcher_create_time": None}
    assert not is_lost(run, alive)  # the launcher still runs (this process)
    reused = {**alive, "launcher_create_time": 1.0}  # same pid, another start time: a reused pid
    assert is_lost(run, reused)
    assert not is_lost(run, {**info, "status": "finished"})
    assert not is_lost(run, {"status": "running"})  # no launcher recorded: no verdict


def test_an_accepted_change_waits_in_the_side_file_until_promoted(preset_path):
    """preset.toml changes only through promote(): a resume whose workers fail leaves it as it was, and the next
    plain --resume drops the stale side file."""
    from torch_handle.launch.run import prepare_run
    from torch_handle.rundir import update_run_info

    _, run = prepare_run(str(preset_path), (), None, None)
    update_run_info(run, status="failed")
    original = (run / "preset.toml").read_bytes()
    with pytest.raises(RunDirError, match=r"model\.n_heads"):
        prepare_run(None, ("model.n_heads=2",), None, run)
    assert json.loads((run / "run.json").read_text())["status"] == "failed"
    loaded, _ = prepare_run(None, ("training.steps=20",), None, run)
    assert loaded.training.steps == 20 and "steps = 20" in (run / RESUME_PRESET).read_text()
    assert (run / "preset.toml").read_bytes() == original
    assert PENDING in json.loads((run / "run.json").read_text())
    loaded, _ = prepare_run(None, (), None, run)  # that resume failed before its first step; a plain one now
    assert loaded.training.steps == 10 and not (run / RESUME_PRESET).exists()
    assert (run / "preset.toml").read_bytes() == original


def test_a_supervised_resume_promotes_its_preset_at_its_first_step(preset_path, monkeypatch):
    """The library's side of handle run (torch_handle.launch.run.SupervisedRun), torchrun faked: the step that
    follows the launch makes preset.resume.toml the run's preset, and interrupts stop, then kill."""
    from torch_handle.launch.run import Interrupt, SupervisedRun, prepare_run
    from torch_handle.launch.supervisor import Launch
    from torch_handle.rundir import update_run_info

    _, run = prepare_run(str(preset_path), (), None, None)
    update_run_info(run, status="stopped")
    loaded, _ = prepare_run(None, ("training.steps=20",), None, run)
    calls = []
    monkeypatch.setattr(Launch, "start", lambda self: calls.append("start"))
    monkeypatch.setattr(Launch, "poll", lambda self: None)
    monkeypatch.setattr(Launch, "request_stop", lambda self: calls.append("stop"))
    monkeypatch.setattr(Launch, "kill", lambda self, grace_s=5.0: calls.append("kill"))
    supervised = SupervisedRun(loaded, run)
    assert supervised.pending and supervised.preset.training.steps == 20
    supervised.start()
    with open(run / "events.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"kind": "step", "step": 4, "time": time.time() + 1, "loss": 2.0}) + "\n")
    assert supervised.poll() == (None, [{"kind": "step", "step": 4, "time": pytest.approx(time.time() + 1, abs=5),
                                         "loss": 2.0}])
    assert not supervised.pending and not (run / RESUME_PRESET).exists()
    assert "steps = 20" in (run / "preset.toml").read_text()
    info = json.loads((run / "run.json").read_text())
    assert PENDING not in info and info["resumes"][-1]["step"] == 3 and info["steps"] == 20
    assert supervised.interrupt() == Interrupt.STOP_REQUESTED  # proc is None: nothing was started to kill
    assert supervised.interrupt() == Interrupt.KILLED
    assert calls == ["start", "stop", "kill"]
