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
weight), including the output weight's fp32 gradient (V x C, which both paths write and the step keeps: at
micro-batch 1 it alone is 0.28x the full path's peak, so this ratio has that floor); transient: the most bytes
allocated at once that do not outlive the loss path, i.e. beyond the two gradients the step keeps either way (the
loss path's own memory, what the target 0.25x is about). On CPU the profiler's allocation events
(``profile_memory=True``: every allocation and free of torch's CPU allocator, in order; an allocation still live at
the end is kept; the run that is profiled is not timed); on CUDA ``torch.cuda.max_memory_allocated`` (the caching
allocator's own count) and transient = that peak less what is allocated after backward (an underestimate of the
full path's, whose weight gradient is made after its peak). ``estimate``: what ``handle estimate`` prices for the
same loss path (``torch_handle.plan.estimate_activations``: what autograd saves, counted on fake tensors, plus the
full path's two fp32 logits-sized buffers, ``full_loss_bytes``, or ``chunked_loss_bytes``), over the measured
transient. Time: the median of ``--rounds`` forward + backward passes, unprofiled, after one warm-up
(``--rounds 0``: memory only). For a CPU, smaller shapes: ``--seq-len 512 --d-model 256``; ``--as-cuda`` runs
on a CPU the paths as CUDA runs them (the full loss ``F.cross_entropy`` on the fp32 logits instead of the CPU's
in-cache ``ChunkedCrossEntropy``, CUDA's chunk size), whose allocations a GPU makes too.

On CUDA each row also checks the chunked path's gradients against the full path's (bf16: within 2e-2 of the
largest; AssertionError otherwise): the fp32-output ``torch.addmm`` that accumulates the output weight's gradient
(``linear_cross_entropy.accumulates_in_fp32``, named in the header line) runs there and nowhere on a CPU;
``--no-fp32-accumulate`` times the blocked path instead.

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
    """(bytes allocated at the loss path's peak, transient bytes: the most allocated at once that do not outlive
    it), both beyond those live before it (see the module)."""
    if hidden.device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss_path(impl, hidden, weight, labels, dtype)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        return peak, peak - (torch.cuda.memory_allocated() - base)
    return profiled_bytes(lambda: loss_path(impl, hidden, weight, labels, dtype))


def profiled_bytes(run) -> tuple[int, int]:
    """(peak, transient) bytes of ``run()`` on CPU from the profiler's allocation events (see the module)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace, encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
    allocs = [e["args"] for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
              if e["args"].get("Device Type", 0) == 0]  # CPU
    kept: dict[int, int] = {}  # address -> index of its live allocation
    for i, a in enumerate(allocs):
        if a["Bytes"] > 0:
            kept[a["Addr"]] = i
        else:
            kept.pop(a["Addr"], None)
    kept_at_end = set(kept.values())
    live = peak = passing = transient = 0
    passing_at: dict[int, int] = {}  # address -> bytes of the live allocation there that does not outlive the path
    for i, a in enumerate(allocs):
        live += a["Bytes"]
        peak = max(peak, live)
        if a["Bytes"] > 0 and i not in kept_at_end:
            passing_at[a["Addr"]] = a["Bytes"]
            passing += a["Bytes"]
        elif a["Bytes"] < 0:
            passing -= passing_at.pop(a["Addr"], 0)
        transient = max(transient, passing)
    return peak, transient


def step_peaks(vocab: int, batch: int, a: argparse.Namespace, dtype, device) -> dict[str, int]:
    """The whole step's peak bytes (forward and backward of a Llama-shaped decoder of ``--step-layers`` layers, as
    the trainer's ``micro_batch_loss`` runs it) for each loss implementation, beyond the model and its inputs."""
    from types import SimpleNamespace

    from torch_handle.model.args import TransformerArgs
    from torch_handle.model.transformer import DecoderLM
    from torch_handle.train.loss import micro_batch_loss

    torch.manual_seed(0)
    model = DecoderLM(TransformerArgs(vocab, d_model=a.d_model, n_heads=a.d_model // 64, n_kv_heads=min(8, a.d_model // 64),
                                      n_layers=a.step_layers, d_ff=4 * a.d_model, dropout=0.0, max_len=a.seq_len,
                                      norm="rmsnorm", position="rope", mlp="swiglu", norm_first=True, bias=False,
                                      scale_embeddings=False)).to(device)
    strategy = SimpleNamespace(model=model, unwrapped=lambda: model, autocast=lambda: torch.autocast(
        device.type, dtype=dtype, enabled=dtype != torch.float32))
    ids = torch.randint(0, vocab, (batch, a.seq_len + 1), device=device)
    peaks = {}
    for impl in ("full", "chunked"):
        model.zero_grad(set_to_none=True)

        def step(impl: str = impl) -> None:
            loss, _ = micro_batch_loss(strategy, {"input_ids": ids[:, :-1]}, ids[:, 1:], impl)
            loss.backward()

        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peaks[impl] = torch.cuda.max_memory_allocated() - base
        else:
            peaks[impl] = profiled_bytes(step)[0]
    return peaks


def estimated_bytes(impl: str, hidden, weight, labels, dtype) -> int:
    """What ``handle estimate`` prices for this loss path: the storages autograd saves (counted on fake tensors, the
    inputs left out, as ``fake_activations`` counts them) plus its loss-path term (``ActivationBytes.logits``):
    ``full_loss_bytes`` (two fp32 (B·T, V) buffers) for ``full``, ``chunked_loss_bytes`` for ``chunked``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch_handle.observe.activations import SavedTensorCounter
    from torch_handle.plan.estimate_activations import chunked_loss_bytes, full_loss_bytes

    with FakeTensorMode():
        h = torch.empty(hidden.shape, dtype=hidden.dtype).requires_grad_()
        w = torch.empty(weight.shape, dtype=weight.dtype).requires_grad_()
        with SavedTensorCounter([h, w]) as counter:
            loss_path(impl, h, w, torch.zeros(labels.shape, dtype=labels.dtype), dtype)
    tokens, vocab, width = labels.numel(), weight.shape[0], weight.shape[1]
    if impl == "full":
        return counter.bytes + full_loss_bytes(tokens, vocab)
    return counter.bytes + chunked_loss_bytes(tokens, vocab, width, dtype, weight.dtype, hidden.element_size())


def gradient_errors(hidden, weight, labels, dtype) -> dict[str, float]:
    """The chunked path's gradients against the full path's: max |chunked - full| / max |full| of the output
    weight's and of the hidden states' (bf16: within 2e-2, as tests/unit/test_chunked_loss.py checks on CPU)."""
    grads = {}
    for impl in ("full", "chunked"):
        _clear(hidden, weight)
        loss_path(impl, hidden, weight, labels, dtype)
        grads[impl] = weight.grad.float(), hidden.grad.float()
    _clear(hidden, weight)
    (w_full, h_full), (w_chunked, h_chunked) = grads["full"], grads["chunked"]
    return {"weight_grad_error": ((w_chunked - w_full).abs().max() / w_full.abs().max()).item(),
            "hidden_grad_error": ((h_chunked - h_full).abs().max() / h_full.abs().max()).item()}


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
    ap.add_argument("--step-layers", type=int, default=0,
                    help="also the whole step's peak (forward + backward) of a Llama-shaped decoder of this many layers "
                         "(d_ff 4 x d_model, 64-wide heads, 8 KV heads at most), each implementation (0: not measured)")
    ap.add_argument("--no-fp32-accumulate", action="store_true",
                    help="the chunked loss adds each chunk's weight gradient through a 16-bit block product even "
                         "where torch.addmm(..., out_dtype=torch.float32) runs (CUDA): the time without it")
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
    if a.no_fp32_accumulate:
        linear_cross_entropy._ADDMM_FP32[device.type] = False
    fused = linear_cross_entropy.accumulates_in_fp32(torch.zeros(1, 1, dtype=torch.bfloat16, device=device),
                                                     torch.zeros(1, 1, device=device))
    print(f"loss path (output layer + cross-entropy, forward + backward), d_model {a.d_model}, seq_len {a.seq_len}, "
          f"{a.precision} autocast, fp32 weights; {name}{' (as on CUDA)' if a.as_cuda else ''}; "
          f"torch {torch.__version__}; chunked weight gradient accumulated in fp32 inside the matmul: "
          f"{'yes' if fused else 'no'}")
    print("| V | B | logits fp32 MiB | full peak MiB | chunked peak MiB | chunked ÷ full | full transient MiB | "
          "chunked transient MiB | chunked ÷ full | estimate ÷ full's | estimate ÷ chunked's | full ms | chunked ms "
          "| chunked ÷ full |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: | ---: |")
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
                row[f"{impl}_peak_bytes"], row[f"{impl}_transient_bytes"] = peak_bytes(impl, hidden, weight, labels,
                                                                                       dtype)
                row[f"{impl}_estimate_bytes"] = estimated_bytes(impl, hidden, weight, labels, dtype)
            timed = seconds(hidden, weight, labels, dtype, a.rounds) if a.rounds else {"full": math.nan,
                                                                                       "chunked": math.nan}
            row.update({f"{impl}_s": s for impl, s in timed.items()})
            _clear(hidden, weight)
            row["peak_ratio"] = row["chunked_peak_bytes"] / row["full_peak_bytes"]
            row["transient_ratio"] = row["chunked_transient_bytes"] / row["full_transient_bytes"]
            for impl in ("full", "chunked"):
                row[f"{impl}_estimate_ratio"] = row[f"{impl}_estimate_bytes"] / row[f"{impl}_transient_bytes"]
            row["time_ratio"] = row["chunked_s"] / row["full_s"]
            row["fp32_accumulate"] = fused
            if device.type == "cuda":  # the GPU's kernels, the fp32-output addmm among them, against the full path
                row.update(gradient_errors(hidden, weight, labels, dtype))
                print(f"V {vocab:,}, B {batch}: chunked against full, max |difference| / max |full|: weight "
                      f"gradient {row['weight_grad_error']:.2e}, hidden {row['hidden_grad_error']:.2e}", flush=True)
                assert max(row["weight_grad_error"], row["hidden_grad_error"]) < 2e-2, row
            if a.step_layers:
                step = step_peaks(vocab, batch, a, dtype, device)
                row.update({f"step_{impl}_peak_bytes": b for impl, b in step.items()})
                row["step_saving_over_logits"] = (step["full"] - step["chunked"]) / row["logits_fp32_bytes"]
                print(f"whole step, {a.step_layers} layers, V {vocab:,}, B {batch}: peak {step['full'] / MiB:,.0f} MiB "
                      f"full, {step['chunked'] / MiB:,.0f} MiB chunked: {(step['full'] - step['chunked']) / MiB:,.0f} "
                      f"MiB lower, {row['step_saving_over_logits']:.2f}x the fp32 logits", flush=True)
            rows.append(row)
            print(f"| {vocab:,} | {batch} | {row['logits_fp32_bytes'] / MiB:,.0f} | {row['full_peak_bytes'] / MiB:,.0f} "
                  f"| {row['chunked_peak_bytes'] / MiB:,.0f} | {row['peak_ratio']:.3f} "
                  f"| {row['full_transient_bytes'] / MiB:,.0f} | {row['chunked_transient_bytes'] / MiB:,.0f} "
                  f"| {row['transient_ratio']:.3f} | {row['full_estimate_ratio']:.2f} "
                  f"| {row['chunked_estimate_ratio']:.2f} | {row['full_s'] * 1e3:,.1f} "
                  f"| {row['chunked_s'] * 1e3:,.1f} | {row['time_ratio']:.3f} |", flush=True)
            del hidden, labels
    how = "max_memory_allocated" if device.type == "cuda" else "the profiler's allocation events"
    print(f"(peak: bytes allocated beyond the hidden states and the weight, the weight's fp32 gradient "
          f"(V x {a.d_model} x 4) included in both; transient: the most allocated at once that does not outlive the "
          f"loss path, i.e. beyond the two gradients the step keeps; estimate: handle estimate's pricing of the "
          f"same path over the measured transient; {how})")
    if a.json:
        for row in rows:
            print(json.dumps(row))


if __name__ == "__main__":
    main()
