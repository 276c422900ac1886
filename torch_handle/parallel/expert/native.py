"""Expert parallelism with torch's own pieces, as torchtitan does (``torchtitan/distributed/expert_parallel.py``):
the experts' stacked weights become DTensors placed ``Shard(0)`` on the mesh's "ep" dimension
(``distribute_module`` with a partition function), the counts travel by the functional ``all_to_all_single`` and
the rows by ``all_to_all_single_autograd`` (``torch.distributed._functional_collectives``, whose backward is the
reverse all-to-all), in the module's input and output functions. The permutation between them is the one the
hand-written path uses (:mod:`~torch_handle.parallel.expert.permute`), and so are the steps (see
:mod:`~torch_handle.parallel.expert.scratch`).

The expert module computes on its weights' local shards (``GroupedExperts`` reads ``to_local()``), as torchtitan's
``GroupedExperts`` does. Counted: the bytes of both directions (the backward's are the forward's with the splits
swapped, so they are added when the forward runs) and the forward's seconds only (torch runs the backward's
all-to-all inside autograd).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from torch_handle.parallel.expert.permute import inverse, source_to_expert_order
from torch_handle.parallel.expert.scratch import Record, row_bytes, split_sizes, waiting


class NativeExpertParallel(ParallelStyle):
    """One MoE layer's experts as ``Shard(0)`` DTensors on the "ep" mesh, dispatch and combine in its input and output
    functions (torchtitan's ``ExpertParallel``). ``apply(experts, mesh)``; ``layer`` and ``record`` as
    :class:`~torch_handle.parallel.expert.scratch.ScratchExpertParallel`'s."""

    def __init__(self, layer: int = 0, record: Record | None = None) -> None:
        super().__init__()
        self.layer, self.record = layer, record
        self.in_splits: list[int] = []
        self.out_splits: list[int] = []
        self.index: Tensor | None = None

    def apply(self, experts: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return self._apply(experts, mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, partition_fn=self._partition, input_fn=self._dispatch,
                                 output_fn=self._combine)

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            # every rank built the same weights: cut locally, no scatter from rank 0
            shard = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(param_name, nn.Parameter(shard, requires_grad=param.requires_grad))

    def _exchange(self, rows: Tensor, out_splits: list[int], in_splits: list[int], group: Any, what: str) -> Tensor:
        start = time.perf_counter()
        with waiting(f"{what} layer {self.layer}", in_splits, out_splits):
            out = all_to_all_single_autograd(rows, out_splits, in_splits, group)
            out = wait_tensor(out)  # the AsyncCollectiveTensor waited for here, inside the phase (autograd: identity)
        if self.record is not None:
            # the backward sends what this forward received
            self.record(rows.shape[0] * row_bytes(rows), time.perf_counter() - start, False)
            self.record(out.shape[0] * row_bytes(rows), 0.0, False)
        return out

    def _dispatch(self, module: nn.Module, inputs: tuple[Tensor, Tensor], mesh: DeviceMesh) -> tuple[Tensor, Tensor]:
        x, counts = inputs
        group = mesh.get_group()
        with torch.no_grad(), waiting(f"dispatch layer {self.layer}"):
            received = all_to_all_single(counts, None, None, group=group)
            received = wait_tensor(received).view(mesh.size(), -1)  # (ep, L)
        self.in_splits, self.out_splits = split_sizes(counts, received)
        rows = self._exchange(x, self.out_splits, self.in_splits, group, "dispatch")
        self.index = source_to_expert_order(received)
        return rows[self.index], received.sum(0)

    def _combine(self, module: nn.Module, y: Tensor, mesh: DeviceMesh) -> Tensor:
        y = y[inverse(self.index)]
        return self._exchange(y, self.in_splits, self.out_splits, mesh.get_group(), "combine")
