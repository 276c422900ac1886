"""The scratch-fsdp checkpoint: one file per rank with its parameter shards and their AdamW state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch_handle.api import CheckpointError, safe_load

STATE_KEYS = ("exp_avg", "exp_avg_sq")


class ParamShardCheckpoint:
    """Checkpoints of ``scratch-fsdp`` (layout format ``param-sharded``): every rank writes ``shard-rank<R>.pt``,
    per parameter (``params``, by name) its full ``shape``, the first row it owns (``start``), ``trainable``, its
    ``shard`` (fp32 when trainable, the parameter's dtype when frozen) and, for a trainable one, AdamW's ``exp_avg``/
    ``exp_avg_sq`` rows and ``step``; every file holds the LR schedule (and in fp16 the loss scaler's state),
    rank 0's the buffers and the names under which ``state_dict`` lists each parameter (``aliases``: tied
    weights). Nothing full is ever built: each rank writes ``1/world_size`` of the state, as FSDP's sharded state
    dict does.

    Read back as it is on the same world size (:meth:`loads_natively`; both stages write the same thing, so a
    ZeRO-2 checkpoint resumes as ZeRO-3 and the reverse); elsewhere :func:`torch_handle.checkpoint.convert`
    joins the shards into the portable form, which :meth:`load_portable` reads (from any strategy).

    Args:
        strategy: the ``ScratchFSDPStrategy`` whose units, optimizer and scheduler are saved and loaded.
    """

    FORMAT = "param-sharded"

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def layout(self) -> dict[str, Any]:
        return {"format": self.FORMAT, "strategy": self.strategy.name, "zero_stage": self.strategy.options.zero_stage}

    def loads_natively(self, layout: dict[str, Any]) -> bool:
        return layout.get("format") == self.FORMAT and layout.get("world_size") == self.strategy.ctx.world_size

    def _sharded(self) -> dict[str, Any]:
        """Every :class:`~shard.ShardedParam` by its parameter's name (tied weights once)."""
        names = {p: n for n, p in self.strategy.unwrapped().named_parameters()}
        return {names[sp.param]: sp for unit in self.strategy.units for sp in unit.params}

    def save(self, ckpt_dir: Path) -> None:
        s = self.strategy
        params = {}
        for name, sp in self._sharded().items():
            entry = {"shape": list(sp.shape), "start": sp.start, "trainable": sp.trainable,
                     "shard": sp.shard.detach().cpu()}
            state = s.optimizer.state.get(sp.shard, {})
            entry.update({k: v.detach().cpu() for k, v in state.items() if torch.is_tensor(v)})
            params[name] = entry
        out: dict[str, Any] = {"rank": s.ctx.rank, "world_size": s.ctx.world_size, "params": params,
                               "scheduler": s.scheduler.state_dict()}
        if s.scaler is not None:
            out["scaler"] = s.scaler.state_dict()
        if s.ctx.is_main:
            model = s.unwrapped()
            names = {p: n for n, p in model.named_parameters()}
            out["buffers"] = {k: v.detach().cpu() for k, v in model.state_dict(keep_vars=True).items()
                              if not isinstance(v, torch.nn.Parameter)}
            out["aliases"] = {k: names[v] for k, v in model.state_dict(keep_vars=True).items()
                              if isinstance(v, torch.nn.Parameter)}
        torch.save(out, ckpt_dir / f"shard-rank{s.ctx.rank}.pt")

    @torch.no_grad()
    def load(self, ckpt_dir: Path) -> None:
        """Every rank loads its own file, and the buffers from rank 0's.

        Raises:
            CheckpointError: a file is missing or unsafe, or its parameters differ from this model's (names,
                shapes or which are trainable).
        """
        from torch_handle.checkpoint import convert

        s = self.strategy
        path = ckpt_dir / f"shard-rank{s.ctx.rank}.pt"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: was the checkpoint written by scratch-fsdp on the same "
                                  f"world size?")
        saved = safe_load(path, s.ctx.device)
        sharded = self._sharded()
        if sorted(saved["params"]) != sorted(sharded):
            raise CheckpointError(f"{path}: its parameters are not this model's")
        state = {}
        for name, sp in sharded.items():
            entry = saved["params"][name]
            if list(sp.shape) != entry["shape"] or sp.trainable != entry["trainable"]:
                raise CheckpointError(f"{path}: {name} has shape {entry['shape']} there, {list(sp.shape)} here, "
                                      f"or is trainable in one and frozen in the other")
            sp.shard.copy_(entry["shard"])
            if "step" in entry:
                state[sp.shard] = {"step": entry["step"], **{k: entry[k] for k in STATE_KEYS}}
        self._set_optimizer_state(state)
        self._load_buffers(safe_load(ckpt_dir / "shard-rank0.pt", s.ctx.device)["buffers"])
        convert.load_schedule(s.optimizer, s.scheduler, saved["scheduler"])
        if s.scaler is not None and "scaler" in saved:
            s.scaler.load_state_dict(saved["scaler"])

    @torch.no_grad()
    def load_portable(self, portable: Path) -> None:
        """Each rank cuts its rows out of the full tensors of a portable form (read in full on every rank:
        :func:`torch_handle.checkpoint.convert.read_portable`).

        Raises:
            CheckpointError: the portable form lacks a parameter, or a trainable parameter's optimizer state.
        """
        from torch_handle.checkpoint import convert

        s = self.strategy
        model_sd, by_name, schedule = convert.read_portable(portable)
        state = {}
        for name, sp in self._sharded().items():
            if name not in model_sd or (sp.trainable and name not in by_name):
                raise CheckpointError(f"{portable}: no weights or optimizer state for {name}")
            sp.shard.copy_(sp.chunk_of(model_sd[name].to(sp.shard.device)))
            if sp.trainable:
                moments = by_name[name]
                state[sp.shard] = {"step": moments["step"].float().reshape(()).clone(), **{
                    k: sp.chunk_of(moments[k].to(sp.shard.device)).float().clone() for k in STATE_KEYS}}
        self._set_optimizer_state(state)
        self._load_buffers(model_sd)
        convert.load_schedule(s.optimizer, s.scheduler, schedule)

    def _set_optimizer_state(self, state: dict[torch.nn.Parameter, dict[str, torch.Tensor]]) -> None:
        optimizer = self.strategy.optimizer
        index = {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        saved = optimizer.state_dict()
        saved["state"] = {index[p]: v for p, v in state.items()}
        optimizer.load_state_dict(saved)

    def _load_buffers(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, buffer in self.strategy.unwrapped().named_buffers():
            if name in tensors:
                buffer.copy_(tensors[name])

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every parameter's shards all-gathered (trainable ones in fp32, frozen ones in their dtype), on rank 0
        with the buffers; collective (every rank must call it)."""
        s = self.strategy
        weights = {}
        for name, sp in self._sharded().items():
            full = torch.empty(sp.world_size * sp.chunk_numel, dtype=sp.shard.dtype, device=sp.shard.device)
            dist.all_gather_single(full, sp.padded_shard(sp.shard.dtype))
            weights[name] = full[:sp.param.numel()].view(sp.shape).cpu().clone()
        if not s.ctx.is_main:
            return None
        model = s.unwrapped()
        names = {p: n for n, p in model.named_parameters()}
        out = {}
        for key, value in model.state_dict(keep_vars=True).items():
            out[key] = weights[names[value]] if isinstance(value, torch.nn.Parameter) else value.detach().cpu()
        return out
