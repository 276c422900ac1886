"""What per-layer activation checkpointing saves and costs, side by side, on the zero2 preset's model.

    python benchmarks/activation_checkpointing.py [--steps 8] [--batch 8] [--seq-len 128] [--dtype fp32|bf16]

Builds ``DecoderLM`` at the zero2 (= single/ddp) preset's dims (d_model 256, 4 heads, 4 layers, d_ff 1024, vocab
4096, pre-LN GELU, dropout 0.1, pad_id set as the datasets set it) for one micro-batch (B, T), with
``activation_checkpointing`` off and on, and prints:

* activation bytes: the distinct storages of the tensors autograd saves for backward during one forward
  (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded; with checkpointing, the saved tensors
  inside a block are never stored (the checkpoint's own hooks take them), so each block's input, which the
  checkpoint keeps instead, is added;
* the step time: median of ``--steps`` forward + backward + AdamW steps (after 2 warm-up steps), in one
  process on this machine's threads, the two models taking turns step by step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from torch_handle.data.datasets import PAD_ID
from torch_handle.model.args import TransformerArgs
from torch_handle.model.transformer import DecoderLM


def build(checkpointing: bool, seq_len: int, dtype: torch.dtype) -> DecoderLM:
    torch.manual_seed(0)
    args = TransformerArgs(vocab_size=4096, d_model=256, n_heads=4, n_layers=4, d_ff=1024, dropout=0.1,
                           mlp="gelu", norm_first=True, max_len=seq_len, pad_id=PAD_ID,
                           activation_checkpointing=checkpointing)
    return DecoderLM(args).to(dtype).train()


def activation_bytes(model: DecoderLM, ids: torch.Tensor) -> tuple[int, int]:
    """(bytes, tensors): distinct storages autograd keeps for backward after one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.nbytes():
            seen[s.data_ptr()] = s.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    hooks = []
    if model.args.activation_checkpointing:  # the checkpoint keeps each block's input (not via saved tensors)
        hooks = [b.register_forward_pre_hook(lambda m, args: keep(args[0])) for b in model.blocks()]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids).float().logsumexp(-1).mean()
    loss.backward()
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    return sum(seen.values()), len(seen)


def step_times(models: dict[bool, DecoderLM], ids: torch.Tensor, steps: int) -> dict[bool, float]:
    """Median seconds of forward + backward + AdamW step per model; the models take turns, step by step, so a
    machine shared with other work slows both alike."""
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times: dict[bool, list[float]] = {k: [] for k in models}
    for i in range(steps + 2):
        for k, model in models.items():
            t0 = time.perf_counter()
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
            loss.backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            if i >= 2:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="micro-batch size (zero2 preset: 8)")
    ap.add_argument("--seq-len", type=int, default=128, help="zero2 preset: 128")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    a = ap.parse_args()
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    ids = torch.randint(4, 4096, (a.batch, a.seq_len))
    models = {ac: build(ac, a.seq_len, dtype) for ac in (False, True)}
    saved = {ac: activation_bytes(m, ids) for ac, m in models.items()}
    times = step_times(models, ids, a.steps)
    rows = {ac: (*saved[ac], times[ac]) for ac in models}
    print(f"DecoderLM d_model 256, 4 layers, d_ff 1024, vocab 4096; batch {a.batch} x {a.seq_len} tokens, {a.dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'activation_checkpointing':<26}{'activation bytes':>18}{'tensors':>9}{'step time':>12}")
    for ac, (nbytes, n, t) in rows.items():
        print(f"{str(ac).lower():<26}{nbytes:>18,}{n:>9}{t * 1e3:>9.1f} ms")
    (b0, _, t0), (b1, _, t1) = rows[False], rows[True]
    print(f"checkpointing keeps {b1 / b0:.2f}x the activation bytes ({(b0 - b1) / 2**20:.1f} MiB less) "
          f"at {t1 / t0:.2f}x the step time")


if __name__ == "__main__":
    main()
