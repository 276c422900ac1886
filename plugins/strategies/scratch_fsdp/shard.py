"""One parameter sharded on its dim 0: the shard the optimizer steps, and the full tensor the module computes with."""

from __future__ import annotations

import torch
from torch import nn


class ShardedParam:
    """A parameter cut into ``world_size`` chunks of rows, rank ``r`` owning chunk ``r`` as its own tensor.

    Layout (``torch.chunk`` on dim 0, FSDP2's ``Shard(0)``): each rank's chunk is ``rows = ceil(dim0 /
    world_size)`` rows of ``row_numel`` elements; rank ``r`` owns rows ``[r * rows, (r + 1) * rows)`` clipped to
    ``dim0``, so the last ranks may own fewer (or none), and collectives pad every chunk to ``rows`` with zeros.
    A scalar parameter counts as one row.

    - ``shard``: this rank's rows, ``(length, *shape[1:])`` (``(length,)`` for a scalar), an ``nn.Parameter``:
      fp32 for a trainable parameter (the master weights the optimizer steps; after the reduce-scatter its
      ``.grad`` is this rank's rows of the mean gradient, same shape), the parameter's own dtype for a frozen one
      (``requires_grad = False``: never stepped, so no master copy; ``shard.requires_grad`` is False).
    - ``param``: the module's own parameter, unchanged in identity, name, shape and ``requires_grad``; its
      ``.data`` is a view of ``full``, a ``(world_size * rows * row_numel,)`` buffer (padded) in ``gather_dtype``
      that the unit's all-gather fills and :meth:`free` empties (the view keeps its shape with no memory behind
      it; the module must not run until the next gather).
    - ``gather_dtype``: the compute dtype for fp32 parameters (bf16/fp16 under mixed precision), else the
      parameter's own (a bf16 frozen weight is gathered as bf16 whatever the precision).

    This is FSDP2's ``FSDPParam`` (torch/distributed/fsdp/_fully_shard/_fsdp_param.py) without DTensor: there
    the module's attribute is swapped between the sharded parameter and the unsharded one; here the module always
    holds ``param`` and the shard lives beside it.

    Args:
        param: the module's parameter (its values become the shard's and the gathered tensor's).
        rank, world_size: this rank's place among the data-parallel ranks.
        compute_dtype: the dtype fp32 parameters are gathered in.
    """

    def __init__(self, param: nn.Parameter, rank: int, world_size: int, compute_dtype: torch.dtype) -> None:
        self.param, self.world_size = param, world_size
        self.shape = param.shape
        self.dim0 = self.shape[0] if param.dim() else 1
        self.row_numel = param.numel() // self.dim0 if self.dim0 else 0
        self.rows = -(-self.dim0 // world_size)
        self.start = min(rank * self.rows, self.dim0)
        self.length = min(self.start + self.rows, self.dim0) - self.start
        self.trainable = param.requires_grad
        self.gather_dtype = compute_dtype if param.dtype == torch.float32 else param.dtype
        with torch.no_grad():
            rows = param.detach().reshape(self.dim0, self.row_numel)[self.start:self.start + self.length]
            dtype = torch.float32 if self.trainable else param.dtype
            self.shard = nn.Parameter(rows.to(dtype).clone().reshape(self.shard_shape), requires_grad=self.trainable)
            self.full = torch.zeros(world_size * self.chunk_numel, dtype=self.gather_dtype, device=param.device)
            self.full[:param.numel()].copy_(param.detach().reshape(-1))
            param.data = self.full[:param.numel()].view(self.shape)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """This rank's rows: ``(length, *shape[1:])``."""
        return (self.length, *self.shape[1:])

    @property
    def chunk_numel(self) -> int:
        """Elements each rank contributes to a collective for this parameter: ``rows * row_numel`` (padded)."""
        return self.rows * self.row_numel

    def chunk_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full-shaped tensor (``param``'s shape), in ``shard_shape`` (a view)."""
        return full.reshape(self.dim0, self.row_numel)[self.start:self.start + self.length].reshape(self.shard_shape)

    def padded_shard(self, dtype: torch.dtype) -> torch.Tensor:
        """The shard as one rank's part of a collective: ``(chunk_numel,)`` in ``dtype``, zero rows after
        ``length``."""
        out = torch.zeros(self.chunk_numel, dtype=dtype, device=self.shard.device)
        out[:self.shard.numel()].copy_(self.shard.detach().reshape(-1))
        return out

    def free(self) -> None:
        """Release ``full``'s memory (``param`` keeps its shape and must not be read until :meth:`alloc`)."""
        self.full.untyped_storage().resize_(0)

    def alloc(self) -> None:
        """Give ``full`` its memory back (contents undefined until an all-gather fills it)."""
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())

    def full_bytes(self) -> int:
        """Bytes ``full`` holds now (0 when freed)."""
        return self.full.untyped_storage().nbytes()
