"""Step 6 of ``benchmarks/gpu_check.py`` (``native-cp``): torch's FlexAttention context parallelism
(``parallel.cp_impl = "native"``, :mod:`torch_handle.parallel.context.native`) forward *and* backward on one GPU,
against the hand-written all-gather and ring attentions and a float64 reference (issue 48's "native against
hand-written ring").

One process, a process group of one rank (nccl): torch's all-gather of one rank is the identity and its
reduce-scatter too, so what runs is everything of ``native_attention`` but the traffic -- the custom op and its
autograd, the gathered positions and documents, the block mask from handle's positions and documents, the compiled
``flex_attention`` and its backward. The tokens come in a head-tail order (cut for cp 2, per document) with packed
documents of random lengths, so the mask must look positions up rather than assume a contiguous shard; GQA (8 query,
2 key/value heads), D 64, causal. Per dtype (bf16, fp32) and length (2,048, and 1,000: not a multiple of
FlexAttention's 128-token blocks): the relative error max|x − ref| / max|ref| of the output and of dq, dk, dv for
native, allgather and ring against the float64 reference; at 2,048 the median milliseconds of forward + backward
(after the compile).

    python benchmarks/_gpu_native_cp.py --json            # on a CUDA machine: one JSON line per case
    python benchmarks/_gpu_native_cp.py --json --device cpu   # the forward only (no FlexAttention backward on a CPU)

:func:`native_cp_row` (standard library only) runs it for gpu_check and makes its row; the CPU smoke version skips it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
B, H, H_KV, D = 2, 8, 2, 64
LENGTHS = (2048, 1000)
"""Sequence lengths checked; the first is timed."""
ITERS = 10
DOCUMENTS = 16
"""Packed documents a sequence holds at most (their starts drawn at random)."""


def native_cp_row(smoke: bool, out: Path, run: Callable[[list[str], Path, float], tuple[int | None, str]],
                  timeout_s: float) -> dict[str, Any]:
    """The ``native-cp`` row: this module's ``--json`` cases (``run``: ``gpu_check.run_command``); skipped in the
    CPU smoke version (FlexAttention has no CPU backward; tests/test_context_parallel.py checks its forward)."""
    row: dict[str, Any] = {"id": "native-cp", "step": 6, "title": "cp_impl native (FlexAttention CP) vs allgather, "
                           "ring: 1 GPU, fwd + bwd"}
    if smoke:
        return {**row, "status": "skipped", "message": "CUDA only: FlexAttention has no CPU backward (its forward "
                                                       "is tested by tests/test_context_parallel.py)"}
    cmd = [sys.executable, "benchmarks/_gpu_native_cp.py", "--json"]
    rc, text = run(cmd, out / "logs" / "native-cp.log", timeout_s)
    cases = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    failed = [f"{c['dtype']} T {c['seq_len']} {n}: {c[n]['error']}" for c in cases for n in ("native", "allgather",
                                                                                            "ring") if "error" in c[n]]
    worst: dict[str, float] = {}  # per dtype, over the lengths
    for c in cases:
        if "error" not in c["native"]:
            worst[c["dtype"]] = max(worst.get(c["dtype"], 0.0), *c["native"].values())
    note = "; ".join([*failed, *(f"{d}: native rel. error {e:.2e}" for d, e in worst.items()), *(
        f"{c['dtype']} T {c['seq_len']} fwd+bwd ms " + ", ".join(f"{n} {ms:.2f}" for n, ms in c["ms"].items())
        for c in cases if c.get("ms"))])
    ok = rc == 0 and cases and not any("error" in c["native"] for c in cases)
    return {**row, "returncode": rc, "command": " ".join(cmd[1:]), "cases": cases,
            "status": "ok" if ok else "failed", "note": note or f"exit {rc}: see logs/native-cp.log"}


def _relative(got: Any, expected: Any) -> float:
    return float((got.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def _case(seq_len: int, dtype: Any, device: str, backward: bool, seed: int) -> dict[str, Any]:
    """One length and dtype: errors against float64 (and timings at the first length on CUDA)."""
    import torch

    from torch_handle.model.attention import scaled_dot_product_attention_reference
    from torch_handle.parallel.context.allgather import allgather_attention
    from torch_handle.parallel.context.blocks import Tokens, visible
    from torch_handle.parallel.context.native import native_attention
    from torch_handle.parallel.context.ring import ring_attention
    from torch_handle.parallel.context.sharding import document_ids_of, shard, shard_order

    g = torch.Generator().manual_seed(seed)
    starts = torch.zeros(seq_len, dtype=torch.long)
    starts[0], starts[torch.randint(1, seq_len, (DOCUMENTS - 1,), generator=g)] = 1, 1  # documents of random lengths
    index = torch.arange(seq_len)
    position_ids = (index - (index * starts).cummax(0).values).expand(B, seq_len)  # restarting at each document
    documents = document_ids_of(position_ids)
    order = shard_order(B, seq_len, 2, documents)  # head-tail for cp 2, per document: the whole of it on one rank
    positions, documents = (shard(x, order, 1, 0).to(device) for x in (position_ids, documents))
    whole = [torch.randn(B, h, seq_len, D, generator=g, dtype=torch.float64) for h in (H, H_KV, H_KV, H)]
    q, k, v, dout = (shard(x, order, 1, 0, dim=2).to(device) for x in whole)
    mask = visible(Tokens(positions, documents), Tokens(positions, documents), True)[:, :, 0]  # (B, 1, T, T)
    grads = [x.clone().requires_grad_(backward) for x in (q, k, v)]
    reference = scaled_dot_product_attention_reference(*grads, mask)
    expected = {"out": reference.detach()}
    if backward:
        (reference * dout).sum().backward()
        expected.update(dq=grads[0].grad, dk=grads[1].grad, dv=grads[2].grad)

    def step(function: Any) -> dict[str, Any]:
        inputs = [x.to(dtype).requires_grad_(backward) for x in (q, k, v)]
        with torch.set_grad_enabled(backward):
            out = function(*inputs, positions, None, document_ids=documents)
        if backward:
            (out * dout.to(dtype)).sum().backward()
        return {"out": out, **({} if not backward else {f"d{n}": x.grad for n, x in zip("qkv", inputs)})}

    functions = {"native": native_attention, "allgather": allgather_attention, "ring": ring_attention}
    case: dict[str, Any] = {"seq_len": seq_len, "dtype": str(dtype).removeprefix("torch."), "backward": backward,
                            "documents": int(starts.sum())}
    for name, function in list(functions.items()):
        try:
            got = step(function)  # the first call compiles native's kernels
        except Exception as e:  # noqa: BLE001 - reported in the case: the others still run
            case[name], functions = {"error": f"{type(e).__name__}: {e}"[:300]}, {
                n: f for n, f in functions.items() if n != name}
            continue
        case[name] = {k: _relative(got[k].detach(), expected[k]) for k in expected}
    if device == "cuda" and seq_len == LENGTHS[0]:
        case["ms"] = {}
        for name, function in functions.items():
            times = []
            for _ in range(ITERS):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(function)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            case["ms"][name] = sorted(times)[len(times) // 2]
    return case


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON line per case (else a table)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the forward only, T 256")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import tempfile

    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            dtypes = (torch.bfloat16, torch.float32) if cuda else (torch.float32,)
            for seed, (seq_len, dtype) in enumerate((n, d) for n in (LENGTHS if cuda else (256,)) for d in dtypes):
                case = _case(seq_len, dtype, args.device, cuda, seed)
                print(json.dumps(case) if args.json else
                      f"T {seq_len} {case['dtype']}: " + ", ".join(
                          f"{n} " + (case[n].get("error") or f"{max(case[n].values()):.2e}")
                          for n in ("native", "allgather", "ring"))
                      + (f"; ms {case['ms']}" if "ms" in case else ""), flush=True)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
