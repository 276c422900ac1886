"""FSDP2 (``torch.distributed.fsdp.fully_shard``; Zhao et al. 2023): parameters, gradients and optimizer state
sharded per parameter as DTensors, each of the model's blocks (``model.blocks()``, e.g. a Transformer layer) its
own communication unit."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch_handle.api import Strategy, optimizer_state_tensors, tensor_bytes
from torch_handle.common.precision import torch_dtype
from torch_handle.model.parallelize import NoBlocksError, model_blocks, pipeline_parts

log = logging.getLogger("torch_handle")


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


class FSDPStrategy(Strategy):
    name = "fsdp"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``fully_shard`` each of ``model.blocks()`` (one all-gather/reduce-scatter per block), then the model.

        A model that declares no blocks (``model_blocks`` raises) is sharded as one unit -- every parameter gathered
        for the whole forward, which defeats most of FSDP's memory saving -- with a logged warning. With tensor
        parallelism the shards of the mesh's "tp" dimension are sharded again over its "dp" dimension (FSDP x TP).
        A pipeline's shard is not sharded as a whole: each of its stage modules is (FSDP x PP; torch's
        ``PipelineStage`` reduces a sharded stage's gradients once a step).
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = None
        if self.training.precision != "fp32":
            mp = MixedPrecisionPolicy(param_dtype=torch_dtype(self.training.precision), reduce_dtype=torch.float32)
        kwargs = {"reshard_after_forward": self.options.reshard_after_forward,
                  **({"mp_policy": mp} if mp is not None else {})}
        if self.ctx.mesh is not None:  # FSDP x TP: shard each TP shard again over the data-parallel ranks
            kwargs["mesh"] = self.ctx.mesh["dp"]
        try:
            blocks = model_blocks(model)
        except NoBlocksError as e:
            blocks = []
            if self.ctx.is_main:
                log.warning("fsdp: %s, so it is sharded as one unit: all of its parameters are gathered for the "
                            "whole forward and backward", e)
        if self.ep_share is not None:
            self._shard_experts(model, kwargs)
        for block in blocks:
            fully_shard(block, **kwargs)
        for part in pipeline_parts(model) or [model]:  # a pipeline's stages each a root, as torchtitan shards them
            fully_shard(part, **kwargs)
        return model

    def _shard_experts(self, model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
        """EP x FSDP as torchtitan's ``apply_fsdp`` does it: each MoE layer's experts (this rank's E/ep of them)
        sharded over the ranks that hold the same experts ("edp", dp / ep of them), before their block is sharded
        over "dp" (which then leaves them out). Their gradients are reduce-scattered over "edp" and divided by dp,
        not edp: summed over edp they hold every dp rank's tokens (the all-to-all's backward brought the EP group's),
        and the one-process scale divides by dp (:mod:`torch_handle.train.shares.expert`)."""
        from torch.distributed.fsdp import fully_shard

        from torch_handle.model.moe import moe_layers

        for layer in moe_layers(model):
            fully_shard(layer.experts, **{**kwargs, "mesh": self.ctx.ep_mesh["edp"]})
            layer.experts.set_gradient_divide_factor(float(self.ctx.layout.dp))
            # a factor other than the group's size is a PREMUL_SUM, which gloo lacks: sum, then divide. Not on one
            # edp rank, where torch 2.13 skips the collective and divides twice (once in the copy, once after)
            if self.ctx.backend == "gloo" and self.ctx.layout.edp > 1:
                layer.experts.set_force_sum_reduction_for_comms(True)
        self.ep_share.reduces_grads = False

    def autocast(self):
        import contextlib

        return contextlib.nullcontext()  # the MixedPrecisionPolicy casts

    def accumulating(self, sync: bool):
        import contextlib

        self._sync = sync
        self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "reshard_after_forward": self.options.reshard_after_forward}

    def param_bytes(self) -> int:
        return tensor_bytes(_local(p) for p in self.model.parameters())

    def local_shard(self, param: torch.Tensor) -> torch.Tensor:
        """The DTensor's local rows (FSDP2's ``Shard(0)``; the root unit may be left gathered after a forward)."""
        return _local(param)

    def grad_bytes(self) -> int:
        return tensor_bytes(_local(p.grad) for p in self.model.parameters() if p.grad is not None)

    def optimizer_bytes(self) -> int:
        return tensor_bytes(_local(t) for t in optimizer_state_tensors(self.optimizer))

    def _state(self) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=False))

    def checkpoint_layout(self) -> dict[str, Any]:
        """``dcp``: the portable form itself (``dcp/`` + ``scheduler.pt``), loadable on any world size."""
        return {"format": "dcp", "strategy": self.name}

    def loads_natively(self, layout: dict[str, Any]) -> bool:
        return layout.get("format") == "dcp"

    def save(self, ckpt_dir: Path) -> None:
        """Every rank writes its shards of the model and optimizer state (DCP, keyed by parameter name); rank 0
        the LR schedule."""
        import torch.distributed.checkpoint as dcp

        model_sd, optim_sd = self._state()
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(Path(ckpt_dir) / "dcp"))
        if self.ctx.is_main:
            torch.save(self.scheduler.state_dict(), Path(ckpt_dir) / "scheduler.pt")

    def load(self, ckpt_dir: Path) -> None:
        """DCP reshards on load: a checkpoint of any world size (the base strategy's :meth:`load_portable`)."""
        self.load_portable(Path(ckpt_dir))

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if dist.get_rank() == 0 else None
