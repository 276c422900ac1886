"""A checkpoint that cannot be written fails the run and keeps the previous one; a --resume that would change
what the checkpoint depends on is refused before anything is touched; an allowed change takes effect and is
recorded. Real single-process torchrun runs of the tiny preset (a few seconds each)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import tiny_preset
from torch_handle.checkpoint.store import FAULT_ENV, newest_valid

pytestmark = pytest.mark.dist

SINGLE = ["launch.nproc_per_node=1", "strategy.name=single", "training.log_every=1"]


def handle(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "handle_cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def sets(*items: str) -> list[str]:
    return [x for s in items for x in ("--set", s)]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def events(run_dir: Path, kind: str) -> list[dict]:
    evs = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in evs if e["kind"] == kind]


def test_disk_full_checkpoint_then_refused_and_allowed_resumes(tmp_path):
    preset = tmp_path / "tiny.toml"
    preset.write_text(tiny_preset(tmp_path / "runs", steps=6))
    run = tmp_path / "run"

    # 1. the checkpoint at step 4 hits ENOSPC (test hook): failed, one line naming the directory; step-2 intact
    proc = handle("run", str(preset), "--run-dir", str(run), *sets(*SINGLE, "training.checkpoint_every=2"),
                  env={FAULT_ENV: "4"})
    assert proc.returncode == 1, proc.stderr
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "failed"
    assert f"checkpoint at step 4 not written to {run / 'checkpoints'}: No space left on device" in info["message"]
    assert "needs about" in info["message"] and "\n" not in info["message"]
    good, skipped = newest_valid(run / "checkpoints")
    assert good == run / "checkpoints" / "step-2" and not skipped
    assert not list((run / "checkpoints").glob(".tmp-*"))

    # 2. settings the checkpoint depends on: exit 2, one line naming the key, the run directory untouched
    before = {p.name: digest(p) for p in run.iterdir() if p.is_file()}
    for override, key in [("model.d_model=128", "model.d_model"), ("run.seed=7", "run.seed"),
                          ("data.seq_len=64", "data.seq_len"), ("training.precision=bf16", "training.precision")]:
        proc = handle("run", "--resume", str(run), "--set", override)
        assert proc.returncode == 2, (override, proc.stdout, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and key in proc.stderr, proc.stderr
        assert "run directory:" not in proc.stdout
    assert {p.name: digest(p) for p in run.iterdir() if p.is_file()} == before

    # 3. allowed: more steps and another LR, without the hook: finishes; preset.toml and run.json record it
    proc = handle("run", "--resume", str(run), *sets("training.steps=8", "training.lr=0.002"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["step"] == 8 and info["steps"] == 8
    assert info["resumes"][-1]["step"] == 2
    assert info["resumes"][-1]["changed"] == {"training.steps": [6, 8], "training.lr": [0.001, 0.002]}
    assert "steps = 8" in (run / "preset.toml").read_text() and not (run / "preset.resume.toml").exists()
    assert any("changed training.steps 6 -> 8" in e["message"] for e in events(run, "log"))
    assert max(e["step"] for e in events(run, "step")) == 8

    # 4. a plain resume of the finished run would train nothing: exit 2, one line saying how to train further,
    # and every file of the run directory (preset.toml, run.json, ...) byte for byte as it was
    before = {p.name: digest(p) for p in run.iterdir() if p.is_file()}
    proc = handle("run", "--resume", str(run))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [f"error: {run}: nothing to train: the run finished at step 8 (training.steps "
                                        f"= 8); to train further add --set training.steps=M with M > 8"]
    assert {p.name: digest(p) for p in run.iterdir() if p.is_file()} == before


def test_disk_full_checkpoint_with_two_ranks_keeps_the_previous_one(tmp_path):
    """DDP, 2 ranks: both fail at their own pace; the one-line failure names the directory, step-2 stays valid
    and a plain --resume without the hook finishes."""
    preset = tmp_path / "tiny.toml"
    preset.write_text(tiny_preset(tmp_path / "runs", steps=6))
    run = tmp_path / "run"
    proc = handle("run", str(preset), "--run-dir", str(run), *sets("training.checkpoint_every=2"),
                  env={FAULT_ENV: "4"})
    assert proc.returncode == 1, proc.stderr
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "failed" and "not written to" in info["message"] and "No space left" in info["message"]
    assert newest_valid(run / "checkpoints")[0] == run / "checkpoints" / "step-2"
    proc = handle("run", "--resume", str(run))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
