"""Strategy plugins: ``single``, ``ddp``, ``deepspeed`` (ZeRO 0-3, offload), ``fsdp`` (FSDP2 fully_shard) and
``scratch-ddp`` (data parallelism and ZeRO-1 written from scratch), ``scratch-fsdp`` (ZeRO-2 and ZeRO-3 written
from scratch).

This module only declares the options and registers factories; each strategy's torch/DeepSpeed code lives in
its own module and is imported when a run starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from torch_handle.api import InvalidValue, hookimpl, param


@dataclass
class SingleConfig:
    """``[strategy]`` with ``name = "single"``: one model replica, no wrapping (one process, or the tp processes
    of one tensor-parallel or pipeline replica)."""

    tensor_parallel: ClassVar[bool] = True
    native_tensor_parallel: ClassVar[bool] = True  # the model's DTensor parameters as they are
    pipeline_parallel: ClassVar[bool] = True
    fp16_loss_scaling: ClassVar[bool] = True  # GradScaler: training.precision = "auto" may pick fp16 (pre-Ampere)


@dataclass
class DDPConfig:
    """``[strategy]`` options of ``ddp`` (torch.nn.parallel.DistributedDataParallel)."""

    tensor_parallel: ClassVar[bool] = True  # replicas of a model split by hand (parallel.tp_impl = "scratch"):
    # DDP's buckets take plain tensors, so no native_tensor_parallel (tp_impl = "auto" picks scratch)
    pipeline_parallel: ClassVar[bool] = True  # each pipeline stage its own DDP over the stage's data-parallel ranks
    expert_parallel: ClassVar[bool] = True  # the experts left out of DDP, reduced over "edp" (parallel.ep > 1)
    fp16_loss_scaling: ClassVar[bool] = True  # GradScaler, as single

    bucket_cap_mb: float = param(25.0, gt=0.0)
    """Gradient bucket size: gradients of one bucket are all-reduced as soon as they are ready (overlap)."""
    gradient_as_bucket_view: bool = True
    """Let gradients be views into the buckets (saves one copy of the gradients)."""
    find_unused_parameters: bool = False
    """Traverse the graph each step to find parameters without gradients (slower; rarely needed)."""
    broadcast_buffers: bool = False
    """Broadcast the model's buffers from rank 0 before every forward (torch's default is on). handle's models hold
    constant buffers (the sinusoidal table, RoPE's cos/sin, LoRA's base hash) or ones every rank updates alike (the
    MoE expert biases, from all-reduced loads): off saves a collective a step. On for a model whose buffers drift
    apart per rank (BatchNorm's running statistics)."""


@dataclass
class DeepSpeedConfig:
    """``[strategy]`` options of ``deepspeed`` (https://www.deepspeed.ai/docs/config-json/)."""

    fp16_loss_scaling: ClassVar[bool] = True  # DeepSpeed's fp16 section: dynamic loss scaling

    zero_stage: int = param(2, ge=0, le=3)
    """ZeRO stage (Rajbhandari et al. 2020): 0 = data parallel, 1 = shard optimizer state, 2 = also gradients,
    3 = also parameters."""
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"
    """Keep optimizer state (and its step) on the CPU or NVMe (ZeRO-Offload; stages 1-3)."""
    offload_param: Literal["none", "cpu", "nvme"] = "none"
    """Keep parameters on the CPU or NVMe between uses (ZeRO-Infinity; stage 3 only)."""
    nvme_path: str = ""
    """Directory for NVMe offload swap files."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward (uses more memory for buckets)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (avoids fragmentation)."""
    reduce_bucket_size: int = param(50_000_000, ge=1)
    """Elements per gradient reduction bucket."""
    loss_scale_window: int = param(1000, ge=1)
    """fp16 dynamic loss scaling: steps without overflow before the scale is raised."""
    initial_scale_power: int = param(16, ge=0, le=32)
    """fp16 dynamic loss scaling starts at 2**initial_scale_power."""
    ds_config: dict[str, Any] = param(default_factory=dict, frozen_on_resume=(
        "it is merged verbatim into DeepSpeed's config (it may change the optimizer or precision the checkpoint's "
        "state belongs to)"))
    """Merged verbatim over the generated ds_config (for power users)."""

    def check(self) -> None:
        if self.offload_param != "none" and self.zero_stage != 3:
            raise InvalidValue("offload_param", f"needs zero_stage = 3 (got {self.zero_stage})")
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise InvalidValue("offload_optimizer", "needs zero_stage 1, 2 or 3 (got 0)")
        if "nvme" in (self.offload_param, self.offload_optimizer) and not self.nvme_path:
            raise InvalidValue("nvme_path", "is required for nvme offload")


@dataclass
class FSDPConfig:
    """``[strategy]`` options of ``fsdp`` (FSDP2: torch.distributed.fsdp.fully_shard)."""

    tensor_parallel: ClassVar[bool] = True  # FSDP x TP: each TP shard sharded again over the data-parallel ranks
    native_tensor_parallel: ClassVar[bool] = True  # fully_shard takes DTensor parameters (torchtitan's FSDP x TP)
    pipeline_parallel: ClassVar[bool] = True  # FSDP x PP: each stage sharded over its data-parallel ranks
    expert_parallel: ClassVar[bool] = True  # the experts sharded over "edp", the dense part over "dp" (torchtitan)

    reshard_after_forward: bool = True
    """Free gathered parameters after forward (ZeRO-3-like); false keeps them until backward (ZeRO-2-like)."""


@dataclass
class ScratchDDPConfig:
    """``[strategy]`` options of ``scratch-ddp``: data parallelism written from scratch (CS336 assignment 2 style),
    optionally with the optimizer state sharded (ZeRO-1, Rajbhandari et al. 2020)."""

    sync: Literal["naive", "flat", "overlap", "bucketed"] = "bucketed"
    """How gradients are averaged: naive (one all-reduce per parameter after backward), flat (one all-reduce of
    all gradients flattened, after backward), overlap (one async all-reduce per parameter, started by a hook as
    its gradient is ready), bucketed (async all-reduce per bucket of bucket_mb, started as the bucket fills)."""
    bucket_mb: float = param(25.0, gt=0.0)
    """Bucket size in MiB for sync = "bucketed" (buckets fill in reverse registration order, as in DDP)."""
    pipeline_parallel: ClassVar[bool] = True  # each stage's gradients all-reduced over its data-parallel ranks
    fp16_loss_scaling: ClassVar[bool] = True  # GradScaler

    shard_optimizer: bool = False
    """ZeRO-1: each rank keeps optimizer state for a balanced share of the parameters, steps it and broadcasts
    the updated parameters; checkpoints hold one optimizer file per rank."""


@dataclass
class ScratchFSDPConfig:
    """``[strategy]`` options of ``scratch-fsdp``: ZeRO-2 and ZeRO-3 (fully sharded data parallelism) written from
    scratch (Rajbhandari et al. 2020; Zhao et al. 2023)."""

    fp16_loss_scaling: ClassVar[bool] = True  # ShardedLossScaler

    zero_stage: int = param(3, ge=2, le=3)
    """2: gradients and optimizer state sharded, full weights on every rank; 3: the weights sharded too, each
    unit (a block, or the rest of the model) gathered only for its forward and backward."""
    reshard_after_forward: bool = True
    """zero_stage 3: free a block's gathered weights after its forward (gather again for backward); false keeps
    them until its backward (more memory, one all-gather fewer per block)."""
    prefetch: bool = False
    """zero_stage 3: start the next unit's all-gather while the current one computes (forward and backward)."""


def _check_single(options, preset) -> None:
    replica = preset.parallel.tp * preset.parallel.pp  # the ranks one model replica spans
    if preset.world_size != replica and replica > 1:
        raise InvalidValue("launch.nproc_per_node", f"strategy 'single' runs one model replica: world size "
                                                    f"{preset.world_size} must equal parallel.tp x parallel.pp = "
                                                    f"{replica}")
    if preset.world_size != replica:
        raise InvalidValue("launch.nproc_per_node", f"strategy 'single' runs one process (world size "
                                                    f"{preset.world_size}); use ddp, deepspeed or fsdp")


def _check_scratch_ddp(options, preset) -> None:
    if options.shard_optimizer and preset.parallel.pp > 1:
        raise InvalidValue("shard_optimizer", "with parallel.pp > 1 is not supported (ZeRO-1 shards over every "
                                              "rank, not a stage's data-parallel ranks): set it to false, or use fsdp")


def _check_deepspeed(options: DeepSpeedConfig, preset) -> Iterator[InvalidValue]:
    """Every contradiction between ``ds_config`` and the rest of the preset (a generator: all are reported)."""
    ds = options.ds_config
    precision = preset.training.precision
    for mode in ("fp16", "bf16"):
        section = ds.get(mode)
        if section is None:
            continue
        if not isinstance(section, dict):
            yield InvalidValue("ds_config", f"{mode} must be a table (for example {mode}.enabled = true), "
                                            f"got {section!r}")
        elif section.get("enabled") and precision != mode:
            yield InvalidValue("ds_config", f"{mode}.enabled contradicts training.precision = {precision!r} "
                                            f"(set training.precision = {mode!r} instead)")
    zero = ds.get("zero_optimization")
    if zero is not None and not isinstance(zero, dict):
        yield InvalidValue("ds_config", f"zero_optimization must be a table, got {zero!r}")
    if isinstance(zero, dict) and "stage" in zero and zero["stage"] != options.zero_stage:
        yield InvalidValue("ds_config", f"zero_optimization.stage = {zero['stage']!r} contradicts zero_stage = "
                                        f"{options.zero_stage} (set strategy.zero_stage instead)")
    training = preset.training
    implied = {"train_micro_batch_size_per_gpu": ("micro_batch_size", training.micro_batch_size),
               "gradient_accumulation_steps": ("grad_accum", training.grad_accum),
               "train_batch_size": ("micro_batch_size * grad_accum * world size",
                                    training.micro_batch_size * training.grad_accum * preset.world_size)}
    for key, (source, value) in implied.items():
        if key in ds and ds[key] != value:
            yield InvalidValue("ds_config", f"{key} = {ds[key]!r} contradicts training.{source} = {value} "
                                            f"(set it in [training] instead)")


def build_single(options, training, ctx, model):
    from handle_plugins.strategies.single import SingleStrategy

    return SingleStrategy(options, training, ctx, model)


def build_ddp(options, training, ctx, model):
    from handle_plugins.strategies.ddp import DDPStrategy

    return DDPStrategy(options, training, ctx, model)


def build_deepspeed(options, training, ctx, model):
    from handle_plugins.strategies.deepspeed import DeepSpeedStrategy

    return DeepSpeedStrategy(options, training, ctx, model)


def build_fsdp(options, training, ctx, model):
    from handle_plugins.strategies.fsdp import FSDPStrategy

    return FSDPStrategy(options, training, ctx, model)


def build_scratch_ddp(options, training, ctx, model):
    from handle_plugins.strategies.scratch_ddp.strategy import ScratchDDPStrategy

    return ScratchDDPStrategy(options, training, ctx, model)


def build_scratch_fsdp(options, training, ctx, model):
    from handle_plugins.strategies.scratch_fsdp.strategy import ScratchFSDPStrategy

    return ScratchFSDPStrategy(options, training, ctx, model)


@hookimpl
def handle_register_strategies(register):
    register("single", SingleConfig, build_single, "one process, no wrapping", _check_single)
    register("ddp", DDPConfig, build_ddp, "DistributedDataParallel: replicate, all-reduce gradients in buckets")
    register("deepspeed", DeepSpeedConfig, build_deepspeed, "DeepSpeed ZeRO stages 0-3 with CPU/NVMe offload",
             _check_deepspeed)
    register("fsdp", FSDPConfig, build_fsdp, "FSDP2 fully_shard: per-parameter sharding (DTensor)")
    register("scratch-ddp", ScratchDDPConfig, build_scratch_ddp,
             "data parallelism from scratch: naive/flat/overlap/bucketed all-reduce, optional ZeRO-1",
             _check_scratch_ddp)
    register("scratch-fsdp", ScratchFSDPConfig, build_scratch_fsdp,
             "ZeRO-2/3 from scratch: flat per-unit shards, all-gather and reduce-scatter by hand")
