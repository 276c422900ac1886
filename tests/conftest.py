"""Shared fixtures (kept generic: each test module holds its own helpers)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

THREADS = 1
"""Intra-op threads of the suite's processes (``OMP_NUM_THREADS``, unless the environment sets it): this one, the
in-process tests of each xdist worker, and every `handle run` it starts (the launcher honours the variable). `make
test` runs two workers on two cores, each about a core: torch's default pool of one thread per core had them
oversubscribed, its threads spinning for each other's cores (tests/unit: 105 CPU seconds with the default pool, 57
with one thread, measured side by side under load)."""


def pytest_configure(config) -> None:
    """Tests (and every process they start) use a copy of the user's peak and precision-probe cache
    (``HANDLE_PEAK_CACHE``): what they measure is not written into the real one, and what it holds spares them
    the measuring. And one data cache (``HANDLE_DATA_CACHE``) for all their runs: a corpus is prepared once. And
    :data:`THREADS` intra-op threads for every process of the suite."""
    from torch_handle.data.cache import CACHE_ENV

    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    if "torch" in sys.modules:  # imported before this hook (a plugin): its pool is sized already
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if not os.environ.get(CACHE_ENV):  # one data cache for every run of the suite: pydoc is prepared once
        os.environ[CACHE_ENV] = config._handle_data_cache = tempfile.mkdtemp(prefix="handle-test-data-")
    if os.environ.get("HANDLE_PEAK_CACHE"):
        return
    from torch_handle.observe.peak import cache_path

    real, copy = cache_path(), Path(tempfile.mkdtemp(prefix="handle-test-cache-")) / "peak.json"
    if real.is_file():
        shutil.copyfile(real, copy)
    os.environ["HANDLE_PEAK_CACHE"] = str(copy)
    config._handle_cache_dir = copy.parent


def pytest_unconfigure(config) -> None:
    data_cache = getattr(config, "_handle_data_cache", None)
    if data_cache is not None:
        shutil.rmtree(data_cache, ignore_errors=True)
        os.environ.pop("HANDLE_DATA_CACHE", None)
    directory = getattr(config, "_handle_cache_dir", None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
        os.environ.pop("HANDLE_PEAK_CACHE", None)


SLOWEST_FIRST = ("test_learn_doc", "test_distributed", "test_nd_parallel",
                 "test_context_parallel_runs",  # ~99 CPU s: 6 launches, 4 of them 4 ranks, and 1 in-process
                 "test_objectives_split",  # 84 CPU s: 7 runs of 2 ranks and 2 in-process
                 "test_dpo",  # 75 CPU s: 5 runs of 2 ranks, 12 in-process
                 "test_sft_strategies",  # 67 CPU s: 5 runs of 2 ranks, 3 in-process
                 "test_gpu_check",  # 64 CPU s, ~88 s wall: the CPU smoke version's runs
                 "test_expert_parallel_runs",
                 "test_multinode",  # ~62 CPU s, ~75 s wall: 2-node launches that wait for each other
                 "test_cross_resume",  # 59 CPU s, ~80 s wall
                 "test_lora_strategies",  # ~56 CPU s: 5 runs of 2 ranks, 1 in-process (2026-12-06, later)
                 "test_tensor_parallel", "test_qlora_strategies", "test_pipeline_parallel",
                 "test_hf_export", "test_estimate", "test_hang", "test_lost_runs",
                 "test_hf", "test_plugins_cli", "test_tp_encoder_decoder", "test_layout_weights", "test_bench_comm",
                 "test_resume_safety", "test_plan", "test_tokens_run", "test_run_info_stress", "test_env",
                 "test_pipeline_checkpoint", "test_docs", "test_data_prepare", "test_scratch_fsdp_run", "test_slurm",
                 "test_lm_eval_in_loop",  # 20 CPU s: a 2-rank run
                 "test_bench_scaling", "test_launch_prepare", "test_context_parallel", "test_lm_eval",
                 "test_estimate_layout")
"""Test files by falling duration (CPU seconds, and wall time where a test waits; 2 cores): `make test` hands whole
files to two xdist workers in collection order (--dist loadfile --no-loadscope-reorder), and the longest first keeps
one long file from running alone at the end (longest-processing-time-first scheduling)."""


def pytest_collection_modifyitems(session, config, items) -> None:
    """Collect the files of :data:`SLOWEST_FIRST` first, in its order, then the rest as collected, tests/unit last
    (many short in-process tests fill the gaps at the end)."""
    def rank(item) -> tuple[int, int]:
        path = Path(str(item.fspath))
        if path.stem in SLOWEST_FIRST and path.parent.name == "tests":
            return (0, SLOWEST_FIRST.index(path.stem))
        return (2, 0) if path.parent.name == "unit" else (1, 0)

    items.sort(key=rank)  # stable: each file keeps its own order


@pytest.fixture
def repo_root() -> Path:
    """The repository checkout (``presets/`` lives here)."""
    return REPO_ROOT


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything tries to start torchrun workers (in this process)."""
    import handle_cli.runner
    import torch_handle.launch.supervisor

    def refuse(*args, **kwargs):
        raise AssertionError("a run was launched")

    monkeypatch.setattr(torch_handle.launch.supervisor.Launch, "start", refuse)
    monkeypatch.setattr(handle_cli.runner, "spawn_detached", refuse)
