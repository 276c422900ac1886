"""The contract between the training loop and a parallel strategy (single, DDP, DeepSpeed, FSDP2, plugins).

The loop owns data, loss, telemetry and checkpoint timing; the strategy owns how the model and optimizer are
wrapped, how gradients are synchronised and stepped, and how its state is saved. A strategy is built with its
model -- ``factory(options, training, ctx, model) -> Strategy`` -- and its constructor wraps the model and builds
the optimizer and LR schedule, so ``model``, ``optimizer`` and ``scheduler`` are always set. One optimizer step is:

    for i, micro_batch in enumerate(micro_batches):       # GradientAccumulation (torch_handle.train.loop)
        with strategy.accumulating(sync=(i == last)), strategy.autocast():
            loss = loss_fn(strategy.model(**inputs), labels)
        strategy.backward(loss)            # loss: mean over this micro-batch's tokens, unscaled
    grad_norm = strategy.step()            # clip, optimizer step, LR schedule step, zero grads

A strategy that runs the micro-batches itself (a pipeline schedule) returns its loop from ``micro_batch_loop``.

Checkpoints: ``save``/``load`` in the strategy's own format; ``checkpoint_layout`` says which format that is and
``loads_natively`` whether ``load`` reads a given checkpoint; any other checkpoint is converted to the portable
form (:mod:`torch_handle.checkpoint.convert`) and read by ``load_portable``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Iterable

import torch
import torch.distributed as dist

from torch_handle.common.precision import torch_dtype
from torch_handle.config.loader import TrainingConfig
from torch_handle.observe.fields import FROZEN_PARAM_BYTES, PARAM_BYTES, TRAINABLE_PARAM_BYTES
from torch_handle.train.routing import register_expert_bias_updates


@dataclass
class DistContext:
    """Where this process sits: from torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE)."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    layout: Any = None
    """The pp × dp × cp × tp :class:`~torch_handle.common.parallel_dims.ParallelDims` when ``parallel.tp``,
    ``parallel.pp``, ``parallel.ep`` or ``parallel.cp`` > 1, else None (dp = world size)."""
    mesh: Any = None
    """The ("dp", "tp") or ("pp", "dp", "tp") ``DeviceMesh`` of ``layout``."""
    tp_group: Any = None
    """This rank's :class:`~torch_handle.parallel.tensor.mappings.TPGroup` (the mesh's "tp" dimension)."""
    pp_group: Any = None
    """This rank's pipeline process group (the mesh's "pp" dimension), None without a pipeline."""
    ep_impl: str = "native"
    """``parallel.ep_impl``: how the experts are split when ``layout.ep`` > 1."""
    ep_mesh: Any = None
    """The ("edp", "ep", "tp") or ("pp", "edp", "ep", "tp") ``DeviceMesh`` when ``layout.ep`` > 1, else None."""
    cp_mesh: Any = None
    """The ("dp", "cp", "tp") ``DeviceMesh`` when ``parallel.cp`` > 1 (``cp_mesh["cp"]``: the ranks that share this
    rank's sequences); ``mesh`` stays None then, so the strategy reduces over dp × cp, the default group."""
    ep_share: Any = None
    """This rank's :class:`~torch_handle.train.shares.expert.ExpertParallel` share when ``layout.ep`` > 1, its
    experts already split (built with the run's other shares:
    :func:`torch_handle.train.shares.compose.build_shares`), for the strategy (:attr:`Strategy.ep_share`); else
    None."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which micro-batches it reads (the TP ranks of a replica read the same)."""
        return self.rank if self.layout is None else self.layout.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        """Model replicas: world_size / (tp · pp · cp)."""
        return self.world_size if self.layout is None else self.layout.dp

    @property
    def cp_size(self) -> int:
        """Ranks sharing each sequence (1 without context parallelism)."""
        return 1 if self.layout is None else self.layout.cp

    @property
    def dp_cp_size(self) -> int:
        """The ranks the data-parallel strategy averages the gradients over: dp × cp."""
        return self.world_size if self.layout is None else self.layout.dp_cp

    @property
    def tp_rank(self) -> int:
        return 0 if self.layout is None else self.layout.tp_rank(self.rank)

    @property
    def cp_rank(self) -> int:
        """Which share of each sequence this rank holds (0 without context parallelism)."""
        return 0 if self.layout is None else self.layout.cp_rank(self.rank)

    @property
    def pp_rank(self) -> int:
        """This rank's place in its pipeline (it runs stage pp_rank, and with v stages per rank more)."""
        return 0 if self.layout is None else self.layout.pp_rank(self.rank)

    @property
    def dp_group(self) -> Any:
        """The process group of this rank's data-parallel replicas (the mesh's "dp" dimension: the ranks that hold
        the same shard of the model); None, the default group, without a layout (every rank is a replica)."""
        return None if self.mesh is None else self.mesh["dp"].get_group()

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def lr_lambda(training: TrainingConfig):
    """Multiplier of the peak lr at optimizer step ``s`` (0-based): linear warm-up, then cosine/linear decay to
    ``min_lr_ratio`` at ``training.steps`` (Loshchilov & Hutter 2017 for cosine)."""
    warmup, total, floor = training.warmup_steps, training.steps, training.min_lr_ratio

    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / (warmup + 1)
        if training.schedule == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if training.schedule == "cosine" else 1 - progress
        return floor + (1 - floor) * decay

    return f


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors``.

    Counting storages rather than tensors is what makes the figure honest: parameters that are views into one
    flat buffer (DeepSpeed, FSDP) count that buffer once, and a shard counts only the shard it owns.
    """
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        if hasattr(t, "to_local"):  # a DTensor (TP, FSDP2): this rank holds its local shard
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class Strategy:
    """Base class of strategies: one process, the model as it is, AdamW and the project's LR schedule.

    The constructor calls three hooks, in order, that subclasses override as needed:
    ``wrap(model) -> nn.Module`` (e.g. DDP, fully_shard), ``build_optimizer(params)`` with the wrapped model's
    parameters, ``build_scheduler(optimizer)``. A subclass that needs more state sets it before calling
    ``super().__init__`` if the hooks read it, after it otherwise.

    Args:
        options: the strategy's ``[strategy]`` options (its registered dataclass).
        training: the ``[training]`` table.
        ctx: this rank's place in the process group (already initialised).
        model: the model, already on ``ctx.device`` with the same initial weights on every rank.
    """

    name = "base"
    ep_share: Any = None
    """The :class:`~torch_handle.train.shares.expert.ExpertParallel` share when ``parallel.ep`` > 1 (``ctx``'s: the
    model's experts are split before the strategy is built, and :meth:`wrap` leaves their parameters to it), else
    None."""
    clips_gradients = True
    """Whether :meth:`step` clips by :meth:`clip_grad_norm` (and reports that norm; NaN when off). A parallel share
    turns it off when it is bound (``ParallelShare.bind``): it clips in its ``before_step``, by the norm over its
    split model or by calling :meth:`clip_grad_norm` itself."""

    def __init__(self, options: Any, training: TrainingConfig, ctx: DistContext, model: torch.nn.Module):
        self.options, self.training, self.ctx = options, training, ctx
        self._sync = True
        self.ep_share = getattr(ctx, "ep_share", None)  # experts split over "ep" before any wrapping
        self.model: torch.nn.Module = self.wrap(model)
        # a frozen parameter (LoRA's base) has no optimizer state: the optimizer sees the trainable ones only
        self.optimizer: torch.optim.Optimizer = self.build_optimizer(
            p for p in self.model.parameters() if p.requires_grad)
        # what the model itself does at every optimizer step: an MoE router's expert biases under balance =
        # "aux_free", moved by the load of the data-parallel replicas (not of the tp ranks, which route the same
        # tokens, nor of other pipeline stages, whose layers are others: the default group would add those in)
        register_expert_bias_updates(model, self.optimizer, ctx.dp_group)
        self.scheduler: torch.optim.lr_scheduler.LRScheduler = self.build_scheduler(self.optimizer)

    # -- set-up (called by the constructor) ----------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the loop calls: ``model`` wrapped (DDP, an engine) or changed in place (fully_shard)."""
        return model

    def build_optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """AdamW from ``[training]`` (Loshchilov & Hutter 2019), fused on CUDA, and on CPU with ``training.compile``
        (plain tensors: not FSDP2's DTensors).

        On CPU the fused kernel is faster (2.6 ms against 8.4 for presets/llama.toml's 4 M parameters, one
        thread), but its rounding differs from the for-loop's, and scratch-ddp's sharded AdamW and the torch-DDP
        reference of tests/test_scratch_ddp.py (bitwise equality) use the for-loop: a compiled run, whose
        rounding differs from eager anyway, takes it (docs/performance.md, "Compiled against litgpt")."""
        t = self.training
        params = list(params)
        plain = all(type(p.data) is torch.Tensor for p in params)  # FSDP2's parameters hold DTensors
        fused = self.ctx.device.type == "cuda" or (t.compile and plain)
        return torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, weight_decay=t.weight_decay,
                                 fused=fused or None)

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        """Warm-up then cosine/linear decay (``lr_lambda``), stepped once per optimizer step."""
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.training))

    def describe(self) -> dict[str, Any]:
        """Facts for run.json and the dashboard (e.g. ``zero_stage``, the optimizer class in use)."""
        return {"strategy": self.name, "optimizer": type(self.optimizer).__name__}

    # -- the step ------------------------------------------------------------------------------------------------
    def autocast(self) -> ContextManager:
        """Mixed precision for single/DDP: autocast to bf16/fp16 with fp32 master weights."""
        p = self.training.precision
        if p == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=torch_dtype(p))

    def micro_batch_loop(self) -> Any:
        """The loop that runs a step's micro-batches (a :class:`~torch_handle.train.loop.MicroBatchLoop`: forward,
        loss and backward of each, and the step's loss sum), for a strategy that schedules them itself; None (the
        default): the trainer's :class:`~torch_handle.train.loop.GradientAccumulation`, whose calls are the ones
        this class documents (``accumulating``, ``autocast``, ``backward``). A pipeline is such a loop."""
        return None

    def pipeline_grad_sync(self) -> Any:
        """Under a pipeline, this strategy's own gradient sync over a stage's data-parallel ranks
        (:class:`~torch_handle.parallel.pipeline.data_parallel.GradSync`), or None (the default): none, or the one
        its DDP or FSDP2 stage modules bring."""
        return None

    def accumulating(self, sync: bool) -> ContextManager:
        """Context of one micro-batch; ``sync`` is false for all but the last micro-batch of a step."""
        self._sync = sync
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.training.grad_accum).backward()

    def step(self) -> float:
        """Clip (unless a share did: :attr:`clips_gradients`), step the optimizer and the LR schedule, zero the
        gradients; return the pre-clip grad norm (NaN when a share clipped)."""
        grad_norm = self.clip_for_step()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def clip_for_step(self) -> torch.Tensor | float:
        """What :meth:`step` clips with: :meth:`clip_grad_norm`'s norm, or NaN without clipping when a share clips
        (:attr:`clips_gradients` off)."""
        return self.clip_grad_norm() if self.clips_gradients else float("nan")

    def clip_grad_norm(self) -> torch.Tensor | float:
        """Clip the gradients of the strategy's model to ``training.grad_clip`` (0: no limit), by their norm as the
        strategy holds them (DDP: the replicated gradients'; FSDP2: over its shards); return that norm before
        clipping. :meth:`step` calls it unless :attr:`clips_gradients` is off."""
        max_norm = self.training.grad_clip if self.training.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # a DTensor: FSDP2

    def skip_step(self) -> None:
        """Drop the accumulated gradients without updating (``on_nan = "skip"``)."""
        self.optimizer.zero_grad(set_to_none=True)

    def step_stats(self) -> dict[str, float | int]:
        """Figures about the optimizer step that just ended, merged into its ``step`` event by the trainer (on
        rank 0: rank 0's figures), e.g. ``comm_s``, ``allreduce_calls``, ``allreduce_bytes``; called once per
        step, after :meth:`step` or :meth:`skip_step`. Default: none, or with expert parallelism the layout."""
        return {} if self.ep_share is None else self.ep_share.step_stats()

    def close(self) -> None:
        """Release what the strategy registered (gradient hooks, ...); called once by the trainer at the end of the
        run, whatever its outcome. Default: nothing to release."""

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    # -- memory --------------------------------------------------------------------------------------------------
    def grad_bytes(self) -> int:
        """Bytes of gradients this rank holds (called after backward, before ``step``)."""
        return tensor_bytes(p.grad for p in self.model.parameters())

    def param_bytes(self) -> int:
        """Bytes of model parameters this rank holds (its shard under ZeRO-3/FSDP)."""
        return tensor_bytes(self.model.parameters())

    def local_shard(self, param: torch.Tensor) -> torch.Tensor:
        """The part of the model's parameter ``param`` this rank stores between steps, (elements,) or its shape:
        the parameter itself where it is whole (single, DDP, ZeRO-1/2); a sharding strategy's own rows of it.
        What a QLoRA run hashes to prove its NF4 base unchanged (:func:`torch_handle.finetune.build.nf4_digest`)."""
        return param

    def frozen_param_bytes(self) -> int:
        """Bytes of the frozen parameters (``requires_grad`` False: a LoRA run's base) among :meth:`param_bytes`."""
        return tensor_bytes(p for p in self.unwrapped().parameters() if not p.requires_grad)

    def param_bytes_split(self) -> dict[str, int]:
        """This rank's ``param_bytes`` as trainable + frozen (the memory telemetry's three fields, bytes). Frozen:
        the frozen parameters, QLoRA's NF4 weights among them (frozen uint8 parameters, held as the strategy holds
        parameters: this rank's shard under fsdp, scratch-fsdp and ZeRO-3). A full fine-tune: frozen 0."""
        total, frozen = self.param_bytes(), self.frozen_param_bytes()
        return {PARAM_BYTES: total, TRAINABLE_PARAM_BYTES: total - frozen, FROZEN_PARAM_BYTES: frozen}

    def optimizer_bytes(self) -> int:
        """Bytes of optimizer state plus any fp32 master copy this rank holds (called after ``step``)."""
        return tensor_bytes(optimizer_state_tensors(self.optimizer))

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def unwrapped(self) -> torch.nn.Module:
        return getattr(self.model, "module", self.model)

    def parameter_names(self) -> list[str]:
        """The one-process model's trainable parameter names in ``named_parameters()`` order (shared ones once):
        how a ``torch`` checkpoint's numbered optimizer state maps to names (``convert.ensure_portable``)."""
        return [n for n, p in self.unwrapped().named_parameters() if p.requires_grad]

    def checkpoint_layout(self) -> dict[str, Any]:
        """What :meth:`save` writes, recorded in every checkpoint's ``layout.json`` (the trainer adds the world
        size and the batch settings): ``format`` -- one that :mod:`torch_handle.checkpoint.convert` can turn into the
        portable form (``torch``, ``torch-sharded``, ``dcp``, ``deepspeed``) -- and ``strategy``, plus what
        :meth:`loads_natively` compares (``zero_stage``, ...). Base: ``model.pt`` + ``optim.pt``, ``torch``."""
        return {"format": "torch", "strategy": self.name}

    def loads_natively(self, layout: dict[str, Any]) -> bool:
        """Whether :meth:`load` reads a checkpoint written with ``layout`` as it is. When not, the trainer has
        rank 0 convert it (:func:`torch_handle.checkpoint.convert.ensure_portable`) and calls :meth:`load_portable`.
        Base: any ``torch`` checkpoint (full model and optimizer state: any world size)."""
        return layout.get("format") == "torch"

    def load_portable(self, portable: Path) -> None:
        """Load the portable form of a checkpoint written by another strategy or world size (see
        :mod:`torch_handle.checkpoint.convert`): weights, optimizer state by parameter name, LR schedule. Called on every
        rank. Base: DCP into ``get_state_dict``'s targets (plain, DDP-wrapped or FSDP2 model; a ``torch.optim``
        optimizer over its parameters), then ``set_state_dict``; a loss scaler starts afresh.

        Raises:
            CheckpointError: the portable form is missing or does not fit the model.
        """
        from torch_handle.checkpoint import convert
        from torch_handle.checkpoint.store import safe_load

        from torch.distributed.checkpoint import CheckpointException

        try:
            convert.load_into(self.model, self.optimizer, Path(portable))
        except (RuntimeError, KeyError, ValueError, CheckpointException) as e:
            from torch_handle.errors import CheckpointError

            raise CheckpointError(f"{portable}: does not fit this model and optimizer "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e})") from None
        convert.load_schedule(self.optimizer, self.scheduler, safe_load(Path(portable) / "scheduler.pt"))

    def apply_schedule(self) -> None:
        """After a checkpoint load: the learning rate of *this* preset's ``[training]`` at the checkpoint's step.

        ``LambdaLR.load_state_dict`` restores the checkpoint's ``base_lrs`` (its peak ``lr``) and the optimizer's
        param groups their last ``lr``, while the schedule's shape (warm-up, ``steps``, ``schedule``,
        ``min_lr_ratio``) comes from the multiplier function built from the current preset. A resume that
        changes ``training.lr`` would keep the old peak: here the peak becomes ``training.lr`` and every param
        group gets ``lr = training.lr · lr_lambda(last_epoch)``, the value ``LambdaLR`` itself computes. With
        an unchanged preset the values are the same as loaded, bit for bit."""
        scheduler, lr = self.scheduler, self.training.lr
        scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
        lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, value in zip(scheduler.optimizer.param_groups, lrs):
            group["initial_lr"] = lr
            group["lr"] = value
        scheduler._last_lr = lrs  # what get_last_lr() reports until the next step

    def save(self, ckpt_dir: Path) -> None:
        """Called on every rank with the (shared) temporary checkpoint directory."""
        if self.ctx.is_main:
            torch.save(self.unwrapped().state_dict(), Path(ckpt_dir) / "model.pt")
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                       Path(ckpt_dir) / "optim.pt")

    def load(self, ckpt_dir: Path) -> None:
        from torch_handle.checkpoint.store import safe_load

        self.unwrapped().load_state_dict(safe_load(Path(ckpt_dir) / "model.pt", self.ctx.device))
        state = safe_load(Path(ckpt_dir) / "optim.pt", self.ctx.device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full fp32/bf16 weights on rank 0 (None elsewhere); called on every rank (ZeRO-3 gathers)."""
        if not self.ctx.is_main:
            return None
        return {k: v.detach().cpu() for k, v in self.unwrapped().state_dict().items()}

