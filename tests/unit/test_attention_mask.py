"""Unpadded batches reach ``F.scaled_dot_product_attention`` with no mask tensor (``is_causal`` only, the flash
kernel's path); padded ones still get their mask, and the key/value cache keeps working around the switch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from torch_handle.data.datasets import PAD_ID, LMDataset, encode_stream, train_tokenizer
from torch_handle.model.args import TransformerArgs
from torch_handle.model.kv_cache import KVCache
from torch_handle.model.pipeline import split_decoder, split_layers
from torch_handle.model.transformer import build_transformer

V = 300


@pytest.fixture
def sdpa_calls(monkeypatch) -> list[dict]:
    """Every ``F.scaled_dot_product_attention`` call's mask (None or its shape), ``is_causal`` and query length."""
    calls: list[dict] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append({"mask": None if attn_mask is None else tuple(attn_mask.shape), "is_causal": is_causal,
                      "T": q.shape[2]})
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal, **kwargs)

    # attention.py looks the kernel up on torch.nn.functional at every call (``F.scaled_dot_product_attention``)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def _model(kind: str = "decoder", vocab: int = V, **kw):
    torch.manual_seed(0)
    args = TransformerArgs(vocab_size=vocab, d_model=32, n_heads=4, n_layers=2, d_ff=64, pad_id=PAD_ID, max_len=32,
                           norm_first=True, dropout=0.0, **kw)
    return build_transformer(args, kind)


def _lm_batch() -> torch.Tensor:
    """input_ids (4, 16) of a real LM batch: BPE trained on a small corpus, ``LMDataset`` windows, default collate."""
    texts = [f"def f{i}(x):\n    return x * {i} + len('padding')\n\nThe <eos> of paragraph {i}." for i in range(40)]
    tok = train_tokenizer(texts, V)
    batch = next(iter(DataLoader(LMDataset(encode_stream(tok, texts), 16), batch_size=4)))
    assert batch["input_ids"].shape == (4, 16) and not (batch["input_ids"] == PAD_ID).any()
    return batch["input_ids"]


def test_an_unpadded_lm_batch_reaches_sdpa_without_a_mask_tensor(sdpa_calls) -> None:
    model = _model(vocab=V).train()  # dropout 0: SDPA on CPU too
    ids = _lm_batch()
    model(ids).sum().backward()
    assert sdpa_calls == [{"mask": None, "is_causal": True, "T": 16}] * 2


def test_a_padded_batch_still_gets_its_mask(sdpa_calls) -> None:
    model = _model().eval()
    ids = torch.randint(4, V, (3, 10))
    ids[1, 7:] = PAD_ID
    unpadded = model(ids[[0, 2]])
    padded = model(ids)
    assert sdpa_calls[2:] == [{"mask": (3, 1, 10, 10), "is_causal": False, "T": 10}] * 2
    torch.testing.assert_close(padded[[0, 2]], unpadded, atol=1e-5, rtol=1e-5)  # the two paths agree


def test_every_pipeline_stage_takes_the_same_decision(sdpa_calls) -> None:
    model = _model().eval()
    _, (first, last) = split_decoder(model, split_layers(2, 2), [0, 1])
    ids = torch.randint(4, V, (2, 12))
    last(first(input_ids=ids), input_ids=ids)
    ids[0, -3:] = PAD_ID
    last(first(input_ids=ids), input_ids=ids)
    assert [c["mask"] for c in sdpa_calls] == [None, None, (2, 1, 12, 12), (2, 1, 12, 12)]


def test_encoder_decoder_masks_only_what_is_padded(sdpa_calls) -> None:
    """Encoder self-attention, decoder self-attention and cross-attention per layer, 2 layers each."""
    model = _model("encoder-decoder").eval()
    src, tgt = torch.randint(4, V, (2, 9)), torch.randint(4, V, (2, 7))
    model(src, tgt)
    no_mask = [c["mask"] for c in sdpa_calls]
    sdpa_calls.clear()
    src[1, 6:] = PAD_ID
    model(src, tgt)
    src_mask = (2, 1, 1, 9)
    assert no_mask == [None] * 6
    # encoder self x2, then per decoder layer: self-attention (causal, unpadded target), cross-attention
    assert [c["mask"] for c in sdpa_calls] == [src_mask, src_mask, None, src_mask, None, src_mask]
    assert [c["is_causal"] for c in sdpa_calls] == [False, False, True, False, True, False]


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
def test_cache_with_a_left_padded_prompt_equals_the_full_recompute(attention) -> None:
    """Left-padded prompt (mask from the first call on), then unpadded tokens (False columns appended); and an
    unpadded prompt followed by a padded chunk (the earlier positions become False columns)."""
    model = _model(attention=attention).eval()
    ids = torch.randint(4, V, (3, 14))
    ids[1, :4] = PAD_ID  # left padding
    late = ids.clone()
    late[:, :6] = torch.randint(4, V, (3, 6))
    late[2, 6:8] = PAD_ID
    with torch.no_grad():
        for seq, prompt in ((ids, 6), (late, 6)):
            full = model(seq)
            cache = KVCache.for_model(model)
            parts = [model(seq[:, :prompt], cache=cache)]
            parts += [model(seq[:, t:t + 1], cache=cache) for t in range(prompt, 10)]
            parts.append(model(seq[:, 10:], cache=cache))
            assert cache.padding_mask is not None and cache.padding_mask.shape == (3, 14)
            assert torch.equal(cache.padding_mask, seq == PAD_ID)
            torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_cache_without_padding_keeps_no_mask() -> None:
    model = _model().eval()
    cache = KVCache.for_model(model)
    with torch.no_grad():
        model(torch.randint(4, V, (2, 5)), cache=cache)
        model(torch.randint(4, V, (2, 1)), cache=cache)
    assert cache.padding_mask is None and cache.length == 6
