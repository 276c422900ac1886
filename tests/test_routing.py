"""Routing telemetry across processes: a real 2-process DDP run of presets/moe.toml with balance = "aux_free", whose
step events' tokens per expert add up to the global tokens × top_k at every step (the dropped ones, with a
capacity: tests/unit/test_moe_training.py), whose expert biases moved by exactly those global counts, and whose
summary ``handle profile --routing`` reads back; and the bias update on 2 gloo processes laid out as 2 pipeline
stages with different MoE layers, each of which moves its own layers' biases as one process would, never mixing in
the other stage's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_on_gloo

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model.d_model": 64, "model.n_heads": 4, "model.n_layers": 2, "model.d_ff": 128, "model.d_ff_expert": 64,
        "model.n_experts": 4, "model.moe_every": 1, "model.router": "sigmoid", "model.balance": "aux_free",
        "model.bias_update_rate": 0.01, "data.seq_len": 32, "data.vocab_size": 512, "training.steps": 4,
        "training.micro_batch_size": 4, "training.grad_accum": 2, "training.precision": "fp32",
        "training.eval_every": 0, "training.eval_steps": 1, "training.checkpoint_every": 0, "training.log_every": 2}


def handle(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "handle_cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, f"handle {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> Path:
    """presets/moe.toml made tiny (2 MoE layers of 4 experts, top-2, sigmoid router, aux-free balancing), 4 steps of
    2 micro-batches on each of the 2 DDP processes."""
    run_dir = tmp_path_factory.mktemp("routing") / "moe"
    sets = [x for k, v in {**TINY, "run.output_dir": str(run_dir.parent)}.items() for x in ("--set", f"{k}={v}")]
    handle("run", "presets/moe.toml", *sets, "--run-dir", str(run_dir))
    return run_dir


def test_tokens_per_expert_add_up_to_the_global_tokens_times_top_k_and_move_the_biases(moe_run: Path):
    import torch
    from safetensors.torch import load_file

    steps = [json.loads(line) for line in (moe_run / "events.jsonl").read_text().splitlines()]
    steps = [e for e in steps if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    expected = torch.zeros(2, 4)
    for event in steps:
        moe = event["moe"]
        assert moe["layers"] == ["layers.0", "layers.1"] and moe["top_k"] == 2 and moe["dropped_tokens"] == [0, 0]
        # every position of both ranks' micro-batches: the global token count (rank 0 alone routed half of it)
        assert event["tokens"] == 2 * 2 * 4 * 32
        assert [sum(counts) for counts in moe["tokens_per_expert"]] == [event["tokens"] * 2] * 2
        assert moe["max_load_ratio"] == pytest.approx([max(c) * 4 / sum(c) for c in moe["tokens_per_expert"]],
                                                      abs=1e-4)
        assert all(a > 0 for a in moe["aux_loss"]) and all(z > 0 for z in moe["z_loss"])
        load = torch.tensor(moe["tokens_per_expert"], dtype=torch.float32)  # the step's bias update, by its counts
        expected += 0.01 * torch.sign(load.mean(dim=1, keepdim=True) - load)
    weights = load_file(str(moe_run / "model.safetensors"))
    biases = torch.stack([weights[f"layers.{i}.ff.gate.expert_bias"] for i in (0, 1)])
    torch.testing.assert_close(biases, expected, rtol=0, atol=1e-6)  # rank 1's counts in too, and only once

    summary = json.loads(handle("profile", str(moe_run), "--routing", "--json").stdout)
    assert summary["steps"] == [1, 4] and summary["top_k"] == 2 and len(summary["layers"]) == 2
    layer = summary["layers"][0]
    total = [sum(e["moe"]["tokens_per_expert"][0][x] for e in steps) for x in range(4)]
    assert layer["share_max"] == pytest.approx(max(total) / sum(total)) and layer["drop_rate"] == 0
    assert layer["aux_loss"][0] == pytest.approx(sum(e["moe"]["aux_loss"][0] for e in steps) / 4)
    text = handle("profile", str(moe_run), "--routing").stdout
    assert "2 MoE layers × 4 experts, top-2, steps 1–4" in text and f"{layer['share_max']:.1%} e" in text


STAGE_LAYERS = {0: [0], 1: [1, 2]}
"""The MoE layers of each pipeline stage: 1 on stage 0, 2 on stage 1 (an all-reduce of the loads over the default
group, both stages, would not even have one shape)."""
STEPS = 3


def _inputs(step: int):
    import torch

    return torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(step))


def _stage(pp_rank: int):
    import torch

    from torch_handle.model.args import TransformerArgs
    from torch_handle.model.moe import MoEFeedForward

    args = TransformerArgs(vocab_size=1, d_model=16, n_heads=2, d_ff=32, d_ff_expert=8, n_experts=4, top_k=2,
                           mlp="swiglu", dropout=0.0, bias=False, router="sigmoid", balance="aux_free",
                           bias_update_rate=0.01)
    layers = []
    for layer in STAGE_LAYERS[pp_rank]:  # the same weights on both replicas of the stage
        torch.manual_seed(layer)
        moe = MoEFeedForward(args)
        torch.nn.init.normal_(moe.gate.weight, std=0.5)  # routing far from uniform: no near ties
        layers.append(moe)
    return torch.nn.Sequential(*layers).train()


def _biases_by_stage(rank: int, tmp: Path) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from handle_plugins.strategies import DDPConfig
    from handle_plugins.strategies.ddp import DDPStrategy
    from torch_handle.config.schema import TrainingConfig
    from torch_handle.train.routing import update_expert_bias
    from torch_handle.train.strategy import DistContext

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))  # rank r runs stage r
    ctx = DistContext(rank, rank, 2, torch.device("cpu"), "gloo", mesh=mesh)
    training = TrainingConfig(lr=0.0, warmup_steps=0, precision="fp32")  # weights stay: only the biases move
    strategy = DDPStrategy(DDPConfig(), training, ctx, _stage(rank))
    reference = _stage(rank)  # the same stage in one process
    for step in range(STEPS):
        strategy.backward(strategy.model(_inputs(step)).square().mean())
        strategy.step()  # the bias update runs before the optimizer step
        reference(_inputs(step))
        for moe in reference:
            update_expert_bias(moe.gate)  # this process's own load
    ours = [moe.gate.expert_bias for moe in strategy.unwrapped()]
    for got, want in zip(ours, [moe.gate.expert_bias for moe in reference]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
    assert sum(b.abs().sum() for b in ours) > 0


def test_each_pipeline_stage_moves_its_own_layers_expert_biases(tmp_path: Path):
    run_on_gloo(_biases_by_stage, tmp_path)
