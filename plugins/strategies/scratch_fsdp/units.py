"""The units of sharding: which parameters are gathered together, and how they lie in one flat buffer."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from torch_handle.model.parallelize import model_blocks


def find_units(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """``(module name, module, parameters)`` per unit, in forward order, the model itself ("the rest") last.

    The units are the model's ``blocks()`` (the ``BlockModel`` protocol) when it declares them; otherwise every
    module with parameters of its own (``recurse=False``), so any ``nn.Module`` works. A parameter used by several
    modules (tied weights) and every parameter in no unit belong to the last unit, the root ``model``, which stays
    gathered for the whole forward and backward. Units without parameters are left out.
    """
    blocks = model_blocks(model, default=None)
    if blocks is not None:
        candidates = [(m, list(m.parameters())) for m in blocks]
    else:
        owners = Counter(p for m in model.modules() for p in m.parameters(recurse=False))
        candidates = [(m, [p for p in m.parameters(recurse=False) if owners[p] == 1])
                      for m in model.modules() if m is not model]
    module_names = {m: n for n, m in model.named_modules()}
    units, taken = [], set()
    for module, params in candidates:
        own = [p for p in params if p not in taken and p.requires_grad]
        taken.update(own)
        if own:
            units.append((module_names[module], module, own))
    rest = [p for p in model.parameters() if p not in taken and p.requires_grad]
    if rest:
        units.append(("", model, rest))
    return units


class FlatUnit:
    """One unit's parameters as one flat buffer, padded to a multiple of the world size and cut into equal shards.

    Layout: parameter ``i`` (in ``params`` order) is elements ``offsets[i] : offsets[i] + numels[i]`` of the flat
    vector; ``padded - numel`` zeros follow (fewer than ``world_size``). Rank ``r`` owns elements
    ``r * shard_numel : (r + 1) * shard_numel`` as ``master``, an fp32 ``nn.Parameter`` (the tensor the optimizer
    steps). The module computes with ``full``, a buffer of ``padded`` elements in the compute dtype whose views
    the parameters' ``.data`` become; :meth:`free` releases its storage (the views keep their shapes, with no
    memory behind them) and :meth:`alloc` brings it back, to be filled by an all-gather.

    Source: the ``FlatParameter`` of PyTorch FSDP (Zhao et al. 2023, VLDB, section 3.2).

    Args:
        name: the unit's module name ("" for the root).
        module: the module whose forward uses the unit (hooks go there).
        params: the unit's parameters, the same order on every rank.
        rank, world_size: this rank's place among the data-parallel ranks.
        dtype: compute dtype of ``full`` (torch.float32, bfloat16 or float16).
    """

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter], rank: int, world_size: int,
                 dtype: torch.dtype) -> None:
        self.name, self.module, self.params = name, module, params
        self.rank, self.world_size, self.dtype = rank, world_size, dtype
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.padded = -(-self.numel // world_size) * world_size
        self.shard_numel = self.padded // world_size
        with torch.no_grad():
            flat = self.flatten([p.detach() for p in params], torch.float32)
            self.master = nn.Parameter(self.shard_of(flat).clone())
            self.full = flat.to(dtype)
            for p, view in zip(params, self.views(self.full)):
                p.data = view
        self.gathered = True
        """Whether ``full`` holds the current weights."""
        self.pending = None
        """An all-gather into ``full`` started and not yet waited for (prefetch)."""

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """``tensors`` (one per parameter, their shapes) as one flat ``(padded,)`` tensor of ``dtype``."""
        flat = torch.zeros(self.padded, dtype=dtype, device=tensors[0].device)
        for t, offset, n in zip(tensors, self.offsets, self.numels):
            flat[offset:offset + n].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per parameter, its part of ``flat`` (padded layout) in its shape."""
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a ``(padded,)`` tensor, ``(shard_numel,)`` (a view)."""
        return flat[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]

    def free(self) -> None:
        """Release ``full``'s memory; the parameters keep their shapes and must not be read until :meth:`alloc`."""
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def alloc(self) -> None:
        """Give ``full`` its memory back (contents undefined until an all-gather fills it)."""
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())

    def full_bytes(self) -> int:
        """Bytes ``full`` holds now (0 when freed)."""
        return self.full.untyped_storage().nbytes()
