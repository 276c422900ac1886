"""How ranks share a node's CPU cores: the cores this process may use (its affinity), the threads per rank, and the
one ``warning:`` line ``handle run`` prints when ranks x threads exceed the cores on a CPU (never on a GPU)."""

from __future__ import annotations

import pytest

from torch_handle.common import procs
from torch_handle.launch import cores
from tests.helpers import tiny_preset


def test_the_usable_cores_are_the_affinity_masks(monkeypatch):
    monkeypatch.setattr(procs.os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert procs.usable_cores() == 3

    def unsupported(pid):
        raise OSError("no affinity here")

    monkeypatch.setattr(procs.os, "sched_getaffinity", unsupported, raising=False)
    monkeypatch.setattr(procs.os, "cpu_count", lambda: 6)
    assert procs.usable_cores() == 6


@pytest.mark.parametrize("nproc, n_cores, omp, expected", [
    (2, 2, None, None),  # one core each: fits
    (1, 8, None, None),
    (8, 2, None, "8 ranks on 2 CPU core(s): oversubscribed, one thread per rank and each rank about 0.25 of a core"),
    (3, 2, None, "3 ranks on 2 CPU core(s): oversubscribed, one thread per rank and each rank about 0.67 of a core"),
    (2, 4, "4", "2 ranks x 4 threads (OMP_NUM_THREADS) on 4 CPU core(s): oversubscribed, expect slow steps; unset "
                "OMP_NUM_THREADS (the launcher gives 2 per rank) or lower it"),
    (2, 4, "2", None),
])
def test_the_warning_says_what_it_costs_and_how_to_reduce_it(nproc, n_cores, omp, expected):
    got = cores.oversubscription_warning(nproc, n_cores, omp)
    if expected is None:
        assert got is None
        return
    assert got.startswith(expected) and "\n" not in got
    if nproc > n_cores:
        assert got.endswith(f"expect slow steps (a collective waits for every rank to be scheduled); "
                            f"launch.nproc_per_node <= {n_cores} runs faster here")


def _tiny(tmp_path, nproc: int):
    from torch_handle.config.loader import load_preset

    path = tmp_path / "tiny.toml"
    path.write_text(tiny_preset(tmp_path / "runs", steps=2).replace("nproc_per_node = 2", f"nproc_per_node = {nproc}"))
    return path, load_preset(path)


def test_only_cpu_ranks_are_warned(tmp_path, monkeypatch):
    from torch_handle.launch import precision

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    _, preset = _tiny(tmp_path, 8)
    monkeypatch.setattr(precision, "target_device", lambda p: "cpu")
    assert cores.node_warning(preset).startswith("8 ranks on 2 CPU core(s): oversubscribed")
    monkeypatch.setattr(precision, "target_device", lambda p: "cuda")
    assert cores.node_warning(preset) is None


def test_handle_run_prints_one_warning_line_before_the_workers_start(tmp_path, monkeypatch, no_launch):
    """``handle run`` of 4 ranks (dp 2 × tp 2 under ddp) on a node with 2 usable cores: the TP implementation auto
    chose with its reason, one ``warning:`` line on stderr, then the launch (refused here by ``no_launch``: the
    lines come before anything starts)."""
    from click.testing import CliRunner

    from handle_cli.main import cli

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    path, _ = _tiny(tmp_path, 4)
    result = CliRunner().invoke(cli, ["run", str(path), "--set", "launch.backend=gloo", "--set", "parallel.tp=2"])
    assert isinstance(result.exception, AssertionError) and "a run was launched" in str(result.exception)
    assert "\ntensor parallelism: tp 2, scratch (auto → scratch: ddp does not wrap DTensor parameters (fsdp and " \
           "single do))\n" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: 4 ranks on 2 CPU core(s): oversubscribed, one thread per rank and each rank about "
                        "0.5 of a core, so expect slow steps (a collective waits for every rank to be scheduled); "
                        "launch.nproc_per_node <= 2 runs faster here"]
    monkeypatch.setattr(cores, "usable_cores", lambda: 4)
    again = CliRunner().invoke(cli, ["run", str(path), "--set", "launch.backend=gloo"])
    assert "a run was launched" in str(again.exception) and "warning:" not in again.stderr


def test_cpu_workers_get_the_malloc_settings_unless_the_environment_chose(tmp_path, monkeypatch):
    """``cores.allocator_env``: the launcher hands CPU workers glibc's ``MALLOC_MMAP_THRESHOLD_`` and
    ``MALLOC_TRIM_THRESHOLD_`` (a step's buffers reused instead of faulted in anew every step), never over the
    environment's own settings or a preloaded allocator, and not to GPU workers."""
    from torch_handle.launch import supervisor

    for name in (*cores.MALLOC_ENV, "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    assert cores.allocator_env({}) == {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}
    assert cores.allocator_env({"MALLOC_TRIM_THRESHOLD_": "0"}) == {}
    assert cores.allocator_env({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == {}
    path, preset = _tiny(tmp_path, 2)
    monkeypatch.setattr(supervisor, "target_device", lambda p: "cpu")
    env = supervisor.Launch(preset, tmp_path / "run").env
    assert {k: env[k] for k in cores.MALLOC_ENV} == cores.MALLOC_ENV
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert "MALLOC_TRIM_THRESHOLD_" not in supervisor.Launch(preset, tmp_path / "run").env
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setattr(supervisor, "target_device", lambda p: "cuda")
    assert "MALLOC_MMAP_THRESHOLD_" not in supervisor.Launch(preset, tmp_path / "run").env
