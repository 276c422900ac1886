"""The four pieces of a modern decoder, each against a written-out reference of its own: RMSNorm against its formula
and ``torch.nn.RMSNorm``, RoPE against the complex-number formulation, SwiGLU against its formula, grouped-query
attention against multi-head attention with the K/V heads repeated; and cached generation against the full
sequence with all of them on (RoPE's positions continue from the cache; the cache holds H_kv heads).
``test_hf_names.py`` checks the whole decoder against ``transformers``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torch_handle.model.args import TransformerArgs
from torch_handle.model.attention import MultiHeadAttention
from torch_handle.model.feed_forward import SwiGLUFeedForward
from torch_handle.model.kv_cache import KVCache
from torch_handle.model.norms import RMSNorm
from torch_handle.model.rope import RotaryEmbedding
from torch_handle.model.transformer import DecoderLM, EncoderDecoder

REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-5
LLAMA = dict(d_model=32, n_heads=4, n_layers=2, d_ff=48, dropout=0.0, max_len=64, norm="rmsnorm", position="rope",
             mlp="swiglu", norm_first=True, bias=False, scale_embeddings=False)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def randomize_(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter drawn at random (norm gains included: a gain left at 1 hides a misplaced one)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return module


def test_rmsnorm_is_its_formula_and_torchs():
    norm = randomize_(RMSNorm(16, eps=1e-6))
    x = torch.randn(3, 5, 16) * 4 + 1
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected, atol=ATOL, rtol=0)
    theirs = torch.nn.RMSNorm(16, eps=1e-6)
    theirs.weight.data.copy_(norm.weight)
    torch.testing.assert_close(norm(x), theirs(x), atol=ATOL, rtol=0)
    # no re-centring: a constant shift changes the output (LayerNorm would remove it)
    assert not torch.allclose(norm(x + 3.0), norm(x), atol=1e-3)


def rope_complex(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as RoFormer §3.2 writes it: channel pair i as one complex number z_i, multiplied by e^{i·m·θ_i}. The
    pairs here are (j, j + d/2) (the rotate-half layout of Llama in transformers)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double())  # (..., T, d/2)
    rotated = z * torch.polar(torch.ones(len(positions), d // 2, dtype=torch.float64),
                              positions.double()[:, None] * freqs[None, :])
    return torch.cat([rotated.real, rotated.imag], dim=-1).to(x.dtype)


@pytest.mark.parametrize("offset", [0, 7])
def test_rope_is_the_complex_rotation(offset):
    rope = RotaryEmbedding(16, theta=500.0)
    x = torch.randn(2, 3, 9, 16)
    positions = torch.arange(offset, offset + 9)
    torch.testing.assert_close(rope(x, offset), rope_complex(x, positions, 500.0), atol=ATOL, rtol=0)


def test_rope_scores_depend_on_the_distance_only():
    rope = RotaryEmbedding(8)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    score = lambda m, n: (rope(q, m) * rope(k, n)).sum()  # noqa: E731
    torch.testing.assert_close(score(3, 1), score(40, 38), atol=1e-4, rtol=0)
    assert not torch.isclose(score(3, 1), score(3, 2), atol=1e-3)
    torch.testing.assert_close(rope(q, 5).norm(), q.norm())  # a rotation keeps lengths


def test_swiglu_is_its_formula():
    ff = SwiGLUFeedForward(8, 12, bias=True)
    x = torch.randn(2, 5, 8)
    gate, up = F.linear(x, ff.gate_proj.weight, ff.gate_proj.bias), F.linear(x, ff.up_proj.weight, ff.up_proj.bias)
    expected = F.linear(gate * torch.sigmoid(gate) * up, ff.down_proj.weight, ff.down_proj.bias)
    torch.testing.assert_close(ff(x), expected, atol=ATOL, rtol=0)
    assert sum(p.numel() for p in ff.parameters()) == 3 * 8 * 12 + 2 * 12 + 8


def repeated_kv_mha(gqa: MultiHeadAttention) -> MultiHeadAttention:
    """A multi-head attention with H K/V heads whose head h is the GQA's K/V head h // (H / H_kv)."""
    H, H_kv, d_k = gqa.n_heads, gqa.n_kv_heads, gqa.d_k
    mha = MultiHeadAttention(gqa.d_model, H, fused_qkv=False, bias=True, attention=gqa.attention,
                             rope_theta=None if gqa.rope is None else gqa.rope.theta,
                             qk_norm=gqa.q_norm is not None)
    if gqa.fused_qkv:
        q_w, k_w, v_w = gqa.qkv_proj.weight.split(gqa.qkv_proj.part_features)
        q_b, k_b, v_b = gqa.qkv_proj.bias.split(gqa.qkv_proj.part_features)
    else:
        (q_w, k_w, v_w), (q_b, k_b, v_b) = ([getattr(gqa, f"{p}_proj").weight for p in "qkv"],
                                            [getattr(gqa, f"{p}_proj").bias for p in "qkv"])

    def repeat(t: torch.Tensor) -> torch.Tensor:  # (H_kv·d_k, ...) -> (H·d_k, ...), each head H/H_kv times
        return t.unflatten(0, (H_kv, d_k)).repeat_interleave(H // H_kv, dim=0).flatten(0, 1)

    with torch.no_grad():
        for proj, w, b in ((mha.q_proj, q_w, q_b), (mha.k_proj, repeat(k_w), repeat(k_b)),
                           (mha.v_proj, repeat(v_w), repeat(v_b)), (mha.out_proj, gqa.out_proj.weight,
                                                                    gqa.out_proj.bias)):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
        if gqa.q_norm is not None:
            mha.q_norm.weight.copy_(gqa.q_norm.weight)
            mha.k_norm.weight.copy_(gqa.k_norm.weight)
    return mha


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
@pytest.mark.parametrize("fused_qkv", [True, False], ids=["fused", "separate"])
@pytest.mark.parametrize("n_kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_grouped_query_attention_is_mha_with_repeated_kv(n_kv_heads, fused_qkv, attention):
    gqa = randomize_(MultiHeadAttention(24, 4, fused_qkv=fused_qkv, attention=attention, n_kv_heads=n_kv_heads,
                                        rope_theta=10000.0, qk_norm=True))
    kv_rows = n_kv_heads * 6
    proj = gqa.qkv_proj if fused_qkv else gqa.k_proj
    assert proj.weight.shape == ((24 + 2 * kv_rows) if fused_qkv else kv_rows, 24)
    mha = repeated_kv_mha(gqa)
    x = torch.randn(2, 7, 24)
    torch.testing.assert_close(gqa(x, causal=True), mha(x, causal=True), atol=ATOL, rtol=0)
    padding = torch.tensor([[True, True] + [False] * 5, [False] * 7])
    torch.testing.assert_close(gqa(x, key_padding_mask=padding, causal=True),
                               mha(x, key_padding_mask=padding, causal=True), atol=ATOL, rtol=0)


def llama_args(**overrides) -> TransformerArgs:
    return TransformerArgs(97, **{**LLAMA, "n_kv_heads": 2, "qk_norm": True, **overrides})


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
@pytest.mark.parametrize("fused_qkv", [True, False], ids=["fused", "separate"])
def test_cached_generation_equals_the_full_sequence(attention, fused_qkv):
    model = randomize_(DecoderLM(llama_args(attention=attention, fused_qkv=fused_qkv))).eval()
    ids = torch.randint(3, 97, (2, 13))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.for_model(model)
        steps = [model(ids[:, :6], cache=cache), model(ids[:, 6:9], cache=cache)]
        steps += [model(ids[:, t:t + 1], cache=cache) for t in range(9, 13)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)
    k = cache.layers[0].self_attn.k
    assert k.shape == (2, 2, 13, 8)  # (B, H_kv, S, d_k): two K/V heads cached, not four
    assert cache.nbytes == 2 * 2 * (2 * 2 * 13 * 8) * 4  # layers x (k, v) x elements x fp32


def test_rope_makes_the_model_order_aware_without_a_table():
    """Without positions, a one-layer model's query sees its keys as a set: swapping tokens 0 and 1 would not change
    position 5's logits. With RoPE it does, though nothing was added to the embeddings and nothing is saved."""
    model = randomize_(DecoderLM(llama_args(n_layers=1))).eval()
    assert not any("pos_encoding" in name for name in model.state_dict())  # no position table
    ids = torch.randint(3, 97, (1, 6))
    swapped = ids[:, [1, 0, 2, 3, 4, 5]]
    with torch.no_grad():
        assert not torch.allclose(model(ids)[:, 5], model(swapped)[:, 5], atol=1e-3)
        model.layers[0].self_attn.rope = None  # positions off: a set again
        torch.testing.assert_close(model(ids)[:, 5], model(swapped)[:, 5], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="max_len 64"):
        model(torch.randint(3, 97, (1, 65)))


def test_the_encoder_decoder_takes_the_new_pieces_too():
    model = randomize_(EncoderDecoder(llama_args(n_kv_heads=1))).eval()
    assert model.decoder_layers[0].cross_attn.rope is None and model.decoder_layers[0].self_attn.rope is not None
    src, tgt = torch.randint(3, 97, (2, 9)), torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        full = model(src, tgt)
        memory, mask = model.encode(src)
        cache = KVCache.for_model(model)
        steps = [model.decode(tgt[:, t:t + 1], memory, mask, cache=cache) for t in range(7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)


def test_parameter_counts_of_the_new_shapes():
    """Closed forms for GQA's smaller K/V projections, SwiGLU's three matrices and RMSNorm's gain-only norms."""
    C, H, H_kv, d_k, ff, L, V = 32, 4, 2, 8, 48, 2, 97
    per_layer = C * H * d_k + 2 * C * H_kv * d_k + H * d_k * C + 3 * C * ff + 2 * C + 2 * d_k
    model = DecoderLM(llama_args(tie_embeddings=False))
    assert model.num_params() == L * per_layer + C + 2 * V * C
    assert model.flops_per_token(64) == 6 * (L * per_layer + C + V * C) + 12 * L * H * d_k * 64


def test_handle_estimate_counts_the_llama_preset_as_built():
    """``handle estimate`` and ``handle plan`` size the preset's model on the meta device: their parameter count and
    FLOPs per token are the built model's, which are the closed forms of GQA and SwiGLU's shapes."""
    from torch_handle.config.loader import load_preset
    from torch_handle.plan.estimate_model import model_shape
    from torch_handle.plan.planner import model_flops_per_token
    from torch_handle.registry import get_registry

    preset = load_preset(REPO / "presets" / "llama.toml")
    o, V, seq_len = preset.model.options, preset.data.options.vocab_size, preset.data.options.seq_len
    assert (o.n_heads, o.n_kv_heads, o.mlp, o.norm, o.position, o.bias) == (4, 2, "swiglu", "rmsnorm", "rope", False)
    C, d_k, L = o.d_model, o.d_model // o.n_heads, o.n_layers
    per_layer = 2 * C * o.n_heads * d_k + 2 * C * o.n_kv_heads * d_k + 3 * C * o.d_ff + 2 * C
    expected = L * per_layer + C + V * C  # + final norm + tied embedding
    built = DecoderLM(TransformerArgs(V, **{k: getattr(o, k) for k in o.__dataclass_fields__
                                            if k not in ("kind", "activation", "init_from")}, max_len=seq_len))
    assert model_shape(preset, get_registry()).n_params == built.num_params() == expected
    assert model_flops_per_token(preset, get_registry()) == 6 * expected + 12 * L * o.n_heads * d_k * seq_len


def test_the_sinusoidal_table_of_an_odd_width():
    """The 2017 position table, which RoPE replaces: an odd d_model leaves the last channel a sine."""
    import math

    from torch_handle.model.embeddings import SinusoidalPositionalEncoding

    pe = SinusoidalPositionalEncoding(d_model=7, max_len=4)
    assert pe.pe[3, 6].item() == pytest.approx(math.sin(3 / 10000 ** (6 / 7)), abs=1e-6)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_the_explicit_causal_attention_is_flash_attentions_arithmetic(n_kv_heads):
    """``kernels.causal_attention`` (what ``sdpa`` takes for short bf16 sequences on CPU) against torch's flash kernel
    and an fp64 reference: outputs and q/k/v gradients in bf16 as close to fp64 as flash's (both keep scores and
    softmax in fp32), fp32 equal to flash to 1e-5; under autocast the scores stay fp32 (the same bits)."""
    from torch_handle.model.kernels import causal_attention

    B, H, T, d = 3, 4, 24, 16
    q0, k0, v0 = (torch.randn(B, h, T, d) * 2 for h in (H, n_kv_heads, n_kv_heads))
    grad = torch.randn(B, H, T, d)
    gqa = n_kv_heads != H

    def run(kernel, dtype):
        q, k, v = (t.to(dtype, copy=True).requires_grad_() for t in (q0, k0, v0))
        out = kernel(q, k, v)
        out.backward(grad.to(dtype))
        return [t.double() for t in (out, q.grad, k.grad, v.grad)]

    def flash(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    exact = run(flash, torch.float64)
    for got, want in zip(run(causal_attention, torch.float32), run(flash, torch.float32)):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    for got, theirs, want in zip(run(causal_attention, torch.bfloat16), run(flash, torch.bfloat16), exact):
        assert (got - want).abs().max() <= 1.25 * (theirs - want).abs().max() + 1e-3
    q, k, v = (t.bfloat16() for t in (q0, k0, v0))
    outside = causal_attention(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(causal_attention(q, k, v), outside)
    torch.testing.assert_close(causal_attention(q, k, v), flash(q, k, v), rtol=0, atol=0.05)


def test_sdpa_takes_the_explicit_kernel_for_short_bf16_causal_attention_on_cpu(monkeypatch):
    """Only where it was measured faster: bf16, CPU, causal, no mask tensor, no dropout, T <= the crossover."""
    from torch_handle.model import attention, kernels

    taken = []
    monkeypatch.setattr(attention, "causal_attention", lambda q, k, v: taken.append(q.shape[2]) or q)
    T = kernels.EXPLICIT_ATTENTION_MAX_LEN
    q, long = torch.randn(1, 2, T, 8).bfloat16(), torch.randn(1, 2, T + 1, 8).bfloat16()
    attention.sdpa(q, q, q, is_causal=True)
    assert taken == [T]
    attention.sdpa(long, long, long, is_causal=True)  # past the crossover
    attention.sdpa(q.float(), q.float(), q.float(), is_causal=True)  # fp32: flash is as fast
    attention.sdpa(q, q, q, torch.ones(T, T, dtype=torch.bool).tril())  # a mask tensor
    attention.sdpa(q, q, q, dropout_p=0.1, is_causal=True)
    attention.sdpa(q, q, q)  # not causal
    assert taken == [T]
