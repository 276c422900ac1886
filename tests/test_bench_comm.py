"""``handle bench comm``: a real 2-process collective benchmark under torchrun (gloo on CPU), its correctness
check catching a wrong result, bad input refused before anything starts, and no process left behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import leftovers, tagged_env

from torch_handle.plan.bench_comm import CORRUPT_ENV, OPS, bus_factor

REPO = Path(__file__).resolve().parents[1]
SIZES = [1024, 2048, 4096, 8192, 16384]  # 1K:16K


def handle(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "handle_cli", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL, check=False)


def only_dir(parent: Path) -> Path:
    dirs = list(parent.iterdir())
    assert len(dirs) == 1 and dirs[0].name.startswith("comm-"), dirs
    return dirs[0]


@pytest.mark.dist
def test_real_run_every_op_and_size_json(tmp_path):
    env, tag = tagged_env()
    t0 = time.perf_counter()
    proc = handle("bench", "comm", "--nproc", "2", "--sizes", "1K:16K", "--iters", "3", "--warmup", "1", "--json",
                  "--output-dir", str(tmp_path), env=env)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]  # stdout is JSON lines and nothing else
    assert sorted((r["op"], r["bytes"]) for r in records) == sorted((op, s) for op in OPS for s in SIZES)
    for r in records:
        assert {"op", "backend", "world_size", "dtype", "bytes", "time_us", "algbw_gbps", "busbw_gbps",
                "correct"} <= set(r), r
        assert (r["backend"], r["world_size"], r["dtype"], r["correct"], r["iters"]) == ("gloo", 2, "fp32", True, 3)
        assert 0 < r["time_us"] < 5e6, r  # a 16 KiB collective on one machine: microseconds to milliseconds
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3, rel=1e-3)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bus_factor(r["op"], 2), rel=1e-3)
        assert r["count"] * 4 == r["bytes"]
    assert all("ProcessGroupGloo" in r["note"] for r in records if r["op"] == "reduce_scatter")
    directory = only_dir(tmp_path)
    assert [json.loads(line) for line in (directory / "results.jsonl").read_text().splitlines()] == records
    meta = json.loads((directory / "bench.json").read_text())
    assert meta["status"] == "finished" and meta["measurements"] == 20 and meta["message"] is None
    assert str(directory / "results.jsonl") in proc.stderr
    print(f"bench comm 4 ops x 5 sizes, 2 ranks: {wall:.1f} s in all (worker {meta['wall_s']:.1f} s)")
    assert leftovers(tag) == []


@pytest.mark.dist
def test_wrong_result_is_caught_and_reported_in_the_table_and_plot(tmp_path):
    """Rank 0 perturbs one input element of all_gather's check call: the collective really returns a wrong
    result, which the check must catch (exit 1, one line naming op and size); broadcast stays right. Without
    --json the table (WRONG next to ok) and the bandwidth plot are still printed."""
    env, tag = tagged_env(**{CORRUPT_ENV: "all_gather"})
    proc = handle("bench", "comm", "--ops", "all_gather,broadcast", "--sizes", "1K,64K", "--iters", "2", "--warmup",
                  "1", "--output-dir", str(tmp_path), env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: bench comm: wrong result: all_gather at 1K "), \
        proc.stderr
    assert "(and 1 more)" in errors[0]
    directory = only_dir(tmp_path)
    records = {(r["op"], r["bytes"]): r
               for r in map(json.loads, (directory / "results.jsonl").read_text().splitlines())}
    assert set(records) == {("all_gather", 1024), ("all_gather", 65536), ("broadcast", 1024), ("broadcast", 65536)}
    assert [records[("all_gather", s)]["correct"] for s in (1024, 65536)] == [False, False]
    assert [records[("broadcast", s)]["correct"] for s in (1024, 65536)] == [True, True]
    assert records[("all_gather", 1024)]["max_rel_error"] > 0
    meta = json.loads((directory / "bench.json").read_text())
    assert meta["status"] == "failed" and "all_gather at 1K" in meta["message"]
    out = proc.stdout
    for text in ("time (µs)", "algbw (GB/s)", "busbw (GB/s)", "all_gather", "broadcast", "64K", "ok", "WRONG",
                 "bus bandwidth (GB/s) by message size", "results: "):
        assert text in out, out
    assert "\x1b[" not in out  # not a terminal: no colours
    assert str(directory / "results.jsonl") in out
    assert leftovers(tag) == []


@pytest.mark.parametrize("args, message", [
    (["--sizes", "5:1K"], "error: --sizes: 5 is not a whole number of fp32 elements"),
    (["--ops", "foo"], "error: --ops: unknown op 'foo'"),
    (["--sizes", "1M:1K"], "error: --sizes: '1M:1K': MIN 1M is larger than MAX 1K"),
    (["--sizes", "2", "--dtype", "bf16"], "error: --sizes: 2 is less than one bf16 element per rank"),
    (["--nproc", "0"], "error: --nproc: 0 is out of range"),
    (["--iters", "x"], "error: --iters: 'x' is not an integer"),
    (["--dtype", "fp16"], "error: --dtype: 'fp16' is not one of fp32, bf16"),
    (["--backend", "mpi"], "error: --backend: 'mpi' is not one of auto, gloo, nccl"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    env, tag = tagged_env()
    proc = handle("bench", "comm", *args, "--output-dir", str(tmp_path / "bench"), env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(message), proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "bench").exists()  # nothing started, nothing written
    assert leftovers(tag) == []


def test_bad_input_starts_nothing(tmp_path, monkeypatch):
    """In-process: validation fails before the launcher is even called."""
    from click.testing import CliRunner

    from torch_handle.launch import supervisor as launch
    from handle_cli.main import cli

    def refuse(*args, **kwargs):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(launch, "run_torchrun", refuse)
    for args in (["--sizes", "5:1K"], ["--ops", "foo"], ["--sizes", "16G", "--nproc", "64"]):
        result = CliRunner().invoke(cli, ["bench", "comm", *args, "--output-dir", str(tmp_path)])
        assert result.exit_code == 2, (args, result.output)
        assert result.stderr.startswith("error: --") and len(result.stderr.splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.cuda
def test_nccl_without_gpus_is_bad_input(tmp_path):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("nccl would work here")
    proc = handle("bench", "comm", "--backend", "nccl", "--output-dir", str(tmp_path / "b"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: --backend nccl needs one CUDA device per "
                                                           "process"), proc.stderr
    assert not (tmp_path / "b").exists()


@pytest.mark.dist
def test_timeout_stops_every_process(tmp_path, monkeypatch):
    """The supervision itself: a torchrun that cannot finish in time is stopped, its whole tree with it."""
    from torch_handle.launch.supervisor import run_torchrun

    tag = uuid.uuid4().hex
    monkeypatch.setenv("HANDLE_TEST_TAG", tag)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "torch_handle.plan.bench_comm", "--sizes", "1K"]
    lines: list[str] = []
    rc, timed_out, wall = run_torchrun(cmd, tmp_path / "torchrun.log", 1.5, lines.append)
    assert (rc, timed_out) == (None, True) and wall < 15
    assert (tmp_path / "torchrun.log").read_text().startswith("$ ")
    assert leftovers(tag) == []


@pytest.mark.dist
def _default_sigint() -> None:
    """As at a terminal: a suite started in the background by a non-interactive shell inherits SIGINT ignored
    (POSIX), and Python then installs no KeyboardInterrupt handler, so the Ctrl-C below would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_workers_and_exits_130(tmp_path):
    env, tag = tagged_env()
    proc = subprocess.Popen([sys.executable, "-m", "handle_cli", "bench", "comm", "--ops", "all_reduce",
                             "--sizes", "1K:16K", "--iters", "1000", "--budget", "0", "--output-dir", str(tmp_path)],
                            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + 60
        results = None
        while time.monotonic() < deadline:  # wait until the workers have measured something
            dirs = list(tmp_path.iterdir())
            if dirs and (dirs[0] / "results.jsonl").exists() and (dirs[0] / "results.jsonl").read_text():
                results = dirs[0]
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        assert results is not None, "no measurement within 60 s"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out + err
    assert "bench comm: stopped" in err
    assert json.loads((results / "bench.json").read_text())["status"] == "stopped"
    assert leftovers(tag) == []
