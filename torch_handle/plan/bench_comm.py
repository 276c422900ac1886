"""Collective benchmark in the spirit of nccl-tests: time all_reduce, all_gather, reduce_scatter and broadcast
over a range of message sizes and check every result.

Two halves in one module:

- pure functions (no torch, so the CLI imports them without it): size parsing, the bytes each
  op moves and nccl-tests' bandwidth formulas (``doc/PERFORMANCE.md``): ``algbw = bytes / time`` and
  ``busbw = algbw * factor`` with factor ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather and
  reduce_scatter, ``1`` for broadcast;
- the worker, run on every rank under torchrun: ``python -m torch.distributed.run ... -m torch_handle.plan.bench_comm
  --ops ... --sizes ...``. Rank 0 prints one line ``HANDLE_BENCH_COMM {json}`` per measurement, and one line
  ``HANDLE_BENCH_COMM_ERROR ...`` if a rank fails.

Bytes follow nccl-tests: all_reduce and broadcast count the buffer, all_gather the whole output (every rank's
part), reduce_scatter the whole input. Times are in microseconds, bandwidths in GB/s (10^9 bytes per second).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from torch_handle.common.precision import ELEMENT_BYTES, torch_dtype
from torch_handle.common.units import parse_bytes, size_label
from torch_handle.launch.probe import Marker, emit, guarded, init_group, leave_group

MARKER = Marker("HANDLE_BENCH_COMM")
CORRUPT_ENV = "HANDLE_BENCH_COMM_CORRUPT"
"""Test hook: a comma list of ops whose check-iteration input rank 0 perturbs (one element + 1), so the
collective's result really is wrong and the check must catch it."""

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
DTYPES = {name: ELEMENT_BYTES[name] for name in ("fp32", "bf16")}
"""Element size in bytes of each supported dtype."""

MAX_SIZE = 16 << 30
"""Largest accepted message size in bytes (16 GiB)."""


def parse_size(text: str) -> int:
    """``"64"``, ``"1K"``, ``"256M"``, ``"1GiB"`` -> bytes; a whole number in the units of
    :mod:`torch_handle.common.units` (``K``, ``M``, ``G`` binary, as nccl-tests' ``-b``/``-e``; ``MB`` = 10^6).

    Raises:
        ValueError: not a positive size, or larger than :data:`MAX_SIZE`.
    """
    value = parse_bytes(text, whole=True)
    if value > MAX_SIZE:
        raise ValueError(f"{text.strip()!r}: larger than the maximum {size_label(MAX_SIZE)}")
    return value


def parse_sizes(spec: str) -> list[int]:
    """Message sizes in bytes from ``MIN:MAX`` (doubling, like nccl-tests ``-b MIN -e MAX -f 2``),
    ``MIN:MAX:FACTOR`` (multiplying by FACTOR) or a comma list ``1K,4K,1M`` (kept in its order, duplicates
    dropped).

    Raises:
        ValueError: a malformed size, MIN > MAX, a FACTOR below 2, or more than 64 sizes.
    """
    spec = spec.strip()
    if ":" in spec:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"{spec!r}: expected MIN:MAX or MIN:MAX:FACTOR, e.g. 1K:64M")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        factor = 2
        if len(parts) == 3:
            if not parts[2].strip().isdigit() or int(parts[2]) < 2:
                raise ValueError(f"{spec!r}: FACTOR must be an integer >= 2")
            factor = int(parts[2])
        if lo > hi:
            raise ValueError(f"{spec!r}: MIN {size_label(lo)} is larger than MAX {size_label(hi)}")
        sizes = []
        while lo <= hi:
            sizes.append(lo)
            lo *= factor
    else:
        sizes = []
        for part in spec.split(","):
            if not part.strip():
                raise ValueError(f"{spec!r}: empty size in the list")
            size = parse_size(part)
            if size not in sizes:
                sizes.append(size)
    if len(sizes) > 64:
        raise ValueError(f"{spec!r}: {len(sizes)} sizes, at most 64")
    return sizes


def parse_ops(spec: str) -> list[str]:
    """A comma list of op names (``all`` = every op) -> the ops, in the given order without duplicates.

    Raises:
        ValueError: an unknown op or an empty list.
    """
    ops: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        names = OPS if part == "all" else (part,)
        for name in names:
            if name not in OPS:
                raise ValueError(f"unknown op {part!r} (valid: {', '.join(OPS)}, all)")
            if name not in ops:
                ops.append(name)
    if not ops:
        raise ValueError("no op given (valid: " + ", ".join(OPS) + ", all)")
    return ops


def check_size(size: int, dtype: str, world_size: int) -> str | None:
    """Why ``size`` bytes cannot be benchmarked with ``dtype`` on ``world_size`` ranks, or None when it can:
    it must be a whole number of elements and give every rank at least one element of all_gather and
    reduce_scatter."""
    elem = DTYPES[dtype]
    if size % elem:
        return f"{size_label(size)} is not a whole number of {dtype} elements ({elem} bytes each)"
    if size < elem * world_size:
        return f"{size_label(size)} is less than one {dtype} element per rank ({elem * world_size} bytes " \
               f"for {world_size} ranks)"
    return None


def element_count(op: str, size: int, elem_size: int, world_size: int) -> int:
    """Elements of the buffer nccl-tests sizes ``op`` by (all_gather: the output, reduce_scatter: the input,
    else the one buffer), rounded down so that all_gather and reduce_scatter split evenly over the ranks."""
    count = size // elem_size
    if op in ("all_gather", "reduce_scatter"):
        count = count // world_size * world_size
    return count


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw ratio of ``op`` on ``world_size`` ranks (doc/PERFORMANCE.md).

    Raises:
        ValueError: an unknown op or world size below 1.
    """
    n = world_size
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown op {op!r} (valid: {', '.join(OPS)})")


def algbw_gbps(nbytes: int, time_us: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 B/s): ``nbytes`` moved in ``time_us`` microseconds.

    Raises:
        ValueError: a time that is not positive.
    """
    if not time_us > 0:
        raise ValueError(f"time must be positive, got {time_us} us")
    return nbytes / (time_us * 1e-6) / 1e9


def busbw_gbps(op: str, nbytes: int, time_us: float, world_size: int) -> float:
    """Bus bandwidth in GB/s: ``algbw_gbps * bus_factor`` (comparable across ops and world sizes).

    Raises:
        ValueError: as :func:`algbw_gbps` and :func:`bus_factor`.
    """
    return algbw_gbps(nbytes, time_us) * bus_factor(op, world_size)


def gloo_note(op: str) -> str | None:
    """How torch's gloo backend implements ``op`` when that differs from what busbw assumes, else None."""
    if op == "reduce_scatter":
        return "reduce_scatter on gloo is an all_reduce of the whole input plus a local copy (torch's " \
               "ProcessGroupGloo), so its busbw is at most half of all_reduce's at the same size"
    return None


# ---------------------------------------------------------------------------------------------------------------
# the worker (torch is imported here only)
# ---------------------------------------------------------------------------------------------------------------


def _collective(op: str, dist: Any):
    """``fn(out, inp)`` running ``op``; all_gather/reduce_scatter use the single-tensor forms (their newest
    name where this torch has one, to avoid deprecation warnings)."""
    if op == "all_reduce":
        return lambda out, inp: dist.all_reduce(out)
    if op == "broadcast":
        return lambda out, inp: dist.broadcast(out, 0)
    if op == "all_gather":
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda out, inp: fn(out, inp)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return lambda out, inp: fn(out, inp)


def _buffers(torch: Any, op: str, count: int, rank: int, world: int, dtype: Any, device: Any, fill: bool):
    """(out, inp) for ``op``; with ``fill`` the known per-rank inputs of the check, else zeros (timing: an
    in-place all_reduce of zeros stays finite however many iterations run)."""
    def make(n: int, value: float):
        return torch.full((n,), value, dtype=dtype, device=device)

    v = float(rank + 1) if fill else 0.0
    if op in ("all_reduce", "broadcast"):
        t = make(count, v)
        return t, t
    if op == "all_gather":
        return make(count, 0.0), make(count // world, v)
    # reduce_scatter: chunk j of rank r's input holds (r+1)(j+1), so rank j must get (j+1) n(n+1)/2
    inp = make(count, 0.0)
    if fill:
        chunk = torch.arange(1, world + 1, dtype=torch.float64, device=device).repeat_interleave(count // world)
        inp.copy_(chunk * (rank + 1))
    return make(count // world, 0.0), inp


def _expected(torch: Any, op: str, count: int, rank: int, world: int, device: Any):
    """What ``out`` must hold after the check iteration (float64)."""
    tri = world * (world + 1) / 2
    if op == "all_reduce":
        return torch.full((count,), tri, dtype=torch.float64, device=device)
    if op == "broadcast":
        return torch.full((count,), 1.0, dtype=torch.float64, device=device)
    if op == "all_gather":
        return torch.arange(1, world + 1, dtype=torch.float64, device=device).repeat_interleave(count // world)
    return torch.full((count // world,), (rank + 1) * tri, dtype=torch.float64, device=device)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on this rank (``RANK``/``WORLD_SIZE`` from torchrun); 0 when every result was right,
    1 when one was wrong."""
    ap = argparse.ArgumentParser(prog="python -m torch_handle.plan.bench_comm")
    ap.add_argument("--ops", default="all")
    ap.add_argument("--sizes", default="1K:64M")
    ap.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--budget", type=float, default=1.0,
                    help="Seconds of timed calls per op and size; fewer iterations where they would exceed it (0: "
                         "always --iters).")
    ap.add_argument("--timeout", type=int, default=120, help="Collective timeout in seconds.")
    args = ap.parse_args(argv)
    ops, sizes = parse_ops(args.ops), parse_sizes(args.sizes)

    import torch
    import torch.distributed as dist

    group = init_group(args.backend, args.timeout)
    rank, world, backend, device = group.rank, group.world_size, group.backend, group.device
    dtype = torch_dtype(args.dtype)
    elem = DTYPES[args.dtype]
    corrupt = {o.strip() for o in os.environ.get(CORRUPT_ENV, "").split(",") if o.strip()}
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def agree(value: float, op: Any) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        return float(t.item())

    all_ok = True
    for op in ops:
        run = _collective(op, dist)
        for size in sizes:
            count = element_count(op, size, elem, world)
            out, inp = _buffers(torch, op, count, rank, world, dtype, device, fill=False)
            for _ in range(args.warmup):
                run(out, inp)
            # one probe call sets the number of timed iterations: the slowest rank's estimate, so all agree
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            run(out, inp)
            sync()
            probe = agree(time.perf_counter() - t0, dist.ReduceOp.MAX)
            iters = args.iters
            if args.budget > 0 and probe > 0:
                iters = max(1, min(iters, int(args.budget / probe)))
            sync()
            dist.barrier()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    run(out, inp)
                end.record()
                end.synchronize()
                mean_us = start.elapsed_time(end) * 1e3 / iters
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    run(out, inp)
                mean_us = (time.perf_counter() - t0) * 1e6 / iters
            time_us = agree(mean_us, dist.ReduceOp.MAX)
            avg_us = agree(mean_us, dist.ReduceOp.SUM) / world

            # the check: one more call on known per-rank inputs, compared with what it must give
            out, inp = _buffers(torch, op, count, rank, world, dtype, device, fill=True)
            if op in corrupt and rank == 0:
                inp[0] += 1
            run(out, inp)
            sync()
            want = _expected(torch, op, count, rank, world, device)
            err = float(((out.double() - want).abs().max() / want.abs().max()).item())
            del want
            max_err = agree(err, dist.ReduceOp.MAX)  # relative: |got - expected| / max |expected|
            correct = max_err <= (world * 2.0 ** -8 if args.dtype == "bf16" else 0.0)
            all_ok &= correct
            del out, inp
            if rank == 0:
                nbytes = count * elem
                rec = {"op": op, "backend": backend, "world_size": world, "dtype": args.dtype, "bytes": nbytes,
                       "count": count, "iters": iters, "time_us": round(time_us, 3),
                       "time_us_rank_avg": round(avg_us, 3),
                       "algbw_gbps": float(f"{algbw_gbps(nbytes, time_us):.6g}"),  # 6 significant digits
                       "busbw_gbps": float(f"{busbw_gbps(op, nbytes, time_us, world):.6g}"),
                       "correct": correct, "max_rel_error": max_err, "device": device.type}
                if backend == "gloo" and gloo_note(op):
                    rec["note"] = gloo_note(op)
                emit(MARKER, rec)
    return leave_group(all_ok)


if __name__ == "__main__":
    sys.exit(guarded(main, MARKER))
