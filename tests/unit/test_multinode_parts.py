"""The multi-node pieces that need no torchrun: which ranks share a directory (probe files), the checkpoint step
every directory has, joining a run directory, and the sbatch script. Ranks are threads with an in-process gather;
the real two-launcher runs are in tests/test_multinode.py and tests/test_slurm.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from torch_handle.checkpoint import store as ckpt
from torch_handle.errors import RunDirError
from torch_handle.checkpoint.shared_dirs import PROBE_PREFIX, agree_on_checkpoint, directory_leaders
from torch_handle.launch.slurm import SlurmJob, sbatch_script


class Group:
    """``world`` ranks as threads: ``gather(rank)`` gives each its all_gather_object."""

    def __init__(self, world: int):
        self.world, self.barrier, self.slots, self.rounds = world, threading.Barrier(world), {}, {}

    def gather(self, rank: int):
        def gather(obj):
            n = self.rounds.get(rank, 0)
            self.rounds[rank] = n + 1
            self.slots[(n, rank)] = obj
            self.barrier.wait(timeout=10)
            out = [self.slots[(n, r)] for r in range(self.world)]
            self.barrier.wait(timeout=10)
            return out
        return gather

    def run(self, fn):
        """``fn(rank, gather)`` on every rank at once; the results by rank."""
        results, errors = [None] * self.world, []

        def one(rank):
            try:
                results[rank] = fn(rank, self.gather(rank))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if errors:
            raise errors[0]
        return results


def test_directory_leaders_tell_a_shared_directory_from_one_per_node(tmp_path):
    """4 ranks, 2 per node. The run directory: one per node (ranks 0,1 see a/, ranks 2,3 see b/); the cache: one
    shared directory. Leaders: the lowest rank that sees the same directory; probe files are gone after."""
    run = {0: tmp_path / "a", 1: tmp_path / "a", 2: tmp_path / "b", 3: tmp_path / "b"}
    cache = tmp_path / "cache"
    leaders = Group(4).run(lambda r, g: directory_leaders([run[r], cache], r, r % 2, g))
    assert all(x == [[0, 0, 2, 2], [0, 0, 0, 0]] for x in leaders)
    assert not [p for p in tmp_path.rglob(f"{PROBE_PREFIX}*")]
    # a stale probe file of a crashed run changes nothing: the tokens are new each time
    (tmp_path / "b" / f"{PROBE_PREFIX}0123").write_text("0\n")
    leaders = Group(4).run(lambda r, g: directory_leaders([run[r]], r, r % 2, g))
    assert leaders[3] == [[0, 0, 2, 2]]


def _checkpoint(root: Path, step: int, files: dict[str, bytes]) -> None:
    tmp = ckpt.tmp_dir_for(root, step)
    tmp.mkdir(parents=True)
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    ckpt.finalize(root, step, keep_last=None)


def test_the_resume_step_is_the_newest_one_every_directory_has_and_verifies(tmp_path):
    """Node 0 finished step 8, node 1 died before it (a restart): both resume from step 4. Then a corrupt step-4
    on node 1 makes it step 2 for both, with a message naming why each newer step was skipped."""
    a, b = tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints"
    for step in (2, 4, 8):
        _checkpoint(a, step, {"model.pt": b"A" * step})
    for step in (2, 4):
        _checkpoint(b, step, {"model.pt": b"B" * step})
    roots, leaders = {0: a, 1: b}, [0, 1]
    found = Group(2).run(lambda r, g: agree_on_checkpoint(roots[r], r, leaders, g))
    assert [p for p, _ in found] == [a / "step-4", b / "step-4"]
    assert "not written in the run directory of rank 1" in found[0][1][0] and found[0][1] == found[1][1]

    (b / "step-4" / "model.pt").write_bytes(b"X")
    found = Group(2).run(lambda r, g: agree_on_checkpoint(roots[r], r, leaders, g))
    assert [p for p, _ in found] == [a / "step-2", b / "step-2"]
    assert any("model.pt has 1 bytes" in m and "rank 1" in m for m in found[0][1])

    # one shared directory (both leaders 0): rank 0's newest valid one, as on one node
    found = Group(2).run(lambda r, g: agree_on_checkpoint(a, r, [0, 0], g))
    assert [p for p, _ in found] == [a / "step-8", a / "step-8"] and found[0][1] == []


def _tiny(tmp_path: Path) -> Path:
    from tests.helpers import tiny_preset

    path = tmp_path / "tiny.toml"
    path.write_text(tiny_preset(tmp_path / "runs"))
    return path


NODES = ("launch.nnodes=2", "launch.rdzv_endpoint=127.0.0.1:29555", "launch.nproc_per_node=1")


def test_node_1_joins_the_run_directory_node_0_created_and_writes_nothing_in_it(tmp_path, no_launch):
    from torch_handle.launch.run import prepare_run

    preset, run_dir = _tiny(tmp_path), tmp_path / "shared"
    _, made = prepare_run(str(preset), (*NODES, "launch.node_rank=0"), run_dir, None)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    info = json.loads((run_dir / "run.json").read_text())
    assert made == run_dir and info["launcher_node_rank"] == 0 and "node_rank = 0" in before["preset.toml"].decode()
    _, joined = prepare_run(str(preset), (*NODES, "launch.node_rank=1"), run_dir, None)
    assert joined == run_dir
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("case, expected", [
    ("other-preset", "already exists with another preset (training.steps = 10 there, 11 here)"),
    ("finished", "already exists and is finished: continue it with --resume"),
    ("second-node-0", "node 0 of this run has started already"),
    ("single-node", "already exists with another preset (launch.nnodes = 1 there, 2 here)"),
])
def test_a_wrong_reuse_of_a_run_directory_is_one_line_and_changes_nothing(tmp_path, no_launch, case, expected):
    from torch_handle.launch.run import prepare_run

    preset, run_dir = _tiny(tmp_path), tmp_path / "shared"
    if case == "single-node":
        prepare_run(str(preset), ("launch.nproc_per_node=1",), run_dir, None)
    else:
        prepare_run(str(preset), (*NODES, "launch.node_rank=0"), run_dir, None)
    if case == "finished":
        info = json.loads((run_dir / "run.json").read_text())
        (run_dir / "run.json").write_text(json.dumps({**info, "status": "finished"}))
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    sets = {"other-preset": (*NODES, "launch.node_rank=1", "training.steps=11"),
            "second-node-0": (*NODES, "launch.node_rank=0")}.get(case, (*NODES, "launch.node_rank=1"))
    with pytest.raises(RunDirError) as e:
        prepare_run(str(preset), sets, run_dir, None)
    assert expected in str(e.value) and str(e.value).startswith(str(run_dir)) and "\n" not in str(e.value)
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_a_multi_node_resume_must_name_the_node(tmp_path, no_launch):
    from torch_handle.launch.run import prepare_run

    preset, run_dir = _tiny(tmp_path), tmp_path / "shared"
    prepare_run(str(preset), (*NODES, "launch.node_rank=0"), run_dir, None)
    info = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**info, "status": "stopped", "launcher_pid": None}))
    with pytest.raises(RunDirError, match=r"give this node's rank, --resume .* --set launch.node_rank=R"):
        prepare_run(None, (), None, run_dir)
    before = (run_dir / "run.json").read_bytes()
    loaded, _ = prepare_run(None, ("launch.node_rank=1",), None, run_dir)  # not the owner: validates, writes nothing
    assert loaded.launch.node_rank == 1 and (run_dir / "run.json").read_bytes() == before
    loaded, _ = prepare_run(None, ("launch.node_rank=0",), None, run_dir)  # node 0 marks the resume
    assert json.loads((run_dir / "run.json").read_text())["status"] == "running"
    assert not (run_dir / "preset.resume.toml").exists()  # node_rank is no change to the run's preset


def test_the_sbatch_script_is_valid_bash_with_the_slurm_settings(tmp_path):
    job = SlurmJob(preset="/shared/p q.toml", name="big", output_dir="/shared/runs", workdir="/shared", nodes=4,
                   gpus_per_node=8, partition="gpu", time="04:00:00", account="proj", port=29411,
                   overrides=["training.steps=5", "run.seed=7"])
    text = sbatch_script(job)
    for line in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=04:00:00", "#SBATCH --account=proj",
                 "#SBATCH --output=slurm-%x-%j.out", "#SBATCH --chdir=/shared",
                 'HEAD_NODE=$(head -n1 <<<"$NODE_LIST")  # (no pipe from scontrol: pipefail would catch its SIGPIPE)',
                 'srun --ntasks-per-node=1 --label bash -c "$NODE_CMD"']:
        assert line in text.splitlines(), line
    assert 'NODE_LIST=$(scontrol show hostnames "$SLURM_JOB_NODELIST")' in text
    start = next(ln for ln in text.splitlines() if ln.startswith("exec ") and "--run-dir" in ln)
    assert "'/shared/p q.toml'" in start and "--set launch.nproc_per_node=8" in start
    assert '--set launch.node_rank="$SLURM_NODEID"' in start and "--set launch.nnodes=4" in start
    bash = shutil.which("bash")
    if bash:
        script = tmp_path / "job.sbatch"
        script.write_text(text)
        assert subprocess.run([bash, "-n", str(script)], check=False, capture_output=True).returncode == 0
