"""Worker of ``handle env --check-dist N``: run under torchrun on every rank.

Each rank initialises the process group (nccl with one GPU per local rank, else gloo), all-reduces its rank + 1
and checks the sum N(N+1)/2, then times a 4 MiB all-reduce. The first rank of every node (``LOCAL_RANK`` 0; on one
node, rank 0) prints one line ``HANDLE_ENV_CHECK {json}`` with the verdict all ranks agreed on, so that each node's
``handle env --check-dist`` reports it. Exit code 0 when every rank saw the right sums, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from torch_handle.launch.probe import Marker, emit, guarded, init_group, leave_group

MARKER = Marker("HANDLE_ENV_CHECK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m handle_cli.env_check")
    ap.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    ap.add_argument("--timeout", type=int, default=60, help="Collective timeout in seconds.")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    import torch
    import torch.distributed as dist

    group = init_group(args.backend, args.timeout)
    rank, world, backend, device = group.rank, group.world_size, group.backend, group.device
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", world))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # 1. the correctness check: sum of rank + 1 over all ranks
    x = torch.tensor([float(rank + 1)], dtype=torch.float64, device=device)
    t0 = time.perf_counter()
    dist.all_reduce(x)
    sync()
    small_s = time.perf_counter() - t0
    expected = world * (world + 1) / 2
    got = float(x.item())

    # 2. a 4 MiB all-reduce (fp32): every element must be the sum of the ranks
    n = 1 << 20
    big = torch.full((n,), float(rank), dtype=torch.float32, device=device)
    dist.all_reduce(big)  # warm-up (connection set-up, algorithm choice)
    big.fill_(float(rank))
    sync()
    t0 = time.perf_counter()
    dist.all_reduce(big)
    sync()
    big_s = time.perf_counter() - t0
    big_ok = bool(torch.all(big == float(world * (world - 1) // 2)).item())

    ok = got == expected and big_ok
    flags = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank agrees on the verdict
    all_ok = bool(flags.item())
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    if local_rank == 0:
        size_mb = n * 4 / 2**20
        # ring all-reduce moves 2(N-1)/N of the buffer per rank ("bus bandwidth", as nccl-tests report it)
        bus = size_mb * 2 * (world - 1) / world / big_s if big_s > 0 and world > 1 else None
        result = {"ok": all_ok, "world_size": world, "backend": backend, "device": str(device),
                  "sum": got, "expected": expected, "large_allreduce_ok": big_ok, "init_s": round(group.init_s, 4),
                  "allreduce_small_s": round(small_s, 6), "allreduce_mib": size_mb,
                  "allreduce_large_s": round(big_s, 6),
                  "bus_bandwidth_mib_s": round(bus, 1) if bus is not None else None,
                  "hosts": sorted(set(h for h in hosts if h)), "torch": torch.__version__, "rank": rank,
                  "nnodes": world // max(1, local_world), "node_rank": int(os.environ.get("GROUP_RANK", "0")),
                  "worker_s": round(time.perf_counter() - t_start, 3)}
        emit(MARKER, result)
    return leave_group(all_ok)


if __name__ == "__main__":
    sys.exit(guarded(main, MARKER))
