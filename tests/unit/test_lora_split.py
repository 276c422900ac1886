"""LoRA's tensor-parallel split in one process: the model's TP plan names each adapted linear's base and adapters
(``LoRALinear.tensor_parallel_plan``), and the slices that plan cuts for 2 ranks, each run as its rank would
run it, give the one-process output once the ranks' outputs are joined as the collectives join them (a
column-parallel layer's slices put back in place per part, a row-parallel layer's partial sums added). Covers
what the 2-process runs of ``tests/test_lora_strategies.py`` do not: a fused Q/K/V with an unadapted part (K)
under grouped-query attention. The collectives themselves run in those runs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torch_handle.finetune.lora import adapter_modules, apply_lora
from torch_handle.model.parallelize import replicated_numel, tensor_parallel_plan
from torch_handle.parallel.tensor.plan import Stacked, Style, shard, split_rule
from tests.unit.test_lora import decoder, randomize_adapters

TP = 2


class _Rank:
    """Rank ``rank`` of a TP group of ``size``, for the plan's slicing rule alone (no communication)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.chunk(self.size, dim)[self.rank].contiguous()


def _model() -> nn.Module:
    model = decoder()  # fused Q/K/V, n_heads 4, n_kv_heads 2: parts (32, 16, 16)
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj", "mlp"])
    randomize_adapters(model)
    return model


def _local(model: nn.Module, name: str, plan: dict, rank: int) -> nn.Module:
    """A copy of the adapted linear ``name`` holding rank ``rank``'s slices of every parameter, as the plan cuts."""
    module = copy.deepcopy(model.get_submodule(name))
    for pname, p in list(module.named_parameters()):
        owner, _, leaf = pname.rpartition(".")
        local = shard(f"{name}.{pname}", p.detach(), plan, _Rank(rank, TP))
        setattr(module.get_submodule(owner), leaf, nn.Parameter(local, requires_grad=p.requires_grad))
    return module


def test_the_plan_splits_each_adapter_with_its_base():
    model = _model()
    plan = tensor_parallel_plan(model)
    qkv = "layers.0.self_attn.qkv_proj"
    assert isinstance(plan[f"{qkv}.base"], Stacked) and qkv not in plan
    assert plan[f"{qkv}.lora_B.q_proj"] is Style.COLWISE and plan[f"{qkv}.lora_A.q_proj"] is Style.NORM
    assert not any(".k_proj" in name for name in plan)  # K is not adapted
    assert split_rule("layers.0.ff.down_proj.lora_A.default.weight", plan) == (1, 1)
    assert split_rule("layers.0.ff.down_proj.lora_B.default.weight", plan) is None
    assert split_rule("layers.1.ff.up_proj.lora_B.default.weight", plan) == (0, 1)
    for name in plan:
        model.get_submodule(name)  # every planned name is a module of the adapted model
    assert replicated_numel(model) > 0


@pytest.mark.parametrize("name", ["layers.0.self_attn.qkv_proj", "layers.1.ff.gate_proj", "layers.0.ff.up_proj"])
def test_column_parallel_slices_join_to_the_one_process_output(name):
    model = _model()
    plan = tensor_parallel_plan(model)
    x = torch.randn(2, 5, 32)
    full = model.get_submodule(name)
    want = full(x)
    parts = full.part_features
    pieces = [_local(model, name, plan, r)(x).split([p // TP for p in parts], dim=-1) for r in range(TP)]
    got = torch.cat([torch.cat([pieces[r][i] for r in range(TP)], dim=-1) for i in range(len(parts))], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["layers.0.self_attn.out_proj", "layers.1.ff.down_proj"])
def test_row_parallel_partial_sums_add_to_the_one_process_output(name):
    model = _model()
    plan = tensor_parallel_plan(model)
    full = model.get_submodule(name)
    x = torch.randn(2, 5, full.in_features)
    got = sum(_local(model, name, plan, r)(x.chunk(TP, dim=-1)[r]) for r in range(TP))
    torch.testing.assert_close(got, full(x), rtol=1e-5, atol=1e-5)
    assert len(adapter_modules(model)) == 2 * 5


@pytest.mark.parametrize("sets,refused", [
    (["parallel.tp=2"], None), (["parallel.pp=2"], None), (["strategy.name=scratch-fsdp"], None),
    (["finetune.method=qlora", "parallel.tp=2"], "parallel.tp: QLoRA's NF4 base is not split by parallel.tp"),
    (["finetune.method=qlora", "parallel.pp=2"], None), (["finetune.method=qlora", "strategy.name=fsdp"], None),
    (["finetune.method=qlora", "strategy.name=deepspeed", "strategy.zero_stage=3"], None)])
def test_lora_runs_under_every_layout_qlora_not_tp_split(tmp_path, sets, refused):
    from tests.helpers import tiny_preset
    from torch_handle.config.loader import load_preset
    from torch_handle.errors import PresetError
    from torch_handle.registry import get_registry

    path = tmp_path / "lora.toml"
    path.write_text(tiny_preset(tmp_path / "runs") + '[finetune]\nmethod = "lora"\ntarget_modules = ["all"]\n')
    overrides = ["training.grad_accum=2", *sets]
    if refused is None:
        assert load_preset(path, overrides, get_registry()).finetune.method in ("lora", "qlora")
        return
    with pytest.raises(PresetError) as err:
        load_preset(path, overrides, get_registry())
    assert refused in str(err.value) and len(str(err.value).splitlines()) == 1


def test_a_split_resume_checks_the_base_hash():
    """A TP or pipeline resume loads the one-process state slice by slice (``load_full_state``), not through
    ``load_state_dict``; the LoRA model's hash check runs there too."""
    from torch_handle.errors import CheckpointError
    from torch_handle.finetune.lora import BASE_HASH_BUFFER
    from torch_handle.parallel.tensor.checkpoint import load_full_state

    model = _model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    load_full_state(model, None, state, None, "scratch", {}, None)  # the same base: loads
    state[BASE_HASH_BUFFER][0] ^= 1
    with pytest.raises(CheckpointError, match="the frozen base changed"):
        load_full_state(model, None, state, None, "scratch", {}, None)
