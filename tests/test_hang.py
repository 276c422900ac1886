"""When a run hangs: the watchdog finds an injected hang (HANDLE_TEST_HANG_RANK makes rank 1 sleep before the
loss all-reduce, so rank 0 waits in it), writes both ranks' stacks, reports the hang (events, `handle runs`, the
dashboard) and, with on_hang = "stop", ends the run failed with nothing left behind; `handle stacks` dumps a live
run on demand; a normal run with the same small hang timeout never fires.

Real 2-process torchrun runs (tiny preset, gloo) for the `dist` tests; the dashboard and the faulthandler round
trip run without torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from handle_cli.tui.app import HandleDashboard
from tests.helpers import leftovers, tagged_env, tiny_preset
from torch_handle.observe.heartbeat import live_beats
from torch_handle.observe.stacks import collect_stacks, take_stacks

HANG_FIXTURES = Path(__file__).parent / "fixtures" / "recorded-hang"


def handle(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "handle_cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    path = run_dir / "events.jsonl"
    text = path.read_text() if path.exists() else ""
    # the run is live: its last line may be half-written (complete lines end with a newline)
    evs = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]
    return [e for e in evs if kind is None or e["kind"] == kind]


def runs_row(run_dir: Path) -> dict:
    proc = handle("runs", str(run_dir.parent), "--json")
    assert proc.returncode == 0, proc.stderr
    return {r["name"]: r for r in json.loads(proc.stdout)}[run_dir.name]


def sections(stacks_text: str) -> dict[int, str]:
    """rank -> its part of a stacks file."""
    out = {}
    for part in stacks_text.split("==== rank ")[1:]:
        out[int(part.split(" ", 1)[0])] = part
    return out


def start_run(tmp_path: Path, name: str, *sets: str, steps: int, **env_extra: str):
    preset = tmp_path / "tiny.toml"
    preset.write_text(tiny_preset(tmp_path / "runs", steps=steps, log_every=1))
    env, tag = tagged_env(HANDLE_PY_SPY="0", **env_extra)  # faulthandler: the same dump on every machine
    run = tmp_path / "runs" / name
    args = [sys.executable, "-m", "handle_cli", "run", str(preset), "--run-dir", str(run)]
    for s in sets:
        args += ["--set", s]
    return run, tag, args, env


def assert_rank_stacks(text: str) -> None:
    """Rank 1's section names its sleeping frame, rank 0's the collective it waits in."""
    by_rank = sections(text)
    assert set(by_rank) == {0, 1}, text[:2000]
    rank1_main = by_rank[1].split("\n\n")[0]
    assert "in train_step" in rank1_main and "time.sleep(self.test_hang[1])" in rank1_main, by_rank[1][:2000]
    rank0_main = by_rank[0].split("\n\n")[0]
    assert "distributed_c10d.py" in rank0_main and ", in all_reduce" in rank0_main, by_rank[0][:2000]
    assert "rank 0 in all_reduce (trainer.py:" in text and "rank 1 in time.sleep (trainer.py:" in text


@pytest.mark.dist
def test_an_injected_hang_is_found_and_stops_the_run(tmp_path: Path) -> None:
    timeout_s = 5
    run, tag, args, env = start_run(tmp_path, "hung", f"launch.hang_timeout_s={timeout_s}", "launch.on_hang=stop",
                                    steps=20, HANDLE_TEST_HANG_RANK="1:3")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert leftovers(tag) == []

    steps = {e["step"]: e for e in events(run, "step")}
    assert sorted(steps) == [1, 2]  # step 3 never completed
    (hang,) = events(run, "hang")
    waited = hang["time"] - steps[2]["time"]  # the hang began right after step 2's event
    assert timeout_s - 0.5 <= waited <= timeout_s + 10, waited
    assert hang["action"] == "stop" and hang["seq"] is None and hang["source"] == "launcher"
    assert {r["rank"]: r["call"] for r in hang["ranks"]} == {0: "all_reduce", 1: "time.sleep"}
    assert all(r["where"].startswith("trainer.py:") and r["where"].endswith(" train_step") for r in hang["ranks"])
    assert "rank 0 in all_reduce (trainer.py:" in hang["message"]
    assert "rank 1 in time.sleep (trainer.py:" in hang["message"]
    assert_rank_stacks((run / hang["stacks"]).read_text())

    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "failed"
    assert info["message"].startswith(hang["message"]) and 'launch.on_hang = "stop"' in info["message"]
    assert "error: hang: no rank advanced" in proc.stdout
    row = runs_row(run)
    assert row["status"] == "failed" and row["message"] == info["message"] and row["hang"] == hang["message"]


@pytest.mark.dist
def test_stacks_of_a_live_hung_run_then_it_recovers(tmp_path: Path) -> None:
    """on_hang = "warn": the hang is reported (status `hung`), `handle stacks` dumps the live ranks, rank 1 wakes
    up and the run finishes. The rest of this run -- start-up, the steps before and after, the evals, checkpoints
    and export -- is a normal run under a 3 s hang timeout: the watchdog fires exactly once, and each rank's last
    heartbeat is the close after step 6."""
    run, tag, args, env = start_run(tmp_path, "warned", "launch.hang_timeout_s=3", "training.checkpoint_every=2",
                                    "training.eval_every=2", steps=6, HANDLE_TEST_HANG_RANK="1:4:12")
    launcher = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 150
        while not events(run, "hang"):
            assert launcher.poll() is None, launcher.communicate()[0]
            assert time.monotonic() < deadline, "no hang event"
            time.sleep(0.2)
        row = runs_row(run)
        assert row["status"] == "hung" and row["message"].startswith("hang: ") and row["hang"] == row["message"]

        proc = handle("stacks", str(run), "--json", env=env)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        path = Path(report["path"])
        assert path.parent == run / "logs" and path.name.startswith("stacks-")
        assert {r["rank"]: r["call"] for r in report["ranks"]} == {0: "all_reduce", 1: "time.sleep"}
        assert all(r["source"] == "faulthandler" and r["error"] is None for r in report["ranks"])
        assert_rank_stacks(path.read_text())
        assert "reason: on demand (handle stacks)" in path.read_text()

        proc = handle("stacks", str(run), env=env)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].startswith(f"stacks: {run}/logs/stacks-")
        assert lines[1].startswith("rank 0 in all_reduce (trainer.py:")
        assert lines[2].startswith("rank 1 in time.sleep (trainer.py:")

        out, _ = launcher.communicate(timeout=150)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, out
    assert leftovers(tag) == []
    assert [e["step"] for e in events(run, "step")] == [1, 2, 3, 4, 5, 6]
    (hang,) = events(run, "hang")  # once: not at start-up, not after the run moved again
    step3 = next(e for e in events(run, "step") if e["step"] == 3)
    assert 3 - 0.5 <= hang["time"] - step3["time"] <= 3 + 10 and hang["action"] == "warn"
    row = runs_row(run)
    assert row["status"] == "finished" and row["hang"] == hang["message"]
    assert "error: hang: no rank advanced" in out
    assert [e["step"] for e in events(run, "eval")][-3:] == [2, 4, 6]
    assert sorted(p.name for p in (run / "heartbeats").iterdir()) == ["rank0.json", "rank1.json"]
    beat = json.loads((run / "heartbeats" / "rank1.json").read_text())
    assert beat["rank"] == 1 and beat["step"] == 6 and beat["progress"] > 10 and beat["phase"] == "close"


def test_stacks_of_a_run_that_is_not_running(tmp_path: Path) -> None:
    shutil.copytree(HANG_FIXTURES, tmp_path / "runs")
    run = tmp_path / "runs" / "ddp-hung"
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "status": "finished"}))
    proc = handle("stacks", str(run))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: {run}: not running (status finished); stacks come from the workers of a live run\n"
    (run / "run.json").write_text(json.dumps(info))  # "running", but no worker ever wrote a heartbeat
    proc = handle("stacks", str(run), "--json")
    assert proc.returncode == 2 and "no live worker on this host yet" in proc.stderr
    proc = handle("stacks", str(tmp_path / "nope"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not a run directory" in proc.stderr
    assert not list((run / "logs").glob("stacks-*.txt"))


CHILD = """
import sys, time
from torch_handle.observe.heartbeat import beat, start_heartbeat

start_heartbeat(sys.argv[1], rank=3, local_rank=1).interval_s = 0.2
beat("train_step", 7)

def stuck():
    print("ready", flush=True)
    time.sleep(60)  # where the stacks must point

stuck()
"""


def test_a_worker_answers_sigusr1_with_its_stacks(tmp_path: Path) -> None:
    """The faulthandler round trip outside torchrun: a process with a heartbeat, its stacks by SIGUSR1."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    run = tmp_path / "run"
    env, tag = tagged_env(PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    child = subprocess.Popen([sys.executable, str(script), str(run)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 10
        while (local := live_beats(run)[0]) and local[0].phase != "train_step" and time.monotonic() < deadline:
            time.sleep(0.05)  # the heartbeat thread writes the beat within 0.2 s
        local, remote = live_beats(run)
        assert [(b.rank, b.local_rank, b.step, b.phase, b.pid) for b in local] == [(3, 1, 7, "train_step", child.pid)]
        assert remote == []
        (stacks,) = collect_stacks(run, local)
        assert stacks.source == "faulthandler" and stacks.error == ""
        assert stacks.summary == "rank 3 in time.sleep (child.py:10 stuck)"
        report = take_stacks(run, local, "test")
        text = report.path.read_text()
        assert "rank 3 in time.sleep (child.py:10 stuck)" in text
        assert "    time.sleep(60)  # where the stacks must point" in text
        assert child.poll() is None  # SIGUSR1 did not kill it
    finally:
        child.kill()
        child.wait()
    assert live_beats(run) == ([], [])  # a dead process's heartbeat is stale
    assert leftovers(tag) == []


async def _loaded(pilot) -> None:
    app = pilot.app
    deadline = time.monotonic() + 5
    while app.batches_applied < 1:
        assert time.monotonic() < deadline, "the first batch never came"
        await pilot.pause(0.02)
    await pilot.pause(0.15)
    await pilot.pause()


@pytest.fixture
def hang_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The recorded hung run (tests/fixtures/make_runs.py) at ./runs."""
    shutil.copytree(HANG_FIXTURES, tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    return Path("runs")


def test_snapshot_hung_run_80x24(hang_runs: Path, snap_compare) -> None:
    """The HUNG badge and where each rank waits, in red, in the header and the log panel."""
    assert snap_compare(HandleDashboard(hang_runs / "ddp-hung", hang_runs), terminal_size=(80, 24),
                        run_before=_loaded)


def test_dashboard_shows_the_hang_then_the_recovery(hang_runs: Path) -> None:
    import asyncio

    run = hang_runs / "ddp-hung"

    async def main() -> None:
        app = HandleDashboard(run, hang_runs, poll_interval=0.05)
        async with app.run_test(size=(120, 40)) as pilot:
            await _loaded(pilot)
            header = " ".join(app.header_widget.plain.split())
            assert header.startswith("HUNG ddp") and "hang: no rank advanced for 6 s" in header
            assert "rank 1 in time.sleep (trainer.py:423" in header  # wrapped, not cut
            logs = "\n".join(app.log_panel.plain_lines)
            assert "ev hang: no rank advanced" in logs
            (hang,) = [r for r in app.log_panel.records if r[2].startswith("hang: ")]
            assert hang[0] == "ev" and hang[3] == "bold red"
            with open(run / "events.jsonl", "a") as f:
                f.write(json.dumps({"seq": 9, "time": 1767621620.0, "kind": "step", "step": 8, "loss": 7.4}) + "\n")
            deadline = time.monotonic() + 5
            while " RUNNING " not in app.header_widget.plain:
                assert time.monotonic() < deadline, app.header_widget.plain
                await pilot.pause(0.05)
            assert "hang:" not in app.header_widget.plain
            assert "step 8: the run moves again after the hang" in "\n".join(app.log_panel.plain_lines)

    asyncio.run(main())
    from handle_cli.tui.model import run_row

    assert run_row(run).status == "running"  # the step after the hang
    lines = (run / "events.jsonl").read_text().splitlines()
    (run / "events.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    assert run_row(run).status == "hung"


def test_env_has_the_flight_recorder_unless_the_user_set_it(tmp_path: Path, monkeypatch) -> None:
    from torch_handle.config.loader import load_preset
    from torch_handle.launch.supervisor import Launch

    preset = tmp_path / "p.toml"
    preset.write_text("[launch]\nbackend = \"auto\"\n")
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    env = Launch(load_preset(preset), tmp_path / "run").env
    assert int(env.get("TORCH_FR_BUFFER_SIZE") or env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"  # the user's
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == str((tmp_path / "run").resolve() / "logs" / "nccl_trace_rank_")
    preset.write_text("[launch]\nbackend = \"gloo\"\n")
    env = Launch(load_preset(preset), tmp_path / "run").env
    assert "TORCH_NCCL_DEBUG_INFO_PIPE_FILE" not in env or "TORCH_NCCL_DEBUG_INFO_PIPE_FILE" in os.environ
