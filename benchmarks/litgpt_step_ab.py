"""The training step alone, handle's model against litgpt's, in one process: what ``vs_litgpt.py`` compares without
the launchers, the data and the telemetry, interleaved every few steps (far less noise on a shared machine).

    /work/litgpt-venv/bin/python benchmarks/litgpt_step_ab.py --precision bf16 [--rounds 12]

Run with the litgpt environment's Python (litgpt and the same torch); it imports this checkout's ``torch_handle``
(the model needs only torch). One thread, presets/llama.toml's model (4,000,000 parameters on both sides), micro-batch
8 × seq_len 128, random token ids, AdamW, clipping at 1, bf16 autocast or fp32. The variants:

* ``litgpt``: ``torch.compile(GPT(config))``, ``chunked_cross_entropy``, AdamW for-loop (its pretrain on CPU);
* ``handle-blocks``: each block compiled in place as the trainer does, the eager ``ChunkedCrossEntropy`` and the
  for-loop AdamW: ``training.compile`` before issue 40's change;
* ``handle-compile``: the same blocks, the loss's cross-entropy compiled and AdamW fused: ``training.compile`` now;
* ``handle-whole``: ``torch.compile`` of the whole model instead of its blocks, with the compiled loss and fused AdamW;
* ``litgpt-eager``, ``handle-eager``: nothing compiled (handle: ``ChunkedCrossEntropy``, for-loop AdamW).

Prints the median step time of each, its range and its speed against the first variant.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from litgpt import GPT  # noqa: E402
from litgpt.utils import chunked_cross_entropy  # noqa: E402
from litgpt_train import llama_preset_config  # noqa: E402

from torch_handle.model.args import TransformerArgs  # noqa: E402
from torch_handle.model.parallelize import model_blocks  # noqa: E402
from torch_handle.model.transformer import DecoderLM  # noqa: E402
from torch_handle.train.loss import loss_fn  # noqa: E402

VOCAB, SEQ, BATCH = 4096, 128, 8
VARIANTS = ("litgpt", "handle-blocks", "handle-compile", "handle-whole", "litgpt-eager", "handle-eager")


def build(variant: str, bf16: bool):
    """One training step of ``variant`` as a function of a (B, T + 1) batch of token ids."""
    compiled_loss = variant in ("handle-compile", "handle-whole")
    if variant.startswith("litgpt"):
        model = GPT(llama_preset_config(VOCAB, SEQ))
        model.apply(model._init_weights)
        model.transformer.wte.weight = model.lm_head.weight
        forward = model if variant == "litgpt-eager" else torch.compile(model)

        def loss_of(logits, targets):
            return chunked_cross_entropy(logits, targets)
    else:
        model = DecoderLM(TransformerArgs(VOCAB, d_model=256, n_heads=4, n_layers=4, d_ff=704, dropout=0.0,
                                          max_len=SEQ, norm="rmsnorm", position="rope", mlp="swiglu", norm_first=True,
                                          bias=False, scale_embeddings=False, n_kv_heads=2))
        forward = torch.compile(model) if variant == "handle-whole" else model
        if variant in ("handle-blocks", "handle-compile"):
            for block in model_blocks(model):
                block.compile()

        def loss_of(logits, targets):
            return loss_fn(logits, targets, compiled=compiled_loss)[0]
    assert sum(p.numel() for p in model.parameters()) == 4_000_000
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01,
                                  fused=True if compiled_loss else None)

    def step(ids: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = forward(ids[:, :-1])
        loss_of(logits, ids[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=3, help="steps of one variant in a round")
    a = ap.parse_args()
    torch.set_num_threads(1)
    variants = a.variants.split(",")
    steps = {v: build(v, a.precision == "bf16") for v in variants}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    for v in variants:  # compile, warm up
        for _ in range(4):
            steps[v](ids)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(a.rounds):
        for v in variants:
            t0 = time.perf_counter()
            for _ in range(a.steps):
                steps[v](ids)
            times[v].append((time.perf_counter() - t0) / a.steps)
    base = statistics.median(times[variants[0]])
    print(f"| {a.precision} | step ms median (range) | tokens/s | speed against {variants[0]} |\n"
          "| --- | ---: | ---: | ---: |")
    for v in variants:
        m = statistics.median(times[v])
        spread = f"{min(times[v]) * 1e3:.1f}–{max(times[v]) * 1e3:.1f}"
        print(f"| {v} | {m * 1e3:.1f} ({spread}) | {BATCH * SEQ / m:,.0f} | {base / m:.3f}× |")


if __name__ == "__main__":
    main()
