"""FSDP2 (``torch.distributed.fsdp.fully_shard``; Zhao et al. 2023): parameters, gradients and optimizer state
sharded per parameter as DTensors, each Transformer layer its own communication unit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch_handle.api import Strategy, optimizer_state_tensors, tensor_bytes


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


class FSDPStrategy(Strategy):
    name = "fsdp"

    def setup(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = None
        if self.training.precision != "fp32":
            dtype = torch.bfloat16 if self.training.precision == "bf16" else torch.float16
            mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        kwargs = {"reshard_after_forward": self.options.reshard_after_forward,
                  **({"mp_policy": mp} if mp is not None else {})}
        for module in model.modules():  # each layer is one all-gather/reduce-scatter unit
            if type(module).__name__ in ("EncoderLayer", "DecoderLayer"):
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        self.model = model
        self.optimizer = self.build_optimizer(model.parameters())
        self.scheduler = self.build_scheduler(self.optimizer)

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

    def grad_bytes(self) -> int:
        return tensor_bytes(_local(p.grad) for p in self.model.parameters() if p.grad is not None)

    def optimizer_bytes(self) -> int:
        return tensor_bytes(_local(t) for t in optimizer_state_tensors(self.optimizer))

    def _state(self) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=False))

    def save(self, ckpt_dir: Path) -> None:
        import torch.distributed.checkpoint as dcp

        model_sd, optim_sd = self._state()
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(Path(ckpt_dir) / "dcp"))
        if self.ctx.is_main:
            torch.save(self.scheduler.state_dict(), Path(ckpt_dir) / "scheduler.pt")

    def load(self, ckpt_dir: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from torch_handle.api import safe_load

        model_sd, optim_sd = self._state()
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(Path(ckpt_dir) / "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(safe_load(Path(ckpt_dir) / "scheduler.pt"))

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if dist.get_rank() == 0 else None
