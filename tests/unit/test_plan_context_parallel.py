"""``handle plan`` with context parallelism (issue 48), in-process on the meta device: a preset that asks for cp is
planned at every cp its ranks allow, each layout priced by the estimate's cp model (activations of seq_len / cp
tokens, the attention's buffers, its communication per layer), labelled with cp, and the choice explained; the
loader's divisibility rules drop what cannot run (Ulysses where the heads do not divide)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torch_handle.config.loader import load_preset
from torch_handle.plan import plan_cost
from torch_handle.plan.estimate_cp import cp_step_volume
from torch_handle.plan.planner import Candidate, candidate_layouts, plan_layouts
from torch_handle.registry import get_registry

LINKS = plan_cost.default_links("gloo")


def _plan(preset, nproc: int, memory: int = 1 << 40):
    return plan_layouts(preset, get_registry(), nproc=nproc, nnodes=1, device_memory=memory, peak_flops=1e11,
                        peak_source="test", links=LINKS)


PRESET = Path(__file__).resolve().parents[2] / "presets" / "long-context.toml"
"""The llama shape (4 layers, 4 query heads, 2 key/value heads) at seq_len 1024 with packed documents, cp 2 allgather."""


def _long_context(*overrides: str):
    return load_preset(PRESET, ["training.precision=fp32", *overrides], get_registry())


def test_candidates_try_cp_at_every_divisor_of_the_ranks_left_with_pp_1_only():
    layouts = candidate_layouts(4, "ddp", lambda dp: 8 // dp, cp_impls=("ring", "ulysses"))
    cp = {(x.dp, x.cp, x.tp, x.pp, x.cp_impl) for x in layouts if x.cp > 1}
    assert cp == {(dp, c, tp, 1, impl) for dp, c, tp in ((2, 2, 1), (1, 4, 1), (1, 2, 2))
                  for impl in ("ring", "ulysses")}
    assert all(x.world_size == 4 and x.ep == 1 and x.strategy == "ddp" for x in layouts if x.cp > 1)
    assert {x.activation_checkpointing for x in layouts if x.cp == 4} == {False, True}
    assert not [x for x in candidate_layouts(4, "ddp", lambda dp: 8 // dp) if x.cp > 1]  # a preset without cp
    assert Candidate(2, 1, 1, cp=2, cp_impl="ring", activation_checkpointing=True).label == \
        "dp 2 × cp 2 × tp 1 × pp 1, ring, ac"


def test_a_sequence_that_fits_only_split_is_planned_with_cp_2():
    """Two samples a step of a multi-query model on 2 ranks (tp 2 refused: one key/value head): dp 2 holds a whole
    sequence a rank, pp 2 half the model and its micro-batches in flight, cp 2 half of each sequence. With memory
    for the smallest cp 2 layout, less than any cp 1 layout needs, the plan is cp 2 only, its first choice says no
    layout without cp fits, and its cp figures are the estimate's."""
    long_context = _long_context("training.micro_batch_size=1", "training.grad_accum=2", "model.n_kv_heads=1")
    everything = _plan(long_context, 2)
    smallest = {cp: min(r.estimate.largest.total_bytes for r in everything.rows if r.layout.cp == cp) for cp in (1, 2)}
    assert smallest[2] < smallest[1]
    plan = _plan(long_context, 2, memory=smallest[2])
    assert plan.rows and all(r.layout.cp == 2 for r in plan.rows)
    first = plan.rows[0]
    assert first.layout.mesh == "dp 1 × cp 2 × tp 1 × pp 1" and first.layout.label.startswith(first.layout.mesh +
                                                                                                  ", allgather")
    assert {"parallel.cp=2", "parallel.cp_impl=allgather"} <= set(first.overrides)
    assert first.estimate.cp == 2 and first.estimate.cp_buffer_bytes > 0
    volume = cp_step_volume(long_context, 4, first.batch.micro_batch_size, first.batch.grad_accum)
    assert first.cost.cp_bytes == volume["bytes"] > 0 and first.cost.cp_s > 0
    assert first.cost.step_s == pytest.approx(first.cost.compute_s + first.cost.dp_s + first.cost.cp_s)
    assert plan.notes[-1].startswith(f"chose {first.layout.label}: the fastest predicted")
    assert "no layout without cp fits" in plan.notes[-1]
    cp1 = [reason for layout, reason in plan.dropped if layout.cp == 1]
    assert cp1 and all(reason.startswith(("largest rank needs", "model.n_kv_heads")) for reason in cp1)


def test_ulysses_gets_no_layout_where_the_heads_do_not_divide():
    """cp_impl auto tries ring, allgather and ulysses; with 2 key/value heads Ulysses runs at cp x tp = 2 and is
    dropped at cp x tp = 4 with the loader's own line, where ring and all-gather run."""
    plan = _plan(_long_context("parallel.cp_impl=auto"), 4)
    planned = {(r.layout.cp, r.layout.tp, r.layout.cp_impl) for r in plan.rows if r.layout.cp > 1}
    assert planned == {(cp, tp, impl) for cp, tp in ((2, 1), (4, 1), (2, 2)) for impl in ("ring", "allgather")} | {
        (2, 1, "ulysses")}
    dropped = {(x.cp, x.tp, x.cp_impl): reason for x, reason in plan.dropped if x.cp > 1}
    assert set(dropped) == {(4, 1, "ulysses"), (2, 2, "ulysses")}
    assert all(reason.startswith('parallel.cp_impl: "ulysses" gives each of the cp x tp = 4 ranks whole heads')
               for reason in dropped.values())
    # tp_impl auto under cp: whichever TP the strategy runs (by hand under DDP, DTensor under FSDP2; both compose)
    assert not [o for r in plan.rows for o in r.overrides if o.startswith("parallel.tp_impl")]


def test_the_table_shows_cp_comm_where_a_layout_has_cp():
    from handle_cli.plan_cmd import plan_table

    row = {"label": "dp 1 × cp 2 × tp 1 × pp 1, ring", "strategy": "ddp", "tp_impl": None, "micro_batch_size": 1,
           "grad_accum": 2, "largest_bytes": 1 << 20, "largest_rank": 0, "predicted_tokens_per_s": 10.0,
           "step_s": 0.5, "pp": 1, "bubble": 0.0, "cp": 2, **{f"{d}_bytes": 0 for d in ("tp", "dp", "pp", "ep")},
           **{f"{d}_s": 0.0 for d in ("tp", "dp", "pp", "ep")}, "cp_bytes": 3 << 20, "cp_s": 0.0042}
    names = [c.header for c in plan_table([row]).columns]
    assert names[-1] == "CP comm" and "EP comm" not in names
    assert list(plan_table([row]).columns[-1].cells) == ["3.0 MiB 4.2 ms"]
    assert "CP comm" not in [c.header for c in plan_table([{**row, "cp": 1}]).columns]


def test_the_estimate_of_a_pipeline_under_cp_prices_each_stage_at_its_share_of_the_sequence():
    """pp 2 × cp 2: each pipeline rank's row says cp and its buffers, dp counts replicas over tp × pp × cp (4 ranks:
    dp 1; 8: dp 2; 6: no row), and a stage's activations are T/cp tokens' (the pp 2 × cp 1 rows' share, less than
    they are) plus the attention's buffers (the cp formula's)."""
    from torch_handle.plan.estimate import estimate_preset
    from torch_handle.plan.estimate_cp import preset_cp_buffer_bytes

    args = ("parallel.pp=2", "training.grad_accum=2", "parallel.cp_impl=ring", "launch.nproc_per_node=4")
    split = _long_context(*args)
    whole = _long_context(*args, "parallel.cp=1")
    rows = estimate_preset(split, get_registry(), [4, 6, 8])
    assert [(r.world_size, r.dp, r.cp, r.pp_rank) for r in rows] == [(4, 1, 2, 0), (4, 1, 2, 1), (8, 2, 2, 0),
                                                                       (8, 2, 2, 1)]
    buffers, impl = preset_cp_buffer_bytes(split, "fp32")
    assert impl == "ring" and buffers > 0 and {(r.cp_impl, r.cp_buffer_bytes) for r in rows} == {("ring", buffers)}
    full = {r.pp_rank: r.activation.saved for r in estimate_preset(whole, get_registry(), [4]) if r.cp == 1}
    for r in rows:
        assert r.activation.saved < 0.6 * full[r.pp_rank]
        assert r.as_dict()["cp"] == 2 and r.as_dict()["dp"] == r.dp
