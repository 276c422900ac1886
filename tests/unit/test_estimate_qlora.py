"""``handle estimate`` of a QLoRA preset against a real quantised model built in this process: the NF4 bytes each rank
holds (whole under every data-parallel strategy, as the run's buffers are; a pipeline stage's own layers; and, priced
as a sharded NF4 parameter would be, each rank's dim-0 rows of every weight quantised on their own) equal the bytes
of the tensors ``quantize_nf4`` stores, to the byte."""

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
    return sum(t.numel() * t.element_size() for m in modules for t in m.buffers(recurse=False))


def test_every_strategy_prices_the_whole_nf4_base_the_run_holds(qlora):
    preset, model, registry = qlora
    linears = [m for m in model.modules() if isinstance(m, NF4Linear)]
    assert len(linears) == 2 * 5  # per layer: the fused q/k/v, out, gate, up and down projections
    whole = _real_bytes(linears)
    assert whole == sum(nf4_stored_bytes(m.in_features * m.out_features) for m in linears)
    rows = estimate_preset(preset, registry, [1, 2], variants=COMPARE_VARIANTS)
    assert {r.strategy for r in rows} == {v.label for v in COMPARE_VARIANTS}  # none left out
    for row in rows:
        assert (row.nf4_bytes, row.nf4_layout) == (whole, "whole"), row.strategy
        assert row.finetune_runs == (row.strategy in ("single", "ddp")), row.strategy
        assert row.as_dict()["nf4_bytes"] == whole and row.frozen_param_bytes > whole


def test_a_sharded_nf4_base_is_each_ranks_rows_quantised(qlora):
    """Priced with ``nf4_sharded``: under fsdp, scratch-fsdp and ZeRO-3 each rank's NF4 bytes are those of its
    ceil(out / W) rows of every weight quantised as a tensor of their own (whole blocks: the codes, absmax codes
    and scales of those rows, the mean once a rank); the other strategies keep the whole base."""
    preset, model, registry = qlora
    linears = [m for m in model.modules() if isinstance(m, NF4Linear)]
    whole = _real_bytes(linears)
    rows = estimate_preset(preset, registry, [2, 4], variants=COMPARE_VARIANTS, nf4_sharded=True)
    for row in rows:
        if row.strategy not in ("fsdp", "scratch-zero2", "scratch-zero3", "zero3", "zero3+offload",
                                "zero3+offload+param"):
            assert (row.nf4_bytes, row.nf4_layout) == (whole, "whole"), row.strategy
            continue
        world = row.world_size
        chunks = [m.dequantize().reshape(m.out_features, -1)[: -(-m.out_features // world)] for m in linears]
        assert row.nf4_layout == "sharded"
        assert row.nf4_bytes == sum(quantize_nf4(c).nbytes for c in chunks), (row.strategy, world)
        if world == 2:
            assert row.nf4_bytes <= 0.55 * whole


def test_a_pipeline_stage_holds_its_own_layers_nf4(qlora):
    """pp 2 (refused by the run so far, priced as a stage would hold it): the first stage the embedding and layer 0,
    the second layer 1 and the head; each stage's NF4 bytes are its own layer's quantised linears'."""
    preset, model, registry = qlora
    rows = estimate_preset(with_layout(preset, pp=2, pp_impl="scratch"), registry, [2])
    assert [r.pp_stages for r in rows] == [[0], [1]]
    for row, layer in zip(rows, model.layers):
        assert row.nf4_layout == "stage" and row.finetune_runs is False
        assert row.nf4_bytes == _real_bytes(m for m in layer.modules() if isinstance(m, NF4Linear)) > 0
