"""Resume on another strategy or world size (issue 12): a DeepSpeed ZeRO-2 run on 2 ranks, stopped at step 10,
resumed (a) with ZeRO-3, (b) under FSDP2, (c) on 1 rank with ``single`` and grad_accum doubled, reproduces the
uninterrupted run's losses for steps 11-20 within 1e-4 relative (fp32, dropout 0: dropout masks are drawn per
rank). Real torchrun runs of the tiny preset on gloo.

One uninterrupted 20-step run (checkpoints at steps 10 and 20) is shared by the three cases: each copies its run
directory without the step-20 checkpoint -- what a run stopped after step 10 leaves -- and resumes the copy, which
converts the ZeRO-2 checkpoint (DeepSpeed's ds_to_universal, then the mapping to the portable DCP form) and trains
steps 11-20 again under the new settings.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import tiny_preset

pytestmark = pytest.mark.dist

STOP_AT, STEPS = 10, 20


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
    handle("run", str(preset), "--run-dir", str(run), *sets("strategy.zero_stage=2", "model.dropout=0",
                                                            f"training.checkpoint_every={STOP_AT}"))
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
