"""The ZeRO-1 checkpoint: the full model once, the optimizer state as one file per rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torch_handle.api import CheckpointError, safe_load


class ShardedCheckpoint:
    """Checkpoints of ``shard_optimizer = true`` (layout format ``torch-sharded``): rank 0 writes ``model.pt``,
    every rank writes its own optimizer shard with the LR schedule, ``optim-rank<R>.pt``, as DeepSpeed's ZeRO
    writes one optimizer file per rank (``zero_pp_rank_<R>_mp_rank_00_optim_states.pt``). A shard holds
    ``owned``, the indices (in parameter order) of the parameters its rank owns, by which
    :mod:`torch_handle.checkpoint.convert` maps its state to parameter names; fp16 adds the loss scaler's state.

    Read back as it is only on the same world size (:meth:`loads_natively`); elsewhere through the portable
    form (:meth:`load_portable`). Sends nothing: every rank reads and writes its own files in the shared
    checkpoint directory.

    Args:
        strategy: the ``ScratchDDPStrategy`` whose model, :class:`ShardedOptimizer`, scheduler and loss scaler
            (None unless fp16) are saved and loaded.
    """

    FORMAT = "torch-sharded"

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def layout(self) -> dict[str, Any]:
        return {"format": self.FORMAT, "strategy": self.strategy.name}

    def loads_natively(self, layout: dict[str, Any]) -> bool:
        """Only its own shards, written on the same world size."""
        return layout.get("format") == self.FORMAT and layout.get("world_size") == self.strategy.ctx.world_size

    def save(self, ckpt_dir: Path) -> None:
        s, ckpt_dir = self.strategy, Path(ckpt_dir)
        if s.ctx.is_main:
            torch.save(s.unwrapped().state_dict(), ckpt_dir / "model.pt")
        every = [p for g in s.optimizer.param_groups for p in g["params"]]
        owned = [i for i, p in enumerate(every) if s.optimizer.owner[p] == s.ctx.rank]
        state = {"optimizer": s.optimizer.state_dict(), "scheduler": s.scheduler.state_dict(), "owned": owned}
        if s.scaler is not None:
            state["scaler"] = s.scaler.state_dict()
        torch.save(state, ckpt_dir / f"optim-rank{s.ctx.rank}.pt")

    def load(self, ckpt_dir: Path) -> None:
        """Every rank loads ``model.pt`` and its own shard.

        Raises:
            CheckpointError: a file is missing or unsafe, or the shard belongs to another partition.
        """
        s, ckpt_dir = self.strategy, Path(ckpt_dir)
        shard = ckpt_dir / f"optim-rank{s.ctx.rank}.pt"
        if not shard.is_file():
            raise CheckpointError(f"{shard} is missing: was the checkpoint written with shard_optimizer = true "
                                  f"and the same world size?")
        s.unwrapped().load_state_dict(safe_load(ckpt_dir / "model.pt", s.ctx.device))
        state = safe_load(shard, s.ctx.device)
        s.optimizer.load_state_dict(state["optimizer"])
        s.scheduler.load_state_dict(state["scheduler"])
        if s.scaler is not None:
            s.scaler.load_state_dict(state["scaler"])

    def load_portable(self, portable: Path) -> None:
        """The full weights, and the optimizer state of the parameters this rank owns (read in full on every rank:
        :func:`torch_handle.checkpoint.convert.read_portable`), and the LR schedule.

        Raises:
            CheckpointError: the portable form does not fit the model, or lacks an owned parameter's state.
        """
        from torch_handle.checkpoint import convert

        s = self.strategy
        model_sd, state, schedule = convert.read_portable(Path(portable))
        model = s.unwrapped()
        try:
            model.load_state_dict(model_sd)
        except RuntimeError as e:
            raise CheckpointError(f"{portable}: does not fit the model ({str(e).splitlines()[0]})") from None
        names = {p: n for n, p in model.named_parameters()}
        inner = s.optimizer.inner
        saved = inner.state_dict()  # its param groups (numbered), the state replaced below
        owned = [p for g in inner.param_groups for p in g["params"]]
        missing = [names[p] for p in owned if names[p] not in state]
        if missing:
            raise CheckpointError(f"{portable}: no optimizer state for {missing[0]}")
        saved["state"] = {i: dict(state[names[p]]) for i, p in enumerate(owned)}
        inner.load_state_dict(saved)
        s.optimizer.state = inner.state
        convert.load_schedule(s.optimizer, s.scheduler, schedule)
