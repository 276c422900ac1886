"""Incremental decoding and search, in one process on random tiny models (fp32, eval mode; well under a second).

- The key/value cache (``torch_handle.model.kv_cache.KVCache``) gives the logits of recomputing the whole prefix.
- Beam search with beam 1 is greedy decoding; a wider beam never finds a worse-scoring hypothesis than greedy
  under the same score.
- Sampling: temperature 0 is greedy, a seed reproduces, top-k keeps to the top k.
"""

from __future__ import annotations

import pytest
import torch

from torch_handle.data.datasets import BOS_ID, EOS_ID
from torch_handle.infer.generate import StreamDecoder, beam_translate, greedy_translate, next_token, sample
from torch_handle.model.args import TransformerArgs
from torch_handle.model.kv_cache import KVCache
from torch_handle.model.transformer import build_transformer

TOL = 1e-5


def _model(kind: str, *, norm_first: bool = True, attention: str = "sdpa", fused_qkv: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    args = TransformerArgs(vocab_size=40, d_model=32, n_heads=4, n_layers=2, d_ff=64, pad_id=0, max_len=24,
                           norm_first=norm_first, attention=attention, fused_qkv=fused_qkv, dropout=0.1)
    return build_transformer(args, kind).eval()


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("fused_qkv", [True, False])
def test_cached_decoder_logits_equal_the_full_recompute(attention, norm_first, fused_qkv):
    model = _model("decoder", norm_first=norm_first, attention=attention, fused_qkv=fused_qkv)
    ids = torch.randint(4, 40, (3, 20))
    with torch.no_grad():
        full = model(ids)  # (3, 20, V)
        cache = KVCache.for_model(model)
        # a prompt of 6, then token by token, then a chunk of 3 after cached keys (bottom-right causal mask)
        parts = [model(ids[:, :6], cache=cache)]
        parts += [model(ids[:, t:t + 1], cache=cache) for t in range(6, 17)]
        parts.append(model(ids[:, 17:], cache=cache))
    assert cache.length == 20
    assert (torch.cat(parts, 1) - full).abs().max().item() <= TOL


@pytest.mark.parametrize("norm_first", [True, False])
def test_cached_encoder_decoder_logits_equal_the_full_recompute(norm_first):
    model = _model("encoder-decoder", norm_first=norm_first)
    src = torch.randint(4, 40, (2, 9))
    src[1, 6:] = 0  # padded source
    tgt = torch.randint(4, 40, (2, 12))
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        full = model.decode(tgt, memory, src_mask)
        cache = KVCache.for_model(model)
        parts = [model.decode(tgt[:, t:t + 1], memory, src_mask, cache=cache) for t in range(12)]
    assert (torch.cat(parts, 1) - full).abs().max().item() <= TOL


def test_cache_reorder_follows_the_rows():
    model = _model("decoder")
    ids = torch.randint(4, 40, (2, 8))
    with torch.no_grad():
        cache = KVCache.for_model(model)
        model(ids[:, :7], cache=cache)
        cache.reorder(torch.tensor([1, 1, 0]))
        step = model(ids[[1, 1, 0], 7:], cache=cache)[:, -1]
        full = model(ids[[1, 1, 0]])[:, -1]
    assert (step - full).abs().max().item() <= TOL


def test_training_path_is_unchanged_without_a_cache():
    model = _model("decoder").train()
    ids = torch.randint(4, 40, (2, 10))
    torch.manual_seed(1)
    a = model(ids)
    torch.manual_seed(1)
    b = model(ids, cache=None)
    assert torch.equal(a, b)


def test_positions_beyond_max_len_are_refused():
    model = _model("decoder")
    cache = KVCache.for_model(model)
    with torch.no_grad():
        model(torch.randint(4, 40, (1, 24)), cache=cache)
        with pytest.raises(ValueError, match="exceeds positional-encoding max_len 24"):
            model(torch.randint(4, 40, (1, 1)), cache=cache)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_one_is_greedy(seed):
    model = _model("encoder-decoder", seed=seed)
    sources = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [7]]
    greedy = greedy_translate(model, sources, max_len=15)
    assert beam_translate(model, sources, max_len=15, beam=1) == greedy
    assert beam_translate(model, sources, max_len=15, beam=1, alpha=0.0) == greedy
    assert any(len(g) > 0 for g in greedy)


def _log_prob(model, source, target) -> float:
    with torch.no_grad():
        src = torch.tensor([source + [EOS_ID]])
        tgt = torch.tensor([[BOS_ID, *target]])
        logp = torch.log_softmax(model(src, tgt)[0], -1)  # (T, V)
        labels = [*target, EOS_ID] if len(target) < 15 else target
        return float(sum(logp[t, y] for t, y in enumerate(labels)))


def test_wider_beams_score_at_least_as_well_as_greedy_without_length_penalty():
    model = _model("encoder-decoder", seed=3)
    sources = [[5, 6, 7, 8], [9, 10, 11]]
    greedy = greedy_translate(model, sources, max_len=15)
    beam = beam_translate(model, sources, max_len=15, beam=4, alpha=0.0)
    for src, g, b in zip(sources, greedy, beam):
        assert _log_prob(model, src, b) >= _log_prob(model, src, g) - 1e-4


def test_next_token_greedy_seed_and_top_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert int(next_token(logits, 0.0, 0, None)) == 1
    draws = {int(next_token(logits, 5.0, 2, torch.Generator().manual_seed(s))) for s in range(40)}
    assert draws == {1, 3}
    a = [int(next_token(logits, 1.0, 0, torch.Generator().manual_seed(7))) for _ in range(3)]
    b = [int(next_token(logits, 1.0, 0, torch.Generator().manual_seed(7))) for _ in range(3)]
    assert a == b


def test_sample_yields_exactly_n_tokens_even_past_the_positional_table():
    model = _model("decoder")
    tokens = list(sample(model, [5, 6, 7], 40, temperature=1.0, generator=torch.Generator().manual_seed(0)))
    assert len(tokens) == 40 and all(0 <= t < 40 for t in tokens)
    # greedy sampling equals the argmax of a full recompute at each step (within the table)
    greedy = list(sample(model, [5, 6, 7], 5, temperature=0.0))
    context = [5, 6, 7]
    with torch.no_grad():
        for t in greedy:
            assert int(model(torch.tensor([context]))[0, -1].argmax()) == t
            context.append(t)


class _Bytes:
    """A stand-in tokenizer: token i is byte i - 4 (ids 0-3 are the special tokens)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i - 4 for i in ids if i >= 4).decode("utf-8", errors="replace")


def test_stream_decoder_holds_back_partial_utf8():
    stream = StreamDecoder(_Bytes())
    pieces = [stream.push(b + 4) for b in "é!".encode()]
    assert pieces == ["", "é", "!"]
    assert stream.push(EOS_ID) == "\n\n"
