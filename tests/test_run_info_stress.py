"""Short runs and resumes at once, each through real `handle run` processes: every one ends `finished` with its
step count, and every resume is recorded and promoted (torch_handle.rundir.run_info_lock).

A resumed run's launcher promotes the resume at the first step event it reads; with one step to go, rank 0 closes
the run about then. HANDLE_TEST_RUN_INFO_DELAY (1 s) makes every writer of run.json (launchers and rank 0) sleep
between reading it and writing it back, so the two updates overlap: without the lock, the run's closing status or
its resume entry is lost.

Tiny model (one layer), one rank per run: one run of 2 steps, then four at once: it and two copies of it resumed
for a third step, and a new run of 3 steps.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import handle_at_once, handle_runs
from torch_handle.checkpoint.resume import PENDING, RESUME_PRESET
from torch_handle.common.testhooks import RUN_INFO_DELAY_ENV

pytestmark = pytest.mark.dist

COMMON = ("--set", "model.n_layers=1", "--set", "training.log_every=1", "--set", "training.eval_steps=1",
          "--set", "training.checkpoint_every=1", "--set", "training.keep_last=1")
SLOW_WRITES = {**os.environ, RUN_INFO_DELAY_ENV: "1.0"}


def test_runs_and_resumes_at_once_all_finish_with_their_steps(tmp_path: Path) -> None:
    seed = handle_runs(tmp_path, {"seed": ("--set", "training.steps=2")}, COMMON, at_once=1, timeout=120)["seed"]
    resumed = {"r0": seed, **{name: shutil.copytree(seed, tmp_path / name) for name in ("r1", "r2")}}
    commands = {name: ("run", "--resume", str(run), "--set", "training.steps=3") for name, run in resumed.items()}
    commands["new"] = ("run", str(tmp_path / "tiny.toml"), "--set", "run.name=new", *COMMON,  # handle_runs' preset
                       "--set", "training.steps=3")
    done = handle_at_once(commands, at_once=4, timeout=120, env=SLOW_WRITES)
    for name, (rc, out) in done.items():
        run = resumed.get(name) or Path(next((ln for ln in out.splitlines() if ln.startswith("run directory: ")),
                                             ": ").split(": ", 1)[1])
        info = json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}
        assert rc == 0 and info["status"] == "finished", f"{name}: {info}\n{out[-2000:]}"
        assert (info["step"], info["steps"], info.get("resumed", 0)) == (3, 3, int(name in resumed)), (name, info)
        if name in resumed:
            assert [(r["step"], r["changed"]) for r in info["resumes"]] == [(2, {"training.steps": [2, 3]})], info
            assert PENDING not in info and not (run / RESUME_PRESET).exists(), (name, info)
            assert "steps = 3" in (run / "preset.toml").read_text(), name
