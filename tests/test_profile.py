"""``[profiler] name = "torch"`` on a real 2-rank run: one trace directory per rank, Chrome trace JSON, and
``handle profile`` reading it (compute, communication, the model's own ranges)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import tiny_preset
from tests.test_distributed import handle, run_dir_of

pytestmark = pytest.mark.dist


def test_two_ranks_write_their_own_traces_and_handle_profile_reads_them(tmp_path):
    preset = tmp_path / "tiny.toml"
    preset.write_text(tiny_preset(tmp_path / "runs", steps=8))
    proc = handle("run", str(preset), "--set", "profiler.name=torch", "--set", "profiler.ranks=[0,1]",
                  "--set", "profiler.wait=1", "--set", "profiler.warmup=1", "--set", "profiler.active=2",
                  "--set", "run.name=prof")
    run = run_dir_of(proc)
    for rank in (0, 1):
        files = sorted((run / "traces" / f"rank{rank}").glob("*.pt.trace.json"))
        assert len(files) == 1, files  # repeat = 1: one cycle, one file; never the other rank's
        assert files[0].name.startswith(f"rank{rank}.")
        trace = json.loads(files[0].read_text())
        assert trace["distributedInfo"]["rank"] == rank and trace["traceEvents"]
    assert not list((run / "traces").glob("*.json"))  # nothing outside the rank directories

    out = handle("profile", str(run), "--json", "--rank", "1").stdout
    s = json.loads(out)
    assert s["rank"] == 1 and s["steps"] == 2 and s["step_ms"] > 0
    assert s["split"]["compute"] > 0 and s["split"]["optimizer"] > 0
    assert abs(sum(s["split"].values()) - s["step_ms"]) <= 1e-6 * s["step_ms"] + 1e-9
    # DDP's gradient all-reduce: launched on the main thread, run by gloo on its own threads
    assert s["comm"]["total_ms"] > 0 and s["split"]["communication"] > 0
    assert {"c10d::allreduce_", "gloo:all_reduce"} <= set(s["comm"]["events"])
    assert 0.0 <= s["comm"]["overlap"] <= 1.0
    assert s["memory_peak_bytes"]["cpu"] > 0  # profile_memory defaults to true
    assert s["top_ops"]["basis"] == "cpu self time" and s["top_ops"]["rows"][0]["self_ms"] > 0
    # the model's own structure: 2 steps x 2 layers, each with attention and feed_forward
    assert s["ranges"]["decoder.layer0"][0] == 2 and s["ranges"]["decoder.layer1"][0] == 2
    assert s["ranges"]["attention"][0] == 4 and s["ranges"]["feed_forward"][0] == 4
    if s["split_source"] == "handle ranges":  # the trainer's handle/... loop ranges
        assert s["split"]["data"] > 0
        assert {"handle/forward", "handle/backward", "handle/optimizer"} <= set(s["ranges"])

    text = handle("profile", str(run), "--rank", "0", "--top", "5").stdout
    assert "time split" in text and "top operators by cpu self time" in text and "decoder.layer1" in text
