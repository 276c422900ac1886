"""Packed documents (``position_ids``, issue 37) split over 2 processes: FSDP2 with activation checkpointing, expert
parallel (an MoE decoder), tensor parallel (hand-written and DTensor, with and without sequence parallelism) and
pipeline parallel (stages chained by hand, and a step of both pipeline implementations' 1F1B schedules) give, on a
packed batch, the logits of each document run on its own in one process (fp32, dropout 0, within 1e-5), and the
pipeline's step the one-process loss and gradients.

One launch of 2 real gloo processes runs every case; each rank computes the one-process reference itself (the same
seed builds the same model everywhere). The one-process equality, the fast path and the mask's single build are in
tests/unit/test_document_mask.py.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from torch_handle.config.schema import ParallelConfig
from torch_handle.model.args import TransformerArgs
from torch_handle.model.transformer import DecoderLM

from tests.helpers import run_on_gloo
from tests.unit.test_document_mask import LLAMA, PAD_ID, V, packed_documents

pytestmark = pytest.mark.dist

T = 24
# sinusoidal table; RoPE with grouped-query attention; and a mixture of experts (dropless) on every second layer
SHAPES = {"paper": {"norm_first": True}, "llama": LLAMA, "moe": {**LLAMA, "n_experts": 4, "top_k": 2, "moe_every": 2}}
TP_CASES = [(shape, impl, sp) for shape in ("paper", "llama") for impl in ("scratch", "native") for sp in (False, True)]
PP_IMPLS = ("scratch", "native")


def _model(shape: str, n_layers: int = 2) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(TransformerArgs(**{"vocab_size": V, "d_model": 32, "n_heads": 4, "n_layers": n_layers,
                                        "d_ff": 64, "dropout": 0.0, "max_len": T, "pad_id": PAD_ID,
                                        **SHAPES[shape]}))


def _alone_error(logits: torch.Tensor, model: DecoderLM, ids: torch.Tensor, spans: list) -> float:
    """Largest |difference| between packed ``logits`` (B, T, V) and each document's logits run on its own."""
    with torch.no_grad():
        return max((logits[b, a:e] - model(ids[b:b + 1, a:e])[0]).abs().max().item() for b, a, e in spans)


def _tensor_parallel(rank: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torch_handle.model.parallelize import parallelize_tensor
    from torch_handle.parallel.tensor.mappings import TPGroup

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    tp = TPGroup(mesh.get_group())
    ids, positions, spans = packed_documents(2, T)
    for shape, impl, sp in TP_CASES:
        case = f"tp 2 {shape} {impl} sp={sp} rank {rank}"
        reference = _model(shape).eval()
        model = parallelize_tensor(_model(shape).eval(), impl, tp if impl == "scratch" else mesh, sequence_parallel=sp)
        with torch.no_grad():
            out = model(ids, position_ids=positions)
        if impl == "native":
            logits = out.full_tensor()  # (B, T, V) from the vocabulary-sharded DTensor
        else:
            parts = [torch.empty_like(out) for _ in range(2)]
            dist.all_gather(parts, out.contiguous())  # each rank's (B, T, V/2)
            logits = torch.cat(parts, dim=-1)
        assert logits.shape == (2, T, V), case
        error = _alone_error(logits, reference, ids, spans)
        assert error <= 1e-5, (case, error)


def _pipeline_by_hand(rank: int) -> None:
    """Stage ``rank`` of 2, each given the batch's input_ids and position_ids, the activation sent from stage 0 to
    stage 1: the last stage's logits are each document's."""
    import torch.distributed as dist

    from torch_handle.model.pipeline import split_decoder, split_layers

    ids, positions, spans = packed_documents(2, T)
    for shape in ("paper", "llama"):
        reference = _model(shape, n_layers=4).eval()
        _, (stage,) = split_decoder(_model(shape, n_layers=4).eval(), split_layers(4, 2), [rank])
        with torch.no_grad():
            if rank == 0:
                dist.send(stage(None, input_ids=ids, position_ids=positions).contiguous(), 1)
            else:
                h = torch.empty(2, T, 32)
                dist.recv(h, 0)
                error = _alone_error(stage(h, input_ids=ids, position_ids=positions), reference, ids, spans)
                assert error <= 1e-5, (f"pp 2 by hand {shape}", error)


def _pipeline_step(rank: int) -> None:
    """One evaluation and one training step of ``PipelineParallel`` (the trainer's glue: the batch's keys re-split
    into m = 2 micro-batches and handed to every stage) over packed batches, both implementations' 1F1B: the
    one-process loss and every gradient of this rank's stage."""
    import torch.distributed as dist

    from torch_handle.train.objectives.tokens import TokenLoss
    from torch_handle.train.phases import PhaseTimer
    from torch_handle.train.shares.pipeline import PipelineParallel
    from torch_handle.train.strategy import DistContext
    from torch_handle.parallel.mesh import attach_layout

    ids, positions, _ = packed_documents(4, T + 1)
    batch = {"input_ids": ids[:, :-1], "position_ids": positions[:, :-1], "labels": ids[:, 1:]}
    reference = _model("llama", n_layers=4)
    loss = F.cross_entropy(reference(batch["input_ids"], position_ids=batch["position_ids"]).flatten(0, 1),
                           batch["labels"].flatten())
    loss.backward()
    for impl in PP_IMPLS:
        case = f"pp 2 {impl} 1f1b rank {rank}"
        parallel = ParallelConfig(pp=2, pp_impl=impl, pp_schedule="1f1b")
        ctx = attach_layout(DistContext(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"),
                                        backend="gloo"), parallel)
        pp = PipelineParallel(parallel, ctx, n_microbatches=2)
        shard = pp.split(_model("llama", n_layers=4))
        strategy = SimpleNamespace(autocast=contextlib.nullcontext, clips_gradients=True,
                                   pipeline_grad_sync=lambda: None, ep_share=None)
        pp.bind(strategy)
        trainer = SimpleNamespace(timer=PhaseTimer(), training=SimpleNamespace(grad_accum=1), step=1,
                                  strategy=strategy, objective=TokenLoss(), share=pp, loss_weight=None,
                                  loss_impl="full")
        val = torch.stack(pp.evaluate(dict(batch), trainer))
        dist.all_reduce(val)
        trainer.timer.begin()
        stats = torch.zeros(2, dtype=torch.float64)
        pp.run(trainer, iter([dict(batch)]), stats)
        dist.all_reduce(stats)
        for got in (val[0] / val[1], stats[0] / stats[1]):
            assert abs(got.item() - loss.item()) <= 1e-6 * loss.item(), (case, got.item(), loss.item())
        want = dict(reference.named_parameters())
        for name, p in shard.named_parameters():
            torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{case} {name}: {m}")


def _fully_sharded(rank: int) -> None:
    """FSDP2 over both ranks (each block its own unit, as the ``fsdp`` strategy shards it) with activation
    checkpointing: the mask and positions reach the sharded, checkpointed blocks as keyword arguments."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torch_handle.model.parallelize import set_activation_checkpointing

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ids, positions, spans = packed_documents(2, T)
    reference = _model("llama").eval()
    model = _model("llama").train()
    set_activation_checkpointing(model, True)
    for block in model.blocks():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    logits = model(ids, position_ids=positions)
    logits.sum().backward()  # the checkpointed blocks recompute with the same mask
    error = _alone_error(logits.detach(), reference, ids, spans)
    assert error <= 1e-5, (f"fsdp 2 rank {rank}", error)


def _expert_parallel(rank: int) -> None:
    """The MoE decoder's experts split over ep = 2 (both implementations; each rank its own packed batch, its tokens
    dispatched to the other rank's experts): each row's documents are its own."""
    from torch.distributed.device_mesh import init_device_mesh

    from torch_handle.train.shares.expert import apply_expert_parallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    ids, positions, spans = packed_documents(4, T)
    mine = [(b - 2 * rank, a, e) for b, a, e in spans if b // 2 == rank]
    reference = _model("moe").eval()
    for impl in ("scratch", "native"):
        model = _model("moe").eval()
        apply_expert_parallel(model, impl, mesh)
        with torch.no_grad():
            logits = model(ids[2 * rank:2 * rank + 2], position_ids=positions[2 * rank:2 * rank + 2])
        error = _alone_error(logits, reference, ids[2 * rank:2 * rank + 2], mine)
        assert error <= 1e-5, (f"ep 2 {impl} rank {rank}", error)


def _every_case(rank: int, tmp: Path) -> None:
    _expert_parallel(rank)
    _fully_sharded(rank)
    _tensor_parallel(rank)
    _pipeline_by_hand(rank)
    _pipeline_step(rank)


def test_packed_documents_over_2_processes_equal_each_document_on_its_own(tmp_path: Path) -> None:
    run_on_gloo(_every_case, tmp_path)
