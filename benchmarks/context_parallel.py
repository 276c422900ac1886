"""Context parallelism measured: the algorithms' balance and speed, and a run's memory per rank as ``handle
estimate`` prices it (docs/context-parallel.md).

    python benchmarks/context_parallel.py [--seq-lens 512 1024 2048] [--ranks 4] [--iters 3] [--balance-len 131072]
                                          [--memory-preset presets/long-context.toml --memory-len 8192 --budget 4GiB]

1. Balance: the attention work per rank (unmasked query-key pairs, ``sharding.attention_pairs``) as max ÷ mean over
   the cp ranks, for a causal sequence of ``--balance-len`` tokens and for packed documents of random lengths
   (exponential, mean T/16 or 1024 tokens; causal within each): contiguous shards, head-tail on the whole sequence,
   head-tail per document (``shard_order`` given the document ids). Pure arithmetic, no process.
2. Speed: ring, all-gather and Ulysses attention, forward + backward, on ``--ranks`` gloo processes (1 CPU thread
   each), B 1, 8 query heads, 4 K/V heads, D 64, fp32, causal, head-tail balanced (the ring also contiguous); the
   median over ``--iters`` iterations after one warm-up of the slowest rank's wall time, and of the slowest rank's
   CPU time (what it computed, not what it waited: steadier on a shared machine); beside them the same attention
   on one process (the ring's kernel at cp 1, the whole sequence).
3. Memory: ``handle estimate``'s bytes per rank for ``--memory-preset`` at ``--memory-len`` tokens, cp 1, 2 and 4
   (cp 1: one process; cp > 1: cp ranks, dp 1, the preset's strategy; bf16): activations on fake tensors at seq_len / cp
   plus the attention's buffers (``plan/estimate_cp.py``; against a run's measured activations: +4 to +11% fp32,
   +10 to +15% bf16, docs/context-parallel.md), and the longest power-of-two seq_len whose device total fits
   ``--budget`` per rank. Skipped with ``--memory-len 0``.

A table for people, then one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

N_HEADS, N_KV_HEADS, HEAD_DIM = 8, 4, 64
VARIANTS = ("ring", "ring contiguous", "allgather", "ulysses")


def _document_lengths(total: int, mean: int, multiple: int, seed: int) -> list[int]:
    """Random document lengths (exponential around ``mean``, rounded up to ``multiple``) packed into ``total``."""
    import random

    rng, lengths = random.Random(seed), []
    while sum(lengths) < total:
        n = max(multiple, -(-int(rng.expovariate(1 / mean)) // multiple) * multiple)
        lengths.append(min(n, total - sum(lengths)))
    return lengths


def balance_rows(seq_len: int, cps: list[int]) -> list[dict]:
    import torch

    from torch_handle.parallel.context.sharding import attention_pairs, document_ids_of, imbalance, shard_order

    rows = []
    for cp in cps:
        layouts = {"causal": None,
                   "documents, mean T/16": _document_lengths(seq_len, seq_len // 16, 1, seed=cp),
                   "documents, mean 1024": _document_lengths(seq_len, 1024, 1, seed=cp)}
        for name, lengths in layouts.items():
            documents = None if lengths is None else document_ids_of(
                torch.cat([torch.arange(n) for n in lengths])[None])
            row = {"bench": "balance", "seq_len": seq_len, "cp": cp, "mask": name,
                   "documents": 1 if lengths is None else len(lengths)}
            orders = {"contiguous": shard_order(1, seq_len, cp, balance=False),
                      "head_tail_whole": shard_order(1, seq_len, cp),
                      "head_tail_per_document": shard_order(1, seq_len, cp, documents)}
            for key, order in orders.items():
                row[key] = round(imbalance(attention_pairs(order, cp, documents)), 4)
            rows.append(row)
    return rows


def _time_rank(rank: int, init: str, world_size: int, seq_lens: list[int], iters: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from torch_handle.parallel.context.allgather import allgather_attention
    from torch_handle.parallel.context.ring import ring_attention
    from torch_handle.parallel.context.sharding import shard, shard_order
    from torch_handle.parallel.context.ulysses import ulysses_attention

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    attention = {"ring": ring_attention, "ring contiguous": ring_attention, "allgather": allgather_attention,
                 "ulysses": ulysses_attention}
    results = []
    for seq_len in seq_lens:
        g = torch.Generator().manual_seed(seq_len)
        whole = [torch.randn(1, h, seq_len, HEAD_DIM, generator=g) for h in (N_HEADS, N_KV_HEADS, N_KV_HEADS)]
        for variant in VARIANTS:
            order = shard_order(1, seq_len, world_size, balance=variant != "ring contiguous")
            q, k, v = (shard(x, order, world_size, rank, dim=2).requires_grad_() for x in whole)
            positions = shard(torch.arange(seq_len)[None], order, world_size, rank)
            times, cpu_times = [], []
            for _ in range(iters + 1):
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                attention[variant](q, k, v, positions).sum().backward()
                elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step waits for the slowest rank
                times.append(float(elapsed[0]))
                cpu_times.append(float(elapsed[1]))
            results.append({"seq_len": seq_len, "variant": variant, "ms": 1e3 * statistics.median(times[1:]),
                            "cpu_ms": 1e3 * statistics.median(cpu_times[1:])})
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _one_process_ms(seq_len: int, iters: int) -> tuple[float, float]:
    """The whole sequence's attention on this process (the ring's kernel at cp 1), forward + backward: median wall
    and CPU ms."""
    import torch

    from torch_handle.parallel.context.ring import ring_attention

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seq_len)
    q, k, v = (torch.randn(1, h, seq_len, HEAD_DIM, generator=g).requires_grad_()
               for h in (N_HEADS, N_KV_HEADS, N_KV_HEADS))
    positions = torch.arange(seq_len)[None]
    times, cpu_times = [], []
    for _ in range(iters + 1):
        start, cpu_start = time.perf_counter(), time.process_time()
        ring_attention(q, k, v, positions).sum().backward()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return 1e3 * statistics.median(times[1:]), 1e3 * statistics.median(cpu_times[1:])


def speed_rows(seq_lens: list[int], world_size: int, iters: int) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_time_rank, args=(f"file://{tmp}/rendezvous", world_size, seq_lens, iters, out), nprocs=world_size,
                 join=True)
        measured = json.loads(Path(out).read_text())
    rows = []
    for seq_len in seq_lens:
        wall, cpu = _one_process_ms(seq_len, iters)
        row = {"bench": "speed", "seq_len": seq_len, "cp": world_size, "one_process_ms": round(wall, 1),
               "one_process_cpu_ms": round(cpu, 1)}
        for m in measured:
            if m["seq_len"] == seq_len:
                name = m["variant"].replace(" ", "_")
                row.update({f"{name}_ms": round(m["ms"], 1), f"{name}_cpu_ms": round(m["cpu_ms"], 1)})
        rows.append(row)
    return rows


def _estimate(preset_path: str, seq_len: int, cp: int):
    from torch_handle.config.loader import load_preset
    from torch_handle.plan.estimate import estimate_preset
    from torch_handle.registry import get_registry

    overrides = [f"data.seq_len={seq_len}", f"parallel.cp={cp}", f"launch.nproc_per_node={cp}",
                 "training.precision=bf16"]
    preset = load_preset(preset_path, overrides + (["strategy.name=single"] if cp == 1 else []))
    return estimate_preset(preset, get_registry(), [cp])[0]


def memory_rows(preset_path: str, seq_len: int, cps: list[int], budget: int) -> list[dict]:
    """One row per cp: the estimate at ``seq_len`` and the longest power-of-two seq_len that fits ``budget``."""
    rows = []
    for cp in cps:
        est = _estimate(preset_path, seq_len, cp)
        fits, n = None, 2 * cp * 64
        while n <= 1 << 22 and _estimate(preset_path, n, cp).device_bytes <= budget:
            fits, n = n, n * 2
        rows.append({"bench": "memory", "seq_len": seq_len, "cp": cp, "cp_impl": est.cp_impl,
                     "activation_bytes": est.activation.total, "cp_buffer_bytes": est.cp_buffer_bytes or 0,
                     "device_bytes": est.device_bytes, "budget_bytes": budget, "longest_fitting_seq_len": fits})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="*", default=[512, 1024, 2048],
                        help="speed at these seq_lens (none: no speed measurement)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--balance-len", type=int, default=131072)
    parser.add_argument("--balance-cps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--memory-preset", default=str(Path(__file__).resolve().parents[1] / "presets" /
                                                       "long-context.toml"))
    parser.add_argument("--memory-len", type=int, default=8192)
    parser.add_argument("--budget", default="4GiB", help="device bytes per rank for the longest seq_len that fits")
    args = parser.parse_args()

    memory: list[dict] = []
    if args.memory_len:
        from torch_handle.common.units import parse_bytes

        memory = memory_rows(args.memory_preset, args.memory_len, [1, 2, 4], parse_bytes(args.budget))
        print(f"bytes per rank, {Path(args.memory_preset).name} at seq_len {args.memory_len} (handle estimate)")
        print(f"{'cp':>3} {'impl':>9} {'activations':>12} {'buffers':>9} {'device':>12} {'vs cp 1':>8} "
              f"{'longest seq_len in ' + args.budget:>26}")
        for r in memory:
            print(f"{r['cp']:>3} {r['cp_impl'] or '-':>9} {r['activation_bytes'] / 2**20:>10.1f}Mi "
                  f"{r['cp_buffer_bytes'] / 2**20:>7.1f}Mi {r['device_bytes'] / 2**20:>10.1f}Mi "
                  f"{r['activation_bytes'] / memory[0]['activation_bytes']:>8.2f} {r['longest_fitting_seq_len']:>26}")
        print()

    balance = balance_rows(args.balance_len, args.balance_cps)
    print(f"attention work per rank, max ÷ mean (seq_len {args.balance_len}, causal)")
    print(f"{'cp':>3} {'mask':<21} {'documents':>9} {'contiguous':>10} {'head-tail whole':>15} {'per document':>12}")
    for r in balance:
        print(f"{r['cp']:>3} {r['mask']:<21} {r['documents']:>9} {r['contiguous']:>10.3f} "
              f"{r['head_tail_whole']:>15.3f} {r['head_tail_per_document']:>12.3f}")
    speed = speed_rows(args.seq_lens, args.ranks, args.iters) if args.seq_lens else []
    if speed:
        _print_speed(speed, args.ranks)
    print()
    for r in memory + balance + speed:
        print(json.dumps(r))


def _print_speed(speed: list[dict], ranks: int) -> None:
    print(f"\nforward + backward ms, slowest of {ranks} ranks (gloo, 1 thread each), H {N_HEADS}, H_kv "
          f"{N_KV_HEADS}, D {HEAD_DIM}, fp32, causal")
    print("(wall ms / the slowest rank's CPU ms: what it computed, without waiting)")
    print(f"{'seq_len':>7} " + " ".join(f"{v:>15}" for v in ("1 process", *VARIANTS)))
    for r in speed:
        cells = [f"{r[v + '_ms']:.0f} / {r[v + '_cpu_ms']:.0f}"
                 for v in ("one_process", *(v.replace(" ", "_") for v in VARIANTS))]
        print(f"{r['seq_len']:>7} " + " ".join(f"{c:>15}" for c in cells))


if __name__ == "__main__":
    main()
