"""``handle bench scaling``: real short runs per world size through ``handle run``'s launcher (gloo on CPU), the
strong-scaling batch split written into each run's preset, a failing run reported while the others go on, bad
input refused before anything starts, Ctrl-C, and no process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.helpers import leftovers, tagged_env, tiny_preset
from tests.test_bench_comm import REPO, handle


def write_tiny(tmp_path: Path, steps: int = 4) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(tiny_preset(tmp_path / "runs", steps=steps), encoding="utf-8")
    return path


def only_dir(parent: Path) -> Path:
    dirs = list(parent.iterdir())
    assert len(dirs) == 1 and dirs[0].name.startswith("scaling-"), dirs
    return dirs[0]


@pytest.mark.dist
def test_real_runs_1_and_2_ranks_json_strong_scaling_halves_grad_accum(tmp_path):
    """One real sweep (1 and 2 ranks, --strong): the measured records, the run directories under the bench's, the
    saved results, and the global batch of 8 kept by halving grad_accum in the 2-rank run's preset and events.
    Weak scaling's plan is checked in-process (test_threads_fix_omp_num_threads_for_every_run)."""
    env, tag = tagged_env()
    t0 = time.perf_counter()
    proc = handle("bench", "scaling", str(write_tiny(tmp_path)), "--nproc", "1,2", "--steps", "4", "--skip", "1",
                  "--strong", "--set", "training.grad_accum=2", "--json", "--output-dir", str(tmp_path / "bench"),
                  env=env, timeout=300)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]  # JSON lines and nothing else
    assert [(r["strategy"], r["nproc"], r["status"]) for r in records] == [("ddp", 1, "finished"),
                                                                          ("ddp", 2, "finished")]
    assert [(r["nproc"], r["grad_accum"], r["global_batch"], r["mode"]) for r in records] == [(1, 2, 8, "strong"),
                                                                                            (2, 1, 8, "strong")]
    one, two = records
    for r in records:
        assert r["measured_steps"] == 3 and r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert r["base_nproc"] == 1 and r["micro_batch_size"] == 4
        assert [m["rank"] for m in r["memory"]] == list(range(r["nproc"]))
        assert all(m["rss_bytes"] > 0 and m["model_state_bytes"] > 0 for m in r["memory"])
        assert r["comm_s"] is None or r["comm_s"] >= 0
    assert one["efficiency"] == 1.0
    assert two["efficiency"] == pytest.approx(two["tokens_per_s"] / (2 * one["tokens_per_s"]))
    bench = only_dir(tmp_path / "bench")
    assert not (tmp_path / "runs").exists()  # every run lives under the bench directory
    for r in records:
        run_dir = Path(r["run_dir"])
        assert run_dir.parent == bench and run_dir.name == f"ddp-n{r['nproc']}"
        assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
        training = tomllib.loads((run_dir / "preset.toml").read_text())["training"]
        assert (training["micro_batch_size"], training["grad_accum"]) == (4, r["grad_accum"])
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        assert {e["tokens"] for e in events if e["kind"] == "step"} == {8 * 32}  # the same global batch
    saved = json.loads((bench / "results.json").read_text())
    assert saved["status"] == "finished" and saved["results"] == records and saved["mode"] == "strong"
    csv_lines = (bench / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("strategy,plugin,nproc,status") and len(csv_lines) == 3
    assert "strong scaling: global batch fixed at 8 samples" in proc.stderr and "results: " in proc.stderr
    print(f"bench scaling tiny, 1 and 2 ranks x 4 steps: {wall:.1f} s")
    assert leftovers(tag) == []


@pytest.mark.parametrize("args, message", [
    (["--nproc", "0"], "error: --nproc: 0 is out of range (1 to 256)"),
    (["--strategies", "nope"], "error: --strategies: unknown strategy 'nope' (valid: ddp, zero0"),
    (["--nproc", "1,x"], "error: --nproc: 'x' is not an integer"),
    (["--steps", "4", "--skip", "4"], "error: --skip 4 leaves none of the 4 steps to measure"),
    (["--strong", "--nproc", "1,3"], ("error: --strong: the global batch of 4 samples (micro_batch_size 4 x "
                                      "grad_accum 1 x 1 ranks) does not divide over 3 ranks")),
    (["--strategies", "single", "--nproc", "2"], "error: nothing to run: single skipped at 2 ranks"),
    (["--set", "training.nope=1"], "error: "),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    env, tag = tagged_env()
    proc = handle("bench", "scaling", str(write_tiny(tmp_path)), *args, "--output-dir", str(tmp_path / "bench"),
                  env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(message), proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "bench").exists() and not (tmp_path / "runs").exists()  # nothing started or written
    assert leftovers(tag) == []


# ---------------------------------------------------------------------------------------------------------------
# in-process, with supervise replaced: the plan, the report and the failure path without starting torchrun
# ---------------------------------------------------------------------------------------------------------------


def fake_supervise(fail_at: set[int] | None = None):
    """A stand-in for runner.supervise: writes step events (tokens/s = 1000 x world size^0.9) and settles run.json;
    world sizes in ``fail_at`` fail with a message."""
    from torch_handle.rundir import update_run_info

    def supervise(preset, run_dir, *, quiet=False):
        n = preset.launch.nproc_per_node
        if n in (fail_at or set()):
            update_run_info(run_dir, status="failed", message="rank 1: RuntimeError: boom")
            return 1
        with open(run_dir / "events.jsonl", "w", encoding="utf-8") as f:
            for step in range(1, preset.training.steps + 1):
                event = {"kind": "step", "seq": step, "step": step, "tokens_per_s": 1000.0 * n ** 0.9,
                         "step_time_s": 0.1, "tokens": 100}
                if step == 1:
                    event["memory"] = [{"rank": r, "param_bytes": 10, "grad_bytes": 10, "optimizer_bytes": 20,
                                        "rss_bytes": 1 << 20} for r in range(n)]
                f.write(json.dumps(event) + "\n")
        update_run_info(run_dir, status="finished")
        return 0

    return supervise


def invoke(monkeypatch, tmp_path, *args, fail_at=None):
    from click.testing import CliRunner

    import handle_cli.runner
    from handle_cli.main import cli

    monkeypatch.setattr(handle_cli.runner, "supervise", fake_supervise(fail_at))
    return CliRunner().invoke(cli, ["bench", "scaling", str(write_tiny(tmp_path)), *args,
                                    "--output-dir", str(tmp_path / "bench")])


def test_strong_scaling_adjusts_grad_accum_in_each_runs_preset(monkeypatch, tmp_path):
    result = invoke(monkeypatch, tmp_path, "--nproc", "1,2,4", "--strong", "--set", "training.grad_accum=4",
                    "--strategies", "ddp,zero2", "--steps", "5")
    assert result.exit_code == 0, result.output
    bench = only_dir(tmp_path / "bench")
    for label in ("ddp", "zero2"):
        for n, ga in ((1, 4), (2, 2), (4, 1)):
            preset = tomllib.loads((bench / f"{label}-n{n}" / "preset.toml").read_text())
            assert (preset["training"]["micro_batch_size"], preset["training"]["grad_accum"]) == (4, ga)
            assert preset["launch"]["nproc_per_node"] == n and preset["training"]["steps"] == 5
            assert preset["strategy"]["name"] == ("ddp" if label == "ddp" else "deepspeed")
    assert tomllib.loads((bench / "zero2-n2" / "preset.toml").read_text())["strategy"]["zero_stage"] == 2
    assert "strong scaling: global batch fixed at 16 samples" in result.stdout
    for text in ("tokens/s (global) by world size", "scaling efficiency by world size", "results: "):
        assert text in result.stdout
    records = json.loads((bench / "results.json").read_text())["results"]
    assert [r["global_batch"] for r in records] == [16] * 6
    assert [round(r["efficiency"], 3) for r in records[:3]] == [1.0, round(2 ** 0.9 / 2, 3), round(4 ** 0.9 / 4, 3)]


def test_strong_scaling_shrinks_the_micro_batch_when_grad_accum_cannot(monkeypatch, tmp_path):
    result = invoke(monkeypatch, tmp_path, "--nproc", "1,2,4", "--strong", "--steps", "3")
    assert result.exit_code == 0, result.output
    bench = only_dir(tmp_path / "bench")
    got = [tomllib.loads((bench / f"ddp-n{n}" / "preset.toml").read_text())["training"] for n in (1, 2, 4)]
    assert [(t["micro_batch_size"], t["grad_accum"]) for t in got] == [(4, 1), (2, 1), (1, 1)]


def test_tp_sweep_sets_parallel_tp_and_runs_one_replica_as_single(monkeypatch, tmp_path):
    result = invoke(monkeypatch, tmp_path, "--nproc", "1,2", "--tp", "1,2", "--strategies", "ddp", "--steps", "3",
                    "--strong", "--json")
    assert result.exit_code == 0, result.output
    bench = only_dir(tmp_path / "bench")
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["strategy"], r["plugin"], r["nproc"], r["dp"], r["tp"]) for r in records] == [
        ("ddp", "ddp", 1, 1, 1), ("ddp", "ddp", 2, 2, 1), ("ddp-tp2", "single", 2, 1, 2)]
    # each run as run, the line every view shows: the tp2 run of the ddp series has one replica, no ddp
    assert [r["layout_label"] for r in records] == ["1 rank (ddp)", "dp 2 (ddp)", "dp 1 × tp 2 (tp native)"]
    assert [r["global_batch"] for r in records] == [4, 4, 4]  # strong: replicas share the batch, not ranks
    preset = tomllib.loads((bench / "ddp-tp2-n2" / "preset.toml").read_text())
    assert preset["parallel"]["tp"] == 2 and preset["strategy"]["name"] == "single"
    assert preset["launch"]["nproc_per_node"] == 2 and preset["training"]["micro_batch_size"] == 4
    assert "tp 2 skipped at 1 rank" in result.stderr and "tensor parallel: tp 1, 2, series" in result.stderr
    (tmp_path / "b").mkdir()
    bad = invoke(monkeypatch, tmp_path / "b", "--nproc", "4", "--tp", "2", "--strategies", "zero2")
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1, bad.output
    assert bad.stderr.startswith("error: zero2-tp2 on 4 ranks: ") and "parallel.tp = 2" in bad.stderr
    (tmp_path / "c").mkdir()
    assert invoke(monkeypatch, tmp_path / "c", "--tp", "0").stderr.startswith("error: --tp: 0 is out of range")


def test_a_failed_run_is_reported_and_the_others_still_run(monkeypatch, tmp_path):
    result = invoke(monkeypatch, tmp_path, "--nproc", "1,2,4", fail_at={2})
    assert result.exit_code == 1, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [errors[0]] and "ddp on 2 ranks failed: rank 1: RuntimeError: boom" in errors[0]
    assert "failed" in result.stdout and "ddp on 2 ranks failed: rank 1: RuntimeError: boom" in result.stdout
    records = json.loads((only_dir(tmp_path / "bench") / "results.json").read_text())["results"]
    assert [r["status"] for r in records] == ["finished", "failed", "finished"]
    assert records[1]["efficiency"] is None and records[2]["efficiency"] == pytest.approx(4 ** 0.9 / 4)
    if (os.cpu_count() or 1) < 4:  # 4 ranks x 1 thread on fewer cores: said once, marked in the table
        assert records[2]["oversubscribed"] and result.stdout.count("oversubscribed") == 1, result.stdout
        assert "warning: 4 ranks x 1 thread(s) each exceed" in result.stdout and "4*" in result.stdout


@pytest.mark.dist
def test_ctrl_c_stops_the_current_run_and_exits_130(tmp_path):
    env, tag = tagged_env()
    proc = subprocess.Popen([sys.executable, "-m", "handle_cli", "bench", "scaling", str(write_tiny(tmp_path)),
                             "--nproc", "2,1", "--steps", "100000", "--set", "training.log_every=1",
                             "--output-dir", str(tmp_path / "bench")],
                            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        events = None
        while time.monotonic() < deadline:  # wait until the first run (1 rank) has made a step
            found = list((tmp_path / "bench").glob("scaling-*/ddp-n1/events.jsonl"))
            if found and '"kind":"step"' in found[0].read_text().replace(" ", ""):
                events = found[0]
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        assert events is not None, "no step within 90 s"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out + err
    assert "bench scaling: stopped" in err
    bench = events.parents[1]
    assert json.loads((bench / "results.json").read_text())["status"] == "stopped"
    assert json.loads((events.parent / "run.json").read_text())["status"] == "stopped"
    assert not (bench / "ddp-n2").exists()  # the next run never started
    assert leftovers(tag) == []


def test_threads_fix_omp_num_threads_for_every_run(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # restored after the test: the command sets it
    result = invoke(monkeypatch, tmp_path, "--nproc", "1,2", "--threads", "1", "--json")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["threads_per_rank"] for r in records] == [1, 1]
    # weak scaling (the default): each rank keeps its batch, so the global batch grows with the world size
    assert [(r["mode"], r["micro_batch_size"], r["grad_accum"], r["global_batch"]) for r in records] == [
        ("weak", 4, 1, 4), ("weak", 4, 1, 8)]
    assert "weak scaling" in result.stderr
    bench = only_dir(tmp_path / "bench")
    assert json.loads((bench / "results.json").read_text())["mode"] == "weak"
    assert [tomllib.loads((bench / f"ddp-n{n}" / "preset.toml").read_text())["training"]["grad_accum"]
            for n in (1, 2)] == [1, 1]
    assert "threads per rank: 1 in every run (OMP_NUM_THREADS)" in result.stderr
    assert os.environ["OMP_NUM_THREADS"] == "1"  # what the launcher hands to the workers
    (tmp_path / "b").mkdir()
    bad = invoke(monkeypatch, tmp_path / "b", "--threads", "0")
    assert bad.exit_code == 2 and bad.stderr.startswith("error: --threads: 0 is out of range"), bad.output


def test_scratch_strategies_and_single_rank_only(monkeypatch, tmp_path):
    from torch_handle.registry import get_registry

    if "scratch-ddp" not in get_registry().names("strategy"):
        pytest.skip("the scratch-ddp plugin is not registered here")
    result = invoke(monkeypatch, tmp_path, "--nproc", "1,2", "--strategies", "scratch-zero1,single", "--steps", "3")
    assert result.exit_code == 0, result.output
    bench = only_dir(tmp_path / "bench")
    assert sorted(p.name for p in bench.iterdir() if p.is_dir()) == ["scratch-zero1-n1", "scratch-zero1-n2",
                                                                      "single-n1"]
    strategy = tomllib.loads((bench / "scratch-zero1-n2" / "preset.toml").read_text())["strategy"]
    assert strategy["name"] == "scratch-ddp" and strategy["shard_optimizer"] is True
    assert "note: single skipped at 2 ranks: it runs on world size 1 only" in result.stdout


def test_unregistered_strategy_plugin_is_skipped_with_a_note(monkeypatch, tmp_path):
    from torch_handle.registry import get_registry

    registry = get_registry()
    names = registry.names
    monkeypatch.setattr(registry, "names", lambda kind: [n for n in names(kind) if n != "scratch-ddp"])
    result = invoke(monkeypatch, tmp_path, "--nproc", "1", "--strategies", "ddp,scratch-ddp", "--steps", "3")
    assert result.exit_code == 0, result.output
    assert "note: scratch-ddp skipped: strategy plugin 'scratch-ddp' is not registered" in result.stdout
    assert [r["strategy"] for r in json.loads((only_dir(tmp_path / "bench") / "results.json").read_text())
            ["results"]] == ["ddp"]
