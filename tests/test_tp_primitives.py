"""The hand-written tensor-parallel pieces against their one-process originals, on 2 real gloo processes.

Each check builds the one-process module with one seed on both ranks, splits it, and compares forward outputs and
(gathered) gradients. Tiny sizes: the point is exactness, not speed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torch_handle.model.linear_cross_entropy_tp import (vocab_parallel_linear_cross_entropy,
                                                        vocab_parallel_sequence_logps)
from torch_handle.parallel.tensor.cross_entropy import (IGNORE_INDEX, vocab_parallel_cross_entropy,
                                                        vocab_parallel_token_losses)
from torch_handle.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                                 all_reduce_sp_grads, mark_sequence_parallel)
from torch_handle.parallel.tensor.mappings import TPGroup, gather_sequence, split_to_sp
from torch_handle.parallel.tensor.plan import Stacked, shard, unshard

from tests.helpers import run_on_gloo, tp_mesh

pytestmark = pytest.mark.dist

B, S, H, FF, V = 2, 4, 8, 12, 10


def _gather(t: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(tp.size)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


def check_mlp(tp: TPGroup, sequence_parallel: bool) -> None:
    """LayerNorm -> column-parallel -> GELU -> row-parallel, with and without sequence parallelism, equals the
    one-process block; the bytes counted equal the analytic volume."""
    torch.manual_seed(0)
    norm, up, down = nn.LayerNorm(H), nn.Linear(H, FF), nn.Linear(FF, H)
    x = torch.randn(B, S, H, requires_grad=True)
    ref = down(F.gelu(up(norm(x))))
    ref.square().sum().backward()

    p_norm = nn.LayerNorm(H)
    p_norm.load_state_dict(norm.state_dict())
    col = ColumnParallelLinear.from_linear(up, tp, sequence_parallel=sequence_parallel)
    row = RowParallelLinear.from_linear(down, tp, sequence_parallel=sequence_parallel)
    xp = x.detach().clone().requires_grad_(True)
    tp.stats.reset()
    if sequence_parallel:
        mark_sequence_parallel(p_norm)
        h = split_to_sp(xp, tp)  # (B, S/tp, H)
        out = gather_sequence(row(F.gelu(col(p_norm(h)))), tp)
    else:
        out = row(F.gelu(col(p_norm(xp))))
    out.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xp.grad, x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_gather(col.weight.grad, tp, 0), up.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_gather(row.weight.grad, tp, 1), down.weight.grad, rtol=1e-5, atol=1e-6)
    act = B * S * H * 4  # one (b, s, h) fp32 activation
    if sequence_parallel:
        # all-gather + reduce-scatter forward, the same backward, plus the two gathers around the block
        assert tp.stats.by_op == {"all_gather": 4, "reduce_scatter": 2}, tp.stats.by_op
        assert tp.stats.bytes == 6 * act
        assert not torch.allclose(p_norm.weight.grad, norm.weight.grad)  # a shard's partial sum...
        all_reduce_sp_grads(nn.ModuleList([p_norm, row]), tp)  # ...until summed over the group
    else:
        assert tp.stats.by_op == {"all_reduce": 2}, tp.stats.by_op  # g forward, f backward
        assert tp.stats.bytes == 2 * act
    torch.testing.assert_close(p_norm.weight.grad, norm.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(row.bias.grad, down.bias.grad, rtol=1e-5, atol=1e-6)


def check_fused_qkv(tp: TPGroup) -> None:
    """A fused [Q; K; V] projection split with parts=3 keeps whole heads: each rank's output is its Q, K, V heads."""
    torch.manual_seed(1)
    qkv = nn.Linear(H, 3 * H)
    x = torch.randn(B, S, H)
    q, k, v = qkv(x).chunk(3, dim=-1)  # (B, S, H) each: heads are consecutive H/n_heads columns
    local = ColumnParallelLinear.from_linear(qkv, tp, parts=3)
    lq, lk, lv = local(x).chunk(3, dim=-1)  # (B, S, H/tp) each
    for full, part in ((q, lq), (k, lk), (v, lv)):
        torch.testing.assert_close(part, full.chunk(tp.size, dim=-1)[tp.rank])


def check_fused_gqa(tp: TPGroup) -> None:
    """Grouped-query attention's fused projection, parts of unequal widths (4 query heads, 2 key/value heads of
    width 4): each rank keeps its slice of each part, the query heads of its key/value heads, and a call with
    ``parts=`` (cross-attention) computes the selected parts of that slice; unshard puts the one-process weight back."""
    torch.manual_seed(1)
    parts = (16, 8, 8)
    qkv = nn.Linear(H, sum(parts))
    x = torch.randn(B, S, H)
    local = ColumnParallelLinear.from_linear(qkv, tp, parts=parts)
    assert local.local_parts == (8, 4, 4)
    mine = [full.chunk(tp.size, dim=-1)[tp.rank] for full in qkv(x).split(parts, dim=-1)]
    for got, want in zip(local(x).split(local.local_parts, dim=-1), mine):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(local(x, parts=slice(1, 3)), torch.cat(mine[1:], dim=-1))
    plan = {"qkv": Stacked(parts)}
    torch.testing.assert_close(unshard("qkv.weight", local.weight.detach(), plan, tp), qkv.weight.detach())
    torch.testing.assert_close(shard("qkv.bias", qkv.bias.detach(), plan, tp), local.bias.detach())


def check_embedding_and_loss(tp: TPGroup, eps: float) -> None:
    """Vocabulary-parallel embedding and cross-entropy (ignore_index, label smoothing) equal the one-process ones."""
    torch.manual_seed(2)
    emb, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    ids = torch.randint(0, V, (B, S))
    labels = torch.randint(0, V, (B, S))
    labels[0, 0] = IGNORE_INDEX
    logits = head(emb(ids))
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, label_smoothing=eps)
    ref.backward()

    p_emb = VocabParallelEmbedding.from_embedding(emb, tp)
    p_head = ColumnParallelLinear.from_linear(head, tp)
    tp.stats.reset()
    loss, n = vocab_parallel_cross_entropy(p_head(p_emb(ids)), labels, tp, label_smoothing=eps)
    forward_calls = tp.stats.calls
    loss.backward()
    assert int(n) == B * S - 1
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_gather(p_emb.weight.grad, tp, 0), emb.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_gather(p_head.weight.grad, tp, 0), head.weight.grad, rtol=1e-5, atol=1e-6)
    assert forward_calls == 3  # embedding's g, the loss's MAX and its (N, 3) SUM
    assert tp.stats.calls == 4  # + the head's f in backward; the loss sends nothing backward


def check_token_losses(tp: TPGroup) -> None:
    """The per-token vocabulary-parallel cross-entropy (a preference loss's row sums) equals ``F.cross_entropy(
    reduction="none")`` in value, 0 where ignored, and in the gradient of a weighted sum of rows."""
    torch.manual_seed(3)
    logits = torch.randn(B, S, V, requires_grad=True)
    labels = torch.randint(0, V, (B, S))
    labels[1, :2] = IGNORE_INDEX
    weights = torch.randn(B)  # a different gradient for each row
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    (ref.view(B, S).sum(1) * weights).sum().backward()
    mine = logits.detach()[..., tp.rank * V // tp.size:(tp.rank + 1) * V // tp.size].clone().requires_grad_()
    token = vocab_parallel_token_losses(mine, labels, tp)
    (token.sum(1) * weights).sum().backward()
    torch.testing.assert_close(token, ref.view(B, S), rtol=1e-5, atol=1e-6)
    assert (token[1, :2] == 0).all()
    torch.testing.assert_close(_gather(mine.grad, tp, -1), logits.grad, rtol=1e-5, atol=1e-6)


def check_chunked_loss(tp: TPGroup, eps: float, sequence_parallel: bool, mesh=None) -> None:
    """The chunked vocabulary-parallel loss (chunks of 3 of the 8 tokens) equals the column-parallel output layer's
    logits through ``vocab_parallel_cross_entropy`` within 1e-6 in fp32: loss, hidden states' gradient (summed over
    the group) and the local weight rows' gradient; with a ``mesh`` (native TP) the weight a ``Shard(0)`` DTensor.
    Two all-reduces per chunk forward."""
    torch.manual_seed(4)
    head = nn.Linear(H, V, bias=False)
    x = torch.randn(B, S, H)
    labels = torch.randint(0, V, (B, S))
    labels[0, 1] = labels[1, 3] = IGNORE_INDEX
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
    col = ColumnParallelLinear.from_linear(head, tp, sequence_parallel=sequence_parallel)
    enter = (lambda t: split_to_sp(t, tp)) if sequence_parallel else (lambda t: t)
    ref, _ = vocab_parallel_cross_entropy(col(enter(x_ref)), labels, tp, label_smoothing=eps)
    ref.backward()
    weight = nn.Parameter(col.weight.detach().clone())
    if mesh is not None:
        from torch.distributed.tensor import Shard, distribute_tensor

        weight = nn.Parameter(distribute_tensor(head.weight.detach(), mesh, [Shard(0)]))
    tp.stats.reset()
    loss = vocab_parallel_linear_cross_entropy(enter(x_new), weight, labels, tp, eps,
                                               sequence_parallel=sequence_parallel, rows=3)
    assert tp.stats.by_op == {"all_reduce": 6} | ({"all_gather": 1} if sequence_parallel else {}), tp.stats.by_op
    loss.backward()
    grad_w = weight.grad if mesh is None else weight.grad.to_local()
    exact = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(loss, ref, **exact)
    torch.testing.assert_close(x_new.grad, x_ref.grad, **exact)
    torch.testing.assert_close(grad_w, col.weight.grad, **exact)


def check_chunked_loss_uneven(tp: TPGroup, mesh) -> None:
    """Native TP splits a vocabulary tp does not divide (9 rows: 5 and 4, ``torch.chunk``'s split): the chunked loss
    equals the one-process ``F.cross_entropy`` of the whole logits within 1e-6 in loss and gradients."""
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(5)
    head = nn.Linear(H, V - 1, bias=False)
    x = torch.randn(B, S, H, requires_grad=True)
    labels = torch.randint(0, V - 1, (B, S))
    labels[1, 0] = IGNORE_INDEX
    ref = F.cross_entropy(head(x).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, label_smoothing=0.1)
    ref.backward()
    weight = nn.Parameter(distribute_tensor(head.weight.detach(), mesh, [Shard(0)]))
    x_new = x.detach().clone().requires_grad_()
    loss = vocab_parallel_linear_cross_entropy(x_new, weight, labels, tp, 0.1, rows=3)
    loss.backward()
    exact = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(loss, ref, **exact)
    torch.testing.assert_close(x_new.grad, x.grad, **exact)
    torch.testing.assert_close(weight.grad.full_tensor(), head.weight.grad, **exact)


def check_chunked_logps(tp: TPGroup, sequence_parallel: bool, mesh=None, vocab: int = V) -> None:
    """The chunked vocabulary-parallel per-sequence log-probabilities (chunks of 3 of the 8 tokens) equal minus the
    row sums of ``vocab_parallel_token_losses`` of the column-parallel output layer's logits within 1e-6 in fp32
    (what DPO takes under tp): values, and the gradients of a weighted sum of rows in the hidden states (summed over
    the group) and the local weight rows; with a ``mesh`` (native TP) the weight a ``Shard(0)`` DTensor, and a
    ``vocab`` tp does not divide (9: 5 and 4 rows) against the one-process ``F.cross_entropy``. Two all-reduces per
    chunk forward, none backward but the hidden states' entry into the TP region."""
    torch.manual_seed(6)
    head = nn.Linear(H, vocab, bias=False)
    x = torch.randn(B, S, H)
    labels = torch.randint(0, vocab, (B, S))
    labels[0, 1] = labels[1, 3] = labels[1, 0] = IGNORE_INDEX
    weights = torch.randn(B)  # a different gradient for each row
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
    if vocab % tp.size:
        ref = -F.cross_entropy(head(x_ref).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="none").view(B, S).sum(1)
        (ref * weights).sum().backward()
        ref_w = head.weight.grad.chunk(tp.size)[tp.rank]
    else:
        col = ColumnParallelLinear.from_linear(head, tp, sequence_parallel=sequence_parallel)
        enter = (lambda t: split_to_sp(t, tp)) if sequence_parallel else (lambda t: t)
        ref = -vocab_parallel_token_losses(col(enter(x_ref)), labels, tp).sum(1)
        (ref * weights).sum().backward()
        ref_w = col.weight.grad
    weight = nn.Parameter(head.weight.detach().chunk(tp.size)[tp.rank].clone())
    if mesh is not None:
        from torch.distributed.tensor import Shard, distribute_tensor

        weight = nn.Parameter(distribute_tensor(head.weight.detach(), mesh, [Shard(0)]))
    tp.stats.reset()
    mine = split_to_sp(x_new, tp) if sequence_parallel else x_new
    logps = vocab_parallel_sequence_logps(mine, weight, labels, tp, sequence_parallel=sequence_parallel, rows=3)
    assert tp.stats.by_op == {"all_reduce": 6} | ({"all_gather": 1} if sequence_parallel else {}), tp.stats.by_op
    (logps * weights).sum().backward()
    grad_w = weight.grad if mesh is None else weight.grad.to_local()
    exact = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(logps, ref.detach(), **exact)
    assert (logps < 0).all() and logps[0] != logps[1]
    torch.testing.assert_close(x_new.grad, x_ref.grad, **exact)
    torch.testing.assert_close(grad_w, ref_w, **exact)


def _checks(rank: int, tmp: Path) -> None:
    tp = TPGroup()
    check_mlp(tp, sequence_parallel=False)
    check_mlp(tp, sequence_parallel=True)
    check_fused_qkv(tp)
    check_fused_gqa(tp)
    check_embedding_and_loss(tp, eps=0.0)
    check_embedding_and_loss(tp, eps=0.1)
    check_token_losses(tp)
    mesh = tp_mesh()[0]
    for eps, sequence_parallel, native in ((0.1, False, False), (0.0, True, False), (0.1, True, True)):
        check_chunked_loss(tp, eps, sequence_parallel, mesh if native else None)
    check_chunked_loss_uneven(tp, mesh)
    for sequence_parallel, native in ((False, False), (True, False), (True, True)):
        check_chunked_logps(tp, sequence_parallel, mesh if native else None)
    check_chunked_logps(tp, False, mesh, vocab=V - 1)


def test_tp_pieces_equal_one_process(tmp_path: Path) -> None:
    run_on_gloo(_checks, tmp_path)
