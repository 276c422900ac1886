"""``training.compile``: which modules the trainer compiles, in place (``nn.Module.compile``: the modules and
their state-dict names stay), and why (docs/performance.md, "Compiled against litgpt")."""

from __future__ import annotations

from typing import Any

from torch import nn

from torch_handle.model.parallelize import model_blocks


def compiles_whole(model: nn.Module, preset: Any, share: Any) -> bool:
    """Whether ``training.compile`` compiles the whole model (one graph for embedding, blocks, final norm and
    output layer: 1.05x the per-block step on presets/llama.toml in bf16, docs/performance.md) rather than each
    block: only for one process (strategy ``single``), no parallel share, no activation checkpointing, no mixture
    of experts, every parameter trained. Elsewhere per block, as torchtitan does: FSDP shards and checkpoints per
    block, DDP overlaps each block's gradient all-reduce with the backward of the blocks below it (one compiled
    backward would hand it every gradient at the end), and the MoE and LoRA blocks are the ones
    tests/unit/test_compile_blocks.py checks."""
    o = preset.model.options
    return (preset.strategy.name == "single" and share is None
            and not getattr(o, "activation_checkpointing", False) and not getattr(o, "n_experts", 0)
            and all(p.requires_grad for p in model.parameters()))


def compile_for_training(model: nn.Module, preset: Any, share: Any) -> str:
    """Compile ``model`` (after its parallel split) as :func:`compiles_whole` decides; returns ``"whole"`` or
    ``"blocks"``."""
    whole = compiles_whole(model, preset, share)
    for module in [model] if whole else model_blocks(model, default=[model]):
        module.compile()
    return "whole" if whole else "blocks"
