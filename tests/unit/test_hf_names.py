"""The decoder against ``transformers``: weights copied through ``torch_handle.model.hf_names`` into
``LlamaForCausalLM`` and ``Qwen3ForCausalLM`` (tiny configs, fp32, no dropout, nothing downloaded) give the same
logits and the same gradient for every parameter, within 1e-5; a Hugging Face model's weights loaded the other way
give its logits; the config and name maps round-trip; and every mismatch is one line naming the first one."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

# `make install-dev` installs the hf extra and CI must run these; a core-only install skips them
if not os.environ.get("CI"):
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[dev,hf]'")
import transformers

from torch_handle.errors import CheckpointError
from torch_handle.model.args import TransformerArgs
from torch_handle.model.hf_names import (from_hf_config, from_hf_state_dict, hf_names, to_hf_config,
                                         to_hf_state_dict)
from torch_handle.model.transformer import DecoderLM

ATOL = 1e-5
V, T = 97, 11
BASE = dict(d_model=32, n_heads=4, n_layers=2, d_ff=48, dropout=0.0, max_len=64, norm="rmsnorm", position="rope",
            mlp="swiglu", norm_first=True, scale_embeddings=False, bias=False, rope_theta=500.0, norm_eps=1e-6,
            pad_id=0)
CASES = {
    "llama-gqa-tied-fused": dict(n_kv_heads=2),
    "llama-mqa-untied-separate-bias": dict(n_kv_heads=1, tie_embeddings=False, fused_qkv=False, bias=True),
    "llama-mha-untied-reference": dict(tie_embeddings=False, attention="reference"),
    "qwen3-gqa-head_dim-untied": dict(n_kv_heads=2, head_dim=12, qk_norm=True, tie_embeddings=False),
    "qwen3-mqa-tied-separate": dict(n_kv_heads=1, qk_norm=True, fused_qkv=False),
}


def args_of(case: str) -> TransformerArgs:
    return TransformerArgs(V, **{**BASE, **CASES[case]})


def hf_model(args: TransformerArgs) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(**to_hf_config(args))
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def ours_random(args: TransformerArgs) -> DecoderLM:
    """A decoder with every parameter random (norm gains too: a gain left at 1 hides a misplaced one)."""
    torch.manual_seed(0)
    model = DecoderLM(args).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def load_into_hf(ours: DecoderLM, theirs: torch.nn.Module) -> None:
    result = theirs.load_state_dict(to_hf_state_dict(ours.state_dict(), ours.args), strict=False)
    tied = {"lm_head.weight"} if ours.args.tie_embeddings else set()
    assert set(result.missing_keys) == tied and not result.unexpected_keys, result


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_every_gradient_match_transformers(case):
    args = args_of(case)
    ours, theirs = ours_random(args), hf_model(args)
    assert type(theirs).__name__ == ("Qwen3ForCausalLM" if args.qk_norm else "LlamaForCausalLM")
    load_into_hf(ours, theirs)
    ids, targets = torch.randint(1, V, (3, T)), torch.randint(1, V, (3 * T,))
    logits = ours(ids)
    hf_logits = theirs(input_ids=ids).logits
    torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=0)
    F.cross_entropy(logits.flatten(0, 1), targets).backward()  # the training loss
    F.cross_entropy(hf_logits.flatten(0, 1), targets).backward()
    grads = to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()}, args)
    hf_grads = dict(theirs.named_parameters())
    assert set(grads) == set(hf_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, hf_grads[name].grad, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("case", ["llama-gqa-tied-fused", "qwen3-gqa-head_dim-untied"])
def test_a_hugging_face_model_loads_into_ours(case):
    """The way ``init_from`` will go: Hugging Face's own random init, its config read back into TransformerArgs."""
    torch.manual_seed(1)
    theirs = hf_model(args_of(case))
    kwargs = from_hf_config(theirs.config.to_dict())
    args = TransformerArgs(**kwargs)
    assert dataclasses.replace(args, fused_qkv=True) == dataclasses.replace(args_of(case), fused_qkv=True,
                                                                           attention="sdpa")
    ours = DecoderLM(args).eval()
    ours.load_state_dict(from_hf_state_dict(theirs.state_dict(), args))  # strict
    ids = torch.randint(1, V, (2, T))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(input_ids=ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_state_dicts_and_configs_round_trip(case):
    args = args_of(case)
    ours = ours_random(args)
    state = ours.state_dict()
    back = from_hf_state_dict(to_hf_state_dict(state, args), args)
    assert list(back) == list(state) or set(back) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    assert TransformerArgs(**from_hf_config(to_hf_config(args))) == dataclasses.replace(
        args, fused_qkv=True, attention="sdpa")
    n_hf = len(hf_names(args))
    assert n_hf == len(to_hf_state_dict(state, args))


def test_each_mismatch_is_one_line_naming_it():
    args = args_of("llama-gqa-tied-fused")
    for change, message in [
        ({"position": "sinusoidal"}, "position = 'sinusoidal': LlamaForCausalLM needs position = 'rope'"),
        ({"norm": "layernorm"}, "norm = 'layernorm': LlamaForCausalLM needs norm = 'rmsnorm'"),
        ({"scale_embeddings": True}, "scale_embeddings = True: LlamaForCausalLM needs scale_embeddings = False"),
        ({"qk_norm": True, "bias": True}, "bias = True: Qwen3ForCausalLM needs bias = False"),
    ]:
        with pytest.raises(CheckpointError) as e:
            to_hf_config(dataclasses.replace(args, **change))
        assert str(e.value) == message
    state = to_hf_state_dict(ours_random(args).state_dict(), args)
    fewer_kv_heads = dataclasses.replace(args, n_kv_heads=1)
    with pytest.raises(CheckpointError, match=r"^Hugging Face state dict: model.layers.0.self_attn.k_proj.weight "
                                              r"has shape \(16, 32\), expected \(8, 32\)$"):
        from_hf_state_dict(state, fewer_kv_heads)
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"^Hugging Face state dict: missing model.layers.1.mlp.up_proj.weight$"):
        from_hf_state_dict(state, args)
    with pytest.raises(CheckpointError, match=r"^DecoderLM state dict: unexpected layers.0.extra$"):
        to_hf_state_dict({**ours_random(args).state_dict(), "layers.0.extra": torch.zeros(1)}, args)
    with pytest.raises(CheckpointError, match="model_type 'gpt2'"):
        from_hf_config({"model_type": "gpt2"})
