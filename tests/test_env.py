"""``handle env``: the environment report, and ``--check-dist N`` (a real torchrun all-reduce) that never leaves
a process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import leftovers, tagged_env

REPO = Path(__file__).resolve().parents[1]


def handle(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "handle_cli", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.cuda
def test_env_json_fields():
    proc = handle("env", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert info["python"]["executable"]
    import torch

    t = info["torch"]
    assert t["version"] == torch.__version__
    assert t["cuda_available"] == torch.cuda.is_available()
    assert len(t["cuda_devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert set(t["backends"]) == {"gloo", "nccl", "mpi", "ucc"} and t["backends"]["gloo"] is True
    assert t["default_backend"] in ("gloo", "nccl")
    assert "nccl_version" in t and "cuda_build" in t
    assert info["cpu"]["count"] == os.cpu_count() and info["cpu"]["usable"] >= 1
    assert "deepspeed" in info and "torch_handle" in info
    plugins = info["plugins"]
    assert {"datasets", "profilers", "strategies", "transformer"} <= set(plugins["loaded"])
    assert isinstance(plugins["failed"], list) and isinstance(plugins["skipped"], list)
    assert "check_dist" not in info


def test_env_text():
    proc = handle("env")
    assert proc.returncode == 0, proc.stderr
    keys = [line.split()[0] for line in proc.stdout.splitlines()]
    for key in ("python", "torch", "deepspeed", "CUDA", "NCCL", "backends", "CPUs", "plugins"):
        assert key in keys, proc.stdout


@pytest.mark.cuda
def test_check_dist_2_succeeds_and_leaves_nothing():
    env, tag = tagged_env()
    proc = handle("env", "--json", "--check-dist", "2", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(proc.stdout)["check_dist"]
    assert r["ok"] is True and r["returncode"] == 0, r
    w = r["result"]
    assert (w["world_size"], w["sum"], w["expected"], w["large_allreduce_ok"]) == (2, 3.0, 3.0, True)
    assert w["backend"] in ("gloo", "nccl") and r["wall_s"] > 0
    print(f"check-dist 2: {r['wall_s']:.2f} s in all, init {w['init_s']:.3f} s, "
          f"4 MiB all_reduce {w['allreduce_large_s'] * 1e3:.1f} ms")
    assert leftovers(tag) == []

    text = handle("env", "--check-dist", "2", env=env)
    assert text.returncode == 0, text.stdout + text.stderr
    line = next(ln for ln in text.stdout.splitlines() if ln.startswith("check-dist:"))
    assert line.startswith("check-dist: ok: 2 processes") and "all_reduce sum 3 == 3" in line
    assert "total" in text.stdout
    assert leftovers(tag) == []


@pytest.mark.cuda
def test_check_dist_failure_exits_1_and_leaves_nothing():
    """nccl without a GPU per process cannot work: exit 1, the worker's error, no process left behind."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("nccl would work here")
    env, tag = tagged_env()
    proc = handle("env", "--check-dist", "2", "--backend", "nccl", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("check-dist:"))
    assert line.startswith("check-dist: FAILED with 2 processes") and "rank " in line
    assert leftovers(tag) == []


def test_check_dist_timeout_stops_every_process(monkeypatch):
    """A check that cannot finish in time is stopped: torchrun and its workers are all gone afterwards."""
    from handle_cli.env_cmd import check_dist

    tag = uuid.uuid4().hex
    monkeypatch.setenv("HANDLE_TEST_TAG", tag)
    r = check_dist(2, "gloo", timeout_s=1.5)  # torchrun alone takes longer than that to start the workers
    assert r["ok"] is False and "timed out" in r["error"], r
    assert leftovers(tag) == []
