"""The CPU fast path (issue 10) computes what the old path computed: chunked cross-entropy vs ``F.cross_entropy``,
the 16-bit-threshold dropout (global RNG, resumable), attention with dropout in fp32 vs SDPA, fused AdamW."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import torch_handle.model.attention as A
from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.model.args import TransformerArgs
from torch_handle.model.kernels import Dropout, dropout
from torch_handle.model.transformer import build_transformer
from torch_handle.train.loss import loss_fn


def _old_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss_fn before issue 10: F.cross_entropy on fp32 (B·T, V) logits."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def test_chunked_cross_entropy_matches_f_cross_entropy_values_and_grads() -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 50, 300, generator=g) * 4).to(torch.bfloat16).float()  # (B, T, V), 300 rows > 1 chunk
    labels = torch.randint(0, 300, (3, 50), generator=g)
    labels[0, :7] = IGNORE_INDEX
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    new, n = loss_fn(a, labels)
    old = _old_loss(b, labels)
    new.backward(), old.backward()
    assert int(n) == 143
    assert torch.allclose(new, old, rtol=0, atol=1e-6)
    assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-7)


def test_cross_entropy_with_every_label_ignored_is_nan_like_before() -> None:
    labels = torch.full((1, 4), IGNORE_INDEX)
    assert loss_fn(torch.randn(1, 4, 9), labels)[0].isnan() and _old_loss(torch.randn(1, 4, 9), labels).isnan()


def test_dropout_is_inverted_dropout_with_p_to_2_pow_minus_16() -> None:
    torch.manual_seed(0)
    x = torch.ones(1 << 20)
    y = dropout(x, 0.1)
    cut = round(0.1 * 2**16)
    assert abs((y == 0).float().mean().item() - 0.1) < 2e-3
    assert torch.all((y == 0) | (y == 2**16 / (2**16 - cut)))
    assert abs(y.mean().item() - 1.0) < 3e-3
    assert dropout(x, 0.1, training=False) is x and dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))


def test_dropout_uses_the_global_generator_so_resume_replays_the_masks() -> None:
    torch.manual_seed(3)
    x = torch.randn(4, 33, dtype=torch.bfloat16, requires_grad=True)
    state = torch.get_rng_state()
    y1 = Dropout(0.3)(x)
    torch.set_rng_state(state)
    y2 = Dropout(0.3)(x)
    assert torch.equal(y1, y2) and y1.dtype == torch.bfloat16
    y1.sum().backward()  # gradient: the same scaled mask
    assert torch.equal(x.grad, (y1.detach() != 0).to(x.dtype) * torch.tensor(1 / 0.7, dtype=x.dtype) * (x != 0))


def test_attention_with_cpu_dropout_computes_what_sdpa_computes(monkeypatch) -> None:
    torch.manual_seed(0)
    mha = A.MultiHeadAttention(32, 4, dropout=0.2).train()
    x = torch.randn(2, 9, 32)
    monkeypatch.setattr(A, "dropout", lambda t, p, training=True: t)  # every mask keeps everything
    fast = mha(x, causal=True)  # the fp32 reference path, chosen for dropout on CPU
    mha.dropout = 0.0
    sdpa = mha(x, causal=True)  # F.scaled_dot_product_attention
    assert torch.allclose(fast, sdpa, atol=1e-6)


def test_bf16_attention_with_cpu_dropout_runs_in_bf16_and_stays_close_to_fp32(monkeypatch) -> None:
    """Under bf16 autocast the reference kernel gets bf16 q/k/v (no fp32 upcast: half the time on CPU) and its
    output stays within bf16 rounding of the fp32 result."""
    torch.manual_seed(0)
    mha = A.MultiHeadAttention(32, 4, dropout=0.2).train()
    x = torch.randn(2, 9, 32)
    monkeypatch.setattr(A, "dropout", lambda t, p, training=True: t)  # every mask keeps everything
    reference, seen = A.scaled_dot_product_attention_reference, []

    def spy(q, k, v, mask=None, dropout_p=0.0):
        seen.append(q.dtype)
        return reference(q, k, v, mask, dropout_p)

    monkeypatch.setattr(A, "scaled_dot_product_attention_reference", spy)
    fp32 = mha(x, causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = mha(x, causal=True)
    assert seen == [torch.float32, torch.bfloat16] and bf16.dtype == torch.bfloat16
    assert torch.allclose(bf16.float(), fp32, atol=2e-2, rtol=2e-2), (bf16.float() - fp32).abs().max()


def _train_losses(fast: bool, steps: int = 20) -> list[float]:
    torch.manual_seed(0)
    args = TransformerArgs(512, 64, 4, 2, 256, dropout=0.0, max_len=32, norm_first=True)
    model = build_transformer(args)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01, fused=fast or None)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        seq = torch.randint(0, 512, (4, 33), generator=data)
        logits = model(seq[:, :-1])
        loss = loss_fn(logits, seq[:, 1:])[0] if fast else _old_loss(logits, seq[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_fast_path_fp32_losses_equal_the_old_path_over_20_steps() -> None:
    """Dropout 0, fp32: new loss_fn + fused AdamW vs F.cross_entropy + for-loop AdamW, same data and init."""
    old, new = _train_losses(fast=False), _train_losses(fast=True)
    assert max(abs(a - b) for a, b in zip(old, new)) < 1e-4, (old, new)
    assert new[-1] < new[0]
