"""Packed documents (issue 37, ``[data] document_mask``): with ``position_ids`` a packed batch's logits are those of
each document run on its own (fp32, dropout 0, within 1e-5), for the paper's decoder (sinusoidal table), Llama- and
Qwen 3-shaped ones (RoPE, grouped-query attention, q/k norm), a mixture of experts, both attention kernels, and
through a pipeline split; a window that crosses no boundary keeps SDPA's causal fast path (no mask tensor); the
mask is built once per forward, outside the blocks, which receive it as an argument; the estimate prices it.

The multi-process paths (FSDP2 with activation checkpointing, ep 2, tp 2, pp 2) are checked in
tests/test_document_mask_parallel.py.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

import torch_handle.model.transformer as transformer
from torch_handle.data.datasets import EOS_ID, PAD_ID, encode_stream, train_tokenizer
from torch_handle.model.args import TransformerArgs
from torch_handle.model.layers import DecoderLayer
from torch_handle.model.pipeline import split_decoder, split_layers
from torch_handle.model.transformer import DecoderLM, document_mask_of

V = 300
T = 24
LLAMA = {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu", "n_kv_heads": 2, "bias": False,
         "scale_embeddings": False, "norm_first": True, "tie_embeddings": False}
SHAPES = {"paper": {"norm_first": True},
          "llama": LLAMA,
          "qwen3": {**LLAMA, "qk_norm": True, "head_dim": 8},
          "moe": {**LLAMA, "n_experts": 4, "top_k": 2, "n_shared_experts": 1, "moe_every": 2},
          "reference-kernel": {**LLAMA, "attention": "reference"}}


@functools.cache
def _stream() -> torch.Tensor:
    """Documents (real BPE ids of small Python sources) joined by ``<eos>``: (N,)."""
    texts = [f"y{i} = f(y{i - 1})\n" * (1 + i % 3) for i in range(40)]
    return encode_stream(train_tokenizer(texts, V), texts)


def packed_documents(n_rows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """A packed batch as ``[data] document_mask`` gives it: documents (real BPE ids of small Python sources, each
    ending in its ``<eos>``) cut into windows across their boundaries; ``position_ids`` restart at 0 at each
    document start and at each window's first token. Returns input_ids (B, T), position_ids (B, T) and the
    documents' (row, start, end) spans in the windows."""
    ids = _stream()[: n_rows * seq_len].view(n_rows, seq_len)
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == EOS_ID  # a document starts after an <eos>
    segment = starts.long().cumsum(1)  # (B, T)
    positions = torch.stack([torch.cat([torch.arange(int((row == s).sum())) for s in row.unique_consecutive()])
                             for row in segment])
    spans = [(b, int(i), int(i) + int((segment[b] == segment[b, i]).sum()))
             for b in range(n_rows) for i in starts[b].nonzero().flatten()]
    return ids, positions, spans


def _model(shape: str) -> DecoderLM:
    torch.manual_seed(0)
    args = TransformerArgs(**{"vocab_size": V, "d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64,
                              "dropout": 0.0, "max_len": T, "pad_id": PAD_ID, **SHAPES[shape]})
    return DecoderLM(args)


def test_the_packed_batch_crosses_boundaries_and_restarts_positions() -> None:
    ids, positions, spans = packed_documents(3, T)
    assert ids.shape == positions.shape == (3, T)
    assert all(len([s for s in spans if s[0] == b]) >= 2 for b in range(3))  # every window holds 2+ documents
    assert (positions[:, 0] == 0).all() and not (positions == torch.arange(T)).all(dim=1).any()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_packed_logits_equal_each_document_run_on_its_own(shape: str) -> None:
    model = _model(shape).train()  # train mode: the MoE's training path runs
    ids, positions, spans = packed_documents(3, T)
    packed = model(ids, position_ids=positions)  # (B, T, V)
    packed.float().sum().backward()  # the backward through the mask
    alone = [model(ids[b:b + 1, a:e])[0] for b, a, e in spans]  # (e - a, V) each: positions 0 .. e - a - 1
    worst = max((packed[b, a:e] - y).abs().max().item() for (b, a, e), y in zip(spans, alone))
    assert worst <= 1e-5, (shape, worst)
    # without position_ids the same batch attends across documents: the check above can fail
    crossing = model(ids)
    assert max((crossing[b, a:e] - y).abs().max().item() for (b, a, e), y in zip(spans, alone)) > 1e-3


def test_the_mask_is_block_causal_by_segment() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    mask = document_mask_of(positions)  # (2, 1, 6, 6)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    want0 = torch.zeros(6, 6, dtype=torch.bool)
    for a, e in ((0, 3), (3, 5), (5, 6)):
        want0[a:e, a:e] = torch.ones(e - a, e - a, dtype=torch.bool).tril()
    assert torch.equal(mask[0, 0], want0)
    assert torch.equal(mask[1, 0], torch.ones(6, 6, dtype=torch.bool).tril())  # one document: causal
    assert document_mask_of(torch.arange(6).repeat(2, 1)) is None and document_mask_of(None) is None


@pytest.fixture
def sdpa_calls(monkeypatch) -> list[dict]:
    """Every ``F.scaled_dot_product_attention`` call's mask (None or its shape) and ``is_causal``."""
    calls: list[dict] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append({"mask": None if attn_mask is None else tuple(attn_mask.shape), "is_causal": is_causal})
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_a_window_crossing_no_boundary_keeps_the_causal_fast_path(sdpa_calls) -> None:
    model = _model("llama").train()
    ids, _, _ = packed_documents(2, T)
    plain = model(ids)
    unpacked = model(ids, position_ids=torch.arange(T).repeat(2, 1))  # every row 0 .. T - 1: one document each
    assert sdpa_calls == [{"mask": None, "is_causal": True}] * 4  # 2 layers x 2 forwards, no mask tensor
    assert torch.equal(plain, unpacked)
    sdpa_calls.clear()
    model(ids, position_ids=packed_documents(2, T)[1])
    assert sdpa_calls == [{"mask": (2, 1, T, T), "is_causal": False}] * 2


def test_the_mask_is_built_once_outside_the_blocks_and_handed_to_each(monkeypatch) -> None:
    model = _model("llama").eval()
    ids, positions, _ = packed_documents(2, T)
    built, seen = [], []
    real = transformer.document_mask_of
    monkeypatch.setattr(transformer, "document_mask_of", lambda p: built.append(real(p)) or built[-1])
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda _m, _a, kw: seen.append((kw["attn_mask"], kw["position_ids"])),
                                        with_kwargs=True)
    model(ids, position_ids=positions)
    assert len(built) == 1 and len(seen) == 2
    assert all(m is built[0] and p is positions for m, p in seen)  # the same tensors, not rebuilt per block
    assert isinstance(model.layers[0], DecoderLayer)


def test_a_pipeline_split_gives_the_packed_logits_of_the_whole_model() -> None:
    """The stages each build the mask from the micro-batch's position_ids: their chain equals the whole model."""
    model = _model("llama").eval()
    ids, positions, _ = packed_documents(2, T)
    _, stages = split_decoder(model, split_layers(2, 2), [0, 1])
    h = None
    for stage in stages:
        h = stage(h, input_ids=ids, position_ids=positions)
    torch.testing.assert_close(h, model(ids, position_ids=positions), rtol=0, atol=1e-6)


def test_bad_position_ids_are_refused_in_one_line() -> None:
    from torch_handle.model.kv_cache import KVCache

    model = _model("llama").eval()
    ids, positions, _ = packed_documents(2, T)
    with pytest.raises(ValueError, match=r"position_ids must have input_ids' shape \(2, 24\)"):
        model(ids, position_ids=positions[:, :-1])
    with pytest.raises(ValueError, match="cannot be combined with a key/value cache"):
        model(ids, position_ids=positions, cache=KVCache.for_model(model))


def test_rope_rotates_each_token_by_its_position_in_its_document(monkeypatch) -> None:
    """Under a block-causal mask RoPE's scores depend on position differences only, so the logits above barely see
    absolute positions: that each document's tokens are rotated as positions 0, 1, ... is checked here."""
    from torch_handle.model.rope import RotaryEmbedding

    rope = RotaryEmbedding(8)
    x = torch.randn(2, 3, 6, 8)  # (B, H, T, d_k)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    out = rope(x, positions=positions)
    torch.testing.assert_close(out[0, :, 3:], rope(x[0:1, :, 3:])[0], rtol=0, atol=0)  # document 2 from 0
    torch.testing.assert_close(out[1], rope(x[1:2])[0], rtol=0, atol=0)
    assert not torch.allclose(out[0, :, 3:], rope(x[0:1], 0)[0, :, 3:])
    seen = []
    real = RotaryEmbedding.forward
    monkeypatch.setattr(RotaryEmbedding, "forward", lambda self, x, offset=0, positions=None, table=None:
                        seen.append(positions) or real(self, x, offset, positions, table))
    ids, positions, _ = packed_documents(2, T)
    _model("llama").eval()(ids, position_ids=positions)
    assert len(seen) == 4 and all(p is positions for p in seen)  # q and k of both layers


def _factory(options, vocab_size, pad_id, max_len):
    return DecoderLM(dataclasses.replace(options, vocab_size=vocab_size, pad_id=pad_id, max_len=max_len))


def test_the_estimate_prices_the_mask_as_a_packed_batch_saves_it() -> None:
    """``handle estimate`` runs the model on fake tensors: with ``[data] document_mask`` it passes position_ids, the
    model builds the mask (values unreadable: priced as a batch crossing boundaries), and what autograd saves is
    what a real packed batch saves (within 2%), more than without the mask."""
    import torch_handle.plan.estimate_activations as A
    from torch_handle.plan.estimate_model import ModelBuild

    batch, seq = 4, 48
    args = TransformerArgs(vocab_size=V, pad_id=PAD_ID, max_len=seq, d_model=64, n_heads=4, n_layers=3, d_ff=160,
                           **LLAMA)
    build = ModelBuild(_factory, args, V, PAD_ID, seq, "lm")
    plain = A.fake_activations(build, batch, seq, "fp32", "fp32", False)
    priced = A.fake_activations(dataclasses.replace(build, document_mask=True), batch, seq, "fp32", "fp32", False)
    torch.manual_seed(0)
    model = _factory(args, V, PAD_ID, seq).train()
    ids, positions, _ = packed_documents(batch, seq)
    real = A.saved_activation_bytes(lambda: F.cross_entropy(model(ids, position_ids=positions).flatten(0, 1),
                                                             ids.flatten()).backward(), model)
    assert priced.saved > plain.saved + batch * seq * seq - 1  # at least the (B, 1, T, T) bool mask
    assert abs(priced.saved - real) <= 0.02 * real, (priced, plain, real)


@pytest.mark.parametrize("case", ["llama-gqa-tied-fused", "qwen3-gqa-head_dim-untied"])
def test_packed_logits_equal_transformers_packing_with_position_ids(case: str) -> None:
    """Hugging Face's "packing with position_ids": given ``position_ids`` and no ``attention_mask``,
    ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` without a cache find the packed sequences (``masking_utils.
    find_packed_sequence_indices``) and attend within each; our decoder with the same weights gives its logits."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[dev,hf]'")
    from tests.unit.test_hf_names import args_of, hf_model, load_into_hf, ours_random

    args = args_of(case)
    ours, theirs = ours_random(args), hf_model(args)
    load_into_hf(ours, theirs)
    ids, positions, _ = packed_documents(3, T)
    ids = ids % args.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, position_ids=positions),
                                   theirs(input_ids=ids, position_ids=positions, use_cache=False).logits,
                                   atol=1e-5, rtol=0)


def test_the_hf_model_plugin_refuses_document_mask() -> None:
    """The ``hf`` plugin's wrapper takes no position_ids (and OPT's mask would ignore them): one line, before
    anything starts."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[dev,hf]'")
    from types import SimpleNamespace

    from handle_plugins.hf import HFConfig, check_preset
    from torch_handle.api import InvalidValue

    data = SimpleNamespace(task="lm", seq_len=64, document_mask=True)
    preset = SimpleNamespace(data=SimpleNamespace(name="tokens", options=data))
    with pytest.raises(InvalidValue) as refused:
        check_preset(HFConfig(), preset)
    assert refused.value.key == "data.document_mask" and "set data.document_mask = false" in str(refused.value)
    data.document_mask = False
    check_preset(HFConfig(), preset)
