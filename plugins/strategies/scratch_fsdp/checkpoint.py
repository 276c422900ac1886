"""The scratch-fsdp checkpoint: one file per rank with its master shards and their AdamW state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch_handle.api import CheckpointError, safe_load

STATE_KEYS = ("exp_avg", "exp_avg_sq")


class FlatShardCheckpoint:
    """Checkpoints of ``scratch-fsdp`` (layout format ``flat-sharded``): every rank writes ``shard-rank<R>.pt``,
    per unit its fp32 master shard, AdamW's ``exp_avg``/``exp_avg_sq`` shards and ``step``, and the unit's layout
    (parameter names, shapes, ``numel``, ``padded``); every file holds the LR schedule (and in fp16 the loss
    scaler's state), rank 0's the buffers and
    the names under which ``state_dict`` lists each parameter (``aliases``: tied weights). Nothing full is ever
    built: each rank writes ``1/world_size`` of the state, as FSDP's sharded state dict does.

    Read back as it is on the same world size (:meth:`loads_natively`; both stages write the same thing, so a
    ZeRO-2 checkpoint resumes as ZeRO-3 and the reverse); elsewhere :func:`torch_handle.checkpoint.convert`
    joins the shards into the portable form, which :meth:`load_portable` reads (from any strategy).

    Args:
        strategy: the ``ScratchFSDPStrategy`` whose units, optimizer and scheduler are saved and loaded.
    """

    FORMAT = "flat-sharded"

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def layout(self) -> dict[str, Any]:
        return {"format": self.FORMAT, "strategy": self.strategy.name, "zero_stage": self.strategy.options.zero_stage}

    def loads_natively(self, layout: dict[str, Any]) -> bool:
        return layout.get("format") == self.FORMAT and layout.get("world_size") == self.strategy.ctx.world_size

    def _names(self) -> dict[torch.nn.Parameter, str]:
        return {p: n for n, p in self.strategy.unwrapped().named_parameters()}

    def save(self, ckpt_dir: Path) -> None:
        s = self.strategy
        names = self._names()
        units = []
        for unit in s.units:
            entry = {"name": unit.name, "params": [names[p] for p in unit.params],
                     "shapes": [list(shape) for shape in unit.shapes], "numel": unit.numel, "padded": unit.padded,
                     "master": unit.master.detach().cpu()}
            state = s.optimizer.state.get(unit.master, {})
            entry.update({k: v.detach().cpu() for k, v in state.items() if torch.is_tensor(v)})
            units.append(entry)
        out: dict[str, Any] = {"rank": s.ctx.rank, "world_size": s.ctx.world_size, "units": units,
                               "scheduler": s.scheduler.state_dict()}
        if s.scaler is not None:
            out["scaler"] = s.scaler.state_dict()
        if s.ctx.is_main:
            model = s.unwrapped()
            out["buffers"] = {k: v.detach().cpu() for k, v in model.state_dict(keep_vars=True).items()
                              if not isinstance(v, torch.nn.Parameter)}
            out["aliases"] = {k: names[v] for k, v in model.state_dict(keep_vars=True).items()
                              if isinstance(v, torch.nn.Parameter)}
        torch.save(out, ckpt_dir / f"shard-rank{s.ctx.rank}.pt")

    @torch.no_grad()
    def load(self, ckpt_dir: Path) -> None:
        """Every rank loads its own file, and the buffers from rank 0's.

        Raises:
            CheckpointError: a file is missing or unsafe, or its units differ from this model's.
        """
        from torch_handle.checkpoint import convert

        s = self.strategy
        path = ckpt_dir / f"shard-rank{s.ctx.rank}.pt"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: was the checkpoint written by scratch-fsdp on the same "
                                  f"world size?")
        saved = safe_load(path, s.ctx.device)
        names = self._names()
        if [u["params"] for u in saved["units"]] != [[names[p] for p in u.params] for u in s.units]:
            raise CheckpointError(f"{path}: its units hold other parameters than this model's")
        state = {}
        for unit, entry in zip(s.units, saved["units"]):
            unit.master.copy_(entry["master"])
            if "step" in entry:
                state[unit.master] = {"step": entry["step"], **{k: entry[k] for k in STATE_KEYS}}
        self._set_optimizer_state(state)
        self._load_buffers(safe_load(ckpt_dir / "shard-rank0.pt", s.ctx.device)["buffers"])
        convert.load_schedule(s.optimizer, s.scheduler, saved["scheduler"])
        if s.scaler is not None and "scaler" in saved:
            s.scaler.load_state_dict(saved["scaler"])

    @torch.no_grad()
    def load_portable(self, portable: Path) -> None:
        """Each rank cuts its shards out of the full tensors of a portable form (read in full on every rank:
        :func:`torch_handle.checkpoint.convert.read_portable`).

        Raises:
            CheckpointError: the portable form lacks a parameter, or its optimizer state.
        """
        from torch_handle.checkpoint import convert

        s = self.strategy
        model_sd, by_name, schedule = convert.read_portable(portable)
        names = self._names()
        state = {}
        for unit in s.units:
            params = [names[p] for p in unit.params]
            missing = [n for n in params if n not in model_sd or n not in by_name]
            if missing:
                raise CheckpointError(f"{portable}: no weights or optimizer state for {missing[0]}")
            shard = lambda tensors: unit.shard_of(unit.flatten(tensors, torch.float32))  # noqa: E731
            unit.master.copy_(shard([model_sd[n].to(unit.master.device) for n in params]))
            state[unit.master] = {"step": by_name[params[0]]["step"].float().reshape(()).clone(), **{
                k: shard([by_name[n][k].to(unit.master.device) for n in params]).clone() for k in STATE_KEYS}}
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
        """Every unit's master shards all-gathered (fp32), cut into the named weights, on rank 0 with the
        buffers; collective (every rank must call it)."""
        s = self.strategy
        names = self._names()
        weights = {}
        for unit in s.units:
            full = torch.empty(unit.padded, dtype=torch.float32, device=unit.master.device)
            dist.all_gather_single(full, unit.master.detach())
            for p, view in zip(unit.params, unit.views(full)):
                weights[names[p]] = view.cpu().clone()
        if not s.ctx.is_main:
            return None
        model = s.unwrapped()
        out = {}
        for key, value in model.state_dict(keep_vars=True).items():
            out[key] = weights[names[value]] if isinstance(value, torch.nn.Parameter) else value.detach().cpu()
        return out
