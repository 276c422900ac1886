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
from torch_handle.model.hf_names import (from_hf_config, from_hf_state_dict, fuse_experts, hf_names,
                                         to_hf_config, to_hf_state_dict)
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
        ({"position": "sinusoidal"}, "LlamaForCausalLM needs position = 'rope' (not 'sinusoidal')"),
        ({"norm": "layernorm"}, "LlamaForCausalLM needs norm = 'rmsnorm' (not 'layernorm')"),
        ({"scale_embeddings": True}, "LlamaForCausalLM needs scale_embeddings = False (not True)"),
        ({"qk_norm": True, "bias": True}, "Qwen3ForCausalLM needs bias = False (not True)"),
        # every option at once, against the family fewest changes away
        ({"position": "sinusoidal", "norm": "layernorm", "mlp": "gelu"},
         "LlamaForCausalLM needs position = 'rope' (not 'sinusoidal'); norm = 'rmsnorm' (not 'layernorm'); "
         "mlp = 'swiglu' (not 'gelu')"),
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


# -- mixture of experts: Qwen 3 MoE and Mixtral ----------------------------------------------------------------------
MOE = dict(n_layers=3, n_experts=4, top_k=2, d_ff_expert=24)
MOE_CASES = {
    "qwen3_moe-every-2nd-gqa-raw-topk": dict(qk_norm=True, moe_every=2, n_kv_heads=2, norm_topk_prob=False),
    "mixtral-untied-separate": dict(tie_embeddings=False, fused_qkv=False),
}


def moe_args(case: str) -> TransformerArgs:
    return TransformerArgs(V, **{**BASE, **MOE, **MOE_CASES[case]})


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_logits_and_every_gradient_match_transformers(case):
    """Router, every expert and the dense layers between: the same logits and gradients as transformers' own
    sparse blocks (its fused gate_up_proj in memory, filled through ``fuse_experts``)."""
    args = moe_args(case)
    ours, theirs = ours_random(args), hf_model(args)
    assert type(theirs).__name__ == ("Qwen3MoeForCausalLM" if args.qk_norm else "MixtralForCausalLM")
    fused = fuse_experts(to_hf_state_dict(ours.state_dict(), args), args)
    result = theirs.load_state_dict(fused, strict=False)
    assert set(result.missing_keys) == ({"lm_head.weight"} if args.tie_embeddings else set())
    assert not result.unexpected_keys
    ids, targets = torch.randint(1, V, (3, T)), torch.randint(1, V, (3 * T,))
    logits, hf_logits = ours(ids), theirs(input_ids=ids).logits
    torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=0)
    F.cross_entropy(logits.flatten(0, 1), targets).backward()
    F.cross_entropy(hf_logits.flatten(0, 1), targets).backward()
    grads = fuse_experts(to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()}, args), args)
    hf_grads = dict(theirs.named_parameters())
    assert set(grads) == set(hf_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, hf_grads[name].grad, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_on_disk_names_load_with_from_pretrained(case, tmp_path):
    """The on-disk names (per expert; Mixtral's block_sparse_moe and w1/w3/w2) are the ones transformers converts
    when it loads a directory: its model of the written directory computes ours."""
    from torch_handle.checkpoint import hf_dir

    args = moe_args(case)
    ours = ours_random(args)
    hf_dir.write(tmp_path / "m", to_hf_config(args), to_hf_state_dict(ours.state_dict(), args), None, {},
                 dtype="float32", metadata={})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    ids = torch.randint(1, V, (2, T))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(input_ids=ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_a_hugging_face_moe_loads_into_ours_and_round_trips(case):
    """transformers' own MoE (its random init, fused experts) read back through its config: our decoder computes
    its logits; our state dict survives the trip through the on-disk names and through the fused form."""
    torch.manual_seed(1)
    args = moe_args(case)
    theirs = hf_model(args)
    back = TransformerArgs(**from_hf_config(theirs.config.to_dict()))
    ours = DecoderLM(back).eval()
    ours.load_state_dict(from_hf_state_dict(theirs.state_dict(), back))  # strict
    ids = torch.randint(1, V, (2, T))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(input_ids=ids).logits, atol=ATOL, rtol=0)
    if args.qk_norm:  # Mixtral's intermediate_size is the expert's: d_ff comes back as d_ff_expert
        assert back == dataclasses.replace(args, fused_qkv=True, attention="sdpa")
    state = ours_random(args).state_dict()
    disk = to_hf_state_dict(state, args)
    n_sparse = sum(map(args.is_moe_layer, range(args.n_layers)))
    assert len(disk) == len(hf_names(args)) and sum(".experts." in k for k in disk) == 3 * args.n_experts * n_sparse
    for hf_state in (disk, fuse_experts(disk, args)):
        back_state = from_hf_state_dict(hf_state, args)
        assert set(back_state) == set(state)
        for name, tensor in state.items():
            assert torch.equal(back_state[name], tensor), name


def test_moe_options_transformers_cannot_express_are_refused_by_name():
    qwen, mixtral = moe_args("qwen3_moe-every-2nd-gqa-raw-topk"), moe_args("mixtral-untied-separate")
    for args, change, message in [
        (qwen, {"n_shared_experts": 1}, "Qwen3MoeForCausalLM needs n_shared_experts = 0 (not 1)"),
        (qwen, {"router": "sigmoid"}, "Qwen3MoeForCausalLM needs router = 'softmax' (not 'sigmoid')"),
        (qwen, {"balance": "aux_free"}, "Qwen3MoeForCausalLM needs balance = 'aux_loss' (not 'aux_free')"),
        (mixtral, {"moe_every": 2}, "MixtralForCausalLM needs moe_every = 1 (not 2) (with qk_norm = True it "
                                    "exports as Qwen3MoeForCausalLM)"),
        # Mixtral is two options away, Qwen 3 MoE one (qk_norm): the closer one is named
        (mixtral, {"moe_every": 2, "norm_topk_prob": False}, "Qwen3MoeForCausalLM needs qk_norm = True (not False)"),
        (qwen, {"router": "sigmoid", "balance": "aux_free", "n_shared_experts": 1},
         "Qwen3MoeForCausalLM needs router = 'softmax' (not 'sigmoid'); n_shared_experts = 0 (not 1); "
         "balance = 'aux_loss' (not 'aux_free')"),
    ]:
        with pytest.raises(CheckpointError) as e:
            to_hf_config(dataclasses.replace(args, **change))
        assert str(e.value) == message
    with pytest.raises(CheckpointError, match=r"^Qwen3ForCausalLM needs n_experts = 0 \(not 4\)$"):
        to_hf_config(qwen, "qwen3")
    with pytest.raises(CheckpointError, match=r"^mlp_only_layers = \[0\]: only decoder_sparse_step maps"):
        from_hf_config({**to_hf_config(qwen), "mlp_only_layers": [0]})
    disk = to_hf_state_dict(ours_random(qwen).state_dict(), qwen)
    del disk["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"^Hugging Face state dict: missing "
                                              r"model.layers.1.mlp.experts.3.up_proj.weight$"):
        from_hf_state_dict(disk, qwen)
