"""Expert parallelism measured on one MoE layer: scratch against native tokens/s on 2 and 4 gloo processes, the
counted all-to-all bytes against the formula 4·N·k·C·b per layer (dispatch and combine, forward and backward, N the
EP group's tokens), and the cost of imbalance (routing forced round-robin against forced onto rank 0's experts).

    python benchmarks/expert_parallel.py [--tokens 2048] [--iters 6] [--ranks 2 4]

Each configuration: one ``MoEFeedForward`` (d_model 256, 8 SwiGLU experts of d_ff 512, top-2, fp32) built with the
same seed on every rank, split over all ranks (ep = world size), ``tokens`` tokens per rank, forward + backward
timed over ``iters`` iterations after one warm-up; tokens/s counts every rank's tokens. A table for people, then one
JSON line per row. CPU threads: 1 per process (the ranks share the machine's cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

D_MODEL, N_EXPERTS, TOP_K, D_FF = 256, 8, 2, 512
ROUTINGS = ("learned", "round-robin", "one-rank")


def _force(layer, routing: str) -> None:
    """Replace the layer's routing: ``round-robin`` sends token t to experts t, t+1 (mod E): every expert and rank
    equally loaded; ``one-rank`` sends every token to experts 0 and 1, which rank 0 holds."""
    import torch

    from torch_handle.model.router import Routing

    if routing == "learned":
        return
    plain = layer.gate.forward

    def forced(x):
        r = plain(x)
        t = torch.arange(x.shape[0])
        experts = (torch.stack([t, t + 1], dim=1) % N_EXPERTS if routing == "round-robin"
                   else torch.tensor([[0, 1]]).expand(x.shape[0], 2))
        weights = r.probs.gather(1, experts)
        return Routing(weights / weights.sum(-1, keepdim=True), experts, r.probs, r.logits)

    layer.gate.forward = forced


def _rank(rank: int, world: int, tmp: str, tokens: int, iters: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from torch_handle.model.args import TransformerArgs
    from torch_handle.model.moe import MoEFeedForward
    from torch_handle.common.parallel_dims import ParallelDims
    from torch_handle.parallel.mesh import build_expert_mesh
    from torch_handle.train.shares.expert import apply_expert_parallel
    from torch_handle.train.routing import reset_stats

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    mesh = build_expert_mesh(ParallelDims(world, ep=world), "cpu")["ep"]
    args = TransformerArgs(vocab_size=8, d_model=D_MODEL, n_heads=4, n_layers=1, d_ff=D_FF, n_experts=N_EXPERTS,
                           top_k=TOP_K, mlp="swiglu", dropout=0.0, router_aux_loss=0.01)
    rows = []
    for impl in ("scratch", "native"):
        for routing in ROUTINGS:
            torch.manual_seed(0)
            layer = MoEFeedForward(args).train()
            apply_expert_parallel(layer, impl, mesh)
            _force(layer, routing)
            x = torch.randn(1, tokens, D_MODEL, generator=torch.Generator().manual_seed(rank), requires_grad=True)
            layer(x).sum().backward()  # warm-up
            reset_stats(layer)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                layer(x).sum().backward()
            dist.barrier()
            seconds = time.perf_counter() - start
            sent = torch.tensor(layer.traffic.bytes)
            dist.all_reduce(sent)
            wait = torch.tensor(layer.traffic.wait_s)
            dist.all_reduce(wait, op=dist.ReduceOp.MAX)
            formula = 4 * (tokens * world) * TOP_K * D_MODEL * 4 * iters
            rows.append({"ranks": world, "impl": impl, "routing": routing,
                         "tokens_per_s": round(tokens * world * iters / seconds),
                         "a2a_bytes": int(sent), "formula_bytes": formula,
                         "a2a_wait_s_per_iter_max_rank": round(float(wait) / iters, 4)})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def measure(world: int, tokens: int, iters: int) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_rank, args=(world, tmp, tokens, iters, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    a = parser.parse_args()
    rows = [row for world in a.ranks for row in measure(world, a.tokens, a.iters)]
    print(f"{'ranks':>5} {'impl':>8} {'routing':>12} {'tokens/s':>9} {'vs scratch':>10} {'bytes = formula':>15} "
          f"{'a2a wait/iter':>13}")
    for row in rows:
        base = next(r for r in rows if r["ranks"] == row["ranks"] and r["routing"] == row["routing"]
                    and r["impl"] == "scratch")
        exact = str(row["a2a_bytes"] == row["formula_bytes"])
        print(f"{row['ranks']:>5} {row['impl']:>8} {row['routing']:>12} {row['tokens_per_s']:>9,} "
              f"{row['tokens_per_s'] / base['tokens_per_s']:>9.2f}x {exact:>15} "
              f"{row['a2a_wait_s_per_iter_max_rank'] * 1000:>10.1f} ms")
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
