"""Two nodes emulated on this machine: two `handle run` launchers (node_rank 0 and 1, nproc_per_node 1) meeting at
one rendezvous endpoint on 127.0.0.1, in both layouts of docs/multi-node.md:

- shared: both launchers on one run directory (a shared filesystem): node 0 creates it, node 1 joins it;
- separate: each node its own run directory and output directory (its own tokenizer cache and checkpoints).

A ZeRO-2 run on 2 nodes x 1 process must compute what 1 node x 2 processes computes (fp32, 1e-5); Ctrl-C on node
0 stops both nodes after a checkpoint and --resume on both continues exactly; a SIGKILLed worker on node 1 makes
torchrun restart the workers on both nodes, which resume from a step both directories have. (`handle env --check-dist`
across two nodes: tests/test_learn_doc.py runs docs/learn.md's two commands and checks both nodes' reports.)
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import find_worker, leftovers, tagged_env, tiny_preset

pytestmark = pytest.mark.dist

STEPS = 12
ZERO2 = ["strategy.name=deepspeed", "strategy.zero_stage=2", f"training.steps={STEPS}", "training.checkpoint_every=4"]
SLOW = "1:0.2"
"""HANDLE_TEST_DELAY_RANK for the runs a test interrupts: rank 1 sleeps 0.2 s per step (timing only, same losses)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sets(items: list[str]) -> list[str]:
    return [x for s in items for x in ("--set", s)]


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    path = run_dir / "events.jsonl"
    evs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [e for e in evs if kind is None or e["kind"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for e in events(run_dir, "step"):
        out[e["step"]] = e["loss"]  # the last occurrence of a step: the one after a restart or resume
    return out


def info(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def assert_same_losses(got: dict[int, float], reference: dict[int, float]) -> None:
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1))
    for step, ref in reference.items():
        assert abs(got[step] - ref) <= 1e-5 * abs(ref), (step, got[step], ref)


class Nodes:
    """Two `handle run` launchers started together, their output in files."""

    def __init__(self, out: Path, env: dict[str, str]):
        self.out, self.env, self.procs, self.started = out, env, [], 0

    def start(self, per_node: list[list[str]]) -> Nodes:
        self.started += 1  # node<R>-<N>.out: node R's output of the N-th start
        for node, args in enumerate(per_node):
            with open(self.out / f"node{node}-{self.started}.out", "w") as log:  # the child keeps its copy
                self.procs.append(subprocess.Popen([sys.executable, "-m", "handle_cli", "run", *args], stdout=log,
                                                   stderr=subprocess.STDOUT, text=True, env=self.env))
        return self

    def wait(self, timeout: float = 300) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                raise AssertionError(f"the launchers did not end within {timeout} s:\n{self.output()}") from None
        self.procs = []
        return codes

    def output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.out.glob("node*.out")))


def wait_for_step(run_dir: Path, step: int, procs: Nodes, timeout: float = 240) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [e["step"] for e in events(run_dir, "step")]
        if done and max(done) >= step:
            return max(done)
        if any(p.poll() is not None for p in procs.procs):
            raise AssertionError(f"a launcher ended before step {step}:\n{procs.output()}")
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s:\n{procs.output()}")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The preset and the reference: the same ZeRO-2 run on 1 node x 2 processes."""
    root = tmp_path_factory.mktemp("multinode")
    preset = root / "tiny.toml"
    preset.write_text(tiny_preset(root / "runs"))
    reference = root / "reference"
    proc = subprocess.run([sys.executable, "-m", "handle_cli", "run", str(preset), "--run-dir", str(reference),
                           *sets(ZERO2)], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return preset, losses(reference)


def node_sets(node: int, port: int, extra: list[str] = ()) -> list[str]:
    return sets([*ZERO2, "launch.nnodes=2", f"launch.node_rank={node}", f"launch.rdzv_endpoint=127.0.0.1:{port}",
                 "launch.nproc_per_node=1", *extra])


def test_shared_run_directory_ctrl_c_on_node_0_stops_both_and_the_resume_matches_one_node(base, tmp_path):
    """Both launchers on one run directory. Ctrl-C on node 0 only: both nodes checkpoint and stop (130, stopped);
    --resume on both nodes finishes with the 1 node x 2 processes losses at every step."""
    preset, reference = base
    env, tag = tagged_env(HANDLE_TEST_DELAY_RANK=SLOW)
    run_dir = tmp_path / "shared"
    port = free_port()
    nodes = Nodes(tmp_path, env).start([[str(preset), "--run-dir", str(run_dir), *node_sets(n, port)] for n in (0, 1)])
    wait_for_step(run_dir, 5, nodes)
    nodes.procs[0].send_signal(signal.SIGINT)
    sent = time.monotonic()
    assert nodes.wait(120) == [130, 130], nodes.output()
    assert time.monotonic() - sent < 30, "the nodes took more than 30 s to stop after Ctrl-C on node 0"
    assert not leftovers(tag)
    stopped = info(run_dir)
    assert stopped["status"] == "stopped" and 5 <= stopped["step"] < STEPS and stopped["launcher_node_rank"] == 0
    assert (run_dir / "checkpoints" / f"step-{stopped['step']}" / "manifest.json").exists()
    assert (run_dir / "logs" / "launcher.log").exists() and (run_dir / "logs" / "launcher-node1.log").exists()
    node1 = (tmp_path / "node1-1.out").read_text()
    assert f"stopped: {run_dir}" in node1 and f"--resume {run_dir} --set launch.node_rank=1" in node1

    port = free_port()  # launch settings may change on a resume: a new rendezvous port
    nodes.start([["--resume", str(run_dir), *sets([f"launch.node_rank={n}", f"launch.rdzv_endpoint=127.0.0.1:{port}"])]
                 for n in (0, 1)])
    assert nodes.wait() == [0, 0], nodes.output()
    assert not leftovers(tag)
    assert info(run_dir)["status"] == "finished"
    assert f"resumed from checkpoints/step-{stopped['step']} at step {stopped['step']}" in [
        e["message"] for e in events(run_dir, "log")]
    assert_same_losses(losses(run_dir), reference)


def test_separate_run_directories_a_killed_worker_restarts_both_nodes_and_resumes_exactly(base, tmp_path):
    """Each node its own output and run directory (no shared filesystem). Rank 1 (node 1) is SIGKILLed after
    step 6: torchrun restarts the workers on both nodes (max_restarts = 1), each resumes from a checkpoint in its own
    directory, and the run finishes with the 1 node x 2 processes losses; node 1's launcher reports it finished."""
    preset, reference = base
    env, tag = tagged_env(HANDLE_TEST_DELAY_RANK=SLOW)
    env.pop("HANDLE_DATA_CACHE", None)  # each node's launcher prepares into its own output_dir's cache
    dirs = [tmp_path / f"node{n}" / "run" for n in (0, 1)]
    port = free_port()
    nodes = Nodes(tmp_path, env).start([[str(preset), "--run-dir", str(dirs[n]),
                                         *node_sets(n, port, [f"run.output_dir={tmp_path / f'node{n}' / 'runs'}",
                                                              "launch.max_restarts=1"])] for n in (0, 1)])
    wait_for_step(dirs[0], 6, nodes)
    victim = find_worker(dirs[1], rank=1)
    assert victim is not None, nodes.output()
    killed = max(e["step"] for e in events(dirs[0], "step"))
    victim.kill()
    assert nodes.wait() == [0, 0], nodes.output()
    assert not leftovers(tag)

    for d in dirs:
        run = info(d)
        assert run["status"] == "finished" and run["restarts"] == 1 and not run["message"], run
    assert not (dirs[1] / "events.jsonl").exists(), "only global rank 0 (node 0) writes events"
    resumed = [ln.split("resumed from ")[1] for n, d in enumerate(dirs)
               for ln in (d / "logs" / f"rank{n}.log").read_text().splitlines() if "resumed from " in ln]
    assert len(resumed) == 2 and resumed[0] == resumed[1], resumed  # both nodes, the same step, own directory
    step = int(resumed[0].split(" at step ")[1])
    assert killed - step <= 4, f"killed after step {killed}, resumed from {step}"
    assert_same_losses(losses(dirs[0]), reference)

    from torch_handle.checkpoint.store import verify

    for d in dirs:  # each node's checkpoints are complete in its own directory; rank 1's shard only on node 1
        verify(d / "checkpoints" / f"step-{STEPS}")
        assert list((d / "checkpoints").glob(f"step-{STEPS}/ds/*model_states.pt"))
        assert (d / "tokenizer.json").exists()
    assert list(dirs[1].glob(f"checkpoints/step-{STEPS}/ds/zero_pp_rank_1_*"))
    assert not list(dirs[0].glob(f"checkpoints/step-{STEPS}/ds/zero_pp_rank_1_*"))
    for n in (0, 1):  # the data was prepared (tokenizer and shards) on each node, in its own cache
        assert list((tmp_path / f"node{n}" / "runs" / ".cache").glob("tokens-*/meta.json"))


@pytest.mark.parametrize("node, sig", [(1, signal.SIGTERM), (0, signal.SIGINT)], ids=["node1-sigterm", "node0-sigint"])
def test_a_signal_while_waiting_at_the_rendezvous_ends_the_launcher_within_5_s(base, tmp_path, node, sig):
    """One node started, the other never comes: the launcher waits at the rendezvous; the first SIGTERM or Ctrl-C
    ends it (no step would ever answer a stop request), status stopped, exit code 130, nothing left."""
    preset, _ = base
    env, tag = tagged_env()
    run_dir = tmp_path / "alone"
    proc = subprocess.Popen([sys.executable, "-m", "handle_cli", "run", str(preset), "--run-dir", str(run_dir),
                             *node_sets(node, free_port())], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (run_dir / "logs" / ("launcher.log" if node == 0 else
                                                                   "launcher-node1.log")).exists():
        time.sleep(0.05)
    time.sleep(2.0)  # torchrun is up and waiting for the other node
    assert proc.poll() is None
    proc.send_signal(sig)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 5.0, f"took {time.monotonic() - sent:.1f} s\n{out}\n{err}"
    assert proc.returncode == 130, out + err
    assert info(run_dir)["status"] == "stopped"
    assert "have not started training" in err
    assert not leftovers(tag)
