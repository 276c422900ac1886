"""Context parallelism's algorithms (torch_handle/parallel/context) against one process's attention:

* sharding: the head-tail permutation, per document and row by row (a document's first n mod 2·cp tokens pooled and
  dealt head-tail), shard and unshard as inverses, labels shifted before sharding, the per-rank work counted exactly
  (the mask's own count) and balanced (imbalance 1.0 with head-tail, 1.75 contiguous at cp 4; ≤ 1.1 for documents of
  random lengths);
* ring, all-gather and Ulysses attention, forward and backward (dq, dk, dv), equal the model's reference attention
  (``scaled_dot_product_attention_reference`` with ``document_mask_of``'s mask) on the whole sequence in float64
  within 1e-10, on real gloo groups of 1, 2, 3 and 4 processes: causal, packed documents (shorter than a shard,
  spanning shards, one token long; lengths that 2·cp divides and that it does not), documents
  without the causal mask; MHA, GQA and MQA; head-tail balanced and contiguous. Ulysses refuses heads that cp does
  not divide, in one line. ``gather_sequence`` (DPO's rows under cp) returns the whole sequence's per-token values
  and cp times each rank's term of the gradient. The ring skips the causal future's tiles: under head-tail
  balancing every rank computes 2cp + 1 of its 4cp tiles per pass;
* ``native`` (torch's FlexAttention context parallel) in its forward only, with inputs that need no gradient, at
  cp 2 (ranks 0 and 1) on a subset (:data:`NATIVE`: causal MHA, documents with GQA and with MQA, documents without
  the causal mask; head-tail balanced and contiguous), within the same 1e-10. Its backward is torch's (``flex_attention``'s and
  ``flex_cp_allgather``'s reduce-scatter), which torch 2.13 has only on CUDA: not tested here (the test holds that
  inputs needing a gradient raise on the CPU; benchmarks/_gpu_native_cp.py checks the backward on a GPU).

One spawn of 4 processes runs every case, in rounds of disjoint groups (cp 1 beside cp 3, cp 2 twice, cp 4); every
rank builds the whole batch from the same seed and checks its share.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import run_on_gloo

pytestmark = pytest.mark.dist

B, T, D = 2, 48, 8
HEADS = {"mha": (12, 12), "gqa": (24, 12), "gqa3": (12, 4), "mqa": (4, 1)}  # (n_heads, n_kv_heads)
ALGORITHMS = ("ring", "allgather", "ulysses", "native")
NATIVE = {("mha", "causal", True), ("gqa3", "documents", True), ("mqa", "documents", False),
          ("mha", "documents-bidirectional", True)}
"""(heads, mask, balance) that ``native`` is checked on, by the cp 2 group of ranks 0 and 1 only: its eager CPU
forward costs 0.15 to 0.3 CPU s a call (``create_block_mask`` and the math path evaluate the mask_mod under vmap) and
1.8 s once a process (torch._dynamo's imports); at cp 4 on all four ranks the file cost about 20 CPU s more. Every
case at cp 1 to 4 passed by hand (max error 1.3e-15)."""


def _position_ids(lengths: list[int]) -> torch.Tensor:
    """handle's position_ids of documents of these lengths, packed: (T,), restarting at 0 at each."""
    return torch.cat([torch.arange(n) for n in lengths])


def _masks(cp: int) -> dict[str, tuple[torch.Tensor | None, bool]]:
    """name -> (position_ids (B, T) or None, causal)."""
    mixed = [1, 3, 17, 1, 14, 12]  # shorter than a shard (12 at cp 4), spanning shards, one token long
    divisible = [2 * cp, 4 * cp, T - 6 * cp]  # every length a multiple of 2·cp: balanced per document
    documents = torch.stack([_position_ids(mixed), _position_ids(divisible)])
    return {"causal": (None, True), "documents": (documents, True), "documents-bidirectional": (documents, False)}


def _reference(q, k, v, position_ids, causal):
    """One process's attention of the whole sequence: the model's reference kernel and document mask."""
    from torch_handle.model.attention import scaled_dot_product_attention_reference
    from torch_handle.model.transformer import document_mask_of

    mask = document_mask_of(position_ids) if position_ids is not None else None
    if mask is None and causal:
        mask = torch.ones(T, T, dtype=torch.bool).tril()
    if mask is not None and not causal:  # documents only: same document, either direction
        from torch_handle.parallel.context.sharding import document_ids_of

        documents = document_ids_of(position_ids)
        mask = (documents[:, None, :, None] == documents[:, None, None, :])
    return scaled_dot_product_attention_reference(q, k, v, mask)


def _backward(out: torch.Tensor, dout: torch.Tensor) -> None:
    """``out.backward(dout)`` through a scalar: its gradient is dout exactly, and autograd's check of a given
    gradient (which imports sympy, seconds per process) is not run."""
    (out * dout).sum().backward()


def _assert_close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal within 1e-10 (float64); ``torch.testing.assert_close`` would import DTensor, seconds per process."""
    assert got.shape == expected.shape and got.dtype == expected.dtype, what
    error = float((got.detach() - expected).abs().max())
    assert error <= 1e-10, f"{what}: max |error| {error:.3g}"


def _attention(name: str):
    from torch_handle.parallel.context.allgather import allgather_attention
    from torch_handle.parallel.context.native import native_attention
    from torch_handle.parallel.context.ring import ring_attention
    from torch_handle.parallel.context.ulysses import ulysses_attention

    return {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention,
            "native": native_attention}[name]


def _whole(heads: tuple[int, int], position_ids, causal: bool, seed: int) -> dict[str, torch.Tensor]:
    """q, k, v, dout of the whole sequence from ``seed`` and one process's output and gradients (float64)."""
    n_heads, n_kv_heads = heads
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n_heads, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, n_kv_heads, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, n_kv_heads, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(B, n_heads, T, D, generator=g, dtype=torch.float64)
    out = _reference(q, k, v, position_ids, causal)
    _backward(out, dout)
    return {"q": q.detach(), "k": k.detach(), "v": v.detach(), "dout": dout, "out": out.detach(), "dq": q.grad,
            "dk": k.grad, "dv": v.grad}


def _check_case(group, algorithm: str, whole: dict[str, torch.Tensor], position_ids, causal: bool,
                balance: bool) -> None:
    """This rank's share of ``algorithm`` on the group against the one-process ``whole``."""
    import torch.distributed as dist

    from torch_handle.parallel.context.sharding import document_ids_of, shard, shard_order

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    heads = (whole["q"].shape[1], whole["k"].shape[1])
    documents = None if position_ids is None else document_ids_of(position_ids)
    positions = torch.arange(T).expand(B, T) if position_ids is None else position_ids
    order = shard_order(B, T, cp, documents, balance)
    q, k, v = (shard(whole[name], order, cp, rank, dim=2).requires_grad_() for name in "qkv")
    args = (q, k, v, shard(positions, order, cp, rank), group)
    kwargs = {"document_ids": None if documents is None else shard(documents, order, cp, rank), "causal": causal}
    if algorithm == "ulysses" and (heads[0] % cp or heads[1] % cp):
        with pytest.raises(ValueError, match=r"^ulysses needs n_heads .* divisible by cp .*; use ring or allgather$"):
            _attention(algorithm)(*args, **kwargs)
        return
    what = f"{algorithm} cp {cp} rank {rank} heads {heads} causal {causal} documents {documents is not None} " \
           f"balance {balance}"
    if algorithm == "native":  # torch's flex_attention: a forward on the CPU, for inputs that need no gradient
        with torch.no_grad():
            out = _attention(algorithm)(*(a.detach() for a in args[:3]), *args[3:], **kwargs)
        _assert_close(out, shard(whole["out"], order, cp, rank, dim=2), what)
        return
    out = _attention(algorithm)(*args, **kwargs)
    _backward(out, shard(whole["dout"], order, cp, rank, dim=2))
    _assert_close(out, shard(whole["out"], order, cp, rank, dim=2), what)
    for name, mine in zip("qkv", (q, k, v)):
        _assert_close(mine.grad, shard(whole[f"d{name}"], order, cp, rank, dim=2), f"d{name}: {what}")


def _cases(cp: int):
    """(heads, position_ids, causal, balances) to check: every head layout causal and with documents, balanced and
    contiguous; documents without the causal mask for MHA."""
    masks = _masks(cp)
    for name, heads in HEADS.items():
        for mask in ("causal", "documents"):
            yield (name, mask), (heads, *masks[mask], (True, False))
    yield ("mha", "documents-bidirectional"), (HEADS["mha"], *masks["documents-bidirectional"], (True,))


def _tile_counts(group, balance: bool) -> list[tuple[int, int]]:
    """(computed, skipped) tiles of every rank for causal attention without documents, forward and backward."""
    import torch.distributed as dist

    from torch_handle.parallel.context.ring import TileCounts, ring_attention
    from torch_handle.parallel.context.sharding import shard, shard_order

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    order = shard_order(1, T, cp, balance=balance)
    q, k, v = (shard(torch.randn(1, 2, T, D, dtype=torch.float64), order, cp, rank, dim=2).requires_grad_()
               for _ in range(3))
    counts = TileCounts()
    ring_attention(q, k, v, shard(torch.arange(T)[None], order, cp, rank), group, counts=counts).sum().backward()
    every = [None] * cp
    dist.all_gather_object(every, (counts.computed, counts.skipped), group=group)
    return every


def _check_gather_sequence(group) -> None:
    """``gather_sequence`` (a preference loss's rows under cp): every rank's per-token values, unsharded, are the
    whole sequence's; each rank's slice gets the gradient of every rank's (identical) loss, cp times its own term."""
    import torch.distributed as dist

    from torch_handle.parallel.context.comms import gather_sequence
    from torch_handle.parallel.context.sharding import shard, shard_order, unshard

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(cp)
    whole, weight = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g,
                                                                                     dtype=torch.float64)
    order = shard_order(B, T, cp, torch.stack([torch.arange(T) // 20, torch.arange(T) // 7]))
    local = shard(whole, order, cp, rank).requires_grad_()
    rows = unshard(gather_sequence(local, 1, group), order)  # (B, T)
    _assert_close(rows, whole, f"gather_sequence cp {cp}")
    (rows * weight).sum().backward()
    _assert_close(local.grad, cp * shard(weight, order, cp, rank), f"gather_sequence's gradient cp {cp}")


def _check_group(group) -> None:
    import torch.distributed as dist

    cp = dist.get_world_size(group)
    native = cp == 2 and dist.get_rank() < 2  # the group of ranks 0 and 1 (see NATIVE)
    _check_gather_sequence(group)
    for seed, (name, (heads, position_ids, causal, balances)) in enumerate(_cases(cp)):
        whole = _whole(heads, position_ids, causal, seed)  # one reference for every algorithm and order
        for algorithm in ALGORITHMS:
            for balance in balances:
                if algorithm != "native" or (native and (*name, balance) in NATIVE):
                    _check_case(group, algorithm, whole, position_ids, causal, balance)
    if native:  # its backward is torch's, CUDA only: the reason handle validate refuses it on a CPU
        q = torch.randn(1, 2, T // cp, D, dtype=torch.float64, requires_grad=True)
        with pytest.raises(NotImplementedError, match="^FlexAttention does not support backward on CPU"):
            _attention("native")(q, q, q, torch.arange(T // cp)[None], group)
    balanced, contiguous = _tile_counts(group, True), _tile_counts(group, False)
    # cp blocks of 4 tiles per rank, forward and backward
    assert all(c + s == 2 * 4 * cp for c, s in balanced + contiguous), (balanced, contiguous)
    assert all(c == 2 * (2 * cp + 1) for c, _ in balanced), f"head-tail: 2cp + 1 tiles a pass, got {balanced}"
    if cp > 1:
        assert contiguous[0][1] > contiguous[-1][1], f"contiguous: rank 0 skips the most future, got {contiguous}"


GROUPS = (([0], [1, 2, 3]), ([0, 1], [2, 3]), ([0, 1, 2, 3],))
"""Rounds of disjoint cp groups on 4 processes: cp 1 beside cp 3, cp 2 twice, cp 4; groups of other ranks than
0 .. cp - 1 check that the ring sends to the group's neighbours by their global ranks."""


def _body(rank: int, tmp: Path) -> None:
    import torch.distributed as dist

    for groups in GROUPS:
        made = [dist.new_group(ranks) for ranks in groups]  # every rank creates every group, in the same order
        for ranks, group in zip(groups, made):
            if rank in ranks:
                _check_group(group)
        dist.barrier()


def test_attention_equals_one_process(tmp_path: Path) -> None:
    run_on_gloo(_body, tmp_path, world_size=4)


def test_head_tail_order_and_shards() -> None:
    from torch_handle.parallel.context.sharding import head_tail_order, shard, shard_batch, shard_order, unshard

    assert head_tail_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert head_tail_order(6, 1).tolist() == list(range(6))
    with pytest.raises(ValueError, match=r"^head-tail balancing needs seq_len \(12\) divisible by 2 × cp \(8\)$"):
        head_tail_order(12, 4)
    # row 0: documents of 4 and 8 tokens, multiples of 2·cp = 4; row 1 (5 + 7 tokens): tokens 0 and 5 .. 7 (each
    # document's first n mod 4) pooled and dealt head-tail, 1 .. 4 and 8 .. 11 head-tail per document
    documents = torch.tensor([[1] * 4 + [2] * 8, [1] * 5 + [2] * 7])
    order = shard_order(2, 12, 2, documents)
    assert order[0].tolist() == [0, 3, 4, 5, 10, 11, 1, 2, 6, 7, 8, 9]
    assert order[1].tolist() == [0, 1, 4, 7, 8, 11, 2, 3, 5, 6, 9, 10]
    x = torch.arange(2 * 12 * 3).view(2, 12, 3)
    shards = [shard(x, order, 2, r) for r in range(2)]
    assert torch.equal(unshard(torch.cat(shards, dim=1), order), x)

    ids = torch.arange(100, 112)[None]
    labels = torch.arange(101, 113)[None]  # shifted on the whole sequence: each shard keeps its last label
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]])
    local = shard_batch(ids, labels, 2, 1, position_ids)
    assert local.input_ids.tolist() == [[101, 102, 106, 107, 108, 109]]
    assert (local.labels - local.input_ids).eq(1).all()
    assert local.positions.tolist() == [[1, 2, 2, 3, 4, 5]] and local.document_ids.tolist() == [[1, 1, 2, 2, 2, 2]]
    assert shard_batch(ids, labels, 2, 0).positions.tolist() == [[0, 1, 2, 9, 10, 11]]


def test_attention_pairs_and_imbalance() -> None:
    from torch_handle.model.transformer import document_mask_of
    from torch_handle.parallel.context.sharding import attention_pairs, document_ids_of, imbalance, shard_order

    position_ids = torch.stack([torch.cat([torch.arange(n) for n in lengths])
                                for lengths in ([1, 3, 17, 1, 14, 12], [8, 16, 24])])
    documents = document_ids_of(position_ids)
    for causal in (True, False):
        pairs = attention_pairs(shard_order(2, 48, 4, documents), 4, documents, causal)
        same = documents[:, :, None] == documents[:, None, :]
        expected = document_mask_of(position_ids) if causal else same
        assert pairs.sum() == expected.sum()  # the count is the mask's own
    whole = attention_pairs(shard_order(1, 4096, 4), 4)
    assert imbalance(whole) == 1.0
    assert imbalance(attention_pairs(shard_order(1, 4096, 4, balance=False), 4)) == pytest.approx(1.75, abs=1e-3)
    assert imbalance(attention_pairs(shard_order(2, 48, 4, documents), 4, documents)) < imbalance(
        attention_pairs(shard_order(2, 48, 4, documents, balance=False), 4, documents))
    divisible = document_ids_of(torch.cat([torch.arange(n) for n in [8, 16, 24]])[None])
    assert imbalance(attention_pairs(shard_order(1, 48, 4, divisible), 4, divisible)) == 1.0
    # documents of random lengths (none a multiple of 8) at cp 4: balanced per document within the 1.1 target
    lengths = torch.randint(1, 3000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    lengths = [n for n in lengths if n % 8] + [16384]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[:16384][None]
    random_documents = document_ids_of(position_ids)
    assert imbalance(attention_pairs(shard_order(1, 16384, 4, random_documents), 4, random_documents)) <= 1.1
