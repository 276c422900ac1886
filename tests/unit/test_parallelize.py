"""The ``BlockModel`` protocol (torch_handle/model/parallelize.py): the one check of a model's repeated blocks that
FSDP wrapping, per-block compilation, activation checkpointing and ``handle estimate`` share."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_handle.model.args import TransformerArgs
from torch_handle.model.parallelize import (BlockModel, NoBlocksError, checkpointed_blocks, model_blocks,
                                            set_activation_checkpointing)
from torch_handle.model.transformer import build_transformer


class NoBlocks(nn.Module):
    """A model plugin's model that does not say which modules repeat."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


class EmptyBlocks(NoBlocks):
    def blocks(self) -> list[nn.Module]:
        return []


def _tiny(kind: str = "decoder", **overrides):
    torch.manual_seed(0)
    return build_transformer(TransformerArgs(11, d_model=8, n_heads=2, n_layers=2, d_ff=16, **overrides), kind)


@pytest.mark.parametrize("model", [NoBlocks(), EmptyBlocks()], ids=["no-method", "empty"])
def test_a_model_without_blocks_is_rejected_with_one_clear_error(model):
    with pytest.raises(NoBlocksError, match=rf"^{type(model).__name__} has no blocks\(\) \(its repeated layers\)$"):
        model_blocks(model)
    assert isinstance(NoBlocksError("x"), TypeError)
    fallback = [model]
    assert model_blocks(model, default=fallback) is fallback  # the trainer compiles such a model whole
    assert checkpointed_blocks(model) == []


@pytest.mark.parametrize("kind", ["decoder", "encoder-decoder"])
def test_the_transformer_is_a_block_model(kind):
    model = _tiny(kind)
    assert isinstance(model, BlockModel)
    assert model_blocks(model) == model.blocks() and len(model_blocks(model)) == model.n_layers_total


def test_checkpointed_blocks_follow_args_and_training_mode_and_unwrap_module():
    model = _tiny().train()
    assert checkpointed_blocks(model) == []
    set_activation_checkpointing(model, True)
    assert model.args.activation_checkpointing and checkpointed_blocks(model) == model.blocks()

    class Wrapper(nn.Module):  # DDP and the DeepSpeed engine hold the model as .module
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    assert checkpointed_blocks(Wrapper(model)) == model.blocks()
    assert checkpointed_blocks(model.eval()) == []
