"""kill -9 of the `handle run` launcher: the workers exit, `handle runs` shows the run as lost within 15 s, and
`handle run --resume` finishes it. A real single-process torchrun run, slowed by the HANDLE_TEST_DELAY_RANK hook
so that it would live about 20 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import tiny_preset

pytestmark = pytest.mark.dist


def runs_json(directory: Path) -> dict[str, dict]:
    proc = subprocess.run([sys.executable, "-m", "handle_cli", "runs", str(directory), "--json"],
                          capture_output=True, text=True, timeout=60, check=True)
    return {r["name"]: r for r in json.loads(proc.stdout)}


def tree_of(run_dir: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(run_dir) in " ".join(p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


def test_killed_launcher_is_lost_then_resumed(tmp_path):
    preset = tmp_path / "tiny.toml"
    preset.write_text(tiny_preset(tmp_path / "runs", steps=40, log_every=1))
    runs = tmp_path / "runs"
    run = runs / "victim"
    args = [sys.executable, "-m", "handle_cli", "run", str(preset), "--run-dir", str(run)]
    for s in ("launch.nproc_per_node=1", "strategy.name=single", "training.checkpoint_every=5"):
        args += ["--set", s]
    launcher = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "HANDLE_TEST_DELAY_RANK": "0:0.5"})  # ~0.5 s a step
    events = run / "events.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (events.exists() and '"step":6,' in events.read_text()):
        assert launcher.poll() is None, "the run ended before it could be killed"
        time.sleep(0.2)
    assert runs_json(runs)["victim"]["status"] == "running"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=10)
    killed = time.monotonic()

    status = None
    while time.monotonic() - killed < 15:
        status = runs_json(runs)["victim"]["status"]
        if status == "lost":
            break
        time.sleep(0.5)
    assert status == "lost", f"still {status} 15 s after kill -9"
    assert json.loads((run / "run.json").read_text())["status"] == "running"  # nobody could record it
    left = tree_of(run)
    assert not left, f"processes outlived the launcher: {[p.pid for p in left]}"

    proc = subprocess.run([sys.executable, "-m", "handle_cli", "run", "--resume", str(run)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = runs_json(runs)["victim"]
    assert row["status"] == "finished" and row["step"] == 40
    assert json.loads((run / "run.json").read_text())["resumes"][-1]["step"] >= 5
