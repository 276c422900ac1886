"""Tests for the model (torch_handle/model/), checked against PyTorch's own Transformer modules where possible."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch_handle.model import attention as A
from torch_handle.model import transformer as M
from torch_handle.model.args import TransformerArgs
from torch_handle.model.attention import MultiHeadAttention, scaled_dot_product_attention_reference
from torch_handle.model.embeddings import SinusoidalPositionalEncoding
from torch_handle.model.layers import DecoderLayer, EncoderLayer
from torch_handle.model.transformer import DecoderLM, EncoderDecoder, build_transformer

D, H, FF, V = 16, 4, 32, 23
ATOL = 1e-5

TINY = dict(d_model=D, n_heads=H, n_layers=2, d_ff=FF, dropout=0.0, max_len=64, norm_first=True)


def tiny(vocab_size: int = V, **overrides) -> TransformerArgs:
    """TransformerArgs of the tiny test models, with ``overrides``."""
    return TransformerArgs(vocab_size, **{**TINY, **overrides})


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def kernel_calls(monkeypatch) -> Counter:
    """Counts the attention-kernel calls torch_handle.model.attention makes, by kernel: both kernels give the same
    numbers, so only the count shows which one ran."""
    calls: Counter = Counter()
    real_sdpa, real_reference = F.scaled_dot_product_attention, A.scaled_dot_product_attention_reference

    def sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return real_sdpa(*args, **kwargs)

    def reference(*args, **kwargs):
        calls["reference"] += 1
        return real_reference(*args, **kwargs)

    monkeypatch.setattr(A.F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(A, "scaled_dot_product_attention_reference", reference)
    return calls


# ---------------------------------------------------------------------------------------------
# helpers: copy our weights into torch.nn modules
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def copy_mha(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    if ours.fused_qkv:
        theirs.in_proj_weight.copy_(ours.qkv_proj.weight)
        theirs.in_proj_bias.copy_(ours.qkv_proj.bias)
    else:
        theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
    theirs.out_proj.weight.copy_(ours.out_proj.weight)
    theirs.out_proj.bias.copy_(ours.out_proj.bias)


@torch.no_grad()
def copy_linear_or_norm(ours: nn.Module, theirs: nn.Module) -> None:
    theirs.weight.copy_(ours.weight)
    theirs.bias.copy_(ours.bias)


def copy_encoder_layer(ours: EncoderLayer, theirs: nn.TransformerEncoderLayer) -> None:
    copy_mha(ours.self_attn, theirs.self_attn)
    copy_linear_or_norm(ours.ff.linear1, theirs.linear1)
    copy_linear_or_norm(ours.ff.linear2, theirs.linear2)
    copy_linear_or_norm(ours.self_attn_norm, theirs.norm1)
    copy_linear_or_norm(ours.ff_norm, theirs.norm2)


def copy_decoder_layer(ours: DecoderLayer, theirs: nn.TransformerDecoderLayer) -> None:
    copy_mha(ours.self_attn, theirs.self_attn)
    copy_mha(ours.cross_attn, theirs.multihead_attn)
    copy_linear_or_norm(ours.ff.linear1, theirs.linear1)
    copy_linear_or_norm(ours.ff.linear2, theirs.linear2)
    copy_linear_or_norm(ours.self_attn_norm, theirs.norm1)
    copy_linear_or_norm(ours.cross_attn_norm, theirs.norm2)
    copy_linear_or_norm(ours.ff_norm, theirs.norm3)


def randomize_(module: nn.Module) -> nn.Module:
    """Non-trivial biases/LayerNorm affines so the comparisons exercise every parameter."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module


def right_padding_mask(lengths: list[int], total: int) -> torch.Tensor:
    """bool (B, total), True = pad, each row keeping at least one real position."""
    return torch.arange(total)[None, :] >= torch.tensor(lengths)[:, None]


def causal_attn_mask(T: int, S: int) -> torch.Tensor:
    """nn.MultiheadAttention convention: True = NOT allowed."""
    return ~torch.ones(T, S, dtype=torch.bool).tril()


# ---------------------------------------------------------------------------------------------
# 1, 2. MultiHeadAttention vs nn.MultiheadAttention, and sdpa vs reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mha_matches_torch(attention, fused, cross, padding, causal):
    B, T = 3, 7
    S = 5 if cross else T
    ours = randomize_(MultiHeadAttention(D, H, fused_qkv=fused, attention=attention)).eval()
    theirs = nn.MultiheadAttention(D, H, batch_first=True).eval()
    copy_mha(ours, theirs)

    x = torch.randn(B, T, D)
    if cross:
        memory = torch.randn(B, S, D)
        key, value = memory, memory
    else:
        key, value = x, x
    kpm = right_padding_mask([S, S - 2, 1], S) if padding else None
    attn_mask = causal_attn_mask(T, S) if causal else None

    with torch.no_grad():
        expected, _ = theirs(x, key, value, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=False)
        got = ours(x, key, value, key_padding_mask=kpm, causal=causal)
    assert got.shape == (B, T, D)
    assert (got - expected).abs().max().item() <= ATOL


def test_mha_cross_attention_distinct_key_and_value():
    """Fused weights split three ways when key and value are different tensors."""
    ours = randomize_(MultiHeadAttention(D, H, fused_qkv=True)).eval()
    theirs = nn.MultiheadAttention(D, H, batch_first=True).eval()
    copy_mha(ours, theirs)
    q, k, v = torch.randn(2, 4, D), torch.randn(2, 6, D), torch.randn(2, 6, D)
    with torch.no_grad():
        expected, _ = theirs(q, k, v, need_weights=False)
        got = ours(q, k, v)
    assert (got - expected).abs().max().item() <= ATOL


def test_mha_self_attention_defaults_key_value_to_query():
    mha = MultiHeadAttention(D, H).eval()
    x = torch.randn(2, 5, D)
    assert torch.equal(mha(x), mha(x, x, x))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_equals_reference(fused, causal, kernel_calls):
    mha = randomize_(MultiHeadAttention(D, H, fused_qkv=fused)).eval()
    x = torch.randn(3, 9, D)
    kpm = right_padding_mask([9, 4, 2], 9)
    for mask in (None, kpm):
        kernel_calls.clear()
        mha.attention = "sdpa"
        a = mha(x, key_padding_mask=mask, causal=causal)
        assert kernel_calls == {"sdpa": 1}  # the selected kernel ran, the other did not
        mha.attention = "reference"
        b = mha(x, key_padding_mask=mask, causal=causal)
        assert kernel_calls == {"sdpa": 1, "reference": 1}
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_reference_function_matches_torch_sdpa():
    q, k, v = torch.randn(2, H, 5, 8), torch.randn(2, H, 7, 8), torch.randn(2, H, 7, 8)
    mask = torch.rand(2, 1, 5, 7) > 0.3
    mask[..., 0] = True  # no fully-masked rows: torch's own result is then well defined
    torch.testing.assert_close(
        scaled_dot_product_attention_reference(q, k, v, mask),
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    )
    torch.testing.assert_close(
        scaled_dot_product_attention_reference(q, k, v), F.scaled_dot_product_attention(q, k, v)
    )


def test_fully_masked_rows_are_finite_and_agree():
    """Left padding + causal mask leaves the first query rows with no visible key."""
    mha = randomize_(MultiHeadAttention(D, H)).eval()
    x = torch.randn(2, 6, D, requires_grad=True)
    kpm = torch.tensor([[True, True, False, False, False, False], [False] * 6])
    outs = {}
    for impl in ("sdpa", "reference"):
        mha.attention = impl
        out = mha(x, key_padding_mask=kpm, causal=True)
        assert torch.isfinite(out).all()
        (grad,) = torch.autograd.grad(out.square().sum(), x)
        assert torch.isfinite(grad).all()
        outs[impl] = out
    torch.testing.assert_close(outs["sdpa"], outs["reference"], atol=1e-6, rtol=1e-5)
    # An empty row attends to nothing: its output is out_proj(0) = out_proj.bias.
    torch.testing.assert_close(outs["sdpa"][0, :2], mha.out_proj.bias.expand(2, D))

    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    ref = scaled_dot_product_attention_reference(q, k, v, torch.zeros(1, 1, 2, 3, dtype=torch.bool))
    assert torch.equal(ref, torch.zeros_like(ref))


def test_mha_rejects_bad_config_and_inputs():
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match="attention"):
        MultiHeadAttention(D, H, attention="flash")
    mha = MultiHeadAttention(D, H)
    x = torch.randn(2, 3, D)
    with pytest.raises(ValueError, match="key_padding_mask"):
        mha(x, key_padding_mask=torch.zeros(2, 3))  # float, not bool
    with pytest.raises(ValueError, match="attention"):
        mha.attention = "nope"
    assert mha.attention == "sdpa"


# ---------------------------------------------------------------------------------------------
# 3, 4. Causality and padding
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_decoder_lm_is_causal(attention, norm_first):
    lm = DecoderLM(tiny(norm_first=norm_first, attention=attention)).eval()
    ids = torch.randint(0, V, (2, 12))
    t = 5
    changed = ids.clone()
    changed[:, t + 1 :] = torch.randint(0, V, (2, 12 - t - 1))
    with torch.no_grad():
        a, b = lm(ids), lm(changed)
    assert a.shape == (2, 12, V) and a.dtype == torch.float32
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=ATOL, rtol=0)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # the later positions did see the change


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
def test_encoder_decoder_target_is_causal(attention):
    model = EncoderDecoder(tiny(attention=attention)).eval()
    src = torch.randint(0, V, (2, 9))
    tgt = torch.randint(0, V, (2, 10))
    t = 3
    changed = tgt.clone()
    changed[:, t + 1 :] = torch.randint(0, V, (2, 10 - t - 1))
    with torch.no_grad():
        a, b = model(src, tgt), model(src, changed)
    assert a.shape == (2, 10, V)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=ATOL, rtol=0)
    # ...and every target position does depend on the source.
    with torch.no_grad():
        c = model(torch.randint(0, V, (2, 9)), tgt)
    assert not torch.allclose(a[:, 0], c[:, 0])


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_source_padding_does_not_change_outputs(attention, norm_first):
    pad = 0
    model = EncoderDecoder(tiny(pad_id=pad, norm_first=norm_first, attention=attention)).eval()
    src = torch.randint(1, V, (2, 6))
    tgt = torch.randint(1, V, (2, 7))
    padded_src = torch.cat([src, torch.full((2, 4), pad)], dim=1)
    with torch.no_grad():
        a = model(src, tgt)
        b = model(padded_src, tgt)
    assert (a - b).abs().max().item() <= ATOL


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
def test_target_and_lm_padding_does_not_change_real_positions(attention):
    pad = 0
    lm = DecoderLM(tiny(pad_id=pad, attention=attention)).eval()
    ids = torch.randint(1, V, (2, 8))
    padded = torch.cat([ids, torch.full((2, 3), pad)], dim=1)
    left_padded = torch.cat([torch.full((2, 3), pad), ids], dim=1)
    with torch.no_grad():
        a, b, c = lm(ids), lm(padded), lm(left_padded)
    assert (a - b[:, :8]).abs().max().item() <= ATOL
    # Left padding shifts positions (so values change) but must stay finite.
    assert torch.isfinite(c).all()

    model = EncoderDecoder(tiny(pad_id=pad, attention=attention)).eval()
    src = torch.randint(1, V, (2, 5))
    with torch.no_grad():
        a = model(src, ids)
        b = model(src, padded)
    assert (a - b[:, :8]).abs().max().item() <= ATOL


# ---------------------------------------------------------------------------------------------
# 5. Positional encoding
# ---------------------------------------------------------------------------------------------


def test_positional_encoding_buffer():
    pe = SinusoidalPositionalEncoding(d_model=8, max_len=32)
    assert "pe" in pe.state_dict()
    assert list(pe.parameters()) == []
    assert pe.pe.shape == (32, 8) and pe.pe.dtype == torch.float32

    for pos, i in [(0, 0), (1, 0), (5, 1), (17, 3), (31, 2)]:
        angle = pos / 10000 ** (2 * i / 8)
        assert pe.pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
        assert pe.pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)

    x = torch.randn(2, 10, 8)
    torch.testing.assert_close(pe(x), x + pe.pe[:10])

    pe64 = pe.to(torch.float64)
    assert pe64.pe.dtype == torch.float64
    x64 = torch.randn(2, 10, 8, dtype=torch.float64)
    assert pe64(x64).dtype == torch.float64
    meta = SinusoidalPositionalEncoding(8, 32).to("meta")
    assert meta.pe.device.type == "meta"

    # In a full model it is a buffer of the model too, and survives a state_dict round trip.
    lm = DecoderLM(tiny())
    assert "pos_encoding.pe" in lm.state_dict()
    assert all("pos_encoding" not in name for name, _ in lm.named_parameters())

    with pytest.raises(ValueError, match="max_len"):
        pe(torch.randn(1, 33, 8))


# ---------------------------------------------------------------------------------------------
# 6. Activation checkpointing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["decoder", "encoder-decoder"])
def test_activation_checkpointing_same_loss_and_grads(kind, monkeypatch):
    calls, checkpointed = [], []
    real_checkpoint = M.checkpoint

    def counting_checkpoint(fn, *args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        checkpointed.append(fn)
        return real_checkpoint(fn, *args, **kwargs)

    monkeypatch.setattr(M, "checkpoint", counting_checkpoint)

    plain = build_transformer(tiny(pad_id=0), kind=kind).train()
    ckpt = build_transformer(tiny(pad_id=0, activation_checkpointing=True), kind=kind).train()
    ckpt.load_state_dict(plain.state_dict())

    src = torch.randint(0, V, (3, 8))
    tgt = torch.randint(0, V, (3, 9))
    losses = []
    for model in (plain, ckpt):
        logits = model(tgt) if kind == "decoder" else model(src, tgt)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), tgt[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss)

    n_layers = plain.n_layers_total
    assert calls == [False] * n_layers  # every layer, non-reentrant, only in the checkpointed model
    assert checkpointed == ckpt.blocks()  # the checkpoint units are the model's blocks, in order
    torch.testing.assert_close(losses[0], losses[1])
    for (name, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)

    calls.clear()
    with torch.no_grad():
        ckpt.eval()(tgt) if kind == "decoder" else ckpt.eval()(src, tgt)
    assert calls == []  # no checkpointing at eval time


def test_blocks_are_the_repeated_layers_in_forward_order():
    lm = build_transformer(tiny(n_layers=3), kind="decoder")
    assert lm.blocks() == list(lm.layers) and all(isinstance(b, DecoderLayer) for b in lm.blocks())
    ed = build_transformer(tiny(n_layers=3), kind="encoder-decoder")
    assert ed.blocks() == [*ed.encoder_layers, *ed.decoder_layers]
    assert [type(b) for b in ed.blocks()] == [EncoderLayer] * 3 + [DecoderLayer] * 3
    assert (lm.n_layers_total, ed.n_layers_total) == (3, 6)


# ---------------------------------------------------------------------------------------------
# 7. Layers vs nn.TransformerEncoderLayer / nn.TransformerDecoderLayer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_encoder_layer_matches_torch(norm_first, activation, attention):
    ours = EncoderLayer(D, H, FF, dropout=0.0, mlp=activation, norm_first=norm_first, attention=attention)
    randomize_(ours).eval()
    theirs = nn.TransformerEncoderLayer(
        D, H, FF, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first
    ).eval()
    copy_encoder_layer(ours, theirs)

    x = torch.randn(3, 7, D)
    kpm = right_padding_mask([7, 5, 2], 7)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=ATOL, rtol=0)
        got = ours(x, key_padding_mask=kpm)
        expected = theirs(x, src_key_padding_mask=kpm)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_decoder_layer_matches_torch(norm_first, activation, attention):
    ours = DecoderLayer(D, H, FF, dropout=0.0, mlp=activation, norm_first=norm_first, attention=attention)
    randomize_(ours).eval()
    theirs = nn.TransformerDecoderLayer(
        D, H, FF, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first
    ).eval()
    copy_decoder_layer(ours, theirs)

    B, T, S = 3, 6, 8
    x, memory = torch.randn(B, T, D), torch.randn(B, S, D)
    tgt_kpm = right_padding_mask([6, 4, 3], T)
    mem_kpm = right_padding_mask([8, 5, 1], S)
    with torch.no_grad():
        got = ours(x, memory, key_padding_mask=tgt_kpm, memory_key_padding_mask=mem_kpm)
        expected = theirs(
            x,
            memory,
            tgt_mask=causal_attn_mask(T, T),
            tgt_key_padding_mask=tgt_kpm,
            memory_key_padding_mask=mem_kpm,
        )
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_decoder_layer_memory_must_match_cross_attention():
    with_cross = DecoderLayer(D, H, FF)
    without = DecoderLayer(D, H, FF, cross_attention=False)
    x = torch.randn(1, 3, D)
    with pytest.raises(ValueError, match="memory"):
        with_cross(x)
    with pytest.raises(ValueError, match="memory"):
        without(x, torch.randn(1, 2, D))
    assert without.cross_attn is None


# ---------------------------------------------------------------------------------------------
# 8. Embedding tying, parameter counts, FLOPs, init, factory errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["decoder", "encoder-decoder"])
def test_tied_embeddings_and_param_count(kind):
    tied = build_transformer(tiny(tie_embeddings=True), kind=kind)
    untied = build_transformer(tiny(tie_embeddings=False), kind=kind)
    assert tied.lm_head.weight is tied.embed.weight
    assert tied.lm_head.weight.data_ptr() == tied.embed.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.embed.weight.data_ptr()

    table = V * D
    # Count unique storages by hand: the tied table appears once.
    seen, manual = set(), 0
    for _, p in tied.named_parameters(remove_duplicate=False):
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            manual += p.numel()
    assert tied.num_params() == manual
    assert untied.num_params() == tied.num_params() + table
    assert tied.num_params(exclude_embeddings=True) == tied.num_params() - table
    assert untied.num_params(exclude_embeddings=True) == untied.num_params() - table


@pytest.mark.parametrize("kind,layers", [("decoder", 2), ("encoder-decoder", 4)])
@pytest.mark.parametrize("tie", [True, False])
def test_flops_per_token(kind, layers, tie):
    model = build_transformer(tiny(tie_embeddings=tie), kind=kind)
    assert model.n_layers_total == layers
    n_matmul = model.num_params(exclude_embeddings=True) + (V * D if tie else 0)
    seq_len = 32
    assert model.flops_per_token(seq_len) == pytest.approx(6 * n_matmul + 12 * layers * D * seq_len)
    if tie:
        assert model.flops_per_token(seq_len) == 6 * model.num_params() + 12 * layers * D * seq_len


def test_errors():
    with pytest.raises(ValueError, match="divisible"):
        DecoderLM(TransformerArgs(V, d_model=10, n_heads=4, n_layers=1, d_ff=8))
    with pytest.raises(ValueError, match="divisible"):
        build_transformer(TransformerArgs(V, d_model=10, n_heads=3, n_layers=1, d_ff=8), kind="encoder-decoder")
    with pytest.raises(ValueError, match=r"'decoder'.*'encoder-decoder'"):
        build_transformer(tiny(), kind="encoder-only")
    with pytest.raises(ValueError, match="mlp"):
        DecoderLM(tiny(mlp="swish"))
    with pytest.raises(ValueError, match="norm"):
        DecoderLM(tiny(norm="batchnorm"))
    with pytest.raises(ValueError, match="position"):
        DecoderLM(tiny(position="alibi"))
    with pytest.raises(ValueError, match="n_kv_heads"):
        DecoderLM(tiny(n_kv_heads=3))
    with pytest.raises(ValueError, match="even"):
        DecoderLM(tiny(position="rope", head_dim=7))
    with pytest.raises(ValueError, match="attention"):
        EncoderDecoder(tiny(attention="flash"))
    with pytest.raises(ValueError, match="max_len"):
        DecoderLM(tiny(max_len=4))(torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("kind", ["decoder", "encoder-decoder"])
def test_init_is_deterministic_and_scaled(kind):
    torch.manual_seed(123)
    a = build_transformer(tiny(), kind=kind)
    torch.manual_seed(123)
    b = build_transformer(tiny(), kind=kind)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    big = build_transformer(tiny(1000, d_model=64), kind=kind)
    assert big.embed.weight.std().item() == pytest.approx(64**-0.5, rel=0.05)
    for name, module in big.named_modules():
        if isinstance(module, nn.Linear) and module is not big.lm_head and module.bias is not None:
            assert torch.count_nonzero(module.bias) == 0, name


@pytest.mark.parametrize("kind,n_attention", [("decoder", 2), ("encoder-decoder", 6)])
def test_attention_switch_propagates(kind, n_attention, kernel_calls):
    """``model.attention = ...`` switches every attention module (2 self-attention layers; 2 encoder
    self-, 2 decoder self- and 2 cross-attention), checked by which kernel actually runs."""
    model = build_transformer(tiny(pad_id=0), kind=kind).eval()
    ids = torch.randint(1, V, (2, 10))
    ids[1, 7:] = 0

    def run():
        kernel_calls.clear()
        with torch.no_grad():
            return model(ids) if kind == "decoder" else model(ids, ids)

    a = run()
    assert model.attention == "sdpa" and kernel_calls == {"sdpa": n_attention}
    model.attention = "reference"
    b = run()
    assert model.attention == "reference" and kernel_calls == {"reference": n_attention}
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)

    with pytest.raises(ValueError, match="attention"):
        model.attention = "flash"
    run()
    assert model.attention == "reference" and kernel_calls == {"reference": n_attention}  # nothing changed

    built = build_transformer(tiny(pad_id=0, attention="reference"), kind=kind).eval()
    kernel_calls.clear()
    with torch.no_grad():
        built(ids) if kind == "decoder" else built(ids, ids)
    assert kernel_calls == {"reference": n_attention}  # TransformerArgs.attention selects the initial kernel


def test_separate_qkv_model_runs():
    for kind in ("decoder", "encoder-decoder"):
        model = build_transformer(tiny(fused_qkv=False), kind=kind).eval()
        assert not any("qkv_proj" in name for name, _ in model.named_parameters())
        ids = torch.randint(0, V, (2, 5))
        out = model(ids) if kind == "decoder" else model(ids, ids)
        assert out.shape == (2, 5, V)


# ---------------------------------------------------------------------------------------------
# 9. It learns
# ---------------------------------------------------------------------------------------------


def test_decoder_lm_overfits_fixed_batch():
    lm = DecoderLM(TransformerArgs(32, d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0, max_len=32,
                                   norm_first=True)).train()
    ids = torch.randint(0, 32, (4, 16))
    opt = torch.optim.Adam(lm.parameters(), lr=3e-3)
    losses = []
    for _ in range(50):
        logits = lm(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_embedding_is_scaled_and_positioned():
    """Token embeddings are multiplied by √d_model before the positions are added (§3.4)."""
    lm = DecoderLM(tiny()).eval()
    ids = torch.randint(0, V, (2, 6))
    expected = lm.embed(ids) * math.sqrt(D) + lm.pos_encoding.pe[:6]
    torch.testing.assert_close(lm._embed(ids), expected)
