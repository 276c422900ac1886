"""DeepSpeed: ZeRO stages 0-3 (Rajbhandari et al. 2020), bf16/fp16, CPU/NVMe offload (Ren et al. 2021).

The ds_config is generated from the preset (micro-batch size, grad_accum, clipping, precision, optimizer, ZeRO
stage and offload) and ``[strategy.ds_config]`` is merged over it verbatim. The learning-rate schedule is the
project's own LambdaLR, handed to DeepSpeed so that it steps and checkpoints it with the engine.

Model-state bytes are counted from the tensors this rank really holds: the engine's parameters (their
``ds_tensor`` shards under ZeRO-3), the gradient buffers of the ZeRO optimizer, and its optimizer state plus the
fp32 master partitions.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, ContextManager, Iterator

import torch

from torch_handle.api import Strategy, deep_merge, lr_lambda, optimizer_state_tensors, tensor_bytes
from torch_handle.checkpoint.store import verify_weights_only  # built-in: guards DeepSpeed's own torch.load
from torch_handle.checkpoint.convert import deepspeed_safe_globals

log = logging.getLogger("torch_handle")
TAG = "ds"


def build_ds_config(options, training, world_size: int, cuda: bool) -> dict[str, Any]:
    """The ds_config for this preset (see https://www.deepspeed.ai/docs/config-json/)."""
    zero: dict[str, Any] = {"stage": options.zero_stage}
    if options.zero_stage > 0:
        zero.update(overlap_comm=options.overlap_comm, contiguous_gradients=options.contiguous_gradients,
                    reduce_bucket_size=options.reduce_bucket_size)
    for kind in ("optimizer", "param"):
        device = getattr(options, f"offload_{kind}")
        if device != "none":
            zero[f"offload_{kind}"] = {"device": device, "pin_memory": cuda,
                                       **({"nvme_path": options.nvme_path} if device == "nvme" else {})}
    adam = {"lr": training.lr, "betas": [training.beta1, training.beta2], "eps": 1e-8,
            "weight_decay": training.weight_decay, "adam_w_mode": True}
    if options.offload_optimizer == "none":
        # torch.optim.AdamW: runs on CPU and GPU without building DeepSpeed's fused kernels. With optimizer
        # offload DeepSpeed picks its own DeepSpeedCPUAdam (compiled on first use).
        adam["torch_adam"] = True
        # ...fused (one pass per tensor; DeepSpeed passes the key through to torch.optim.AdamW): on CPU 1.3 ms per
        # step for a 2.1 M-element ZeRO-2 partition against 8.2 ms for the default for-loop (2 AMD EPYC cores).
        adam["fused"] = True
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": training.micro_batch_size,
        "gradient_accumulation_steps": training.grad_accum,
        "train_batch_size": training.micro_batch_size * training.grad_accum * world_size,
        "gradient_clipping": training.grad_clip,
        "optimizer": {"type": "AdamW", "params": adam},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if training.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif training.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": options.initial_scale_power,
                       "loss_scale_window": options.loss_scale_window, "hysteresis": 2, "min_loss_scale": 1}
    return deep_merge(cfg, options.ds_config)


def _tensors(obj: Any, depth: int = 3) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth - 1)
    elif depth > 0 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth - 1)


def _skip_shm_comm_build() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce op (``deepspeed_shm_comm``) at start-up.

    ``deepspeed.init_distributed`` on a CPU builds that C++ extension with the host compiler the first time (about
    50 s on 2 cores, silently, inside the first ``make demo``), yet only ``inference_all_reduce`` (AutoTP
    inference) uses it: ZeRO training reduces through ``torch.distributed``. DeepSpeed probes its ops once per
    process into ``deepspeed.ops.__compatible_ops__`` and keeps that dict, so marking the op incompatible there
    makes ``build_shm_op`` return None and DeepSpeed use the process group, as on a machine without a compiler.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class DeepSpeedStrategy(Strategy):
    """``deepspeed.initialize`` builds the engine, its (ZeRO) optimizer and the LR schedule together: ``wrap``
    makes the engine, and ``build_optimizer`` / ``build_scheduler`` hand back the ones the engine built."""

    name = "deepspeed"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        import deepspeed

        self.ds_config = build_ds_config(self.options, self.training, self.ctx.world_size,
                                         self.ctx.device.type == "cuda")
        if self.ctx.is_main:
            log.info("ds_config %s", json.dumps(self.ds_config))
        _skip_shm_comm_build()
        deepspeed.init_distributed(dist_backend=self.ctx.backend)  # reuses the initialised process group
        self.engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=self.ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(self.training)))
        log.info("DeepSpeed engine: zero_stage=%d optimizer=%s", self.engine.zero_optimization_stage(),
                 type(optimizer).__name__)
        return self.engine

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        return self.engine.optimizer  # ZeRO's optimizer (wrapping AdamW) from the ds_config

    def build_scheduler(self, optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return self.engine.lr_scheduler  # the LambdaLR above, stepped and checkpointed by the engine

    def describe(self) -> dict[str, Any]:
        inner = getattr(self.optimizer, "optimizer", None)
        return {"strategy": self.name, "zero_stage": self.engine.zero_optimization_stage(),
                "optimizer": type(self.optimizer).__name__,
                "base_optimizer": type(inner).__name__ if inner is not None else None,
                "offload_optimizer": self.options.offload_optimizer, "offload_param": self.options.offload_param}

    # DeepSpeed casts the model itself (bf16/fp16), so no autocast.
    def autocast(self) -> ContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)  # scales by 1/grad_accum itself
        if not self._sync:
            self.engine.step()  # not a boundary: DeepSpeed only counts the micro-step

    def step(self) -> float:
        self.engine.step()  # boundary: reduce, clip, optimizer step, LR schedule step, zero grads
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def skip_step(self) -> None:
        # DeepSpeed must see the boundary to reset its buffers; a zero learning rate makes the step a no-op on
        # the weights (AdamW's decoupled decay is scaled by lr too).
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        self.engine.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    # -- memory --------------------------------------------------------------------------------------------------
    def _zero3(self) -> bool:
        return self.engine.zero_optimization_stage() == 3

    def param_bytes(self, frozen_only: bool = False) -> int:
        params = [p for p in self.engine.module.parameters() if not (frozen_only and p.requires_grad)]
        if self._zero3():  # this rank's partition of each parameter, frozen ones too
            return tensor_bytes(getattr(p, "ds_tensor", None) for p in params)
        return tensor_bytes(params)

    def local_shard(self, param: torch.Tensor) -> torch.Tensor:
        """ZeRO-3: this rank's partition (``ds_tensor``) without its padding; stages 0-2: the parameter."""
        part = getattr(param, "ds_tensor", None)
        if not self._zero3() or part is None:
            return param
        owned = max(0, min(part.numel(), param.ds_numel - self.ctx.rank * part.numel()))
        return part.narrow(0, 0, owned)

    def frozen_param_bytes(self) -> int:
        return self.param_bytes(frozen_only=True)

    def _optimizer_attrs(self, want_grads: bool) -> Iterator[torch.Tensor]:
        for name, value in vars(self.optimizer).items():
            lname = name.lower()
            if want_grads and "grad" in lname and "norm" not in lname:
                yield from _tensors(value)
            elif not want_grads and "fp32" in lname and "grad" not in lname:
                yield from _tensors(value)

    def grad_bytes(self) -> int:
        grads = [p.grad for p in self.engine.module.parameters()]
        master = [getattr(t, "grad", None) for t in self._optimizer_attrs(want_grads=False)]
        return tensor_bytes([*grads, *master, *self._optimizer_attrs(want_grads=True)])

    def optimizer_bytes(self) -> int:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        return tensor_bytes([*optimizer_state_tensors(inner), *self._optimizer_attrs(want_grads=False)])

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def checkpoint_layout(self) -> dict[str, Any]:
        """``deepspeed``: ``engine.save_checkpoint``'s directory ``ds/``, partitioned by the ZeRO stage and the
        world size (and laid out differently with optimizer offload)."""
        o = self.options
        return {"format": "deepspeed", "strategy": self.name, "zero_stage": self.engine.zero_optimization_stage(),
                "offload_optimizer": o.offload_optimizer, "offload_param": o.offload_param}

    def loads_natively(self, layout: dict[str, Any]) -> bool:
        """``engine.load_checkpoint`` needs the same ZeRO stage, offloading and world size."""
        mine = self.checkpoint_layout()
        return (layout.get("format") == "deepspeed" and layout.get("world_size") == self.ctx.world_size
                and all(layout.get(k) == mine[k] for k in ("zero_stage", "offload_optimizer", "offload_param")))

    def save(self, ckpt_dir: Path) -> None:
        # every rank writes its own ZeRO shards; model + optimizer + LR schedule + loss scaler
        self.engine.save_checkpoint(str(ckpt_dir), tag=TAG)

    def load(self, ckpt_dir: Path) -> None:
        # DeepSpeed unpickles its files with weights_only=False; prove first that they hold no code.
        verify_weights_only(sorted(Path(ckpt_dir).rglob("*.pt")), deepspeed_safe_globals())
        path, _ = self.engine.load_checkpoint(str(ckpt_dir), tag=TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {ckpt_dir}")

    def load_portable(self, portable: Path) -> None:
        """Another strategy's or world size's checkpoint, through DeepSpeed's documented setters of partitioned
        state (``deepspeed.utils.safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``,
        https://deepspeed.readthedocs.io/en/latest/zero3.html#modifying-partitioned-states): every rank reads the
        full tensors and keeps its partition. The 16-bit/working copy of the weights follows the fp32 master
        (ZeRO-1/2 and the bf16 optimizer: ``optimizer.update_lp_params``; ZeRO-3: ``GatheredParameters`` with rank
        0 as modifier). ZeRO-0 in fp32 has a plain torch optimizer: the base strategy's loader; ZeRO-0 in fp16
        (``FP16_Optimizer``) cannot load one.

        Raises:
            CheckpointError: a parameter or its optimizer state missing from the portable form.
        """
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        from torch_handle.checkpoint import convert
        from torch_handle.api import CheckpointError, safe_load

        module = self.engine.module
        params = {n: p for n, p in module.named_parameters() if p.requires_grad}  # LoRA: the adapters alone
        if not any(hasattr(p, "ds_id") or getattr(p, "_hp_mapping", None) is not None for p in params.values()):
            # no partitioned fp32 master copy (ZeRO-0 in fp32): a torch optimizer over the module's parameters
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise CheckpointError(f"{portable}: DeepSpeed ZeRO-0 with {self.training.precision} "
                                      f"({type(self.optimizer).__name__}) cannot load another strategy's checkpoint "
                                      f"(use zero_stage 1-3)")
            convert.load_into(module, self.optimizer, Path(portable))
            convert.load_schedule(self.optimizer, self.scheduler, safe_load(Path(portable) / "scheduler.pt"))
            return
        model_sd, state, schedule = convert.read_portable(Path(portable))
        missing = [n for n in params if n not in model_sd or n not in state]
        if missing:
            raise CheckpointError(f"{portable}: no weights or optimizer state for {missing[0]} "
                                  f"({len(missing)} parameters missing)")
        self._init_optimizer_state()
        zero3 = self.engine.zero_optimization_stage() == 3
        for name, p in params.items():
            if zero3:  # the working copy, gathered, set on rank 0 and partitioned again on exit
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if self.ctx.is_main:
                        p.data.copy_(model_sd[name].reshape(p.shape))
            safe_set_full_fp32_param(p, model_sd[name].to(p.device))
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, state[name][key].to(p.device), key)
        steps = {float(state[n]["step"]) for n in params}
        if len(steps) > 1:
            log.warning("Adam step counts differ across parameters (%s): using the largest", sorted(steps))
        inner = self.optimizer.optimizer
        for _, flat in self._flat_partitions():
            flat_state = inner.state[flat]  # torch's AdamW keeps a tensor, DeepSpeedCPUAdam (offload) a number
            if torch.is_tensor(flat_state.get("step")):
                flat_state["step"].fill_(max(steps))
            else:
                flat_state["step"] = int(max(steps))
        if not zero3:
            self.optimizer.update_lp_params()  # fp32 partitions -> the module's weights (an all-gather)
        for name, buffer in module.named_buffers():
            if name in model_sd:
                buffer.copy_(model_sd[name])
        convert.load_schedule(self.optimizer, self.scheduler, schedule)

    def _flat_partitions(self) -> list[tuple[int, torch.Tensor]]:
        """This rank's flat fp32 master partitions, each with the index of the inner optimizer's param group
        that steps it (ZeRO-1/2 and DeepSpeed's bf16 optimizer: one per group; ZeRO-3: one per sub-group)."""
        opt = self.optimizer
        if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
            return [(opt.sub_group_to_group_id[i], flat) for i, flat in enumerate(opt.fp32_partitioned_groups_flat)]
        for name in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition"):  # ZeRO-1/2, bf16
            if hasattr(opt, name):
                return list(enumerate(getattr(opt, name)))
        raise RuntimeError(f"{type(opt).__name__}: no flat fp32 partitions found")

    def _init_optimizer_state(self) -> None:
        """Create the inner optimizer's state of every flat fp32 partition (it is created lazily, at the first
        step) with one step of zero gradients at learning rate 0 per partition, as ZeRO-3 steps its sub-groups
        (no change to the weights; what ``torch.distributed.checkpoint.state_dict`` does for an empty optimizer),
        then link ZeRO-1/2's per-parameter fragments to it."""
        inner = self.optimizer.optimizer
        for group_id, flat in self._flat_partitions():
            if inner.state.get(flat):  # state is a defaultdict: ZeRO-3 leaves empty entries
                continue
            group = inner.param_groups[group_id]
            params, lr, grad = group["params"], group["lr"], flat.grad
            group["params"], group["lr"], flat.grad = [flat], 0.0, torch.zeros_like(flat)
            inner.step()
            group["params"], group["lr"], flat.grad = params, lr, grad
        link = getattr(self.optimizer, "_lazy_init_hp_params_optimizer_state", None)  # ZeRO-1/2, bf16
        if link is not None:
            link()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self._zero3():
            # collective: every rank calls it; a frozen base (LoRA) stays out, as module.state_dict() leaves it
            frozen = any(not p.requires_grad for p in self.engine.module.parameters())
            state = self.engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=frozen)
        else:
            state = self.engine.module.state_dict() if self.ctx.is_main else None
        if not self.ctx.is_main or state is None:
            return None
        return {k: v.detach().cpu() for k, v in state.items()}
