"""A mixture-of-experts decoder in the training loop, in this process (a gloo group of world size 1, as
tests/unit/test_trainer_step.py): the balancing losses reach the gradients through the loop's own loss, the expert
biases move once per optimizer step by the load the step events report, and the events' routing counts add up
over the step's micro-batches (the 2-process sums: tests/test_routing.py)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.test_trainer_step import _events, _preset, fake_peak, process_group  # noqa: F401 (fixtures)
from torch_handle.config.loader import dump_preset, load_preset
from torch_handle.model.router import TopKRouter
from torch_handle.registry import get_registry
from torch_handle.rundir import create_run_dir
from torch_handle.train.routing import routing_stats
from torch_handle.train.trainer import Trainer
from torch_handle.launch.run import prepare_data

STEPS, ACCUM, BATCH, SEQ = 3, 2, 4, 16  # as _preset writes them
MOE = {"n_layers": 2, "norm_first": "true", "mlp": '"swiglu"', "n_experts": 4, "top_k": 2, "moe_every": 2,
       "router": '"sigmoid"', "router_z_loss": 0.001}


def _train(tmp_path, process_group, **options):
    _preset(tmp_path, steps=STEPS)  # test_trainer_step's tiny decoder, 2 micro-batches of 4 x 16 tokens a step
    preset = load_preset(tmp_path / "p.toml", [f"model.{k}={v}" for k, v in {**MOE, **options}.items()])
    run_dir = create_run_dir(tmp_path / "runs", "moe", dump_preset(preset), {"status": "starting"})
    prepare_data(preset)  # what the launcher does before the workers start
    trainer = Trainer(preset, run_dir, process_group, get_registry())
    trainer.build()
    status = trainer.train()
    model = trainer.strategy.unwrapped()
    trainer.close(status)
    assert status == "finished"
    steps = [e for e in _events(run_dir) if e["kind"] == "step"]
    assert len(steps) == STEPS and all(math.isfinite(e["loss"]) for e in steps)
    return model, [e["moe"] for e in steps], steps


def test_an_aux_free_moe_decoder_moves_its_biases_once_per_step_by_the_load_of_the_events(tmp_path, process_group):
    model, moe, steps = _train(tmp_path, process_group, balance='"aux_free"', bias_update_rate=0.01)
    (router,) = [m for m in model.modules() if isinstance(m, TopKRouter)]
    expected = torch.zeros(4)
    for step in moe:  # each step's bias update: 0.01 · sign(mean load - load) of that step's counts
        assert step["layers"] == ["layers.1"] and step["top_k"] == 2 and step["dropped_tokens"] == [0]
        (load,) = torch.tensor(step["tokens_per_expert"], dtype=torch.float32)
        expected += 0.01 * torch.sign(load.mean() - load)
    torch.testing.assert_close(router.expert_bias, expected, rtol=0, atol=1e-6)
    assert expected.abs().sum() > 0
    for step, event in zip(moe, steps):  # every position of every micro-batch, k times
        assert event["tokens"] == ACCUM * BATCH * SEQ and sum(step["tokens_per_expert"][0]) == event["tokens"] * 2
        assert step["max_load_ratio"][0] == pytest.approx(max(step["tokens_per_expert"][0]) * 4 / (event["tokens"] * 2),
                                                          abs=1e-4)
        assert step["aux_loss"][0] > 0 and step["z_loss"][0] > 0
    assert routing_stats(model)["micro_batches"] == 0  # the trainer reads and resets the counts at every step


def test_a_capacity_drops_assignments_and_the_events_count_them(tmp_path, process_group):
    _, moe, steps = _train(tmp_path, process_group, capacity_factor=0.5)
    capacity = math.ceil(0.5 * BATCH * SEQ * 2 / 4)  # per expert and micro-batch
    for step, event in zip(moe, steps):
        counts, (dropped,) = step["tokens_per_expert"][0], step["dropped_tokens"]
        assert dropped > 0 and sum(counts) == event["tokens"] * 2 - dropped
        assert max(counts) <= ACCUM * capacity


def _decoder_with_two_moe_layers():
    from torch_handle.model.args import TransformerArgs
    from torch_handle.model.transformer import build_transformer

    torch.manual_seed(0)
    args = TransformerArgs(vocab_size=40, d_model=16, n_heads=2, n_layers=2, d_ff=32, d_ff_expert=8, n_experts=4,
                           top_k=2, mlp="swiglu", dropout=0.0, bias=False, norm_first=True)
    model = build_transformer(args).train()
    ids = torch.randint(0, 40, (2, 8))
    model(ids).sum().backward()  # one micro-batch of 16 positions through layers 0 and 1
    return model


def test_the_routing_table_is_what_the_all_reduce_sums_over_dp_ranks_once_per_tp_group_with_a2a_passed_through():
    from torch_handle.model.moe import moe_layers
    from torch_handle.model.pipeline import PipelineShard
    from torch_handle.train.routing import RoutingTelemetry, attach_traffic

    model = _decoder_with_two_moe_layers()
    for m in moe_layers(model):  # expert parallelism's counters (apply_expert_parallel attaches them)
        attach_traffic(m).record(1000, 0.002, backward=True)
    counts = routing_stats(model, reset=False)["tokens_per_expert"]
    aux = [float(m.stats["aux_loss"]) for m in moe_layers(model)]
    telemetry = RoutingTelemetry(model, tp_rank=0, dp_size=2)
    vector = telemetry.attach(torch.tensor([5.0, 16.0, 0.0], dtype=torch.float64), model)
    assert vector.shape == (3 + 2 * (4 + 6),) and routing_stats(model)["micro_batches"] == 0  # read and reset
    moe = telemetry.fields(vector * 2)["moe"]  # two dp ranks that routed the same: the all-reduce's sum
    assert moe["layers"] == ["layers.0", "layers.1"] and moe["top_k"] == 2
    assert moe["tokens_per_expert"] == [[2 * c for c in row] for row in counts]
    assert [sum(row) for row in moe["tokens_per_expert"]] == [2 * 16 * 2] * 2 and moe["dropped_tokens"] == [0, 0]
    assert moe["a2a_bytes"] == [2000, 2000] and moe["a2a_wait_ms"] == [2.0, 2.0]  # bytes of all; wait per rank
    assert moe["aux_loss"] == pytest.approx(aux, abs=1e-6)  # a mean over the micro-batches of both ranks

    # a tp rank other than 0 adds nothing (its tokens are tp rank 0's); a pipeline stage fills its own rows only
    model(torch.randint(0, 40, (2, 8))).sum().backward()
    assert not RoutingTelemetry(model, tp_rank=1).attach(torch.zeros(3, dtype=torch.float64), model)[3:].any()
    model(torch.randint(0, 40, (2, 8))).sum().backward()
    stage = PipelineShard(model, [1], first=False, last=True)
    table = RoutingTelemetry(model).attach(torch.zeros(3, dtype=torch.float64), stage)[3:].view(2, -1)  # per layer: 4 experts, then the figures
    assert not table[0].any() and table[1, :4].sum() == 16 * 2
    dense = RoutingTelemetry(torch.nn.Linear(2, 2))
    vector = torch.zeros(3, dtype=torch.float64)
    assert dense.attach(vector, model) is vector and dense.fields(vector) == {}


def test_the_routing_table_is_built_on_the_step_vectors_device():
    """On a GPU the step vector is on the device while ``a2a_wait_s`` is a host counter: the table goes to the
    vector's device (the first CUDA MoE run, 2026-11-27, failed its first step on this). The meta device stands
    in for CUDA here: a host tensor mixed into it fails the same way."""
    from torch_handle.train.routing import RoutingTelemetry

    model = _decoder_with_two_moe_layers()
    vector = RoutingTelemetry(model).attach(torch.zeros(3, dtype=torch.float64, device="meta"), model)
    assert vector.device.type == "meta" and vector.shape[0] > 3
