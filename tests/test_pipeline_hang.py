"""A stage that stalls inside the pipeline schedule: the hang report names where each stage is, the stalled one in
its forward of a micro-batch and the other in its receive of that micro-batch's activation.

A real pp = 2 run (hand-written 1F1B, 2 micro-batches, tiny preset) with ``HANDLE_TEST_HANG_RANK = 0:2:3600:1``:
rank 0 (stage 0) sleeps before its forward of micro-batch 1 in step 2. By then stage 1 has run F0 and B0 of that
step, so it waits for micro-batch 1's activation.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import leftovers
from tests.test_hang import events, start_run
from torch_handle.common.testhooks import parse_test_hang, parse_test_stall


def test_the_stall_form_of_the_hang_hook() -> None:
    assert parse_test_stall("0:2:3600:1", 0) == (2, 3600.0, 1)
    assert parse_test_stall("0:2:3600:1", 1) is None
    for bad in ("0:2", "0:2:5", "0:0:5:1", "0:2:0:1", "0:2:5:-1", "0:2:5:x", "0:2:5:1:1"):
        assert parse_test_stall(bad, 0) is None, bad
    assert parse_test_hang("0:2:3600:1", 0) is None  # the trainer's all-reduce hook leaves this form alone


@pytest.mark.dist
def test_a_stalled_stage_is_found_in_its_schedule(tmp_path: Path) -> None:
    run, tag, args, env = start_run(
        tmp_path, "pp-hung", "strategy.name=single", "parallel.pp=2", "parallel.pp_impl=scratch",
        "parallel.pp_schedule=1f1b", "training.grad_accum=2", "launch.hang_timeout_s=3", "launch.on_hang=stop",
        steps=4, HANDLE_TEST_HANG_RANK="0:2:3600:1")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert leftovers(tag) == []
    assert [e["step"] for e in events(run, "step")] == [1]
    (hang,) = events(run, "hang")
    by_rank = {r["rank"]: r for r in hang["ranks"]}
    assert by_rank[0]["phase"] == "forward mb 1" and by_rank[0]["call"] == "time.sleep", by_rank[0]
    assert by_rank[1]["phase"] == "recv activation mb 1 from stage 0", by_rank[1]
    assert by_rank[1]["where"].startswith("p2p.py:") and by_rank[1]["where"].endswith(" _recv"), by_rank[1]
    assert all(r["step"] == 1 for r in hang["ranks"])
    assert "rank 0 in time.sleep (pipeline.py:" in hang["message"], hang["message"]
    assert "rank 1 in dist.irecv (p2p.py:" in hang["message"], hang["message"]
    stacks = (run / hang["stacks"]).read_text()
    assert "after step 1 · phase forward mb 1 ·" in stacks
    assert "after step 1 · phase recv activation mb 1 from stage 0 ·" in stacks
