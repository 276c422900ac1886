"""Expert parallelism on 2 real gloo processes, both implementations (by hand and native), in one spawn:

* dispatch then combine through the all-to-alls returns the input and its gradient exactly, with the rows reaching
  the experts grouped by local expert, also when an expert, or a whole rank, receives no rows and when a rank sends
  none; a rank stuck in the combine is named so in its heartbeat's phase, with the split sizes it used;
* an MoE decoder (fp32, dropless, aux and z losses on) split over ep = 2 gives the one-process loss of the same two
  micro-batches and every gradient within 1e-6 once the strategy's reductions ran (dense: the DDP average; experts:
  :meth:`ExpertParallel.sync_grads`), also with routing forced onto one rank's experts (the other receives no token),
  and the norm the trainer clips by; the all-to-all bytes are 4·N·k·C·4 per layer summed over the ranks (dispatch
  and combine, forward and backward, fp32); the gathered state dict is the one-process one, and cut again it loads
  back into a split model.

Each rank computes the one-process reference itself (the same seed builds the same model everywhere).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.helpers import run_on_gloo

pytestmark = pytest.mark.dist

E, B, T, C = 4, 2, 8, 16
IMPLS = ("scratch", "native")


class _Rows(nn.Module):
    """An "experts" module that returns its rows: a stacked parameter (E, 1) to split, and a record of what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(E, 1))
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sleep_s = 0.0

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.detach().clone(), counts.clone()))
        time.sleep(self.sleep_s)
        return x * 1.0


def _meshes():
    """(layout, mesh, expert mesh) of ep 2 on the 2 ranks."""
    from torch_handle.common.parallel_dims import ParallelDims
    from torch_handle.parallel.mesh import build_expert_mesh, build_mesh

    layout = ParallelDims(2, ep=2)
    return layout, build_mesh(layout, "cpu"), build_expert_mesh(layout, "cpu")


def _style(impl: str, ep_mesh, module: nn.Module):
    from torch_handle.parallel.expert.native import NativeExpertParallel
    from torch_handle.parallel.expert.scratch import ScratchExpertParallel

    if impl == "scratch":
        return ScratchExpertParallel(ep_mesh.get_group(), 0).apply(module)
    return NativeExpertParallel(0).apply(module, ep_mesh)


def _round_trips(rank: int, tmp: Path, mesh) -> None:
    """Dispatch -> identity experts -> combine is the identity, forward and backward, for every routing case."""
    # rows per expert sent by (rank 0, rank 1): all experts; none for expert 1 and rank 1's experts from rank 0;
    # nothing for rank 1's experts at all (rank 1 receives no row); rank 1 sends no row
    cases = [([3, 1, 2, 5], [2, 4, 1, 1]), ([4, 0, 0, 0], [1, 0, 2, 3]), ([3, 2, 0, 0], [1, 4, 0, 0]),
             ([1, 2, 3, 1], [0, 0, 0, 0])]
    for impl in IMPLS:
        module = _Rows()
        _style(impl, mesh, module)
        for counts_by_rank in cases:
            counts = torch.tensor(counts_by_rank[rank])
            # column 0 tags a row with its expert, column 1 with its source rank: the experts' order is checkable
            experts = torch.repeat_interleave(torch.arange(E), counts).double()
            x = torch.cat([experts[:, None], torch.full_like(experts[:, None], rank),
                           torch.randn(len(experts), C - 2, dtype=torch.float64)], dim=1).requires_grad_()
            y = module(x, counts)
            assert torch.equal(y, x), (impl, counts_by_rank)
            grad = torch.randn_like(x)
            y.backward(grad)
            assert torch.equal(x.grad, grad), (impl, counts_by_rank)
            rows, local_counts = module.seen[-1]
            mine = [c[2 * rank: 2 * rank + 2] for c in counts_by_rank]
            assert local_counts.tolist() == [a + b for a, b in zip(*mine)], (impl, counts_by_rank)
            want = torch.repeat_interleave(torch.arange(2 * rank, 2 * rank + 2), local_counts).double()
            assert torch.equal(rows[:, 0], want), (impl, counts_by_rank)  # grouped by local expert, in order
            for e in range(2):  # within an expert: rank 0's rows, then rank 1's
                sources = rows[rows[:, 0] == 2 * rank + e, 1]
                assert torch.equal(sources, sources.sort().values)

    # a rank stuck in the combine: its heartbeat's phase names the combine and its split sizes
    from torch_handle.observe import heartbeat

    hb = heartbeat.start_heartbeat(tmp / f"hb{rank}", rank, interval_s=60)
    hb.beat("train_step")
    module = _Rows()
    _style("scratch", mesh, module)
    module.sleep_s = 1.0 if rank == 1 else 0.0
    phases: list[str] = []
    if rank == 0:
        threading.Timer(0.5, lambda: phases.append(hb.phase)).start()
    module(torch.randn(5, C), torch.tensor([1, 1, 2, 1]))
    hb.stop()
    if rank == 0:
        # each rank dispatched 2 rows to rank 0's experts and 3 to rank 1's: rank 0 got 2 + 2 and returns them
        assert phases == ["ep combine layer 0: send [2, 2] recv [2, 3]"], phases
        assert hb.phase == "train_step"  # restored once the all-to-all returned


def _args(**extra):
    from torch_handle.model.args import TransformerArgs

    return TransformerArgs(vocab_size=32, d_model=C, n_heads=4, n_layers=2, d_ff=32, dropout=0.0, max_len=T,
                           mlp="swiglu", n_experts=E, top_k=2, moe_every=1, norm_first=True, router_aux_loss=0.01,
                           router_z_loss=0.001, **extra)


def _force_onto_rank_0(model: nn.Module) -> None:
    """Route every token of every MoE layer to experts 0 and 1 (rank 0's): rank 1's experts receive no token. The
    weights stay the router's (differentiable)."""
    from torch_handle.model.moe import moe_layers
    from torch_handle.model.router import Routing

    for layer in moe_layers(model):
        gate = layer.gate
        plain = gate.forward

        def forced(x, plain=plain):
            r = plain(x)
            experts = torch.tensor([[0, 1]]).expand(x.shape[0], 2)
            weights = r.probs.gather(1, experts)
            return Routing(weights / weights.sum(-1, keepdim=True), experts, r.probs, r.logits)

        gate.forward = forced


def _decoder(rank: int, meshes, impl: str, forced: bool) -> None:
    from torch_handle.model.moe import moe_layers
    from torch_handle.model.transformer import DecoderLM
    from torch_handle.parallel.tensor.checkpoint import load_full_state
    from torch_handle.train.shares.expert import ExpertParallel
    from torch_handle.train.grad_norm import mesh_grad_norm
    from torch_handle.train.loss import AuxLossScale

    case = f"{impl} forced={forced}"
    layout, mesh, expert_mesh = meshes
    ctx = SimpleNamespace(layout=layout, mesh=mesh, ep_mesh=expert_mesh, is_main=rank == 0)
    ids = torch.randint(0, 32, (2, B, T), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(0)
    ref = DecoderLM(_args()).train()
    AuxLossScale(ref, 0.5)  # one process: the two micro-batches as gradient accumulation, each aux loss at 1/2
    if forced:
        _force_onto_rank_0(ref)
    ref_loss = sum(F.cross_entropy(ref(ids[r]).flatten(0, 1), ids[r].flatten()) for r in range(2)) / 2
    ref_loss.backward()
    ref_norm = torch.stack([p.grad.double().pow(2).sum() for p in ref.parameters()]).sum().sqrt().item()

    torch.manual_seed(0)
    model = DecoderLM(_args()).train()
    AuxLossScale(model, 1.0)  # each rank its micro-batch, as DDP runs it (and averages)
    ep = ExpertParallel(ctx, impl)
    ep.parallelize(model)
    if forced:
        _force_onto_rank_0(model)
    loss = F.cross_entropy(model(ids[rank]).flatten(0, 1), ids[rank].flatten())
    loss.backward()
    both = loss.detach().clone()
    dist.all_reduce(both)
    assert abs(both.item() / 2 - ref_loss.item()) <= 1e-6, (case, both.item() / 2, ref_loss.item())
    experts = {id(p) for p in ep.params}
    for p in model.parameters():  # DDP's average of the dense gradients
        if id(p) not in experts:
            dist.all_reduce(p.grad)
            p.grad /= 2
    ep.sync_grads()
    norm = mesh_grad_norm(list(model.named_parameters()), mesh, **ep.norm_args(model))
    assert abs(norm - ref_norm) <= 1e-6 * ref_norm, (case, norm, ref_norm)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        want = q.grad.chunk(2)[rank] if id(p) in experts else q.grad
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {name}: {m}")
        if forced and rank == 1 and id(p) in experts:
            assert not grad.any(), (case, name)  # its experts saw no token

    sent = torch.tensor([m.traffic.bytes for m in moe_layers(model)])
    dist.all_reduce(sent)
    assert sent.tolist() == [4 * (2 * B * T) * 2 * C * 4] * 2, (case, sent.tolist())  # 4·N·k·C·4, N both ranks'
    assert all(m.traffic.wait_s > 0 for m in moe_layers(model))

    torch.manual_seed(0)
    initial = DecoderLM(_args()).state_dict()  # the weights both models started from (not stepped)
    full = ep.full_state_dict(model)  # a collective: gathered on rank 0
    if rank == 0:
        assert full.keys() == initial.keys()
        for name, value in initial.items():
            assert torch.equal(full[name], value), (case, name)
    weights = {k: v.clone() for k, v in initial.items()}
    torch.manual_seed(1)
    fresh = DecoderLM(_args()).train()
    ep2 = ExpertParallel(ctx, impl)
    ep2.parallelize(fresh)
    ep2.cut_state(fresh, weights, None)
    load_full_state(fresh, None, weights, None, "scratch", {}, SimpleNamespace(rank=0))
    for name, p in fresh.named_parameters():
        value, q = (p.to_local() if hasattr(p, "to_local") else p), initial[name]
        assert torch.equal(value, q.chunk(2)[rank] if any(p is x for x in ep2.params) else q), (case, name)


def _body(rank: int, tmp: Path) -> None:
    meshes = _meshes()
    _round_trips(rank, tmp, meshes[2]["ep"])
    for impl in IMPLS:
        for forced in (False, True):
            _decoder(rank, meshes, impl, forced)


def test_dispatch_combine_and_an_moe_decoder_split_over_two_ranks(tmp_path: Path) -> None:
    run_on_gloo(_body, tmp_path)
