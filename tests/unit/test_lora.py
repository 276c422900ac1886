"""LoRA (``torch_handle/finetune/``) in one process: the layer against its formula and against peft's own LoRA layer,
the frozen base kept out of the optimizer and of saved state, the base hash checked on load, merging, the FLOP
count, and the adapters handed on in peft's format: ``PeftModel.from_pretrained`` on the ``transformers`` model
gives our logits within 1e-5, for fused and separate Q/K/V, and the merged weights give them too."""

from __future__ import annotations

import json
import os

import pytest
import torch

from torch_handle.errors import CheckpointError
from torch_handle.finetune.lora import (BASE_HASH_BUFFER, LoRALinear, adapter_modules, apply_lora, merge_lora,
                                        resolve_targets)
from torch_handle.finetune.peft_format import adapter_config, peft_state_dict, write_adapter
from torch_handle.model.args import TransformerArgs
from torch_handle.model.attention import StackedLinear
from torch_handle.model.transformer import DecoderLM

ATOL = 1e-5
V, T = 97, 11
LLAMA = dict(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=48, dropout=0.0, max_len=64, norm="rmsnorm",
             position="rope", mlp="swiglu", norm_first=True, scale_embeddings=False, bias=False, pad_id=0)


def decoder(**kw) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(TransformerArgs(V, **{**LLAMA, **kw})).eval()


def randomize_adapters(model: torch.nn.Module) -> None:
    """B starts at zero (the adapted model is the base): give every B a value so a misplaced update shows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for module in adapter_modules(model).values():
            for b in module.lora_B.values():
                b.weight.normal_(0, 0.5)


def test_the_layer_is_base_plus_scaled_low_rank_update():
    torch.manual_seed(0)
    base = torch.nn.Linear(16, 24)
    layer = LoRALinear(base, rank=4, alpha=8.0)
    x = torch.randn(3, 5, 16)
    assert torch.equal(layer(x), base(x))  # B = 0: the adapted layer starts as the base
    torch.nn.init.normal_(layer.lora_B["default"].weight)
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    torch.testing.assert_close(layer(x), base(x) + (8.0 / 4) * x @ A.T @ B.T)
    assert not base.weight.requires_grad and not base.bias.requires_grad
    assert A.requires_grad and B.requires_grad
    torch.testing.assert_close(torch.nn.functional.linear(x, layer.merged_weight(), base.bias), layer(x))


def test_init_and_forward_match_peft_lora_linear():
    peft = pytest.importorskip("peft")
    base, ours_base = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 24, bias=False)
    torch.manual_seed(3)
    ours = LoRALinear(ours_base, rank=4, alpha=8.0)
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0)
    theirs = peft.tuners.lora.Linear(base, "default", config, r=4, lora_alpha=8)
    assert torch.equal(ours.lora_A["default"].weight, theirs.lora_A["default"].weight)  # same draw, same init
    assert torch.equal(theirs.lora_B["default"].weight, torch.zeros(24, 4))
    with torch.no_grad():
        theirs.base_layer.weight.copy_(ours.base.weight)
        theirs.lora_B["default"].weight.normal_()
        ours.lora_B["default"].weight.copy_(theirs.lora_B["default"].weight)
    x = torch.randn(2, 16)
    torch.testing.assert_close(ours(x), theirs(x), atol=ATOL, rtol=0)


def test_targets_resolve_groups_and_peft_names():
    assert resolve_targets(["attention"]) == {"q_proj", "k_proj", "v_proj", "out_proj"}
    assert resolve_targets(["o_proj", "down_proj"]) == {"out_proj", "down_proj"}
    with pytest.raises(ValueError, match="'wq' is not a linear"):
        resolve_targets(["wq"])


def test_fused_qkv_gets_one_adapter_per_targeted_part():
    model = decoder(fused_qkv=True)
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, LoRALinear) and isinstance(qkv.base, StackedLinear)
    assert sorted(qkv.parts) == ["q_proj", "v_proj"]
    randomize_adapters(model)
    x = torch.randn(2, 5, 32)
    delta = qkv(x) - qkv.base(x)
    q, k, v = delta.split(qkv.part_features, dim=-1)
    assert torch.equal(k, torch.zeros_like(k)) and q.abs().sum() > 0 and v.abs().sum() > 0
    torch.testing.assert_close(qkv(x, parts=slice(1, 3)), qkv(x)[..., qkv.part_features[0]:])  # cross-attention


def test_only_adapters_train_and_only_they_are_saved():
    model = decoder()
    info = apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["all"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert info["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    state = model.state_dict()
    assert set(state) == trainable | {BASE_HASH_BUFFER}  # no frozen base in any checkpoint
    base = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(1, V, (2, T))
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not p.requires_grad)
    again = decoder()
    apply_lora(again, rank=4, alpha=8.0, dropout=0.0, target_modules=["all"])
    again.load_state_dict(model.state_dict())  # strict: the frozen base may be absent
    torch.testing.assert_close(again(ids), model(ids))


def test_a_changed_base_is_refused_in_one_line():
    model = decoder()
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj"])
    other = decoder()
    with torch.no_grad():
        other.final_norm.weight.add_(1e-3)
    apply_lora(other, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj"])
    with pytest.raises(CheckpointError, match="the frozen base changed") as e:
        other.load_state_dict(model.state_dict())
    assert "\n" not in str(e.value)


def test_flops_count_no_weight_gradient_for_the_frozen_base():
    model = decoder(tie_embeddings=False)
    full = model.flops_per_token(T)
    info = apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj"])
    embed = model.embed.weight.numel()
    frozen_matmul = info["frozen"] - embed  # the untied input table is indexed, not multiplied
    assert model.flops_per_token(T) == full + 6 * info["trainable"] - 2 * frozen_matmul


@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
def test_peft_loads_the_adapters_with_our_logits(tmp_path, fused):
    if not os.environ.get("CI"):
        pytest.importorskip("peft", reason="needs the hf extra: pip install -e '.[dev,hf]'")
    import peft
    import transformers

    from torch_handle.model.hf_names import to_hf_config, to_hf_state_dict

    model = decoder(fused_qkv=fused, tie_embeddings=False)
    args = model.args
    base_state = to_hf_state_dict(model.state_dict(), args)
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    randomize_adapters(model)
    files = write_adapter(tmp_path / "adapter", peft_state_dict(model, args),
                          adapter_config(model, args, dropout=0.0, base=None))
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "o_proj", "q_proj", "v_proj"]
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**to_hf_config(args)),
                                                       dtype=torch.float32)
    hf.load_state_dict(base_state, strict=False)
    adapted = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    ids = torch.randint(1, V, (2, T))
    with torch.no_grad():
        ours = model(ids)
        torch.testing.assert_close(adapted(ids).logits, ours, atol=ATOL, rtol=0)
        merged = to_hf_state_dict(merge_lora(model).state_dict(), args)
        plain = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32).eval()
        plain.load_state_dict(merged, strict=False)
        torch.testing.assert_close(plain(ids).logits, ours, atol=ATOL, rtol=0)
