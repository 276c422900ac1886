"""``init_from``'s reader on directories ``transformers`` wrote itself: a random ``LlamaForCausalLM`` and
``Qwen3ForCausalLM`` saved by ``save_pretrained`` (the Qwen 3 one in shards, with model.safetensors.index.json) load
into a ``DecoderLM`` of the same shape with the same logits; a config of another shape is named, key by key
(tests/test_hf_export.py covers the round trip through real runs)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not os.environ.get("CI"):
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[dev,hf]'")
import transformers

from torch_handle.checkpoint import hf_dir
from torch_handle.errors import CheckpointError
from torch_handle.model.args import TransformerArgs
from torch_handle.model.hf_names import to_hf_config
from torch_handle.model.transformer import DecoderLM

LLAMA = TransformerArgs(97, d_model=32, n_heads=4, n_layers=2, d_ff=48, dropout=0.0, max_len=64, norm="rmsnorm",
                        position="rope", mlp="swiglu", norm_first=True, scale_embeddings=False, bias=False,
                        rope_theta=500.0, norm_eps=1e-6, n_kv_heads=2, tie_embeddings=False)
QWEN3 = dataclasses.replace(LLAMA, qk_norm=True, head_dim=12, tie_embeddings=True, n_kv_heads=1)


def saved(args: TransformerArgs, directory, **kwargs):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**to_hf_config(args))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # every weight random, norm gains too (a gain left at 1 hides a misplaced one)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, **kwargs)
    return model


@pytest.mark.parametrize("args, shards", [(LLAMA, {}), (QWEN3, {"max_shard_size": "20KB"})], ids=["llama", "qwen3"])
def test_a_directory_transformers_wrote_loads_with_its_logits(tmp_path, args, shards):
    theirs = saved(args, tmp_path, **shards)
    assert (tmp_path / hf_dir.WEIGHTS_INDEX).is_file() == bool(shards)
    ours = DecoderLM(args).eval()
    assert hf_dir.load_into(ours, tmp_path).startswith(f"weights from {tmp_path} ({to_hf_config(args)['model_type']}")
    ids = torch.randint(4, args.vocab_size, (2, 11))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() <= 1e-5


def test_the_first_option_that_differs_is_named_with_its_config_key(tmp_path):
    saved(LLAMA, tmp_path)
    where = tmp_path / "config.json"
    cases = {"n_layers": (3, "num_hidden_layers = 2"), "d_ff": (64, "intermediate_size = 48"),
             "norm_eps": (1e-5, "rms_norm_eps = 1e-06"), "n_kv_heads": (4, "num_key_value_heads = 2"),
             "rope_theta": (10000.0, "rope_parameters.rope_theta = 500.0"),
             "qk_norm": (True, "model_type = 'llama'")}
    for name, (value, theirs) in cases.items():
        message = hf_dir.config_mismatch(dataclasses.replace(LLAMA, **{name: value}), tmp_path)
        assert message == f"model.{name} = {value!r} but {where} has {theirs}", name
    assert hf_dir.config_mismatch(dataclasses.replace(LLAMA, dropout=0.1, fused_qkv=False), tmp_path) is None
    assert hf_dir.config_mismatch(dataclasses.replace(LLAMA, n_kv_heads=None), tmp_path) == (
        f"model.n_kv_heads is unset (so 4) but {where} has num_key_value_heads = 2")
    assert hf_dir.config_mismatch(dataclasses.replace(LLAMA, position="sinusoidal"), tmp_path) == (
        "LlamaForCausalLM needs model.position = 'rope' (not 'sinusoidal') (init_from loads Llama, Qwen 3, "
        "Qwen 3 MoE and Mixtral weights only)")
    with pytest.raises(CheckpointError, match=r"model\.d_model = 64 but .* has hidden_size = 32"):
        hf_dir.load_into(DecoderLM(dataclasses.replace(LLAMA, d_model=64)), tmp_path)
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight has shape \(97, 32\), expected \(90, 32\)"):
        hf_dir.load_into(DecoderLM(dataclasses.replace(LLAMA, vocab_size=90)), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model.safetensors or model.safetensors.index.json"):
        hf_dir.load_into(DecoderLM(LLAMA), tmp_path)
