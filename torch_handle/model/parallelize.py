"""How a model is cut into units: its repeated blocks, what activation checkpointing, FSDP sharding and
per-block compilation all act on, declared once (``BlockModel``) and checked once (``model_blocks``).

The place of torchtitan's ``models/llama3/parallelize.py``: the model's parallel plan (tensor and pipeline
splits) joins it here. Users: the trainer (``training.compile`` compiles each block), the ``fsdp`` strategy
(``fully_shard`` per block, then the model), ``handle estimate`` and the activation telemetry
(``checkpointed_blocks``). The project's ``DecoderLM`` / ``EncoderDecoder`` and the ``hf`` plugin's wrapper are
``BlockModel``s. No torch at import.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

_REQUIRED: Any = object()


@runtime_checkable
class BlockModel(Protocol):
    """A model made of repeated blocks (e.g. Transformer layers).

    ``blocks()`` returns them in forward order, non-empty; each is checkpointed on its own when
    ``args.activation_checkpointing`` is set, is its own FSDP unit and its own ``torch.compile`` unit. ``args`` is
    a frozen dataclass with a bool ``activation_checkpointing``; assigning a new one (``dataclasses.replace``)
    switches checkpointing of the built model (``set_activation_checkpointing``). A model plugin's model may
    leave both out: it is then sharded and compiled as one unit and never checkpointed.
    """

    args: Any

    def blocks(self) -> list[nn.Module]: ...


class NoBlocksError(TypeError):
    """The model does not declare its repeated blocks (``BlockModel.blocks``)."""


def model_blocks(model: Any, default: Any = _REQUIRED) -> list[nn.Module]:
    """The blocks ``model`` declares: ``list(model.blocks())``.

    Args:
        model: an ``nn.Module``, unwrapped (not DDP/DeepSpeed's wrapper).
        default: returned instead of raising for a model that declares none.

    Raises:
        NoBlocksError: ``"<class> has no blocks() (its repeated layers)"``, when ``model`` has no callable
            ``blocks`` or it returns nothing, and no ``default`` is given.
    """
    blocks = list(model.blocks()) if callable(getattr(model, "blocks", None)) else []
    if blocks:
        return blocks
    if default is not _REQUIRED:
        return default
    raise NoBlocksError(f"{type(model).__name__} has no blocks() (its repeated layers)")


def activation_checkpointing(model: Any) -> bool:
    """``model.args.activation_checkpointing``; False for a model without it."""
    return bool(getattr(getattr(model, "args", None), "activation_checkpointing", False))


def set_activation_checkpointing(model: Any, on: bool) -> None:
    """Switch activation checkpointing of a built ``BlockModel`` by replacing its ``args``."""
    model.args = dataclasses.replace(model.args, activation_checkpointing=on)


def checkpointed_blocks(model: Any) -> list[nn.Module]:
    """The blocks whose inputs autograd keeps instead of their activations: the blocks of a model that trains
    with activation checkpointing (``model`` may be DDP's or DeepSpeed's wrapper: its ``.module`` is used), else
    none."""
    model = getattr(model, "module", model)
    if activation_checkpointing(model) and model.training:
        return model_blocks(model, default=[])
    return []
