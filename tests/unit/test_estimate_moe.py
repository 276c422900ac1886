"""``handle estimate`` and ``handle plan`` with experts: total and active parameters counted by hand from the
model's named parameters, the routed experts split by ``[parallel] ep`` (their gradients and optimizer state with
them; the dense tensors under the strategy as before), the all-to-all bytes and token buffers against their
formulas, and the plan's enumeration of ep. ep > 1 is computed at the function level: the presets here get it by
``with_layout`` (unchecked, as a planner does), so the arithmetic is tested whatever the loader accepts."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from tests.helpers import tiny_preset
from torch_handle.config.loader import load_preset
from torch_handle.plan import estimate as E
from torch_handle.plan.estimate_layout import estimate_layout, with_layout
from torch_handle.plan.estimate_model import build_model, model_build, model_shape
from torch_handle.plan.estimate_moe import (all_to_all_bytes, dispatched_rows, preset_moe, rank_state_bytes,
                                            split_experts, token_buffer_bytes)
from torch_handle.plan.model_states import model_state_bytes
from torch_handle.plan.planner import candidate_layouts, expert_degrees
from torch_handle.registry import get_registry

E_, K, EVERY, F_EXPERT = 4, 2, 2, 32
MOE = f"mlp = \"swiglu\"\nn_experts = {E_}\ntop_k = {K}\nmoe_every = {EVERY}\nd_ff_expert = {F_EXPERT}\n"


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    path = root / "moe.toml"
    path.write_text(tiny_preset(root / "runs", strategy="ddp").replace("[model]\n", "[model]\n" + MOE))
    return load_preset(path, [], get_registry())


def by_hand(preset) -> dict[str, int]:
    """Counts from the model's own parameter names: the routed experts are ``*.ff.experts.*``."""
    with torch.device("meta"):
        model = build_model(model_build(preset, get_registry()))
    named = dict(model.named_parameters())
    experts = {n: p for n, p in named.items() if ".ff.experts." in n}
    per_expert = sum(p.numel() for p in experts.values()) // (E_ * len({n.split(".")[1] for n in experts}))
    return {"params": sum(p.numel() for p in named.values()), "experts": sum(p.numel() for p in experts.values()),
            "expert_tensors": len(experts), "dense_tensors": len(named) - len(experts),
            "moe_layers": len({n.split(".")[1] for n in experts}), "per_expert": per_expert}


def test_total_active_and_expert_parameters(preset):
    hand, moe = by_hand(preset), preset_moe(preset, get_registry())
    assert hand["moe_layers"] == 2 // EVERY and moe.moe_layers == hand["moe_layers"]
    assert (moe.params, moe.expert_params, moe.n_experts, moe.top_k) == (hand["params"], hand["experts"], E_, K)
    assert hand["per_expert"] == 3 * F_EXPERT * 64  # SwiGLU: gate, up (F, C) and down (C, F)
    assert moe.active_params == hand["params"] - (E_ - K) * hand["per_expert"] * hand["moe_layers"]
    (row,) = E.estimate_preset(preset, get_registry(), [2])
    out = row.as_dict()
    assert (out["params"], out["active_params"], out["expert_params"]) == (moe.params, moe.active_params,
                                                                          moe.expert_params)
    assert out["expert_param_bytes"] == 4 * hand["experts"] and out["all_to_all_bytes"] == 0  # ddp, ep 1


def test_experts_split_by_ep_with_their_gradients_and_optimizer_state(preset):
    """ddp on dp = 4 with ep 2: every rank the dense model and half of each layer's experts, AdamW for both."""
    hand, registry = by_hand(preset), get_registry()
    shape = model_shape(preset, registry)
    dense_n = hand["params"] - hand["experts"]
    one = rank_state_bytes(shape, E.preset_variant(preset), "fp32", 4, 0, 1)
    assert one == model_state_bytes(shape, E.preset_variant(preset), "fp32", 4, 0)  # ep 1: unchanged, to the byte
    two = rank_state_bytes(shape, E.preset_variant(preset), "fp32", 4, 0, 2)
    local = dense_n + hand["experts"] // 2
    assert (two.param, two.grad) == (4 * local, 4 * local)
    assert two.optimizer == 8 * local + 4 * (hand["dense_tensors"] + hand["expert_tensors"])
    rows = E.estimate_preset(with_layout(preset, ep=2), registry, [1, 2, 4])
    assert [r.world_size for r in rows] == [2, 4]  # ep divides dp
    assert all(r.param_bytes == 4 * local and r.expert_param_bytes == 2 * hand["experts"] for r in rows)
    with pytest.raises(ValueError, match="parallel.ep = 3 does not divide n_experts = 4"):
        split_experts(shape, 3)


def test_fsdp_shards_the_experts_again_over_their_expert_group(preset):
    """FSDP2 with ep 2 on dp 4: the dense tensors chunked over 4 ranks, each rank's 2 experts over the 2 ranks of
    its expert group (torchtitan's layout), so the experts per rank are the same as ep 1's chunks over 4."""
    registry = get_registry()
    shape = model_shape(preset, registry)
    fsdp = dataclasses.replace(E.preset_variant(preset), label="fsdp", strategy="fsdp")
    dense, experts = split_experts(shape, 2)
    assert experts.dim0 == (E_ // 2,) * len(experts.dim0) and sum(experts.numels) * 2 == by_hand(preset)["experts"]
    got = rank_state_bytes(shape, fsdp, "fp32", 4, 3, 2)
    want = [model_state_bytes(dense, fsdp, "fp32", 4, 3), model_state_bytes(experts, fsdp, "fp32", 2, 1)]
    assert got.param == sum(s.param for s in want) and got.optimizer == sum(s.optimizer for s in want)
    assert sum(s.param for s in want[1:]) == 4 * sum(math.ceil(d / 2) * (n // d) for n, d in
                                                     zip(experts.numels, experts.dim0))
    layout = estimate_layout(with_layout(preset, nproc_per_node=4, ep=2), registry, every_rank=True)
    assert layout.ep == 2 and [r.params_bytes for r in layout.ranks] == [
        rank_state_bytes(shape, E.preset_variant(preset), "fp32", 4, r, 2).param for r in range(4)]


def test_all_to_all_bytes_and_token_buffers_follow_their_formulas(preset):
    moe = preset_moe(preset, get_registry())
    n, c = 4 * 32, 64  # micro_batch_size x seq_len tokens, d_model
    assert dispatched_rows(moe, n) == n * K
    assert all_to_all_bytes(moe, n, 1, 4) == 0
    for ep in (2, 4):  # 4 all-to-alls of N·k rows and one exchange of E int64 counts per MoE layer
        assert all_to_all_bytes(moe, n, ep, 4) == moe.moe_layers * (4 * n * K * c * 4 + E_ * 8) * (ep - 1) // ep
    capped = dataclasses.replace(moe, capacity_factor=0.5)
    assert dispatched_rows(capped, n) == E_ * math.ceil(0.5 * n * K / E_) < n * K
    assert dispatched_rows(dataclasses.replace(moe, capacity_factor=2.0), n) == n * K  # at most every assignment
    assert token_buffer_bytes(moe, n, 2) == moe.moe_layers * 2 * n * K * c * 2
    (row,) = E.estimate_preset(with_layout(preset, ep=2), get_registry(), [2])
    assert row.all_to_all_bytes == preset.training.grad_accum * all_to_all_bytes(moe, n, 2, 4)


def test_a_capacity_factor_is_estimated_dropless(preset):
    """A capacity's cut is data-dependent (fake tensors cannot size it): the activations are the dropless ones."""
    registry = get_registry()
    capped = dataclasses.replace(preset, model=dataclasses.replace(
        preset.model, options=dataclasses.replace(preset.model.options, capacity_factor=1.0)))
    (a,), (b,) = E.estimate_preset(preset, registry, [2]), E.estimate_preset(capped, registry, [2])
    assert a.activation == b.activation


def test_plan_enumerates_ep_dividing_dp_and_n_experts():
    assert expert_degrees(4, 0) == [1]
    assert expert_degrees(4, 8) == [1, 2, 4] and expert_degrees(6, 8) == [1, 2] and expert_degrees(4, 6) == [1, 2]
    layouts = candidate_layouts(4, "ddp", lambda dp: 16 // dp, n_experts=4)
    assert {(x.dp, x.tp, x.pp, x.ep) for x in layouts if x.ep > 1} == {(4, 1, 1, 2), (4, 1, 1, 4), (2, 2, 1, 2),
                                                                       (2, 1, 2, 2)}
    dense = candidate_layouts(4, "ddp", lambda dp: 16 // dp)
    assert len(layouts) > len(dense) and all(x.ep == 1 for x in dense)
    assert next(x for x in layouts if x.ep == 4).mesh == "dp 4 × tp 1 × pp 1 (ep 4)"


def test_the_estimate_command_prints_and_writes_the_moe_figures(preset):
    from click.testing import CliRunner

    from handle_cli.main import cli

    moe = preset_moe(preset, get_registry())
    result = CliRunner().invoke(cli, ["estimate", str(preset.source), "--nproc", "2"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert (f"experts: {E_} per MoE layer in 1 layer(s), top_k {K}: {moe.active_params:,} of {moe.params:,} "
            f"parameters active per token") in text
    assert f"{moe.expert_params:,} in the routed experts, split over ep = 1" in text
    result = CliRunner().invoke(cli, ["estimate", str(preset.source), "--nproc", "2", "--json"])
    row = json.loads(result.stdout)
    assert (row["ep"], row["n_experts"], row["active_params"]) == (1, E_, moe.active_params)


def test_plan_times_the_all_to_alls_and_drops_what_the_loader_refuses(preset):
    """The EP part of a layout's step (bytes that leave the rank over the link, a latency per all-to-all and per
    count exchange), and ``plan_layouts`` trying ep = 2 on 2 ranks: planned where the preset loader runs it, else
    dropped with the loader's own line."""
    from torch_handle.plan import plan_cost
    from torch_handle.plan.planner import Batch, Candidate, plan_layouts, step_cost

    registry, links = get_registry(), plan_cost.default_links("gloo")
    moe = preset_moe(preset, registry)
    layout, batch = Candidate(2, 1, 1, strategy="ddp", ep=2), Batch(4, 2)
    est = estimate_layout(with_layout(preset, nproc_per_node=2, ep=2), registry)
    cost = step_cost(layout, batch, preset, est, 1e6, 1e12, links, 2, 8 * 32, moe)
    assert cost.ep_bytes == 2 * all_to_all_bytes(moe, 4 * 32, 2, 4)
    assert cost.ep_s == pytest.approx(cost.ep_bytes / (links.intra_gbps * 1e9) + 5 * 2 * links.latency_s)
    assert step_cost(dataclasses.replace(layout, ep=1), batch, preset, est, 1e6, 1e12, links, 2, 8 * 32, moe).ep_s == 0
    plan = plan_layouts(preset, registry, nproc=2, nnodes=1, device_memory=1 << 40, peak_flops=1e12,
                        peak_source="test", links=links)
    planned = [r for r in plan.rows if r.layout.ep == 2]
    dropped = [reason for x, reason in plan.dropped if x.ep == 2]
    assert len(planned) + len(dropped) == 2  # activation checkpointing off and on
    assert all(r.cost.ep_bytes > 0 and "parallel.ep=2" in r.overrides for r in planned)
    assert all(reason.startswith("parallel.ep") for reason in dropped)
    assert any("experts: 4 per MoE layer" in note for note in plan.notes)


def test_the_estimate_runs_after_a_real_backward_in_the_same_process(preset):
    """A real backward leaves a real tensor as the balancing losses' scale (``AuxLossScale.value``); the fake-tensor
    measurement must not take it in (it did when the scale was process-wide), and leaves it as it was."""
    from torch_handle.model.args import TransformerArgs
    from torch_handle.model.transformer import build_transformer
    from torch_handle.train.loss import AuxLossScale, loss_fn

    model = build_transformer(TransformerArgs(vocab_size=40, d_model=16, n_heads=2, n_layers=1, d_ff=32, n_experts=4,
                                              top_k=2, dropout=0.0)).train()
    scale = AuxLossScale(model)
    ids = torch.randint(0, 40, (2, 8))
    (scale.probe(loss_fn(model(ids), ids)[0]) * 0.5).backward()
    real = scale.value
    assert isinstance(real, torch.Tensor) and real.item() == 0.5
    (row,) = E.estimate_preset(preset, get_registry(), [2])
    assert row.activation.saved > 0 and scale.value is real and real.item() == 0.5
