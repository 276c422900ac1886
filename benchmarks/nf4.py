"""NF4 (torch_handle/finetune/nf4.py, docs/qlora.md) measured: bytes, dequantisation cost, error and loss.

    python benchmarks/nf4.py [bytes] [dequant] [quality] [--run RUN_DIR] [--steps 150] [--threads 1] [--reps 11]
    python benchmarks/nf4.py cuda    # on a GPU, with bitsandbytes installed

* ``bytes``: the weights of a d_model 512 decoder's linears (4 layers, d_ff 2048: every attention projection and
  feed-forward matrix; the output projection is tied to the embedding and stays as it is) in fp32, bf16, NF4 with
  float32 absmax constants and NF4 double-quantised: bytes counted from the stored tensors, bits per parameter,
  and the ratio to bf16.
* ``dequant``: that model's forward pass on CPU (a batch of 8 x 128 tokens, fp32, no grad, ``--threads`` intra-op
  threads: 1 is a torchrun worker's), with nn.Linear and with NF4Linear, interleaved, median of ``--reps``; and
  the dequantisation of all its NF4 weights alone, the cost NF4 adds to every forward (and again to the backward).
* ``quality``: a trained model (``--run``, or presets/single.toml's decoder, d_model 256, trained for ``--steps``)
  with its linears quantised: the relative error ||W - Q(W)||_F / ||W||_F over all of them and the worst layer's,
  and the validation loss of the fp32 weights, the weights cast to bf16, NF4 and NF4 double-quantised.
* ``cuda`` (only when named): against bitsandbytes' CUDA kernels on the same weights (bf16, fp16, fp32), the 4-bit
  codes and 8-bit constants that differ and whether the dequantised weights are equal; the dequantisation and an
  NF4Linear's forward against bitsandbytes and a bf16 nn.Linear; the allocated bytes of eight 4096x4096 linears.

Bytes and losses do not depend on the machine's load; times do.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import _common
import torch
from torch import nn

from torch_handle.finetune.nf4 import NF4Linear, quantize_linears
from torch_handle.model.args import TransformerArgs
from torch_handle.model.transformer import DecoderLM

MODEL = {"d_model": 512, "n_heads": 8, "n_layers": 4, "d_ff": 2048, "dropout": 0.0, "norm_first": True,
         "max_len": 128}
PRESET = _common.ROOT / "presets" / "single.toml"


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, NF4Linear)}


def _quantized(model: nn.Module, double_quant: bool) -> nn.Module:
    copied = copy.deepcopy(model)
    quantize_linears(copied, double_quant=double_quant)
    return copied


def measure_bytes(model: DecoderLM) -> list[dict[str, Any]]:
    names = quantize_linears(copy.deepcopy(model))
    weights = [model.get_submodule(n).weight for n in names]
    n = sum(w.numel() for w in weights)
    rows = [{"format": "fp32", "bytes": 4 * n}, {"format": "bf16", "bytes": 2 * n}]
    for label, dq in (("NF4, fp32 absmax", False), ("NF4, double-quantised", True)):
        stored = sum(m.nf4_weight().nbytes for m in _linears(_quantized(model, dq)).values())
        rows.append({"format": label, "bytes": stored})
    for row in rows:
        row |= {"linears": len(names), "params": n, "bits_per_param": round(8 * row["bytes"] / n, 4),
                "vs_bf16": round(row["bytes"] / (2 * n), 4)}
    return rows


def measure_dequant(model: DecoderLM, threads: int, reps: int) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    nf4 = _quantized(model, True).eval()
    ids = torch.randint(3, model.args.vocab_size, (8, 128))
    cases = {"nn.Linear (fp32)": lambda: model(ids), "NF4Linear": lambda: nf4(ids),
             "dequantise all NF4 weights": lambda: [m.dequantize(torch.float32) for m in _linears(nf4).values()]}
    times: dict[str, list[float]] = {name: [] for name in cases}
    with torch.no_grad():
        for rep in range(reps + 1):
            for name, fn in cases.items():
                start = time.perf_counter()
                fn()
                if rep:  # the first repetition warms up
                    times[name].append(time.perf_counter() - start)
    return [{"case": name, "ms": round(statistics.median(t) * 1e3, 2), "threads": threads, "batch": [8, 128]}
            for name, t in times.items()]


def _trained_run(args: argparse.Namespace) -> Path:
    if args.run:
        return args.run
    return _common.handle_run(PRESET, [f"run.output_dir={args.out}", "run.name=nf4-base",
                                       f"training.steps={args.steps}", "training.eval_every=0",
                                       "training.checkpoint_every=0"])


def measure_quality(args: argparse.Namespace) -> list[dict[str, Any]]:
    from torch_handle.infer.generate import evaluate_loss, load_run, validation_split

    loaded = load_run(_trained_run(args))
    valid, collate = validation_split(loaded)
    base = loaded.model
    names = quantize_linears(copy.deepcopy(base))
    weights = {n: base.get_submodule(n).weight.detach() for n in names}
    bf16 = copy.deepcopy(base)
    for n in names:  # the same linears, their weights rounded to bf16 (and computed in fp32)
        bf16.get_submodule(n).weight.data = weights[n].bfloat16().float()
    rows = [{"weights": "fp32 (trained)", "val_loss": evaluate_loss(base, valid, collate)[0]},
            {"weights": "bf16", "val_loss": evaluate_loss(bf16, valid, collate)[0]}]
    for label, dq in (("NF4, fp32 absmax", False), ("NF4, double-quantised", True)):
        model = _quantized(base, dq)
        errors = {n: weights[n] - m.dequantize(torch.float32) for n, m in _linears(model).items()}
        relative = {n: float(e.norm() / weights[n].norm()) for n, e in errors.items()}
        total = sum(float(e.square().sum()) for e in errors.values()) / sum(float(w.square().sum())
                                                                             for w in weights.values())
        worst = max(relative, key=relative.get)
        rows.append({"weights": label, "val_loss": evaluate_loss(model, valid, collate)[0],
                     "rel_error": round(total ** 0.5, 5), "worst_layer": worst,
                     "worst_rel_error": round(relative[worst], 5)})
    for row in rows:
        row["loss_change"] = round(row["val_loss"] - rows[0]["val_loss"], 5)
        row["val_loss"] = round(row["val_loss"], 5)
    return rows


def _median_ms(fn, reps: int) -> float:
    times = []
    for rep in range(reps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if rep:
            times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 4)


def measure_cuda(reps: int) -> list[dict[str, Any]]:
    """On a CUDA device, against bitsandbytes' CUDA kernels: the codes and constants that differ, and timings."""
    import bitsandbytes.functional as bnb

    from torch_handle.finetune.nf4 import quantize_nf4

    if not torch.cuda.is_available():
        raise SystemExit("cuda: no CUDA device")
    rows = []
    for shape, dtype in (((4096, 4096), torch.bfloat16), ((11008, 4096), torch.bfloat16),
                         ((1024, 2816), torch.float16), ((4096, 4096), torch.float32)):
        w = (torch.randn(shape, device="cuda") * torch.rand(shape[0], 1, device="cuda") * 0.05).to(dtype)
        packed, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        ours = quantize_nf4(w)
        rows.append({"shape": list(shape), "dtype": str(dtype).split(".")[1],
                     "codes_differing": int((packed.flatten() != ours.packed).sum()), "codes": ours.numel,
                     "constants_differing": int((state.absmax != ours.absmax_codes).sum()),
                     "constants": ours.absmax_codes.numel(),
                     "mean_and_scales_equal": torch.equal(state.offset, ours.absmax_mean)
                     and torch.equal(state.state2.absmax, ours.absmax_scale),
                     "dequantised_equal": torch.equal(bnb.dequantize_4bit(packed, state), ours.dequantize())})
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    ours, linear = quantize_nf4(w), nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    nf4_linear, x = NF4Linear.from_linear(linear), torch.randn(8, 512, 4096, device="cuda", dtype=torch.bfloat16)
    rows.append({"dequantise_4096x4096_bf16_ms": _median_ms(lambda: ours.dequantize(torch.bfloat16), reps),
                 "bitsandbytes_ms": _median_ms(lambda: bnb.dequantize_4bit(packed, state), reps),
                 "linear_8x512_tokens_ms": _median_ms(lambda: linear(x), reps),
                 "nf4_linear_ms": _median_ms(lambda: nf4_linear(x), reps)})
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    layers = [nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    bf16_bytes = torch.cuda.memory_allocated() - base
    layers = [NF4Linear.from_linear(layer) for layer in layers]
    torch.cuda.empty_cache()
    nf4_bytes = torch.cuda.memory_allocated() - base
    rows.append({"allocated_8_linears_4096x4096_bf16": bf16_bytes, "nf4": nf4_bytes,
                 "vs_bf16": round(nf4_bytes / bf16_bytes, 4)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="*", choices=["bytes", "dequant", "quality", "cuda"], default=[])
    ap.add_argument("--run", type=Path, help="a finished run directory to quantise (default: train one)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--out", type=Path, default=_common.ROOT / "runs" / "bench-nf4")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = DecoderLM(TransformerArgs(4096, **MODEL, tie_embeddings=True)).eval()
    sections = {"bytes": lambda: measure_bytes(model), "dequant": lambda: measure_dequant(model, args.threads,
                                                                                          args.reps),
                "quality": lambda: measure_quality(args), "cuda": lambda: measure_cuda(args.reps)}
    for what in args.what or ["bytes", "dequant", "quality"]:
        for row in sections[what]():
            print(json.dumps({"section": what, **row}) if args.json else
                  f"{what:8} " + "  ".join(f"{k} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
