"""Helpers shared by test modules."""

from __future__ import annotations

from pathlib import Path


def tiny_preset(output_dir: str | Path, *, steps: int = 10, strategy: str = "ddp", log_every: int = 5) -> str:
    """A preset for real 2-process torchrun tests: a 2-layer d_model=64 Transformer on the embedded corpus,
    fp32 (so strategies can be compared exactly), no evals or checkpoints unless a test asks with --set."""
    return f"""
[run]
output_dir = "{output_dir}"
[model]
d_model = 64
n_heads = 4
n_layers = 2
d_ff = 128
[data]
seq_len = 32
vocab_size = 512
[training]
steps = {steps}
micro_batch_size = 4
precision = "fp32"
eval_every = 0
checkpoint_every = 0
log_every = {log_every}
[strategy]
name = "{strategy}"
[launch]
nproc_per_node = 2
"""
