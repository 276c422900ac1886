"""The pure half of ``handle bench scaling``: efficiency, the strong-scaling batch split, strategy names as
overrides, the summary of step events and the CSV (no torch, no processes)."""

from __future__ import annotations

import csv
import io

import pytest

from torch_handle.launch.cores import oversubscribed, threads_per_rank
from torch_handle.plan.bench_scaling import (CSV_COLUMNS, LayoutSpec, add_efficiency, csv_text, efficiency,
                                             layout_runs, parse_layout, parse_layouts, parse_nproc, parse_strategies,
                                             preset_strategy_label, strategy_spec, strong_batch, summarize, sweep,
                                             table_parts)


def test_efficiency():
    assert efficiency(2000.0, 2, 1000.0, 1) == pytest.approx(1.0)  # linear
    assert efficiency(1500.0, 2, 1000.0, 1) == pytest.approx(0.75)  # N / (N x base)
    assert efficiency(1000.0, 4, 1000.0, 1) == pytest.approx(0.25)
    assert efficiency(3000.0, 4, 2000.0, 2) == pytest.approx(0.75)  # base 2: 3000 / (4/2 x 2000)
    assert efficiency(1000.0, 1, 1000.0, 1) == 1.0
    with pytest.raises(ValueError):
        efficiency(1.0, 2, 0.0, 1)


@pytest.mark.parametrize("global_batch, mbs, ga, n, expected", [
    (16, 8, 2, 1, (8, 2)),   # the base itself
    (16, 8, 2, 2, (8, 1)),   # grad_accum halves
    (64, 8, 8, 4, (8, 2)),
    (16, 8, 2, 4, (4, 1)),   # 4 per rank: grad_accum cannot go below 1, the micro-batch shrinks
    (24, 8, 3, 2, (6, 2)),   # 12 per rank: 8 does not divide it, 6 is the largest divisor <= 8
    (12, 4, 1, 1, (4, 3)),
    (6, 6, 1, 3, (2, 1)),
])
def test_strong_batch(global_batch, mbs, ga, n, expected):
    m, g = strong_batch(global_batch, mbs, ga, n)
    assert (m, g) == expected
    assert m * g * n == global_batch and m <= max(mbs, 1)


def test_strong_batch_impossible():
    with pytest.raises(ValueError, match="global batch of 8 samples does not divide over 3 ranks"):
        strong_batch(8, 8, 1, 3)


def test_strategy_specs():
    assert strategy_spec("ddp").overrides == ("strategy.name=ddp",)
    z2 = strategy_spec("zero2")
    assert (z2.plugin, z2.overrides) == ("deepspeed", ("strategy.name=deepspeed", "strategy.zero_stage=2"))
    assert strategy_spec("zero0").overrides[-1] == "strategy.zero_stage=0"
    assert strategy_spec("scratch-zero1").overrides == ("strategy.name=scratch-ddp", "strategy.shard_optimizer=true")
    assert strategy_spec("single").single_rank_only and not strategy_spec("fsdp").single_rank_only
    for bad in ("zero4", "zero", "nope", "DDP"):
        with pytest.raises(ValueError, match="unknown strategy"):
            strategy_spec(bad)
    assert preset_strategy_label("deepspeed", 3) == "zero3" and preset_strategy_label("ddp") == "ddp"


def test_sweep_runs_each_world_size_with_each_tp_that_divides_it():
    runs, notes = sweep(strategy_spec("fsdp"), [1, 2, 4], [1, 2, 4])
    got = [(r.label, r.spec.plugin, r.nproc, r.dp, r.tp) for r in runs]
    assert got == [("fsdp", "fsdp", 1, 1, 1),
                   ("fsdp", "fsdp", 2, 2, 1), ("fsdp-tp2", "single", 2, 1, 2),  # dp = 1: one TP replica
                   ("fsdp", "fsdp", 4, 4, 1), ("fsdp-tp2", "fsdp", 4, 2, 2), ("fsdp-tp4", "single", 4, 1, 4)]
    assert runs[4].overrides == ("strategy.name=fsdp", "parallel.tp=2")
    assert runs[2].overrides == ("strategy.name=single", "parallel.tp=2")
    assert notes == ["tp 2 skipped at 1 rank: it does not divide the world size",
                     "tp 4 skipped at 1 rank: it does not divide the world size",
                     "tp 4 skipped at 2 ranks: it does not divide the world size"]


def test_sweep_of_single_and_without_tp():
    runs, notes = sweep(strategy_spec("single"), [1, 2, 4], [1, 2])
    assert [(r.label, r.nproc, r.tp) for r in runs] == [("single", 1, 1), ("single-tp2", 2, 2)]
    assert "single skipped at 4 ranks with tp 2: it runs one model replica (world size = tp)" in notes
    plain, notes = sweep(strategy_spec("ddp"), [1, 2])  # no --tp: the preset's own layout, no override
    assert [(r.label, r.nproc, r.tp, r.overrides) for r in plain] == [("ddp", 1, None, ("strategy.name=ddp",)),
                                                                      ("ddp", 2, None, ("strategy.name=ddp",))]
    assert notes == [] and sweep(strategy_spec("single"), [1, 2])[1] == [
        "single skipped at 2 ranks: it runs on world size 1 only"]


def test_parse_lists():
    assert parse_nproc("4,1,2,2") == [1, 2, 4]
    assert parse_nproc(" 2 ") == [2]
    for bad, match in (("0", "out of range"), ("1,x", "not an integer"), ("", "not an integer"), ("-1", "range")):
        with pytest.raises(ValueError, match=match):
            parse_nproc(bad)
    assert parse_strategies("ddp, zero2,ddp") == ["ddp", "zero2"]
    for bad in ("", "ddp,,fsdp", "nope"):
        with pytest.raises(ValueError):
            parse_strategies(bad)


def test_parse_layouts():
    got = parse_layouts("dp2, tp2,pp2,dp2xtp2,tp2xdp2,dp1,dp1xpp2,PP2xDP2xTP2,dp02")
    assert [(x.label, x.nproc) for x in got] == [("dp2", 2), ("tp2", 2), ("pp2", 2), ("dp2xtp2", 4), ("dp1", 1),
                                                 ("dp2xtp2xpp2", 8)]  # the same degrees once, in the given order
    assert parse_layout("tp2xpp4") == LayoutSpec(dp=1, tp=2, pp=4)
    for bad in ("dp0", "dp", "dp2x", "xdp2", "dp2xdp2", "tp2.5", "cp2", "dp-1", "dp²", "dp 2", "2"):
        with pytest.raises(ValueError, match=f"^{bad!r} is not a layout \\(valid: dp<N>, tp<N>, pp<N>, or"):
            parse_layout(bad)
    with pytest.raises(ValueError, match="'dp16xtp32' needs 512 ranks"):
        parse_layout("dp16xtp32")
    for bad in ("", "dp2,,tp2", "dp2,"):
        with pytest.raises(ValueError, match="expected a comma list of layouts"):
            parse_layouts(bad)


def test_layout_runs_set_tp_and_pp_and_run_one_replica_as_single():
    runs, notes = layout_runs(strategy_spec("scratch-ddp"), parse_layouts("dp1,dp2,tp2,pp2,dp2xtp2xpp2"))
    got = [(r.label, r.layout, r.spec.plugin, r.nproc, r.dp, r.tp, r.pp) for r in runs]
    assert got == [("scratch-ddp", "dp1", "scratch-ddp", 1, 1, 1, 1), ("scratch-ddp", "dp2", "scratch-ddp", 2, 2, 1, 1),
                   ("scratch-ddp", "tp2", "single", 2, 1, 2, 1), ("scratch-ddp", "pp2", "single", 2, 1, 1, 2),
                   ("scratch-ddp", "dp2xtp2xpp2", "scratch-ddp", 8, 2, 2, 2)]
    assert runs[4].overrides == ("strategy.name=scratch-ddp", "parallel.tp=2", "parallel.pp=2")
    assert runs[0].overrides == ("strategy.name=scratch-ddp", "parallel.tp=1", "parallel.pp=1") and notes == []
    single, notes = layout_runs(strategy_spec("single"), parse_layouts("dp1,dp2,tp2"))
    assert [r.layout for r in single] == ["dp1", "tp2"]
    assert notes == ["single skipped at dp2: it runs one model replica (dp = 1)"]


def test_threads_and_oversubscription():
    assert threads_per_rank(1, 2, None) == 2 and threads_per_rank(2, 2, None) == 1
    assert threads_per_rank(4, 2, None) == 1 and threads_per_rank(2, 2, "3") == 3
    assert threads_per_rank(2, 8, "x") == 4  # not a number: the launcher's default
    assert not oversubscribed(1, 2, None) and not oversubscribed(2, 2, None)
    assert oversubscribed(4, 2, None) and oversubscribed(2, 2, "2")


def _step(step, tps, dt, memory=None, **extra):
    e = {"kind": "step", "seq": step, "step": step, "tokens_per_s": tps, "step_time_s": dt, **extra}
    if memory is not None:
        e["memory"] = memory
    return e


def test_summarize_skips_warmup_and_takes_medians_and_peaks():
    mem0 = [{"rank": 0, "param_bytes": 100, "grad_bytes": 0, "optimizer_bytes": 0, "rss_bytes": 5000},
            {"rank": 1, "param_bytes": 100, "grad_bytes": 0, "optimizer_bytes": 0, "rss_bytes": 7000}]
    mem4 = [{"rank": 0, "param_bytes": 100, "grad_bytes": 100, "optimizer_bytes": 200, "rss_bytes": 4000},
            {"rank": 1, "param_bytes": 100, "grad_bytes": 50, "optimizer_bytes": 200, "rss_bytes": 9000,
             "cuda_max_allocated_bytes": 123}]
    events = [{"kind": "status", "status": "running"}, _step(1, 10.0, 9.0, mem0), _step(2, 20.0, 5.0),
              _step(3, 100.0, 1.0, comm_s=0.25), _step(4, 300.0, 0.5, mem4, comm_s=0.5), _step(5, 200.0, 0.75),
              {"kind": "eval", "step": 5, "val_loss": 1.0}, {"kind": "step", "step": "bad"}]
    s = summarize(events, skip=2)
    assert s["measured_steps"] == 3
    assert s["tokens_per_s"] == 200.0 and s["step_time_s"] == 0.75
    assert s["comm_s"] == pytest.approx(0.375) and s["data_s"] is None and s["forward_s"] is None
    assert s["comm_dp_s"] is s["comm_tp_s"] is s["comm_pp_s"] is None
    assert s["memory"] == [
        {"rank": 0, "rss_bytes": 5000, "model_state_bytes": 400, "cuda_max_allocated_bytes": None},
        {"rank": 1, "rss_bytes": 9000, "model_state_bytes": 350, "cuda_max_allocated_bytes": 123}]
    assert summarize(events, skip=5)["measured_steps"] == 0 and summarize(events, skip=5)["tokens_per_s"] is None


def test_summary_covers_every_breakdown_field_and_the_table_adds_sync_to_comm():
    """Every part of the step breakdown is summarised (``sync_s`` was left out, so the parts did not tile the
    step); the table's ``comm`` column is the strategy's ``comm_s`` plus the trainer's ``sync_s``."""
    parts = {"data_s": 0.1, "forward_s": 0.2, "backward_s": 0.3, "sync_s": 0.01, "optimizer_s": 0.05}
    s = summarize([_step(1, 100.0, 0.66, **parts), _step(2, 100.0, 0.66, **parts)], skip=0)
    assert s["sync_s"] == 0.01 and s["comm_s"] is None and "sync_s" in CSV_COLUMNS
    assert table_parts(s) == [0.1, 0.2, 0.3, 0.05, 0.01]
    assert table_parts({**s, "comm_s": 0.02}) == [0.1, 0.2, 0.3, 0.05, pytest.approx(0.03)]
    assert table_parts({}) == [None] * 5


def test_summary_takes_the_median_comm_of_each_dimension():
    comm = [{"dp": 0.1, "pp": 0.02}, {"dp": 0.3, "pp": 0.04}, {"dp": 0.2}, {"pp": "x"}]
    s = summarize([_step(i + 1, 100.0, 0.5, comm=c) for i, c in enumerate(comm)], skip=0)
    assert (s["comm_dp_s"], s["comm_tp_s"], s["comm_pp_s"]) == (pytest.approx(0.2), None, pytest.approx(0.03))
    assert {"layout", "pp", "comm_dp_s", "comm_tp_s", "comm_pp_s"} <= set(CSV_COLUMNS)


def _rec(strategy, n, tps, status="finished"):
    return {"strategy": strategy, "nproc": n, "tokens_per_s": tps, "status": status, "memory": []}


def test_add_efficiency_uses_each_strategys_smallest_finished_world_size():
    records = [_rec("ddp", 1, 1000.0), _rec("ddp", 2, 1800.0), _rec("ddp", 4, 2000.0),
               _rec("zero2", 1, None, "failed"), _rec("zero2", 2, 1500.0), _rec("zero2", 4, 2400.0)]
    add_efficiency(records)
    assert records[3]["efficiency"] is None  # failed: no figure, and not the base
    assert [r["efficiency"] for r in records if r["efficiency"] is not None] == pytest.approx([1.0, 0.9, 0.5, 1.0, 0.8])
    assert records[5]["base_nproc"] == 2 and records[1]["base_nproc"] == 1


def test_csv():
    records = [_rec("ddp", 1, 1000.0), _rec("ddp", 2, None, "failed")]
    records[0]["memory"] = [{"rank": 0, "rss_bytes": 10, "model_state_bytes": 3, "cuda_max_allocated_bytes": None}]
    records[1]["message"] = "boom, with a comma"
    add_efficiency(records)
    rows = list(csv.DictReader(io.StringIO(csv_text(records))))
    assert list(rows[0]) == list(CSV_COLUMNS)
    assert rows[0]["tokens_per_s"] == "1000.0" and rows[0]["peak_rss_bytes"] == "10" and rows[0]["efficiency"] == "1.0"
    assert rows[0]["peak_cuda_max_allocated_bytes"] == ""
    assert rows[1]["status"] == "failed" and rows[1]["message"] == "boom, with a comma" and rows[1]["efficiency"] == ""
