"""Causal attention on one CPU thread: torch's flash kernel against ``kernels.causal_attention`` (two matmuls and an
fp32 softmax), forward + backward, eager and compiled, by sequence length: where the explicit one is faster.

    python benchmarks/attention_cpu.py [--rounds 8] [--tokens 1024] [--lengths 128,256,512,1024,2048]

Each case is one attention layer's forward and backward (the gradient of q, k and v) with B = ``--tokens`` / T
sequences of T tokens, in the two shapes of the presets: presets/llama.toml's grouped-query attention (4 query heads,
2 key/value heads, d_k 64) and ddp.toml's multi-head attention (4 heads, d_k 64) widened to 12 heads (GPT-2 small's
count). Both kernels run interleaved, ``--rounds`` times; the table gives the median milliseconds and flash ÷
explicit (> 1: the explicit one is faster). ``kernels.EXPLICIT_ATTENTION_MAX_LEN`` is the longest T at which the
explicit kernel won in bf16 on the machines measured (docs/performance.md); fp32 is printed to show why fp32 keeps
flash.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_handle.model.kernels import causal_attention  # noqa: E402


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024, help="B·T of every case")
    ap.add_argument("--lengths", default="128,256,512,1024,2048")
    ap.add_argument("--dtypes", default="bf16,fp32")
    a = ap.parse_args()
    torch.set_num_threads(1)
    kernels = {"flash": flash, "explicit": causal_attention,
               "flash compiled": torch.compile(flash), "explicit compiled": torch.compile(causal_attention)}
    print("| dtype | heads (q/kv) | T | B | flash ms | explicit ms | flash ÷ explicit | compiled: flash ms | "
          "explicit ms | flash ÷ explicit |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for dtype in a.dtypes.split(","):
        for H, H_kv in ((4, 2), (12, 12)):
            for T in map(int, a.lengths.split(",")):
                B = max(1, a.tokens // T)
                make = [torch.randn(B, h, T, 64, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
                        for h in (H, H_kv, H_kv)]
                grad = torch.randn(B, H, T, 64, dtype=make[0].dtype)
                times: dict[str, list[float]] = {name: [] for name in kernels}
                for r in range(a.rounds + 2):  # the first two: compile and warm up
                    for name, kernel in kernels.items():
                        q, k, v = (t.clone().requires_grad_() for t in make)
                        t0 = time.perf_counter()
                        kernel(q, k, v).backward(grad)
                        if r >= 2:
                            times[name].append((time.perf_counter() - t0) * 1e3)
                ms = {name: statistics.median(t) for name, t in times.items()}
                print(f"| {dtype} | {H}/{H_kv} | {T} | {B} | {ms['flash']:.2f} | {ms['explicit']:.2f} | "
                      f"{ms['flash'] / ms['explicit']:.2f}× | {ms['flash compiled']:.2f} | "
                      f"{ms['explicit compiled']:.2f} | {ms['flash compiled'] / ms['explicit compiled']:.2f}× |",
                      flush=True)


if __name__ == "__main__":
    main()
