"""One process: the model as it is, AdamW, optional autocast (and GradScaler for fp16)."""

from __future__ import annotations

from pathlib import Path

import torch

from torch_handle.api import Strategy


class SingleStrategy(Strategy):
    name = "single"

    def __init__(self, options, training, ctx, model: torch.nn.Module) -> None:
        super().__init__(options, training, ctx, model)
        # fp16 needs loss scaling to keep small gradients representable (Micikevicius et al. 2018)
        self.scaler = torch.amp.GradScaler(ctx.device.type) if training.precision == "fp16" else None

    def backward(self, loss: torch.Tensor) -> None:
        loss = loss / self.training.grad_accum
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> float:
        if self.scaler is None:
            return super().step()
        self.scaler.unscale_(self.optimizer)
        grad_norm = self.clip_for_step()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def save(self, ckpt_dir: Path) -> None:
        super().save(ckpt_dir)
        if self.scaler is not None and self.ctx.is_main:
            torch.save(self.scaler.state_dict(), Path(ckpt_dir) / "scaler.pt")

    def load(self, ckpt_dir: Path) -> None:
        super().load(ckpt_dir)
        if self.scaler is not None:
            from torch_handle.api import safe_load

            self.scaler.load_state_dict(safe_load(Path(ckpt_dir) / "scaler.pt"))
