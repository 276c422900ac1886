"""The pure parts of ``handle plan``: the step-time formulas, the links read from a ``bench comm`` result, rank
correlation, and the layouts enumerated."""

from __future__ import annotations

import json

import pytest

from torch_handle.plan import plan_cost
from torch_handle.plan.planner import candidate_layouts, factorizations


def test_factorizations_multiply_to_the_world_size():
    got = factorizations(8)
    assert len(got) == len(set(got)) == 10  # ordered triples of a product of 2^3: C(5, 2)
    assert all(dp * tp * pp == 8 for dp, tp, pp in got)
    assert factorizations(1) == [(1, 1, 1)]


def test_candidates_try_every_schedule_m_and_ac():
    layouts = candidate_layouts(4, "fsdp", lambda dp: 16 // dp)
    pp2 = [x for x in layouts if (x.dp, x.tp, x.pp) == (2, 1, 2)]
    assert {(x.schedule, x.v, x.microbatches) for x in pp2} == {
        (s, v, m) for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)) for m in (2, 4, 8)}
    assert {x.activation_checkpointing for x in pp2} == {False, True}
    assert all(x.strategy == ("single" if x.dp == 1 else "fsdp") for x in layouts)
    odd = candidate_layouts(4, "ddp", lambda dp: 6 // dp if 6 % dp == 0 else None)
    assert {x.microbatches for x in odd if x.pp == 2} == {2}  # 4 and 8 do not divide the 6 samples


def test_bubble_is_the_schedules_idle_fraction():
    b, seconds = plan_cost.bubble_seconds(1.0, "1f1b", 4, 8, 1)
    assert b == pytest.approx(3 / 11) and seconds == pytest.approx(3 / 8)  # (p-1)/(v m) of compute
    b, seconds = plan_cost.bubble_seconds(1.0, "interleaved-1f1b", 4, 8, 2)
    assert b == pytest.approx(3 / 19) and seconds == pytest.approx(3 / 16)
    assert plan_cost.bubble_seconds(1.0, None, 1, 0, 1) == (0.0, 0.0)


def test_communication_times():
    links = plan_cost.Links("gloo", 2.0, 0.5, 1e-4, "assumed", False)
    assert plan_cost.dp_seconds(4_000_000, 1, "ddp", links, False) == 0
    assert plan_cost.dp_seconds(4_000_000, 4, "ddp", links, False) == pytest.approx(4e6 * 1.5 / 2e9 + 1e-4)
    assert plan_cost.dp_seconds(4_000_000, 4, "fsdp", links, True) == pytest.approx(4e6 * 2.25 / 0.5e9 + 2e-4)
    volume = {"calls": 10, "bytes": 1_000_000}
    assert plan_cost.tp_seconds(volume, 2, links) == pytest.approx(1e6 / 2e9 + 10e-4)
    assert plan_cost.compute_seconds(6e6, 1000, 4, 1e9, True) == pytest.approx(6e9 * 4 / 3 / 4e9)


def test_groups_crossing_nodes():
    # 8 ranks on 2 nodes of 4, tp fastest: a tp 4 group is one node; dp 2 with stride tp 4 spans both
    assert not plan_cost.crosses_nodes(4, 1, 4)
    assert plan_cost.crosses_nodes(2, 4, 4)
    assert not plan_cost.crosses_nodes(2, 2, 4)
    assert not plan_cost.crosses_nodes(1, 8, 4)


def test_links_from_a_bench_comm_result(tmp_path):
    run = tmp_path / "comm-1"
    run.mkdir()
    (run / "bench.json").write_text(json.dumps({"backend": "gloo"}))
    records = [{"op": "all_reduce", "backend": "gloo", "world_size": 2, "bytes": 1024, "time_us": 80.0,
                "busbw_gbps": 0.01, "correct": True},
               {"op": "all_reduce", "backend": "gloo", "world_size": 2, "bytes": 1 << 24, "time_us": 13000.0,
                "busbw_gbps": 1.29, "correct": True},
               {"op": "all_gather", "backend": "gloo", "world_size": 2, "bytes": 1 << 24, "time_us": 1.0,
                "busbw_gbps": 99.0, "correct": True}]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plan_cost.newest_bench_comm(tmp_path, "gloo") == run / "results.jsonl"
    assert plan_cost.newest_bench_comm(tmp_path, "nccl") is None
    links = plan_cost.links_from_bench(run / "results.jsonl")
    assert links.measured and links.intra_gbps == 1.29 and links.latency_s == pytest.approx(80e-6)
    assert links.source.startswith("measured:")
    across = plan_cost.links_from_bench(run / "results.jsonl", nnodes=2)
    assert across.inter_gbps == plan_cost.DEFAULT_LINKS["gloo"][1] and "assumed" in across.source
    (run / "results.jsonl").write_text("not json\n")
    assert plan_cost.links_from_bench(run / "results.jsonl") is None
    assert not plan_cost.default_links("nccl").measured


def test_spearman():
    assert plan_cost.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert plan_cost.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert plan_cost.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert plan_cost.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)  # ties: average ranks
    assert plan_cost.spearman([1], [2]) is None and plan_cost.spearman([1, 1], [1, 2]) is None


def test_measured_activations_prefer_the_pipelines_in_flight_peak():
    from torch_handle.plan.plan_measured import peak_saved_activations

    plain = [{"kind": "step", "step": 1, "memory": [{"rank": 0, "activation_saved_bytes": 100},
                                                    {"rank": 1, "activation_saved_bytes": 300}]},
             {"kind": "eval", "memory": [{"rank": 0, "activation_saved_bytes": 999}]}]
    assert peak_saved_activations(plain) == 300
    piped = [{**plain[0], "pipeline": {"ranks": [{"activation_peak_bytes": 700}, {"activation_peak_bytes": 500}]}}]
    assert peak_saved_activations(piped) == 700
    assert peak_saved_activations([{"kind": "step", "step": 1}]) is None
