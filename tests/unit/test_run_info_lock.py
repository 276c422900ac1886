"""One writer of run.json at a time (torch_handle.rundir.run_info_lock): real processes update one run directory
at once and no update is lost.

HANDLE_TEST_RUN_INFO_DELAY makes every writer sleep between its read and its write, so that without the lock the
updates below are lost every time, not now and then.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from tests import run_info_writers as writers
from tests.helpers import tiny_preset
from torch_handle.checkpoint.resume import PENDING
from torch_handle.config.loader import load_preset
from torch_handle.errors import RunDirError
from torch_handle.launch.supervisor import Launch
from torch_handle.rundir import LOCK_FILE, RUN_FILE, run_info_lock, update_run_info

WORKERS, UPDATES = 6, writers.UPDATES
SPAWN = multiprocessing.get_context("spawn")  # no fork of a process that may hold torch's threads


def _run_dir(root: Path, **info) -> Path:
    run = root / "run"
    run.mkdir()
    (run / RUN_FILE).write_text(json.dumps({"status": "running", **info}))
    return run


def _info(run: Path) -> dict:
    return json.loads((run / RUN_FILE).read_text())


def test_writers_in_many_processes_lose_no_update(tmp_path):
    run = _run_dir(tmp_path, count=0, **{PENDING: {"time": 1.0}})
    started = SPAWN.Event()
    procs = [SPAWN.Process(target=writers.hammer, args=(str(run), i, 0.002, started)) for i in range(WORKERS)]
    for p in procs:
        p.start()
    started.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * WORKERS
    info = _info(run)
    assert info["count"] == WORKERS * UPDATES, info
    assert all(info[f"w{i}"] == UPDATES - 1 for i in range(WORKERS)), info
    assert PENDING not in info and [r["step"] for r in info["resumes"]] == [3], info


def test_a_workers_closing_update_during_a_promote_survives(tmp_path):
    """The race seen in test_pipeline_checkpoint: the launcher promotes the resume (read ... write) while rank 0
    writes its closing status in between. Both updates must be in run.json."""
    run = _run_dir(tmp_path, step=6, train_start_time=2.0, end_time=None, **{PENDING: {"time": 1.0}})
    reading = SPAWN.Event()
    launcher = SPAWN.Process(target=writers.promote_slowly, args=(str(run), reading))
    launcher.start()
    assert reading.wait(60)
    time.sleep(0.3)  # the launcher has read run.json and sleeps before writing it back
    update_run_info(run, status="finished", end_time=3.0, step=4, message="")  # rank 0's close
    launcher.join(60)
    assert launcher.exitcode == 0
    info = _info(run)
    assert (info["status"], info["end_time"], info["step"]) == ("finished", 3.0, 4), info
    assert PENDING not in info and info["resumes"][0]["step"] == 2 and info["train_start_time"] == 2.0, info


def test_the_launchers_settle_reads_run_json_under_the_lock(tmp_path):
    """Launch.finish decides on the run.json it holds the lock for: a worker's final status written meanwhile
    stands (an earlier view, "running", would have settled it failed)."""
    preset = tmp_path / "tiny.toml"
    preset.write_text(tiny_preset(tmp_path / "runs"))
    run = _run_dir(tmp_path, launcher_pid=os.getpid())
    holding = SPAWN.Event()
    worker = SPAWN.Process(target=writers.write_late, args=(str(run), holding))
    worker.start()
    assert holding.wait(60)
    time.sleep(0.3)
    info = Launch(load_preset(preset), run).finish(0)
    worker.join(60)
    assert info["status"] == "finished" and _info(run)["status"] == "finished", info


def test_a_lock_not_given_up_in_time_is_skipped_with_a_warning(tmp_path, monkeypatch, caplog):
    import torch_handle.rundir as rundir

    monkeypatch.setattr(rundir, "LOCK_TIMEOUT_S", 0.3)
    run = _run_dir(tmp_path)
    holding, release = SPAWN.Event(), SPAWN.Event()
    holder = SPAWN.Process(target=writers.hold, args=(str(run), holding, release))
    holder.start()
    try:
        assert holding.wait(60)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="torch_handle.rundir"):
            update_run_info(run, step=1)
        assert 0.3 <= time.monotonic() - t0 < 5 and _info(run)["step"] == 1
        assert "run.json written without its lock (still held by another writer after 0.3 s)" in caplog.text
    finally:
        release.set()
        holder.join(60)
    holding, never = SPAWN.Event(), SPAWN.Event()
    holder = SPAWN.Process(target=writers.hold, args=(str(run), holding, never))
    holder.start()
    assert holding.wait(60)
    holder.kill()  # a writer killed while holding it: the kernel releases its lock
    holder.join(60)
    caplog.clear()
    update_run_info(run, step=2)
    assert _info(run)["step"] == 2 and "without its lock" not in caplog.text


def test_the_lock_nests_in_one_thread_and_bad_input_creates_nothing(tmp_path):
    run = _run_dir(tmp_path)
    t0 = time.monotonic()
    with run_info_lock(run):
        update_run_info(run, step=5)  # the same thread: no wait for itself
    assert time.monotonic() - t0 < 5 and _info(run)["step"] == 5 and (run / LOCK_FILE).exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RunDirError, match="no run.json"):
        update_run_info(empty, step=1)
    with pytest.raises(RunDirError, match="no such directory"):
        update_run_info(tmp_path / "missing", step=1)
    assert list(empty.iterdir()) == [] and not (tmp_path / "missing").exists()
