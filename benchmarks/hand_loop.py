"""The training loop a PyTorch user would write by hand, for comparison with `handle run` (benchmarks/fast_path.py).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/hand_loop.py [--steps 30] [--skip 5] [--precision bf16]

PyTorch's own ``nn.TransformerEncoderLayer`` stack (batch_first, pre-LN, GELU, causal mask, dropout 0.1) with a
token embedding, sinusoidal positions, a final LayerNorm and an output projection tied to the embedding -- the P1
dims of presets/zero2.toml: d_model 256, 4 heads, 4 layers, d_ff 1024, vocabulary 4096, seq_len 128, micro-batch 8
per rank. Same work per step as ``handle run presets/zero2.toml`` on 2 ranks: global batch 2 × 8 × 128 = 2048
tokens, AdamW (lr 2e-3, betas (0.9, 0.95), weight decay 0.01), grad-norm clipping at 1.0, bf16 autocast (or fp32),
DDP over gloo (``--no-ddp``: plain all-reduce-free loop per rank). Token ids are random in [0, 4096) (the vocabulary
size of the pydoc BPE), drawn from a private generator. Rank 0 prints one JSON line: median step time (s) and
median and best (fastest step) global tokens/s over the steps after ``--skip``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class HandLM(nn.Module):
    """ids (B, T) -> logits (B, T, V): embed·√C + sinusoidal PE -> dropout -> L × TransformerEncoderLayer (causal)
    -> LayerNorm -> tied output projection."""

    def __init__(self, vocab: int, d_model: int, n_heads: int, n_layers: int, d_ff: int, dropout: float,
                 max_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        pos = torch.arange(max_len, dtype=torch.float32)[:, None]
        div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe)  # (max_len, C)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, d_ff, dropout, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.layers = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=d_model**-0.5)
        self.d_model = d_model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        x = self.drop(self.embed(ids) * math.sqrt(self.d_model) + self.pe[:T])
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=ids.device)  # (T, T) float -inf above diag
        x = self.layers(x, mask=mask, is_causal=True)
        return self.head(self.norm(x))  # (B, T, V)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--no-ddp", action="store_true")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    model = HandLM(4096, 256, 4, 4, 1024, a.dropout, 1024)
    wrapped = model if a.no_ddp else nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    torch.manual_seed(1234 + 1000 * rank)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        seq = torch.randint(0, 4096, (a.micro_batch, a.seq_len + 1), generator=gen)
        ids, labels = seq[:, :-1], seq[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            logits = wrapped(ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    kept = times[a.skip:]
    step = statistics.median(kept)
    if rank == 0:
        tokens = world * a.micro_batch * a.seq_len  # global tokens per step
        print(json.dumps({"case": "hand loop", "step_time_s": step, "tokens_per_s": tokens / step,
                          "best_tokens_per_s": tokens / min(kept), "loss": loss.item(),
                          "threads": torch.get_num_threads(),
                          "omp": os.environ.get("OMP_NUM_THREADS")}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
