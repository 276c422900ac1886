"""litgpt's side of ``vs_litgpt.py``: litgpt's pretraining step, as ``litgpt/pretrain.py`` (0.5.13) runs it, on
presets/llama.toml's shape. Run by ``vs_litgpt.py`` under torchrun with the litgpt environment's Python; it needs
litgpt, never handle (handle and its tests never import litgpt).

What it keeps from ``litgpt.pretrain.main``/``fit``: ``L.Fabric`` (DDP on several processes, one device
otherwise) with the precision given (``32-true`` or litgpt's default on CPU, ``bf16-mixed``), ``GPT(config)``
with ``tie_embeddings`` (``model.transformer.wte.weight = model.lm_head.weight``), ``torch.compile(model)``
before ``fabric.setup`` (unless ``--eager``), ``torch.optim.AdamW`` (not fused on CPU, as pretrain asks), each
iteration's LR set by hand, forward, ``chunked_cross_entropy``, ``fabric.backward``, ``fabric.clip_gradients``
(max norm 1), ``optimizer.step``, ``optimizer.zero_grad``. The tokens are random ids (B, T + 1) drawn once per
step (the step's speed does not depend on their values). Rank 0 writes the wall time of every iteration (seconds)
as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import lightning as L
import torch
from litgpt import GPT, Config
from litgpt.utils import chunked_cross_entropy


def llama_preset_config(vocab_size: int, seq_len: int) -> Config:
    """presets/llama.toml's model as a litgpt ``Config``: d_model 256, 4 layers, 4 query heads sharing 2 key/value
    heads (head size 64), SwiGLU (``LLaMAMLP``) with d_ff 704, RMSNorm (eps 1e-5), full RoPE (base 10,000),
    sequential pre-norm residuals, no biases, no embedding scaling."""
    return Config(name="handle-llama", block_size=seq_len, vocab_size=vocab_size, padded_vocab_size=vocab_size,
                  n_layer=4, n_head=4, n_embd=256, head_size=64, n_query_groups=2, rotary_percentage=1.0,
                  parallel_residual=False, bias=False, norm_class_name="RMSNorm", norm_eps=1e-5,
                  mlp_class_name="LLaMAMLP", intermediate_size=704, rope_base=10000, scale_embeddings=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    ap.add_argument("--eager", action="store_true", help="leave out pretrain's torch.compile(model)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    strategy = "ddp" if a.devices > 1 else "auto"
    fabric = L.Fabric(accelerator="cpu", devices=a.devices, strategy=strategy, precision=a.precision)
    fabric.launch()
    fabric.seed_everything(1234)
    config = llama_preset_config(a.vocab_size, a.seq_len)
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    model.apply(model._init_weights)
    model.transformer.wte.weight = model.lm_head.weight  # pretrain's train.tie_embeddings
    n_params = sum(p.numel() for p in model.parameters())
    if not a.eager:
        model = torch.compile(model)
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)
    gen = torch.Generator().manual_seed(1234 + fabric.global_rank)
    times = []
    fabric.barrier()
    for it in range(a.steps):
        t0 = time.perf_counter()
        lr = 2e-3 * min(1.0, (it + 1) / 30) * 0.5 * (1 + math.cos(math.pi * it / a.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        data = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_len + 1), generator=gen)
        input_ids, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        logits = model(input_ids)
        loss = chunked_cross_entropy(logits, targets)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
    if fabric.global_rank == 0:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump({"step_time_s": times, "params": n_params, "world_size": fabric.world_size,
                       "tokens_per_step": a.micro_batch_size * a.seq_len * fabric.world_size,
                       "loss": float(loss)}, f)


if __name__ == "__main__":
    main()
