"""``handle estimate`` of a QLoRA preset against a real quantised model built in this process: the NF4 bytes each rank
holds (whole under the strategies that do not shard parameters; each rank's dim-0 chunk of every linear's
``weight_nf4`` under those that do; a pipeline stage's own layers) equal the bytes of the tensors ``quantize_nf4``
stores, to the byte. The runs' own telemetry against the estimate: tests/test_qlora_strategies.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_preset
from torch_handle.config.loader import load_preset
from torch_handle.finetune.build import quantize_base
from torch_handle.finetune.lora import apply_lora
from torch_handle.finetune.nf4 import NF4Linear, quantize_nf4
from torch_handle.plan.estimate import estimate_preset
from torch_handle.plan.estimate_layout import with_layout
from torch_handle.plan.estimate_model import model_build
from torch_handle.plan.model_states import COMPARE_VARIANTS, nf4_stored_bytes
from torch_handle.registry import get_registry

# Llama-shaped; d_ff 96: a 96 x 64 weight is 96 blocks of 64 (one group of 256 constants, part full), and its
# rows split over 2 ranks in whole blocks (48 x 64 = 3,072 elements)
QLORA = """[model]
d_model = 64
n_heads = 4
n_layers = 2
d_ff = 96
norm = "rmsnorm"
position = "rope"
mlp = "swiglu"
bias = false
norm_first = true
[finetune]
method = "qlora"
rank = 4
alpha = 8.0
target_modules = ["all"]
"""


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    """(preset, the real model: built as the run builds it, its block linears quantised to NF4)."""
    root = tmp_path_factory.mktemp("qlora")
    text = tiny_preset(root / "runs", steps=1).replace(
        "[model]\nd_model = 64\nn_heads = 4\nn_layers = 2\nd_ff = 128\n", QLORA)
    (root / "qlora.toml").write_text(text)
    registry = get_registry()
    preset = load_preset(root / "qlora.toml", ["training.grad_accum=2"], registry)
    build = model_build(preset, registry)
    torch.manual_seed(0)
    model = build.factory(build.options, build.vocab_size, build.pad_id, build.max_len)
    ft = preset.finetune
    apply_lora(model, ft.rank, ft.alpha, ft.dropout, ft.target_modules, quantize=quantize_base)
    return preset, model, registry


def _real_bytes(modules) -> int:
    return sum(m.weight_nf4.numel() * m.weight_nf4.element_size() for m in modules)


SHARDING = ("fsdp", "scratch-zero2", "scratch-zero3", "zero3", "zero3+offload", "zero3+offload+param")
"""The variants that shard parameters, and with them the NF4 base (a frozen uint8 parameter per linear)."""


def test_the_strategies_that_do_not_shard_parameters_hold_the_whole_nf4_base(qlora):
    preset, model, registry = qlora
    linears = [m for m in model.modules() if isinstance(m, NF4Linear)]
    assert len(linears) == 2 * 5  # per layer: the fused q/k/v, out, gate, up and down projections
    whole = _real_bytes(linears)
    assert whole == sum(nf4_stored_bytes(m.in_features * m.out_features) for m in linears)
    assert whole == sum(quantize_nf4(m.dequantize()).nbytes for m in linears)
    rows = estimate_preset(preset, registry, [1, 2], variants=COMPARE_VARIANTS)
    assert {r.strategy for r in rows} == {v.label for v in COMPARE_VARIANTS}  # none left out
    for row in rows:
        assert row.finetune_runs, row.strategy
        if row.strategy in SHARDING:
            continue
        assert (row.nf4_bytes, row.nf4_layout) == (whole, "whole"), row.strategy
        assert row.as_dict()["nf4_bytes"] == whole and row.frozen_param_bytes > whole


def test_a_sharded_nf4_base_is_each_ranks_bytes_of_every_weight(qlora):
    """Under fsdp, scratch-fsdp and ZeRO-3 each rank holds its dim-0 chunk of every linear's ``weight_nf4``:
    ceil(bytes / W) on rank 0 (FSDP2 and ZeRO-3 pad every rank to it; scratch-fsdp's rank 0 owns it), and at 2
    ranks at most 0.55x the whole base."""
    preset, model, registry = qlora
    linears = [m for m in model.modules() if isinstance(m, NF4Linear)]
    whole = _real_bytes(linears)
    rows = estimate_preset(preset, registry, [2, 4], variants=COMPARE_VARIANTS, rank=0)
    for row in (r for r in rows if r.strategy in SHARDING):
        world = row.world_size
        assert row.nf4_layout == "sharded"
        chunks = [m.weight_nf4.chunk(world)[0].numel() for m in linears]  # torch.chunk: FSDP2's Shard(0)
        assert row.nf4_bytes == sum(chunks) + (whole if row.strategy == "scratch-zero2" else 0), (row.strategy,
                                                                                                  world)
        if world == 2 and row.strategy != "scratch-zero2":  # scratch-fsdp's stage 2 keeps the gathered whole
            assert row.nf4_bytes <= 0.55 * whole


def test_a_pipeline_stage_holds_its_own_layers_nf4(qlora):
    """pp 2: the first stage the embedding and layer 0, the second layer 1 and the head; each stage's NF4 bytes
    are its own layer's quantised linears'."""
    preset, model, registry = qlora
    rows = estimate_preset(with_layout(preset, pp=2, pp_impl="scratch"), registry, [2])
    assert [r.pp_stages for r in rows] == [[0], [1]]
    for row, layer in zip(rows, model.layers):
        assert row.nf4_layout == "stage" and row.finetune_runs is True
        assert row.nf4_bytes == _real_bytes(m for m in layer.modules() if isinstance(m, NF4Linear)) > 0
