"""CUDA-only tests: what no CPU run reaches. `handle env --peak` on a GPU, a bf16 run's CUDA-event step breakdown and
CUDA memory telemetry (pinned-memory loader workers, non_blocking copies), a checkpoint resumed on the GPU, every
strategy on nccl, `handle bench comm` and `--check-dist` on nccl, NCCL's flight recorder dumped on a hang.

Each test skips without the CUDA devices it needs. benchmarks/gpu_check.py runs them, with every other test marked
`cuda`, on a GPU machine: ``python -m pytest -m cuda tests``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import leftovers, tagged_env, tiny_preset

torch = pytest.importorskip("torch")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA devices")
REPO = Path(__file__).resolve().parents[1]
PARTS = ("data_s", "forward_s", "backward_s", "sync_s", "optimizer_s")


def handle(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "handle_cli", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL, check=False)


def train(tmp_path: Path, *overrides: str, strategy: str = "single", nproc: int = 1, steps: int = 8,
          **env_extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`handle run` of the tiny preset in bf16 on nccl and ``nproc`` GPUs; no process may be left behind."""
    preset = tmp_path / "tiny.toml"
    preset.write_text(tiny_preset(tmp_path / "runs", steps=steps, strategy=strategy, log_every=1))
    run_dir = tmp_path / "runs" / "r"
    env, tag = tagged_env(**env_extra)
    sets = ["training.precision=bf16", "launch.backend=nccl", f"launch.nproc_per_node={nproc}", *overrides]
    proc = handle("run", str(preset), "--run-dir", str(run_dir), *[x for s in sets for x in ("--set", s)], env=env)
    assert leftovers(tag) == []
    return proc, run_dir


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["kind"] == kind]


def assert_cuda_steps(steps: list[dict], ranks: int) -> None:
    """CUDA events tile the step as perf_counter does on a CPU; every rank reports its CUDA memory."""
    for e in steps:
        total = sum(e[k] for k in PARTS)
        assert abs(total - e["step_time_s"]) <= 0.1 * e["step_time_s"] + 1e-3, (total, e)
        assert e["forward_s"] > 0 and e["backward_s"] > 0 and 0 < e["mfu"] < 1, e
        assert [m["rank"] for m in e["memory"]] == list(range(ranks)), e
        for m in e["memory"]:
            assert 0 < m["cuda_allocated_bytes"] <= m["cuda_max_allocated_bytes"], m
            assert m["cuda_reserved_bytes"] > 0, m


def test_peak_on_the_gpu(tmp_path):
    env, _ = tagged_env(HANDLE_PEAK_CACHE=str(tmp_path / "peak.json"))
    first = handle("env", "--peak", "--json", env=env)
    assert first.returncode == 0, first.stderr
    r = json.loads(first.stdout)
    assert r["key"].startswith("cuda:") and r["device"] == "cuda" and r["cached"] is False, r
    assert r["bf16"] > r["fp32"] > 0 and r["fp16"] > r["fp32"], r  # tensor cores: 16-bit well above fp32 (no TF32)
    again = json.loads(handle("env", "--peak", "--json", env=env).stdout)
    assert again["cached"] is True and again["bf16"] == r["bf16"]


def test_a_bf16_gpu_run_reports_its_breakdown_and_cuda_memory_and_resumes(tmp_path):
    proc, run_dir = train(tmp_path, "training.checkpoint_every=6", "data.num_workers=2", steps=12)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "finished" and info["precision"] == "bf16" and info["peak_flops"] > 1e12, info
    steps = events(run_dir, "step")
    assert [e["step"] for e in steps] == list(range(1, 13))
    assert_cuda_steps(steps, ranks=1)
    assert "cuda peak" in proc.stdout

    resumed = handle("run", "--resume", str(run_dir), "--set", "training.steps=16")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [e["step"] for e in events(run_dir, "step")][12:] == [13, 14, 15, 16]
    assert any(e["message"].startswith("resumed from checkpoints/step-12") for e in events(run_dir, "log"))


@two_gpus
@pytest.mark.parametrize("strategy, extra", [("ddp", []), ("fsdp", []), ("scratch-ddp", []),
                                             ("deepspeed", ["strategy.zero_stage=2"])],
                         ids=["ddp", "fsdp", "scratch-ddp", "zero2"])
def test_every_strategy_trains_on_nccl(tmp_path, strategy, extra):
    proc, run_dir = train(tmp_path, *extra, strategy=strategy, nproc=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = events(run_dir, "step")
    assert [e["step"] for e in steps] == list(range(1, 9))
    assert all(abs(e["loss"] - math.log(512)) < 1.0 for e in steps), steps  # a global token-mean, near ln(vocabulary)
    assert_cuda_steps(steps, ranks=2)
    assert all([r["rank"] for r in e["ranks"]] == [0, 1] for e in steps)


@two_gpus
def test_bench_comm_and_check_dist_on_nccl(tmp_path):
    env, tag = tagged_env()
    proc = handle("bench", "comm", "--backend", "nccl", "--nproc", "2", "--sizes", "1K:1M", "--iters", "5",
                  "--warmup", "2", "--dtype", "bf16", "--json", "--output-dir", str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(records) == 4 * 11 and all(r["backend"] == "nccl" and r["dtype"] == "bf16" for r in records)
    assert all(r["correct"] and r["busbw_gbps"] > 0 for r in records), [r for r in records if not r["correct"]]
    check = handle("env", "--json", "--check-dist", "2", "--backend", "nccl", env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    result = json.loads(check.stdout)["check_dist"]["result"]
    assert (result["backend"], result["device"], result["sum"]) == ("nccl", "cuda:0", 3.0), result
    assert leftovers(tag) == []


@two_gpus
def test_a_hang_on_nccl_dumps_the_flight_recorder(tmp_path):
    """Rank 1 sleeps before step 3's loss all-reduce; the watchdog asks NCCL's flight recorder for each rank's
    recent collectives (through the per-rank pipe) before it stops the run."""
    proc, run_dir = train(tmp_path, "launch.hang_timeout_s=5", "launch.on_hang=stop",
                          strategy="ddp", nproc=2, steps=20, HANDLE_TEST_HANG_RANK="1:3", HANDLE_PY_SPY="0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (hang,) = events(run_dir, "hang")
    assert "logs/nccl_trace_rank_0" in hang.get("flight_recorder", []), hang
    assert (run_dir / "logs" / "nccl_trace_rank_0").is_file()
