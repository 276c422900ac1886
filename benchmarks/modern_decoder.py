"""One figure for each piece of the modern decoder (docs/modern-decoder.md): GQA's key/value cache, RMSNorm's speed,
SwiGLU's loss at matched parameters, RoPE's loss beyond the training length, the cost of packed documents' mask.

    python benchmarks/modern_decoder.py kv-cache [--json]
    python benchmarks/modern_decoder.py norm [--reps 21] [--threads 1] [--json]
    python benchmarks/modern_decoder.py swiglu [--steps 200] [--json]
    python benchmarks/modern_decoder.py rope [--steps 300] [--seq-len 64] [--json]
    python benchmarks/modern_decoder.py document-mask [--reps 21] [--threads 1] [--seq-len 256] [--json]

* ``kv-cache``: the bytes a ``KVCache`` holds after feeding a context to presets/llama.toml's model (4 layers,
  4 query heads of 64) with 4 (multi-head), 2 (the preset: grouped-query) and 1 (multi-query) key/value heads,
  fp32, batch 1. Counted from the cache's tensors, so it does not depend on the machine.
* ``norm``: forward + backward of LayerNorm, this project's RMSNorm (``norms.RMSNorm``, written out in fp32) and
  ``torch.nn.RMSNorm`` (a fused kernel) on the preset's activations (8 x 128 x 256, fp32), median of ``--reps``
  after a warm-up, the three interleaved in each repetition, ``--threads`` intra-op threads (1: a torchrun worker).
* ``swiglu``: two real 2-rank runs of presets/llama.toml for ``--steps`` steps, its SwiGLU (d_ff 704, three
  matrices) against a GELU FFN of the same parameter count (d_ff 1024, two matrices: 540,672 vs 524,288 per
  layer); the validation loss of each (the same data order and seed).
* ``rope``: two real 2-rank runs at ``--seq-len`` tokens, presets/llama.toml (RoPE, unscaled embeddings) against
  the same model with the sinusoidal table (and the paper's √d_model embedding scale that goes with it); then each
  model reads the validation split in windows 4x as long, and the loss per position range is reported: up to the
  training length, and the positions it never saw.
* ``document-mask``: forward + backward of presets/llama.toml's model (vocabulary 4096) on 8 windows of
  ``--seq-len`` tokens (on CUDA when there is one, in bf16 autocast; else fp32 with ``--threads``): without
  ``position_ids``, with ``position_ids`` that cross no boundary (the causal fast path kept), and packed documents
  of 1/4 and 1/16 of the window (the block-causal mask, built once per forward); median of ``--reps`` after a
  warm-up, interleaved, and the mask's bytes.

Runs go to ``--out`` (default runs/bench-modern-decoder). Losses and bytes do not depend on the machine's load;
times do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import _common
import torch

from torch_handle.model.args import TransformerArgs
from torch_handle.model.kv_cache import KVCache
from torch_handle.model.transformer import DecoderLM

PRESET = _common.ROOT / "presets" / "llama.toml"
LLAMA = dict(d_model=256, n_heads=4, n_layers=4, d_ff=704, dropout=0.0, norm="rmsnorm", position="rope",
             mlp="swiglu", norm_first=True, bias=False, scale_embeddings=False)


def kv_cache(_args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for n_kv_heads in (4, 2, 1):
        for context in (128, 1024):
            model = DecoderLM(TransformerArgs(4096, **LLAMA, n_kv_heads=n_kv_heads, max_len=context)).eval()
            cache = KVCache.for_model(model)
            with torch.no_grad():
                model(torch.randint(3, 4096, (1, context)), cache=cache)
            rows.append({"n_kv_heads": n_kv_heads, "context": context, "kv_cache_bytes": cache.nbytes,
                         "params": model.num_params()})
    return rows


def norm(args: argparse.Namespace) -> list[dict[str, Any]]:
    from torch_handle.model.norms import RMSNorm

    torch.set_num_threads(args.threads)
    x = torch.randn(8, 128, 256, requires_grad=True)
    grad = torch.randn_like(x)
    modules = {"LayerNorm": torch.nn.LayerNorm(256), "RMSNorm (ours, written out)": RMSNorm(256, 1e-5),
               "torch.nn.RMSNorm": torch.nn.RMSNorm(256, 1e-5)}
    times: dict[str, list[float]] = {name: [] for name in modules}
    for rep in range(args.reps + 1):
        for name, module in modules.items():
            start = time.perf_counter()
            module(x).backward(grad)
            if rep:  # the first repetition warms up
                times[name].append(time.perf_counter() - start)
    return [{"norm": name, "fwd_bwd_ms": round(statistics.median(t) * 1e3, 3), "threads": args.threads,
             "shape": [8, 128, 256]} for name, t in times.items()]


def _val_losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["val_loss"] for e in _common.read_events(run_dir, "eval")}


def _run(out: Path, name: str, overrides: list[str]) -> Path:
    return _common.handle_run(PRESET, [f"run.output_dir={out}", f"run.name={name}", "training.checkpoint_every=0",
                                       *overrides])


def swiglu(args: argparse.Namespace) -> list[dict[str, Any]]:
    steps = [f"training.steps={args.steps}", f"training.eval_every={args.steps // 4}"]
    rows = []
    for name, mlp, d_ff in (("swiglu", "swiglu", 704), ("gelu", "gelu", 1024)):
        run_dir = _run(args.out, f"ffn-{name}", [*steps, f"model.mlp={mlp}", f"model.d_ff={d_ff}"])
        losses = _val_losses(run_dir)
        rows.append({"mlp": mlp, "d_ff": d_ff, "ffn_params_per_layer": (3 if mlp == "swiglu" else 2) * 256 * d_ff,
                     "val_loss": losses, "run_dir": str(run_dir)})
    return rows


def _loss_by_position(run_dir: Path, length: int, train_len: int) -> dict[str, float]:
    """Mean validation loss (nats) over position ranges of windows ``length`` long, the run's model rebuilt for that
    length (RoPE has no table; the sinusoidal table is computed for the longer length, its first rows the same)."""
    import torch.nn.functional as F

    from torch_handle.infer.generate import load_run, validation_split

    loaded = load_run(run_dir)
    data = dataclasses.replace(loaded.preset.data.options, seq_len=length)
    longer = dataclasses.replace(loaded.preset, data=dataclasses.replace(loaded.preset.data, options=data))
    valid, _ = validation_split(dataclasses.replace(loaded, preset=longer))
    model = DecoderLM(dataclasses.replace(loaded.model.args, max_len=length, dropout=0.0)).eval()
    state = {k: v for k, v in loaded.model.state_dict().items() if k != "pos_encoding.pe"}
    model.load_state_dict(state, strict=False)
    sums, count = torch.zeros(length), 0
    with torch.no_grad():
        for batch in torch.utils.data.DataLoader(valid, batch_size=16):
            logits = model(batch["input_ids"])  # (B, L, V)
            sums += F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").sum(0)
            count += batch["input_ids"].shape[0]
    per_position = sums / count
    edges = sorted({0, train_len, 2 * train_len, length})
    return {f"{a}-{b - 1}": round(float(per_position[a:b].mean()), 4) for a, b in zip(edges, edges[1:])}


def rope(args: argparse.Namespace) -> list[dict[str, Any]]:
    common = [f"training.steps={args.steps}", f"training.eval_every={args.steps // 3}", f"data.seq_len={args.seq_len}"]
    rows = []
    for position, scale in (("rope", "false"), ("sinusoidal", "true")):
        run_dir = _run(args.out, f"pos-{position}", [*common, f"model.position={position}",
                                                     f"model.scale_embeddings={scale}"])
        rows.append({"position": position, "train_seq_len": args.seq_len, "val_loss": _val_losses(run_dir),
                     "loss_by_position": _loss_by_position(run_dir, 4 * args.seq_len, args.seq_len),
                     "run_dir": str(run_dir)})
    return rows


def document_mask(args: argparse.Namespace) -> list[dict[str, Any]]:
    from torch_handle.model.transformer import document_mask_of

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, T = 8, args.seq_len
    model = DecoderLM(TransformerArgs(4096, **LLAMA, n_kv_heads=2, max_len=T)).to(device).train()
    ids = torch.randint(3, 4096, (B, T), device=device)
    arange = torch.arange(T, device=device)
    cases = {"no position_ids": None, "position_ids, no boundary": arange.expand(B, T)}
    for n_docs in (4, 16):
        cases[f"{n_docs} documents a window"] = (arange % (T // n_docs)).expand(B, T)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(args.reps + 1):
        for name, positions in cases.items():
            kwargs = {} if positions is None else {"position_ids": positions}
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                model(ids, **kwargs).float().mean().backward()
            if cuda:
                torch.cuda.synchronize()
            if rep:  # the first repetition warms up
                times[name].append(time.perf_counter() - start)
    rows = []
    for name, positions in cases.items():
        mask = document_mask_of(positions)
        rows.append({"case": name, "fwd_bwd_ms": round(statistics.median(times[name]) * 1e3, 2),
                     "mask_bytes": 0 if mask is None else mask.numel(), "device": torch.cuda.get_device_name()
                     if cuda else f"cpu x{args.threads}", "shape": [B, T]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["kv-cache", "norm", "swiglu", "rope", "document-mask"])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--out", type=Path, default=_common.ROOT / "runs" / "bench-modern-decoder")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args()
    args.steps = args.steps or {"swiglu": 200, "rope": 300}.get(args.what, 0)
    args.seq_len = args.seq_len or (256 if args.what == "document-mask" else 64)
    rows = {"kv-cache": kv_cache, "norm": norm, "swiglu": swiglu, "rope": rope,
            "document-mask": document_mask}[args.what](args)
    for row in rows:
        print(json.dumps(row) if args.json else "  ".join(f"{k} {v}" for k, v in row.items() if k != "run_dir"))


if __name__ == "__main__":
    main()
