"""``handle estimate`` with tensor parallelism: one TP rank's model states are its shard of the model as the
model's own plan splits it, counted by hand here from the plan (split tensors 1/tp, replicated ones whole), then
the data-parallel strategy's formula over dp = world_size / tp."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from handle_cli.estimate_cmd import layout_overrides
from tests.helpers import tiny_preset
from torch_handle.config.loader import load_preset
from torch_handle.model.args import TransformerArgs
from torch_handle.model.parallelize import tensor_parallel_plan
from torch_handle.model.transformer import DecoderLM
from torch_handle.parallel.tensor.plan import Stacked, Style
from torch_handle.plan import estimate as E
from torch_handle.plan.estimate_model import ModelBuild, ModelShape, build_model, model_build
from torch_handle.registry import get_registry

SPLIT_ROWS = (Style.COLWISE, Style.VOCAB_EMBED, Style.VOCAB_HEAD)


def _args(**overrides) -> TransformerArgs:
    return TransformerArgs(**{"vocab_size": 512, "pad_id": 0, "max_len": 32, "d_model": 64, "n_heads": 4,
                              "n_layers": 2, "d_ff": 128, "norm_first": True, **overrides})


def _by_hand(model: torch.nn.Module, tp: int) -> tuple[ModelShape, int]:
    """One TP rank's parameter list from the plan of the one-process ``model`` (on meta), and the elements that
    stay whole (replicated) on every rank."""
    plan = tensor_parallel_plan(model)
    numels, dim0, replicated = [], [], 0
    for name, p in model.named_parameters():  # tied weights once
        module, _, kind = name.rpartition(".")
        style = plan.get(module)
        if style in SPLIT_ROWS or isinstance(style, Stacked):  # weight and bias split over output rows
            numels.append(p.numel() // tp)
            dim0.append(p.shape[0] // tp)
        elif style is Style.ROWWISE and kind == "weight":  # split over input columns
            numels.append(p.numel() // tp)
            dim0.append(p.shape[0])
        else:  # LayerNorms, row-parallel biases
            numels.append(p.numel())
            dim0.append(p.shape[0])
            replicated += p.numel()
    return ModelShape(tuple(numels), tuple(dim0)), replicated


def _preset(tmp_path: Path, *sets: str):
    path = tmp_path / "tiny.toml"
    path.write_text(tiny_preset(tmp_path / "runs", strategy="single"))
    return load_preset(path, layout_overrides(list(sets)), get_registry())


@pytest.mark.parametrize("fused_qkv,norm_first,tie", [(False, True, True), (True, False, False)])
def test_the_split_model_is_the_plan_counted_by_hand(fused_qkv, norm_first, tie):
    args = _args(fused_qkv=fused_qkv, norm_first=norm_first, tie_embeddings=tie)
    with torch.device("meta"):
        one_process = DecoderLM(args)
        shard = ModelShape.of(build_model(ModelBuild(lambda *_: DecoderLM(args), None, 512, 0, 32, "lm", tp=2)))
    whole = ModelShape.of(one_process)
    hand, replicated = _by_hand(one_process, 2)
    assert shard == hand
    # LayerNorms (2 per layer, + the final one pre-LN) and the two row-parallel biases per layer stay whole
    assert replicated == args.n_layers * (2 * 2 + 2) * args.d_model + (2 * args.d_model if norm_first else 0)
    assert shard.n_params == (whole.n_params - replicated) // 2 + replicated


def test_a_qwen3_shaped_split_is_the_plan_counted_by_hand():
    """Grouped-query attention's fused QKV (4 query heads of width 8, 2 key/value heads) is split part by part, the
    SwiGLU's gate and up by rows and down by columns; the RMSNorms and the per-head q/k norms stay whole."""
    args = _args(norm="rmsnorm", position="rope", mlp="swiglu", n_kv_heads=2, head_dim=8, qk_norm=True, bias=False,
                 tie_embeddings=False)
    with torch.device("meta"):
        one_process = DecoderLM(args)
        shard = ModelShape.of(build_model(ModelBuild(lambda *_: DecoderLM(args), None, 512, 0, 32, "lm", tp=2)))
    hand, replicated = _by_hand(one_process, 2)
    assert shard == hand
    assert replicated == args.n_layers * (2 * args.d_model + 2 * 8) + args.d_model
    assert (4 + 2 * 2) * 8 * args.d_model // 2 in shard.numels  # this rank's [Q_r; K_r; V_r]


def test_model_states_with_tp_2_are_the_shard_and_halve(tmp_path):
    registry = get_registry()
    (one,) = E.estimate_preset(_preset(tmp_path, "launch.nproc_per_node=1"), registry, [1])
    (two,) = E.estimate_preset(_preset(tmp_path, "parallel.tp=2"), registry, [1, 2, 4])  # single: dp = 1 only
    build = model_build(_preset(tmp_path, "launch.nproc_per_node=1"), registry)
    with torch.device("meta"):
        hand, replicated = _by_hand(build.factory(build.options, build.vocab_size, build.pad_id, build.max_len), 2)
    assert (two.world_size, two.dp, two.tp, two.rank) == (2, 1, 2, 0)
    assert two.params == one.params and two.tp_shard_params == hand.n_params
    assert two.param_bytes == two.grad_bytes == 4 * hand.n_params
    assert two.optimizer_bytes == 8 * hand.n_params + 4 * hand.n_tensors  # AdamW moments + one step per tensor
    # half of everything but the replicated LayerNorms and row-parallel biases
    assert two.param_bytes == (one.param_bytes + 4 * replicated) // 2
    assert two.as_dict()["dp"] == 1 and two.as_dict()["tp"] == 2


def test_the_data_parallel_strategy_shards_the_tp_shard_over_dp():
    with torch.device("meta"):
        hand, _ = _by_hand(DecoderLM(_args()), 2)
    fsdp = E.model_state_bytes(hand, E.Variant("fsdp", "fsdp"), "fp32", world=2, rank=0)  # dp = 2 x tp = 2
    padded = sum(math.ceil(d0 / 2) * (n // d0) for n, d0 in zip(hand.numels, hand.dim0))
    assert fsdp.param == fsdp.grad == 4 * padded
    ddp = E.model_state_bytes(hand, E.Variant("ddp", "ddp"), "fp32", world=2, rank=0)
    assert ddp.param == 4 * hand.n_params  # DDP keeps the TP shard whole on each replica


def test_strategies_without_tensor_parallelism_are_refused(tmp_path):
    preset = _preset(tmp_path, "parallel.tp=2")
    zero1 = next(v for v in E.COMPARE_VARIANTS if v.label == "zero1")
    with pytest.raises(ValueError, match="^strategy 'deepspeed' does not run with parallel.tp = 2$"):
        E.estimate_preset(preset, get_registry(), [2], [zero1])
    assert E.supports_tensor_parallel(get_registry(), "single")
    assert not E.supports_tensor_parallel(get_registry(), "deepspeed")


def test_layout_overrides_size_the_preset_to_one_tp_replica():
    assert layout_overrides(["parallel.tp=2", "training.steps=3"]) == [
        "launch.nproc_per_node=2", "parallel.tp=2", "training.steps=3"]
    assert layout_overrides(["parallel.tp=2", "launch.nproc_per_node=4"]) == ["parallel.tp=2",
                                                                             "launch.nproc_per_node=4"]
    assert layout_overrides(["parallel.tp=1"]) == ["parallel.tp=1"]
    assert layout_overrides(["oops"]) == ["oops"]  # the loader reports it
