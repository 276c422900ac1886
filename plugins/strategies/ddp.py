"""DistributedDataParallel (Li et al. 2020, "PyTorch Distributed"): every rank holds the full model and
optimizer; gradients are all-reduced in buckets that overlap with backward."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
from handle_plugins.strategies.single import SingleStrategy
from torch.nn.parallel import DistributedDataParallel as DDP

from torch_handle.model.parallelize import pipeline_parts


class DDPStrategy(SingleStrategy):
    name = "ddp"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``DDP(model)``; for a pipeline's shard, each of its stage modules its own ``DDP`` and the shard as it is
        (the pipeline calls the stages; each syncs its gradients once a step, on its last backward, as torch's
        ``PipelineStage`` does for a DDP submodule)."""
        parts = pipeline_parts(model)
        if parts is None:
            return self._ddp(model)
        parts[:] = [self._ddp(part) for part in parts]
        return model

    def _ddp(self, module: torch.nn.Module) -> DDP:
        o = self.options
        device_ids = [self.ctx.local_rank] if self.ctx.device.type == "cuda" else None
        # with tensor or pipeline parallelism: all-reduce over the ranks that hold the same shard ("dp" of the mesh)
        group = None if self.ctx.mesh is None else self.ctx.mesh["dp"].get_group()
        if self.ep_share is not None:  # each rank's experts are its own: reduced over "edp" by the EP share
            DDP._set_params_and_buffers_to_ignore_for_model(module, self.ep_share.expert_names(module))
        return DDP(module, device_ids=device_ids, process_group=group, bucket_cap_mb=o.bucket_cap_mb,
                   gradient_as_bucket_view=o.gradient_as_bucket_view, find_unused_parameters=o.find_unused_parameters,
                   broadcast_buffers=o.broadcast_buffers)

    def accumulating(self, sync: bool) -> ContextManager:
        # Skip the all-reduce on all but the last micro-batch: gradients accumulate locally for free.
        self._sync = sync
        return contextlib.nullcontext() if sync else self.model.no_sync()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "bucket_cap_mb": self.options.bucket_cap_mb}
