"""The launcher's pure parts: the torchrun command line and finding the cause of a failure in the logs."""

from __future__ import annotations

from torch_handle.config.loader import load_preset
from torch_handle.launch.supervisor import failure_message, torchrun_command


def test_torchrun_command_single_node_picks_a_free_port(repo_root, tmp_path):
    preset = load_preset(repo_root / "presets" / "zero2.toml", ["launch.max_restarts=2"])
    cmd = torchrun_command(preset, tmp_path / "run", python="python")
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
    assert "--nproc_per_node=2" in cmd and "--max_restarts=2" in cmd and "--rdzv_endpoint=localhost:0" in cmd
    assert cmd[-3:] == ["-m", "torch_handle.train.worker", str(tmp_path / "run")]


def test_torchrun_command_multi_node_uses_the_rendezvous_endpoint(repo_root, tmp_path):
    preset = load_preset(repo_root / "presets" / "ddp.toml",
                         ["launch.nnodes=2", "launch.node_rank=1", "launch.rdzv_endpoint=node0:29400"])
    cmd = torchrun_command(preset, tmp_path / "run")
    # static: node_rank decides the global ranks (c10d would ignore it), so global rank 0 runs on node 0
    assert {"--nnodes=2", "--node_rank=1", "--rdzv_endpoint=node0:29400", "--rdzv_backend=static",
            f"--rdzv_id={preset.run.name}"} <= set(cmd)


def _logs(tmp_path, **files):
    (tmp_path / "logs").mkdir()
    for name, text in files.items():
        (tmp_path / "logs" / f"{name}.log").write_text(text)
    return tmp_path


def test_the_cause_beats_the_peers_connection_errors(tmp_path):
    run = _logs(tmp_path,
                rank0="2026-01-01 10:00:02,000 rank0 ERROR torch_handle: rank 0: RuntimeError: Connection closed by peer\n",
                rank1="2026-01-01 10:00:03,000 rank1 ERROR torch_handle: rank 1: ValueError: bad batch\n")
    assert failure_message(run) == "rank 1: ValueError: bad batch"


def test_a_rank_killed_by_a_signal_is_named(tmp_path):
    run = _logs(tmp_path,
                rank0="2026-01-01 10:00:02,000 rank0 ERROR torch_handle: rank 0: RuntimeError: Connection reset by peer\n",
                launcher="Failures:\n[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 5)  (SIGKILL)\n"
                         "Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n"
                         "  exitcode  : 1 (pid: 4)\n")
    assert failure_message(run) == "rank 1 was killed by SIGKILL (exit code -9)"


def test_a_traceback_without_our_log_line_still_gives_its_last_exception(tmp_path):
    run = _logs(tmp_path, rank0="Traceback (most recent call last):\n  File x\nImportError: no module named y\n")
    assert failure_message(run) == "rank0: ImportError: no module named y"
