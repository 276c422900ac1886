"""The loss path's memory and time, the whole logits against the chunked loss (``training.loss_impl``, issue 49).

    python benchmarks/loss_memory.py [--vocabs 32000,128256,151936] [--seq-len 2048] [--micro-batches 1,4]
                                     [--d-model 2048] [--precision bf16] [--rounds 5] [--threads N] [--as-cuda]
                                     [--json]

The loss path is what runs after the model's final norm: hidden states (B, T, C) -> output layer (V, C) ->
token-mean cross-entropy, forward and backward (the gradients of the hidden states and of the output weight), on a
Llama-shaped head (d_model 2,048 and an untied output layer are Llama 3.2 1B's) under bf16 autocast with fp32
weights, as the trainer runs it: ``full`` is ``F.linear`` then ``train.loss.loss_fn`` (the (B·T, V) logits),
``chunked`` is ``train.loss.chunked_loss_fn`` (``model.linear_cross_entropy``).

Peak memory: the most bytes allocated during the loss path beyond what existed before it (the hidden states, the
weight), including the output weight's fp32 gradient (V x C, which both paths write); transient: that peak less the
bytes still allocated after backward (the gradients of the hidden states and the weight, which the step keeps
either way). On CUDA
``torch.cuda.max_memory_allocated`` (the caching allocator's own count of live tensor bytes); on CPU the
profiler's allocation events (``profile_memory=True``: every allocation and free of torch's CPU allocator, summed
in order; the run that is profiled is not timed). Time: the median of ``--rounds`` forward + backward passes,
unprofiled, after one warm-up (``--rounds 0``: memory only). For a CPU, smaller shapes: ``--seq-len 512 --d-model
256``; ``--as-cuda`` runs on a CPU the paths as CUDA runs them (the full loss ``F.cross_entropy`` on the fp32 logits
instead of the CPU's in-cache ``ChunkedCrossEntropy``, CUDA's chunk size), whose allocations a GPU makes too.

Prints a table (the figures side by side, chunked ÷ full) and with ``--json`` one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_handle.model import kernels, linear_cross_entropy  # noqa: E402
from torch_handle.train import loss as loss_module  # noqa: E402
from torch_handle.train.loss import chunked_loss_fn, loss_fn  # noqa: E402

MiB = 1 << 20


def loss_path(impl: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, dtype) -> None:
    """Forward and backward of the loss path; gradients land in ``hidden.grad`` and ``weight.grad``."""
    with torch.autocast(hidden.device.type, dtype=dtype, enabled=dtype != torch.float32):
        if impl == "chunked":
            loss, _ = chunked_loss_fn(hidden, weight, labels)
        else:
            loss, _ = loss_fn(F.linear(hidden, weight), labels)  # (B, T, V) logits
    loss.backward()


def _clear(*tensors: torch.Tensor) -> None:
    for t in tensors:
        t.grad = None


def peak_bytes(impl: str, hidden, weight, labels, dtype) -> tuple[int, int]:
    """(bytes allocated at the loss path's peak, bytes still allocated after it: the gradients), both beyond those
    live before it (see the module)."""
    if hidden.device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss_path(impl, hidden, weight, labels, dtype)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss_path(impl, hidden, weight, labels, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace, encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
    live = peak = 0
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        if e["args"].get("Device Type", 0) == 0:  # CPU
            live += e["args"]["Bytes"]
            peak = max(peak, live)
    return peak, live


def seconds(hidden, weight, labels, dtype, rounds: int) -> dict[str, float]:
    """Median seconds of each implementation's loss path, the two interleaved round by round (a busy machine slows
    both alike), after one warm-up round."""
    times: dict[str, list[float]] = {"full": [], "chunked": []}
    for r in range(rounds + 1):
        for impl, spent in times.items():
            _clear(hidden, weight)
            if hidden.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss_path(impl, hidden, weight, labels, dtype)
            if hidden.device.type == "cuda":
                torch.cuda.synchronize()
            if r:
                spent.append(time.perf_counter() - t0)
    return {impl: statistics.median(spent) for impl, spent in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", default="32000,128256,151936")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batches", default="1,4")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (0: memory only)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--as-cuda", action="store_true",
                    help="on CPU, the paths as they run on CUDA: the full loss F.cross_entropy on the fp32 logits "
                         "(not the CPU's in-cache ChunkedCrossEntropy), CUDA's chunk size")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.as_cuda:
        loss_module.cross_entropy = lambda logits, labels, eps=0.0, ignore=-100, **_: kernels._fp32_cross_entropy(
            logits, labels, eps, ignore)
        linear_cross_entropy.CHUNK_ELEMENTS["cpu"] = linear_cross_entropy.CHUNK_ELEMENTS["cuda"]
    if a.threads:
        torch.set_num_threads(a.threads)
    device, dtype = torch.device(a.device), torch.bfloat16 if a.precision == "bf16" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"loss path (output layer + cross-entropy, forward + backward), d_model {a.d_model}, seq_len {a.seq_len}, "
          f"{a.precision} autocast, fp32 weights; {name}{' (as on CUDA)' if a.as_cuda else ''}; "
          f"torch {torch.__version__}")
    print("| V | B | logits fp32 MiB | full peak MiB | chunked peak MiB | chunked ÷ full | full transient MiB | "
          "chunked transient MiB | chunked ÷ full | full ms | chunked ms | chunked ÷ full |\n"
          "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for vocab in map(int, a.vocabs.split(",")):
        gen = torch.Generator(device="cpu").manual_seed(0)
        weight = (torch.randn(vocab, a.d_model, generator=gen) * a.d_model**-0.5).to(device).requires_grad_()
        for batch in map(int, a.micro_batches.split(",")):
            hidden = torch.randn(batch, a.seq_len, a.d_model, generator=gen).to(device).requires_grad_()
            labels = torch.randint(0, vocab, (batch, a.seq_len), generator=gen).to(device)
            row = {"vocab": vocab, "micro_batch": batch, "seq_len": a.seq_len, "d_model": a.d_model,
                   "precision": a.precision, "device": name,
                   "logits_fp32_bytes": batch * a.seq_len * vocab * 4}
            for impl in ("full", "chunked"):
                _clear(hidden, weight)
                peak, after = peak_bytes(impl, hidden, weight, labels, dtype)
                row[f"{impl}_peak_bytes"], row[f"{impl}_transient_bytes"] = peak, peak - after
            timed = seconds(hidden, weight, labels, dtype, a.rounds) if a.rounds else {"full": math.nan,
                                                                                       "chunked": math.nan}
            row.update({f"{impl}_s": s for impl, s in timed.items()})
            _clear(hidden, weight)
            row["peak_ratio"] = row["chunked_peak_bytes"] / row["full_peak_bytes"]
            row["transient_ratio"] = row["chunked_transient_bytes"] / row["full_transient_bytes"]
            row["time_ratio"] = row["chunked_s"] / row["full_s"]
            rows.append(row)
            print(f"| {vocab:,} | {batch} | {row['logits_fp32_bytes'] / MiB:,.0f} | {row['full_peak_bytes'] / MiB:,.0f} "
                  f"| {row['chunked_peak_bytes'] / MiB:,.0f} | {row['peak_ratio']:.3f} "
                  f"| {row['full_transient_bytes'] / MiB:,.0f} | {row['chunked_transient_bytes'] / MiB:,.0f} "
                  f"| {row['transient_ratio']:.3f} | {row['full_s'] * 1e3:,.1f} "
                  f"| {row['chunked_s'] * 1e3:,.1f} | {row['time_ratio']:.3f} |", flush=True)
            del hidden, labels
    how = "max_memory_allocated" if device.type == "cuda" else "the profiler's allocation events"
    print(f"(peak: bytes allocated beyond the hidden states and the weight, the weight's fp32 gradient "
          f"(V x {a.d_model} x 4) included in both; transient: the peak less what is still allocated after "
          f"backward, i.e. less the two gradients the step keeps; {how})")
    if a.json:
        for row in rows:
            print(json.dumps(row))


if __name__ == "__main__":
    main()
