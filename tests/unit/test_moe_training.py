"""A mixture-of-experts decoder in the training loop, in this process (a gloo group of world size 1, as
tests/unit/test_trainer_step.py): the balancing losses reach the gradients through the loop's own loss, the expert
biases move once per optimizer step, and the routing statistics add up over the step's micro-batches."""

from __future__ import annotations

import math

import torch

from tests.unit.test_trainer_step import _events, _preset, fake_peak, process_group  # noqa: F401 (fixtures)
from torch_handle.config.loader import dump_preset, load_preset
from torch_handle.model.moe import routing_stats
from torch_handle.model.router import TopKRouter
from torch_handle.registry import get_registry
from torch_handle.rundir import create_run_dir
from torch_handle.train.trainer import Trainer

STEPS, ACCUM, BATCH, SEQ = 3, 2, 4, 16  # as _preset writes them


def test_an_aux_free_moe_decoder_trains_and_moves_its_biases_once_per_step(tmp_path, process_group):
    _preset(tmp_path, steps=STEPS)  # test_trainer_step's tiny decoder, 2 micro-batches of 4 x 16 tokens a step
    moe = {"n_layers": 2, "norm_first": "true", "mlp": '"swiglu"', "n_experts": 4, "top_k": 2, "moe_every": 2,
           "router": '"sigmoid"', "balance": '"aux_free"', "bias_update_rate": 0.01, "router_z_loss": 0.001}
    preset = load_preset(tmp_path / "p.toml", [f"model.{k}={v}" for k, v in moe.items()])
    run_dir = create_run_dir(tmp_path / "runs", "moe", dump_preset(preset), {"status": "starting"})
    trainer = Trainer(preset, run_dir, process_group, get_registry())
    trainer.build()
    status = trainer.train()
    model = trainer.strategy.unwrapped()
    trainer.close(status)
    assert status == "finished"
    losses = [e["loss"] for e in _events(run_dir) if e["kind"] == "step"]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
    (router,) = [m for m in model.modules() if isinstance(m, TopKRouter)]
    # each of the 3 steps moved every bias by ±0.01 or 0: a multiple of 0.01, at most 0.03 away from 0
    steps_of_bias = router.expert_bias / 0.01
    assert torch.allclose(steps_of_bias, steps_of_bias.round(), atol=1e-4) and steps_of_bias.abs().max() <= STEPS
    assert steps_of_bias.abs().sum() > 0
    stats = routing_stats(model)  # every training micro-batch of the run (evaluation is not counted)
    assert stats["micro_batches"] == STEPS * ACCUM and stats["dropped_tokens"] == 0
    assert sum(stats["tokens_per_expert"][0]) == STEPS * ACCUM * BATCH * SEQ * 2
