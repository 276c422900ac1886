"""The decoder split over 2 tensor-parallel ranks (by hand and with DTensor, with and without sequence parallelism,
post-LN and pre-LN, fused and separate QKV) gives the one-process loss and every gradient (gathered) within 1e-5.

Real gloo processes; a tiny model, fp32, dropout 0. Each rank also computes the one-process reference itself (the
same seed builds the same model everywhere), so the comparison needs no communication but the TP run's own.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from torch_handle.model.args import TransformerArgs
from torch_handle.model.parallelize import parallelize_tensor, tensor_parallel_plan
from torch_handle.model.transformer import DecoderLM
from torch_handle.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from torch_handle.parallel.tensor.layers import all_reduce_sp_grads
from torch_handle.parallel.tensor.mappings import TPGroup
from torch_handle.parallel.tensor.plan import unshard

pytestmark = pytest.mark.dist

B, T = 2, 8
CASES = [(impl, sp, norm_first, fused) for impl in ("scratch", "native") for sp in (False, True)
         for norm_first, fused in ((False, True), (True, False))]


def _args(norm_first: bool, fused: bool) -> TransformerArgs:
    return TransformerArgs(vocab_size=32, d_model=16, n_heads=4, n_layers=2, d_ff=32, dropout=0.0, max_len=T,
                           norm_first=norm_first, fused_qkv=fused, tie_embeddings=True)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 32, (B, T), generator=g)
    labels = torch.randint(0, 32, (B, T), generator=g)
    labels[0, :2] = -100
    return ids, labels


def _reference(args: TransformerArgs) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = DecoderLM(args)
    ids, labels = _batch()
    loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _tensor_parallel(args: TransformerArgs, impl: str, sp: bool, tp: TPGroup, mesh
                     ) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = DecoderLM(args)
    plan = tensor_parallel_plan(model)
    parallelize_tensor(model, impl, tp if impl == "scratch" else mesh, sequence_parallel=sp)
    ids, labels = _batch()
    if impl == "scratch":
        loss, _ = vocab_parallel_cross_entropy(model(ids), labels, tp)
        loss.backward()
        if sp:
            all_reduce_sp_grads(model, tp)
        grads = {n: unshard(n, p.grad, plan, tp) for n, p in model.named_parameters()}
    else:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
            loss.backward()
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for n, p in model.named_parameters()}
    return loss.item(), grads


def _worker(rank: int, init: str, errors: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        tp = TPGroup(mesh.get_group())
        for impl, sp, norm_first, fused in CASES:
            case = f"{impl} sp={sp} norm_first={norm_first} fused_qkv={fused}"
            args = _args(norm_first, fused)
            ref_loss, ref_grads = _reference(args)
            loss, grads = _tensor_parallel(args, impl, sp, tp, mesh)
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, loss, ref_loss)
            assert grads.keys() == ref_grads.keys(), case
            for name, ref in ref_grads.items():
                torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {name}: {m}")
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def test_decoder_split_two_ways_equals_one_process(tmp_path: Path) -> None:
    try:
        mp.spawn(_worker, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2, join=True)
    except Exception as e:
        raise AssertionError("\n".join(p.read_text() for p in sorted(tmp_path.glob("rank*.txt"))) or str(e)) from None
