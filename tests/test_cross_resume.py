"""Resume on another strategy or world size (issue 12): a DeepSpeed ZeRO-2 run on 2 ranks, stopped at step 10,
resumed (a) with ZeRO-3, (b) under FSDP2, (c) on 1 rank with ``single`` and grad_accum doubled, reproduces the
uninterrupted run's losses for steps 11-20 within 1e-4 relative (fp32, dropout 0: dropout masks are drawn per
rank). Real torchrun runs of the tiny preset on gloo.

One uninterrupted 20-step run (checkpoints at steps 10 and 20) is shared by the three cases: each copies its run
directory without the step-20 checkpoint -- what a run stopped after step 10 leaves -- and resumes the copy, which
converts the ZeRO-2 checkpoint (DeepSpeed's ds_to_universal, then the mapping to the portable DCP form) and trains
steps 11-20 again under the new settings. The same run is the reference of a Ctrl-C + --resume of the same
settings, whose newest checkpoint is damaged before the resume.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import assert_no_processes, tiny_preset

pytestmark = pytest.mark.dist

STOP_AT, STEPS = 10, 20
ZERO2 = ("strategy.zero_stage=2", "model.dropout=0", f"training.checkpoint_every={STOP_AT}")


def handle(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "handle_cli", *args], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, f"handle {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def sets(*items: str) -> list[str]:
    return [x for s in items for x in ("--set", s)]


def events(run_dir: Path, kind: str) -> list[dict]:
    evs = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in evs if e["kind"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a step run twice (before the stop and after the resume) keeps its last value."""
    return {e["step"]: e["loss"] for e in events(run_dir, "step")}


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory) -> Path:
    """The uninterrupted run: DeepSpeed ZeRO-2 on 2 ranks, fp32, dropout 0, checkpoints every 10 steps."""
    root = tmp_path_factory.mktemp("cross")
    preset = root / "tiny.toml"
    preset.write_text(tiny_preset(root / "runs", steps=STEPS, strategy="deepspeed", log_every=1))
    run = root / "zero2"
    handle("run", str(preset), "--run-dir", str(run), *sets(*ZERO2))
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
    assert json.loads((run / "checkpoints" / f"step-{STOP_AT}" / "layout.json").read_text())["zero_stage"] == 2
    return run


@pytest.mark.parametrize("changes, expected", [
    (["strategy.zero_stage=3"], {"strategy": "deepspeed", "zero_stage": 3, "world_size": 2}),
    (["strategy.name=fsdp"], {"strategy": "fsdp", "zero_stage": None, "world_size": 2}),
    (["strategy.name=single", "launch.nproc_per_node=1", "training.grad_accum=2"],
     {"strategy": "single", "zero_stage": None, "world_size": 1}),
], ids=["zero3", "fsdp", "single-1-rank-accum2"])
def test_a_zero2_checkpoint_resumed_elsewhere_continues_the_uninterrupted_losses(zero2_run, tmp_path, changes,
                                                                                expected):
    run = tmp_path / "stopped"
    shutil.copytree(zero2_run, run)
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS}")  # the run as a stop after step 10 leaves it

    handle("run", "--resume", str(run), *sets(*changes))

    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["step"] == STEPS
    assert {k: info.get(k) for k in expected} == expected
    assert set(info["resumes"][-1]["changed"]) >= {c.split("=")[0] for c in changes}
    logs = [e["message"] for e in events(run, "log")]
    resumed = [m for m in logs if m.startswith("resumed from")]
    assert len(resumed) == 1 and re.fullmatch(
        rf"resumed from checkpoints/step-{STOP_AT} at step {STOP_AT} \(written by deepspeed ZeRO-2 on 2 ranks; "
        r"converted to the portable form in [\d.]+ s \([\d.]+ [KM]iB\), loaded in [\d.]+ s\)", resumed[0]), resumed
    # the global batch (8) did not change, and every rank of the resumed run has its RNG state in the checkpoint
    assert not [m for m in logs if "global batch changed" in m or "no RNG state" in m or "predates" in m], logs
    meta = json.loads((run / "checkpoints" / f"step-{STOP_AT}" / "portable" / "meta.json").read_text())
    assert meta["source"]["format"] == "deepspeed" and meta["bytes"] > 0

    full, after = losses(zero2_run), losses(run)
    assert sorted(after) == list(range(1, STEPS + 1))
    for step in range(STOP_AT + 1, STEPS + 1):
        assert abs(after[step] - full[step]) <= 1e-4 * abs(full[step]), (step, after[step], full[step])
    assert full[STEPS] < full[1]  # it learns: the comparison is not between two flat lines


def _run_until_step_then_sigint(args: list[str], run_dir: Path, at_step: int, env: dict[str, str]):
    proc = subprocess.Popen([sys.executable, "-m", "handle_cli", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 240
    path = run_dir / "events.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and any(e.get("step", 0) >= at_step for e in events(run_dir, "step")):
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.05)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 15, "handle run took more than 15 s to stop after Ctrl-C"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ctrl_c_then_resume_past_a_damaged_checkpoint_continues_the_uninterrupted_losses(zero2_run, tmp_path):
    """The uninterrupted run's settings (ZeRO-2 on 2 ranks, its rank 1 slowed by 0.3 s a step with
    HANDLE_TEST_DELAY_RANK so that Ctrl-C lands mid-run; a delay changes no number): Ctrl-C after step 12 stops
    within 15 s with exit 130, no process left and a checkpoint of the stop step. That newest checkpoint damaged (a
    disk filled mid-copy), --resume says so, resumes from step 10's, and steps 11-20 equal the uninterrupted losses
    within 1e-5; event seq numbers continue without gaps."""
    preset = zero2_run.parent / "tiny.toml"
    run_dir = tmp_path / "interrupted"
    env = {**os.environ, "HANDLE_TEST_DELAY_RANK": "1:0.3"}
    proc = _run_until_step_then_sigint([str(preset), "--run-dir", str(run_dir), *sets(*ZERO2)], run_dir,
                                       STOP_AT + 2, env)
    assert proc.returncode == 130, proc.stderr
    assert_no_processes(run_dir)
    info = json.loads((run_dir / "run.json").read_text())
    stopped_at = info["step"]
    assert info["status"] == "stopped" and STOP_AT < stopped_at < STEPS, info
    newest = run_dir / "checkpoints" / f"step-{stopped_at}"
    assert (newest / "manifest.json").exists()
    assert f"handle run --resume {run_dir}" in proc.stdout

    shard = sorted(newest.rglob("*optim_states.pt"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc = handle("run", "--resume", str(run_dir))
    assert f"warning: skipping {newest}" in proc.stdout
    assert f"resumed from checkpoints/step-{STOP_AT} at step {STOP_AT}" in " ".join(
        e["message"] for e in events(run_dir, "log"))
    full, resumed = losses(zero2_run), losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    for step in range(STOP_AT + 1, STEPS + 1):
        assert abs(resumed[step] - full[step]) <= 1e-5 * abs(full[step]), (step, resumed[step], full[step])
    seqs = [json.loads(line)["seq"] for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert seqs == list(range(len(seqs))), "seq must continue across the resume without gaps"
    assert (run_dir / "model.safetensors").stat().st_size > 0
