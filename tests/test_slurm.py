"""`handle slurm`: the sbatch script it writes, run without Slurm. Stand-ins for `srun` (starts the per-node command
once per node, locally, with SLURM_NODEID/SLURM_PROCID/SLURM_LOCALID set as srun sets them), `scontrol` (`show
hostnames`) and `sbatch` are small scripts placed first on PATH; the script then runs a real 2-node run here."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import leftovers, tagged_env, tiny_preset

SRUN = f"""#!{sys.executable}
# stand-in srun: options, then a command; runs it once per node of the job (SLURM_JOB_NUM_NODES), locally
import json, os, subprocess, sys
args = sys.argv[1:]
options = []
while args and args[0].startswith("-"):
    options.append(args.pop(0))
nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write(json.dumps({{"tool": "srun", "options": options, "command": args, "tasks": nodes}}) + "\\n")
procs = []
for node in range(nodes):
    env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node), SLURM_LOCALID="0",
               SLURM_NTASKS=str(nodes), SLURM_STEP_NUM_NODES=str(nodes), SLURMD_NODENAME=f"node{{node}}")
    procs.append(subprocess.Popen(args, env=env))
codes = [p.wait() for p in procs]
sys.exit(next((c for c in codes if c), 0))
"""

SCONTROL = f"""#!{sys.executable}
# stand-in scontrol: `scontrol show hostnames LIST` with LIST comma-separated
import sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join(sys.argv[3].split(",")))
"""

SBATCH = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write(json.dumps({{"tool": "sbatch", "args": sys.argv[1:]}}) + "\\n")
print("Submitted batch job 4242")
"""


def _standins(directory: Path, **tools: str) -> Path:
    directory.mkdir()
    for name, text in tools.items():
        path = directory / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return directory


def _handle(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "handle_cli", *args], check=False, capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


@pytest.fixture
def preset(tmp_path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(tiny_preset(tmp_path / "runs", steps=4))
    return path


@pytest.mark.dist
def test_the_script_runs_one_handle_run_per_node_under_a_stand_in_srun(tmp_path, preset):
    env, tag = tagged_env()
    script = tmp_path / "job.sbatch"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _handle("slurm", str(preset), "--nodes", "2", "--partition", "debug", "--time", "00:10:00",
                   "--account", "proj", "--port", str(port), "--script", str(script), "--set", "launch.nproc_per_node=1",
                   "--set", "strategy.name=ddp", env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(script)
    text = script.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=debug",
                 "#SBATCH --time=00:10:00", "#SBATCH --account=proj", "#SBATCH --output=slurm-%x-%j.out"):
        assert line in text.splitlines()
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0

    bin_dir = _standins(tmp_path / "bin", srun=SRUN, scontrol=SCONTROL)
    log = tmp_path / "standin.jsonl"
    job_env = {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "STANDIN_LOG": str(log),
               "SLURM_JOB_ID": "777", "SLURM_JOB_NAME": "handle", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
               "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.1"}
    run = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True, env=job_env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert leftovers(tag) == []
    run_dir = tmp_path / "runs" / "handle-slurm-777"
    assert f"rendezvous 127.0.0.1:{port}, run directory {run_dir}" in run.stdout
    srun = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(srun) == 1 and srun[0]["tasks"] == 2 and "--ntasks-per-node=1" in srun[0]["options"]
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "finished" and info["world_size"] == 2 and info["step"] == 4
    # two nodes, one shared run directory: node 0's torchrun log and node 1's, one log per rank
    assert {p.name for p in (run_dir / "logs").glob("*.log")} >= {"launcher.log", "launcher-node1.log",
                                                                  "rank0.log", "rank1.log"}
    assert "--node_rank=1" in (run_dir / "logs" / "launcher-node1.log").read_text()
    assert run.stdout.count(f"finished: {run_dir}") == 2  # both nodes' `handle run` report the outcome

    # a requeued job (same job id) of the finished run: nothing left to train, said, exit 0, run.json as it was
    before = (run_dir / "run.json").read_bytes()
    requeued = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True, env=job_env,
                              cwd=tmp_path, timeout=300)
    assert requeued.returncode == 0, requeued.stdout[-3000:] + requeued.stderr[-3000:]
    assert f"handle: {run_dir} finished already: nothing to train" in requeued.stdout
    assert (run_dir / "run.json").read_bytes() == before
    # a requeue of a run that did not finish (as a preempted job leaves it) continues it with --resume on every node
    (run_dir / "run.json").write_text(json.dumps({**info, "status": "stopped"}))
    requeued = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True, env=job_env,
                              cwd=tmp_path, timeout=300)
    assert requeued.returncode == 0, requeued.stdout[-3000:] + requeued.stderr[-3000:]
    assert json.loads((run_dir / "run.json").read_text())["resumed"] == 1
    assert leftovers(tag) == []


def test_submit_calls_sbatch_and_reports_the_job(tmp_path, preset):
    env, _ = tagged_env()
    bin_dir = _standins(tmp_path / "bin", sbatch=SBATCH)
    log = tmp_path / "standin.jsonl"
    env = {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "STANDIN_LOG": str(log)}
    proc = _handle("slurm", str(preset), "--nodes", "3", "--gpus-per-node", "4", "--submit", "--json", env=env,
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["job_id"] == "4242" and result["processes"] == 12 and Path(result["script"]).is_file()
    assert json.loads(log.read_text())["args"] == [result["script"]]
    assert "#SBATCH --gpus-per-node=4" in Path(result["script"]).read_text()


@pytest.mark.parametrize("args, message", [
    (["--submit"], "--submit: sbatch is not on PATH"),
    (["--set", "training.steps=0"], "training.steps"),
    (["--set", "launch.node_rank=1"], "launch.node_rank is set by the script"),
    (["--set", "data.path=/nonexistent/x.txt", "--set", "data.name=text"], "/nonexistent/x.txt"),
], ids=["no-sbatch", "bad-value", "node-rank", "missing-data"])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, preset, args, message):
    env, _ = tagged_env()
    env["PATH"] = str(tmp_path / "empty")  # no sbatch
    proc = _handle("slurm", str(preset), *args, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()
