"""The ``scratch-fsdp`` strategy: units, the gradient reducer, at stage 3 the parameter gatherer, AdamW over the
shards, and the checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from handle_plugins.strategies.scratch_fsdp.checkpoint import ParamShardCheckpoint
from handle_plugins.strategies.scratch_fsdp.comm import CountedCollectives
from handle_plugins.strategies.scratch_fsdp.reduce import GradientReducer
from handle_plugins.strategies.scratch_fsdp.scaler import ShardedLossScaler
from handle_plugins.strategies.scratch_fsdp.units import Unit, find_units
from handle_plugins.strategies.scratch_fsdp.zero3 import ParameterGatherer
from torch_handle.api import Strategy, optimizer_state_tensors, tensor_bytes
from torch_handle.common.precision import torch_dtype


class ScratchFSDPStrategy(Strategy):
    """Hand-written ZeRO-2 and ZeRO-3 (see the package docstring). Options: ``ScratchFSDPConfig``
    (``zero_stage``, ``reshard_after_forward``, ``prefetch``).

    Per rank: every parameter's shard (its rows of dim 0, :class:`~shard.ShardedParam`), fp32 for the trainable
    ones, and AdamW's state for those (:meth:`build_optimizer` builds the project's AdamW over the trainable
    shards only: a frozen parameter, ``requires_grad = False``, has no optimizer state and no gradient). ZeRO-2
    keeps every full weight in the compute dtype and all-gathers the updated shards into them after each step;
    ZeRO-3 keeps only the shards and gathers a unit for its forward and its backward (:class:`ParameterGatherer`).
    Both reduce-scatter the trainable gradients unit by unit during the last micro-batch's backward
    (:class:`GradientReducer`), which leaves each trainable shard its gradient rows in ``shard.grad``.

    Mixed precision (``training.precision`` bf16 or fp16): the gathered weights, hence the compute, are in that
    dtype and the base class's autocast stays on (norms and softmax in fp32); gradients are reduced and the shards
    stepped in fp32. fp16 adds dynamic loss scaling whose overflow check spans every rank's shards
    (:class:`ShardedLossScaler`).

    :meth:`step_stats`: ``allgather_calls``/``bytes``, ``reducescatter_calls``/``bytes`` (full padded buffers,
    numel x element size), ``allreduce_calls``/``bytes`` (the gradient norm: one float per step) and ``comm_s``
    (seconds waited, not hidden behind compute). Memory: :meth:`param_bytes` is the resident shards (ZeRO-3) or full
    weights (ZeRO-2, plus the frozen shards) plus, for ZeRO-3, whatever unit is gathered at the moment of
    measurement (between steps: none); :meth:`optimizer_bytes` is AdamW's state, plus the trainable shards for
    ZeRO-2 (fp32 masters beside the full weights). Needs a process group (torchrun starts one for every run).
    """

    name = "scratch-fsdp"

    def __init__(self, options: Any, training: Any, ctx: Any, model: torch.nn.Module) -> None:
        self.comm = CountedCollectives(ctx)
        super().__init__(options, training, ctx, model)
        self.scaler = ShardedLossScaler(self.comm) if training.precision == "fp16" else None
        self.shards = ParamShardCheckpoint(self)

    # -- set-up --------------------------------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Broadcast rank 0's weights and buffers, cut the model into :class:`Unit` s (each parameter sharded,
        its ``.data`` a view of its gathered buffer), hook the reducer and, at stage 3, the gatherer, and free every
        unit's full weights. The model itself is not wrapped."""
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t, src=0)
        p = self.training.precision
        dtype = torch.float32 if p == "fp32" else torch_dtype(p)
        self.units = [Unit(name, module, params, self.ctx.rank, self.ctx.world_size, dtype)
                      for name, module, params in find_units(model)]
        self.reducer = GradientReducer(self.units, self.comm)
        self.gatherer = None
        if self.options.zero_stage == 3:
            self.gatherer = ParameterGatherer(self.units, self.comm, self.options.reshard_after_forward,
                                              self.options.prefetch)
            self.reducer.on_grads_done = self.gatherer.grads_done
            for unit in self.units:
                unit.free()
        return model

    def build_optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The project's AdamW (the base class's) over the trainable parameters' shards, not the model's
        parameters."""
        return super().build_optimizer(self.trainable_shards())

    def trainable_shards(self) -> list[torch.nn.Parameter]:
        """Every trainable parameter's fp32 shard, unit by unit: what the optimizer steps."""
        return [sp.shard for unit in self.units for sp in unit.trainable]

    def describe(self) -> dict[str, Any]:
        o = self.options
        return {**super().describe(), "zero_stage": o.zero_stage, "reshard_after_forward": o.reshard_after_forward,
                "prefetch": o.prefetch, "units": len(self.units)}

    # -- the step ------------------------------------------------------------------------------------------------
    def accumulating(self, sync: bool):
        self.reducer.last_micro_batch = sync
        return super().accumulating(sync)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss / grad_accum`` (times the loss scale in fp16); then the reducer finishes (on the
        last micro-batch: every trainable ``shard.grad`` is its rows of the mean over the ranks) and ZeRO-3 frees
        whatever is still gathered."""
        loss = loss / self.training.grad_accum
        (loss * self.scaler.scale if self.scaler is not None else loss).backward()
        self.reducer.finish(self._sync)
        if self.gatherer is not None:
            self.gatherer.release_all()

    @torch.no_grad()
    def clip_grad_norm(self) -> torch.Tensor:
        """Scale the gradient shards so that the norm of the whole model's gradient is at most
        ``training.grad_clip``: each rank's sum of squares, all-reduced (padding adds zeros), square-rooted.
        Equal to ``torch.nn.utils.clip_grad_norm_`` over the full gradients up to rounding (another summation
        order); coefficient as in torch, ``max_norm / (norm + 1e-6)`` capped at 1.

        Returns:
            The global norm before clipping, a float32 scalar tensor (:meth:`step` calls it unless a parallel
            share clips: :attr:`clips_gradients`).
        """
        grads = [s.grad for s in self.trainable_shards() if s.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for g in grads:
            squares += g.square().sum()
        self.comm(squares)
        total = squares.sqrt()
        max_norm = self.training.grad_clip if self.training.grad_clip > 0 else float("inf")
        coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coefficient)
        return total

    def step(self) -> float:
        """fp16: unscale, or skip the step on every rank when any shard overflowed (the LR schedule still
        steps, as with ``GradScaler``). Clip, step AdamW on the shards and the LR schedule, zero the gradients;
        ZeRO-2 then all-gathers the updated shards into the full weights (ZeRO-3 gathers them when a unit next
        computes).

        Returns:
            The global gradient norm before clipping (inf for a step skipped on overflow).
        """
        if self.scaler is not None:
            overflow = self.scaler.unscale([s.grad for s in self.trainable_shards() if s.grad is not None])
            self.scaler.update(overflow)
            if overflow:
                self.skip_step()
                self.scheduler.step()
                return float("inf")
        grad_norm = super().step()
        if self.gatherer is None:
            self.gather_all(trainable_only=True)
        return grad_norm

    def skip_step(self) -> None:
        super().skip_step()
        self.reducer.drop_gradients()

    @torch.no_grad()
    def gather_all(self, trainable_only: bool = False) -> None:
        """ZeRO-2: every unit's full weights from the ranks' shards, in their gather dtypes (``trainable_only``:
        after a step, which changed only those)."""
        for unit in self.units:
            unit.start_gather(self.comm, trainable_only)
        for unit in self.units:
            unit.finish_gather(self.comm)

    def step_stats(self) -> dict[str, float | int]:
        """Communication since the previous call (one optimizer step): see the class docstring."""
        return self.comm.take_stats()

    def close(self) -> None:
        """Remove the hooks (idempotent; nothing in flight is waited for)."""
        self.reducer.close()
        if self.gatherer is not None:
            self.gatherer.close()

    # -- memory --------------------------------------------------------------------------------------------------
    def master_bytes(self) -> int:
        return tensor_bytes(self.trainable_shards())

    def param_bytes(self) -> int:
        gathered = sum(unit.full_bytes() for unit in self.units)
        frozen = tensor_bytes(sp.shard for unit in self.units for sp in unit.params if not sp.trainable)
        return gathered + frozen + (self.master_bytes() if self.gatherer is not None else 0)

    def local_shard(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``param`` (its :class:`ShardedParam`'s ``shard``)."""
        return next(sp.shard for unit in self.units for sp in unit.params if sp.param is param)

    def frozen_param_bytes(self) -> int:
        """The frozen parameters' part of :meth:`param_bytes`: their shards and whatever full weights of theirs are
        gathered now (every one at ZeRO-2; none between steps at ZeRO-3)."""
        frozen = [sp for unit in self.units for sp in unit.params if not sp.trainable]
        return tensor_bytes(sp.shard for sp in frozen) + sum(sp.full_bytes() for sp in frozen)

    def grad_bytes(self) -> int:
        return tensor_bytes([*(s.grad for s in self.trainable_shards()),
                             *(sp.param.grad for u in self.units for sp in u.trainable)])

    def optimizer_bytes(self) -> int:
        state = tensor_bytes(optimizer_state_tensors(self.optimizer))
        return state + (self.master_bytes() if self.gatherer is None else 0)

    # -- checkpoints: one file per rank (format param-sharded) ---------------------------------------------------
    def checkpoint_layout(self) -> dict[str, Any]:
        return self.shards.layout()

    def loads_natively(self, layout: dict[str, Any]) -> bool:
        return self.shards.loads_natively(layout)

    def save(self, ckpt_dir: Path) -> None:
        self.shards.save(Path(ckpt_dir))

    def load(self, ckpt_dir: Path) -> None:
        self.shards.load(Path(ckpt_dir))
        self.after_load()

    def load_portable(self, portable: Path) -> None:
        self.shards.load_portable(Path(portable))
        self.after_load()

    def after_load(self) -> None:
        """The full weights follow the loaded shards (ZeRO-2; ZeRO-3 gathers on use)."""
        if self.gatherer is None:
            self.gather_all()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The fp32 weights (the master shards gathered) and the buffers on rank 0; collective."""
        return self.shards.full_state_dict()
