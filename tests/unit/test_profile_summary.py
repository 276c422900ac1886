"""``torch_handle.observe.profile_summary`` on small hand-made Chrome traces: interval math, categorisation, the split,
overlap, self times, the memory peak; and ``handle profile``'s one-line errors. No torch, no processes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from handle_cli.main import cli
from torch_handle.observe.profile_summary import (TraceError, find_traces, intersect, is_comm, load_trace, subtract,
                                          summarize, summarize_files, union)

MAIN, GLOO = 1, 2


def x(name: str, ts: float, end: float, tid: int = MAIN, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": end - ts}


def ann(name: str, ts: float, end: float, tid: int = MAIN) -> dict:
    return x(name, ts, end, tid, cat="user_annotation")


def mem(ts: float, allocated: int, device_type: int = 0) -> dict:
    return {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 7, "tid": MAIN, "ts": ts,
            "args": {"Total Allocated": allocated, "Device Type": device_type, "Device Id": -1}}


def step_trace(handle_ranges: bool = True) -> dict:
    """One 100 µs step: data 0-10, forward 10-40, backward 40-70 (its all-reduce launched at 55, running on a gloo
    thread 50-65, the main thread idle 57-65), optimizer 70-90, nothing 90-100."""
    events = [ann("ProfilerStep#3", 0, 100), x("aten::stack", 2, 8),
              x("aten::linear", 12, 30), x("aten::addmm", 14, 28), x("aten::mm", 40, 55),
              x("c10d::allreduce_", 55, 57), ann("gloo:all_reduce", 50, 65, tid=GLOO),
              ann("Optimizer.step#AdamW.step", 70, 90), x("aten::add_", 70, 88),
              ann("decoder.layer0", 12, 30), mem(1, 100), mem(2, 300), mem(3, 200)]
    if handle_ranges:
        events += [ann("handle/data", 0, 10), ann("handle/forward", 10, 40), ann("handle/backward", 40, 70),
                   ann("handle/optimizer", 70, 90)]
    return {"traceEvents": events}


def test_interval_math():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]
    a, b = [(0, 10), (20, 30)], [(5, 25)]
    assert intersect(a, b) == [(5, 10), (20, 25)]
    assert subtract(a, b) == [(0, 5), (25, 30)]
    assert subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert subtract([(0, 10)], []) == [(0, 10)] and intersect([], b) == []


@pytest.mark.parametrize("name,comm", [("gloo:all_reduce", True), ("nccl:all_reduce", True),
                                       ("c10d::allreduce_", True), ("record_param_comms", True),
                                       ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", True), ("handle/comm", True),
                                       ("aten::mm", False), ("handle/backward", False), ("decoder.layer0", False)])
def test_is_comm(name, comm):
    assert is_comm(name) is comm


def test_split_overlap_self_times_and_memory_with_handle_ranges():
    s = summarize(step_trace())
    assert s["steps"] == 1 and s["step_ms"] == pytest.approx(0.1)
    assert s["split_source"] == "handle ranges"
    us = {k: round(v * 1e3, 6) for k, v in s["split"].items()}
    assert us == {"compute": 50, "communication": 10, "data": 10, "optimizer": 20, "other": 10}
    assert s["comm"]["total_ms"] == pytest.approx(0.015)  # 50-65 on the gloo thread (the launch lies inside)
    assert s["comm"]["overlapped_ms"] == pytest.approx(0.005)  # main thread in aten::mm until 55
    assert s["comm"]["overlap"] == pytest.approx(1 / 3)
    assert s["comm"]["events"] == {"c10d::allreduce_": 1, "gloo:all_reduce": 1}
    rows = {r["name"]: (r["calls"], round(r["self_ms"] * 1e3, 6)) for r in s["top_ops"]["rows"]}
    assert rows == {"aten::add_": (1, 18), "aten::mm": (1, 15), "aten::addmm": (1, 14), "aten::stack": (1, 6),
                    "aten::linear": (1, 4), "c10d::allreduce_": (1, 2)}
    assert [r["name"] for r in s["top_ops"]["rows"]][:2] == ["aten::add_", "aten::mm"]
    assert s["memory_peak_bytes"] == {"cpu": 300}
    assert s["ranges"]["decoder.layer0"] == [1, pytest.approx(0.018)]


def test_split_without_handle_ranges_falls_back_to_operators():
    s = summarize(step_trace(handle_ranges=False), top=2)
    assert s["split_source"] == "operators"
    us = {k: round(v * 1e3, 6) for k, v in s["split"].items()}
    # data: no enumerate range here and aten::stack is compute; compute = main-thread operators only
    assert us == {"compute": 6 + 18 + 15, "communication": 10, "data": 0, "optimizer": 20, "other": 100 - 69}
    assert sum(us.values()) == 100 and len(s["top_ops"]["rows"]) == 2


def test_cuda_kernels_nccl_overlap_and_no_memory_events():
    trace = {"traceEvents": [ann("ProfilerStep#1", 0, 100), x("aten::mm", 0, 10),
                             x("ampere_sgemm_128x64", 0, 50, tid=9, cat="kernel"),
                             x("ncclDevKernel_AllReduce_Sum_f32", 40, 80, tid=10, cat="kernel")]}
    s = summarize(trace)
    assert s["top_ops"]["basis"] == "cuda kernel time"
    assert [r["name"] for r in s["top_ops"]["rows"]] == ["ampere_sgemm_128x64", "ncclDevKernel_AllReduce_Sum_f32"]
    assert s["comm"]["overlap"] == pytest.approx(0.25)  # 40-50 of 40-80
    assert s["memory_peak_bytes"] is None


def test_a_ring_pass_in_flight_overlaps_the_compute_posted_after_it():
    """Ring attention on gloo: the autograd function (0-100) posts a send (c10d::send 1-2) whose life is a gloo:send
    range on the main thread (2-60), computes the block (aten::bmm 10-40) and waits (40-60). The pass is
    communication in flight for 59 µs, 30 of them beside the block's compute; the function itself is not compute."""
    trace = {"traceEvents": [ann("ProfilerStep#1", 0, 100), x("_RingAttention", 0, 100), x("c10d::send", 1, 2),
                             ann("gloo:send", 2, 60), x("aten::bmm", 10, 40), x("aten::add", 70, 80)]}
    s = summarize(trace)
    assert s["comm"]["total_ms"] == pytest.approx(0.059)
    assert s["comm"]["overlapped_ms"] == pytest.approx(0.030)
    us = {k: round(v * 1e3, 6) for k, v in s["split"].items()}
    assert us["compute"] == 30 + 10 and us["communication"] == 1 + 8 + 20


def test_files_add_up_and_bad_files_raise(tmp_path):
    d = tmp_path / "run" / "traces" / "rank1"
    d.mkdir(parents=True)
    for i in range(2):
        (d / f"rank1.{i}.pt.trace.json").write_text(json.dumps(step_trace()))
    paths = find_traces(tmp_path / "run", 1)
    assert len(paths) == 2 and find_traces(tmp_path / "run", 0) == []
    s = summarize_files(paths)
    assert s["steps"] == 2 and s["split"]["compute"] == pytest.approx(0.1)
    assert s["comm"]["overlap"] == pytest.approx(1 / 3)
    assert {r["name"]: r["calls"] for r in s["top_ops"]["rows"]}["aten::mm"] == 2
    (d / "rank1.9.pt.trace.json").write_text('{"schemaVersion": 1}')
    with pytest.raises(TraceError, match="no traceEvents"):
        load_trace(d / "rank1.9.pt.trace.json")


def _run_dir(tmp_path, with_trace: bool):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text('{"status": "finished"}')
    if with_trace:
        (run / "traces" / "rank0").mkdir(parents=True)
        (run / "traces" / "rank0" / "rank0.1.pt.trace.json").write_text(json.dumps(step_trace()))
    return run


def test_cli_without_traces_is_one_line_exit_2(tmp_path):
    run = _run_dir(tmp_path, with_trace=False)
    result = CliRunner().invoke(cli, ["profile", str(run)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(run) in lines[0]
    assert "--set profiler.name=torch" in lines[0]
    result = CliRunner().invoke(cli, ["profile", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "not a run directory" in result.output


def test_cli_json_and_text(tmp_path):
    run = _run_dir(tmp_path, with_trace=True)
    result = CliRunner().invoke(cli, ["profile", str(run), "--json", "--top", "3"])
    assert result.exit_code == 0, result.output
    s = json.loads(result.output)
    assert s["rank"] == 0 and len(s["top_ops"]["rows"]) == 3 and s["split"]["data"] == pytest.approx(0.01)
    text = CliRunner().invoke(cli, ["profile", str(run)]).output
    assert "time split" in text and "overlapped compute" in text and "memory peak: cpu 300 B" in text
    assert CliRunner().invoke(cli, ["profile", str(run), "--rank", "1"]).exit_code == 2
