"""The model-state part of ``handle estimate``: bytes of parameters, gradients and optimizer state one rank holds
under each built-in strategy, from the parameter list of the model (:class:`~torch_handle.plan.estimate_model.
ModelShape`): ZeRO's accounting (Rajbhandari et al. 2020) made exact for each implementation, from real runs'
telemetry (:data:`MEASURED`). :mod:`torch_handle.plan.estimate` and :mod:`torch_handle.plan.estimate_layout`
apply it to a whole model, a TP shard or a pipeline stage's layers.

Standard library only at import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch_handle.plan.estimate_model import ModelShape

if TYPE_CHECKING:
    from torch_handle.config.schema import Preset

__all__ = ["BUILTIN", "COMPARE_VARIANTS", "MEASURED", "States", "Variant", "frozen_param_bytes",
           "model_state_bytes", "nf4_rank_bytes", "nf4_stored_bytes", "preset_variant", "shards_parameters",
           "trainable_state_bytes"]

# ---------------------------------------------------------------------------------------------------------------
# What is estimated
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One strategy configuration: the ``[strategy]`` options that change what a rank holds."""

    label: str
    """Short name in tables, e.g. ``"zero3+offload"``."""
    strategy: str
    """The registered strategy name: single, ddp, deepspeed, fsdp, scratch-ddp, scratch-fsdp."""
    zero_stage: int = 0
    offload_optimizer: str = "none"
    offload_param: str = "none"
    shard_optimizer: bool = False


COMPARE_VARIANTS: tuple[Variant, ...] = (
    Variant("single", "single"),
    Variant("ddp", "ddp"),
    Variant("scratch-ddp", "scratch-ddp"),
    Variant("scratch-ddp+zero1", "scratch-ddp", shard_optimizer=True),
    Variant("zero0", "deepspeed", zero_stage=0),
    Variant("zero1", "deepspeed", zero_stage=1),
    Variant("zero1+offload", "deepspeed", zero_stage=1, offload_optimizer="cpu"),
    Variant("zero2", "deepspeed", zero_stage=2),
    Variant("zero2+offload", "deepspeed", zero_stage=2, offload_optimizer="cpu"),
    Variant("zero3", "deepspeed", zero_stage=3),
    Variant("zero3+offload", "deepspeed", zero_stage=3, offload_optimizer="cpu"),
    Variant("zero3+offload+param", "deepspeed", zero_stage=3, offload_optimizer="cpu", offload_param="cpu"),
    Variant("fsdp", "fsdp"),
    Variant("scratch-zero2", "scratch-fsdp", zero_stage=2),
    Variant("scratch-zero3", "scratch-fsdp", zero_stage=3),
)
"""Every built-in strategy, as ``handle estimate --compare`` lists them (offload = to the CPU)."""

BUILTIN = ("single", "ddp", "deepspeed", "fsdp", "scratch-ddp", "scratch-fsdp")

MEASURED = {
    # rank 0 of 2, model of 132,864 parameters in 27 tensors (benchmarks/zero_memory.py's tiny preset)
    "fp32": {"ddp": (531_456, 531_456, 1_063_020), "zero0": (531_456, 531_456, 1_063_020),
             "zero1": (531_456, 330_240, 797_188), "zero2": (531_456, 330_240, 797_188),
             "zero3": (265_728, 265_728, 797_188), "fsdp": (265_728, 265_728, 531_564),
             "scratch-ddp": (531_456, 531_456, 1_063_020), "scratch-ddp+zero1": (531_456, 531_456, 531_508),
             "zero1+offload": (531_456, 527_872, 797_184), "zero2+offload": (531_456, 527_872, 797_184),
             "zero3+offload": (265_728, 531_456, 797_184), "zero3+offload+param": (265_728, 531_456, 797_184)},
    "bf16": {"ddp": (531_456, 531_456, 1_063_020), "zero0": (265_728, 265_728, 1_594_476),
             "zero1": (265_728, 165_120, 797_188), "zero2": (265_728, 165_120, 797_188),
             "zero3": (132_864, 132_864, 797_188), "fsdp": (265_728, 265_728, 531_564),
             "scratch-ddp": (531_456, 531_456, 1_063_020), "scratch-ddp+zero1": (531_456, 531_456, 531_508),
             "zero1+offload": (265_728, 396_800, 797_184), "zero2+offload": (265_728, 396_800, 797_184),
             "zero3+offload": (132_864, 398_592, 797_184), "zero3+offload+param": (132_864, 398_592, 797_184)},
}
"""(param_bytes, grad_bytes, optimizer_bytes) of rank 0 that the formulas were derived from: `handle run` on 2
ranks, gloo, log_every = 1 (tests/test_estimate.py re-measures them)."""


# ---------------------------------------------------------------------------------------------------------------
# Model states: the per-strategy formulas
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class States:
    """Bytes of model states one rank holds; ``host_*`` is the part of each that lives in host memory."""

    param: int = 0
    """Every parameter byte, trainable and frozen (``frozen_param`` of them)."""
    grad: int = 0
    optimizer: int = 0
    frozen_param: int = 0
    """A fine-tuning run's frozen base (parameters, QLoRA's NF4 storage among them), part of ``param``."""
    nf4: int = 0
    """QLoRA's NF4 weights (packed codes, block absmax codes, second-level scales, means), part of
    ``frozen_param``."""
    host_param: int = 0
    host_grad: int = 0
    host_optimizer: int = 0

    @property
    def host(self) -> int:
        return self.host_param + self.host_grad + self.host_optimizer


def _model_dtype_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _ds12_partition(shape: ModelShape, world: int, rank: int) -> tuple[int, int]:
    """DeepSpeed ZeRO-1/2 (stage_1_and_2.py): all parameters in one flat buffer padded to a multiple of
    ``2 * world`` elements (``nccl_start_alignment_factor``), cut into ``world`` equal partitions. Returns
    (partition elements, elements of partition-straddling parameters that lie outside this rank's partition).

    The second term is measured: a rank keeps the whole gradient of each parameter that starts in, or reaches
    into, its partition (``params_in_partition``), so a parameter straddling a boundary counts in full on the
    rank where it starts and on the rank it reaches into.
    """
    alignment = 2 * world
    partition = math.ceil(shape.n_params / alignment) * alignment // world
    start, end = partition * rank, partition * (rank + 1)
    outside, offset = 0, 0
    for n in shape.numels:
        first, last = offset, offset + n
        if start <= first < end or first < start < last:  # deepspeed's get_partition_info
            outside += n - max(0, min(last, end) - max(first, start))
        offset = last
    return partition, outside


def _ds3_partition(shape: ModelShape, world: int) -> int:
    """DeepSpeed ZeRO-3 partitions every parameter on its own: ``ds_tensor`` of ceil(numel / world) elements
    (padded), the same on every rank."""
    return sum(math.ceil(n / world) for n in shape.numels)


def _fsdp_local(shape: ModelShape, world: int, rank: int) -> tuple[int, int, int]:
    """FSDP2 shards every parameter on dim 0 like ``torch.chunk``: rank r owns rows [r*c, (r+1)*c), c =
    ceil(dim0 / world). Returns (padded elements: every rank's parameter and gradient shard is stored padded to
    c rows, elements it owns: what Adam's state is allocated for, tensors with a non-empty shard here)."""
    padded, owned, tensors = 0, 0, 0
    for n, d0 in zip(shape.numels, shape.dim0):
        rows_per = math.ceil(d0 / world)
        rows = max(0, min(d0, rows_per * (rank + 1)) - rows_per * rank)
        padded += rows_per * (n // d0)
        owned += rows * (n // d0)
        tensors += rows > 0
    return padded, owned, tensors


def _greedy_owned(shape: ModelShape, world: int, rank: int) -> tuple[int, int]:
    """scratch-ddp's ``ShardedOptimizer`` partition: largest parameter first, each to the rank that owns the
    fewest elements so far (ties: lowest rank). Returns (elements, tensors) owned by ``rank``."""
    owned = [0] * world
    mine = [0, 0]
    for n in sorted(shape.numels, reverse=True):  # stable: equal sizes keep registration order, as in the plugin
        r = min(range(world), key=lambda i: owned[i])
        owned[r] += n
        if r == rank:
            mine[0] += n
            mine[1] += 1
    return mine[0], mine[1]


def model_state_bytes(shape: ModelShape, variant: Variant, precision: str, world: int, rank: int = 0) -> States:
    """:func:`trainable_state_bytes` of ``shape``'s trainable parameters plus its frozen base
    (:func:`frozen_param_bytes`), which adds to ``param`` (and ``frozen_param``) alone: a frozen parameter has no
    gradient and no optimizer state under any strategy (Hu et al. 2021, §4.2).

    Raises:
        ValueError: as :func:`trainable_state_bytes`.
    """
    s = trainable_state_bytes(shape, variant, precision, world, rank)
    if shape.frozen_numels or shape.stored_bytes:
        device, host = frozen_param_bytes(shape, variant, precision, world, rank)
        nf4_device, nf4_host = nf4_rank_bytes(shape, variant, world, rank)
        s.nf4 = nf4_device + nf4_host
        s.frozen_param = device + host + s.nf4
        s.param += s.frozen_param
        s.host_param += host + nf4_host
    return s


def frozen_param_bytes(shape: ModelShape, variant: Variant, precision: str, world: int, rank: int = 0,
                       element_bytes: int | None = None) -> tuple[int, int]:
    """(device, host) bytes of the frozen parameters one rank holds, in the dtype and sharding the strategy gives
    every parameter (QLoRA's NF4 weights apart: :func:`nf4_rank_bytes`). F = frozen parameters, b as in
    :func:`trainable_state_bytes`; ``element_bytes``: the bytes of an element of ``shape``'s own tensors (not its
    ``frozen`` ones) in a dtype no strategy casts, in place of 4 and b (the NF4 base).

    * single, ddp, scratch-ddp, deepspeed stage 0 in fp32: the fp32 model, whole: 4F.
    * fsdp (FSDP2 shards every parameter of a ``fully_shard`` unit, frozen or not): 4 x its padded dim-0 chunk.
    * scratch-fsdp: every frozen parameter's own dim-0 rows in its dtype (fp32 here: 4 x the elements this rank
      owns; no master copy, it is never stepped); at stage 2 also every full padded weight in the compute dtype,
      as for the trainable ones (b x padded chunk x W).
    * deepspeed: the engine casts every parameter to the model dtype; stages 0-2 partition only what the optimizer
      holds, so the base stays whole, bF; stage 3 partitions every module parameter (``ds_tensor``), b x
      ceil(n / W) each, on the host with ``offload_param``.

    Measured equal to the byte against the telemetry of 2-rank fp32 LoRA runs (ddp, fsdp, ZeRO-2, ZeRO-3,
    scratch-fsdp, pp 2) and of a QLoRA run (tests/test_lora_strategies.py, tests/unit/test_lora_run.py); bf16
    under DeepSpeed follows its cast, not measured.

    Raises:
        ValueError: a strategy that is not built in.
    """
    frozen, b, name = shape.frozen, _model_dtype_bytes(precision), variant.strategy
    if element_bytes is not None:  # a dtype no strategy casts (QLoRA's uint8 NF4 storage)
        frozen, b = shape, element_bytes
    fp32 = element_bytes or 4
    if name in ("single", "ddp", "scratch-ddp"):
        return fp32 * frozen.n_params, 0
    if name == "fsdp":
        return fp32 * _fsdp_local(frozen, world, 0)[0], 0
    if name == "scratch-fsdp":
        padded, owned, _ = _fsdp_local(frozen, world, rank)
        return fp32 * owned + (b * padded * world if variant.zero_stage == 2 else 0), 0
    if name != "deepspeed":
        raise ValueError(f"no memory model for a frozen base under strategy {name!r}")
    if variant.zero_stage < 3:
        return b * frozen.n_params, 0
    partition = b * _ds3_partition(frozen, world)
    if variant.offload_param != "none":
        return 0, partition
    return partition, 0


def shards_parameters(variant: Variant) -> bool:
    """Whether the variant shards parameters (fsdp, scratch-fsdp, ZeRO-3), so shards QLoRA's NF4 base too (a frozen
    uint8 parameter: :func:`nf4_rank_bytes`)."""
    return variant.strategy in ("fsdp", "scratch-fsdp") or (variant.strategy == "deepspeed"
                                                             and variant.zero_stage == 3)


def nf4_stored_bytes(numel: int, block_size: int = 64, absmax_block_size: int = 256, double_quant: bool = True
                     ) -> int:
    """Bytes of one weight of ``numel`` elements stored in NF4 (:mod:`torch_handle.finetune.nf4`): ceil(n / 2)
    packed codes, and per block of ``block_size`` one uint8 absmax code plus, per group of ``absmax_block_size``
    blocks, one float32 scale, and one float32 mean (double quantisation); one float32 absmax per block without."""
    blocks = -(-numel // block_size)
    if not double_quant:
        return (numel + 1) // 2 + 4 * blocks
    return (numel + 1) // 2 + blocks + 4 * -(-blocks // absmax_block_size) + 4


def nf4_rank_bytes(shape: ModelShape, variant: Variant, world: int, rank: int = 0) -> tuple[int, int]:
    """(device, host) bytes of QLoRA's NF4 base on ``rank`` of ``world``.

    Each NF4 linear stores its weight as one frozen uint8 parameter, ``weight_nf4`` of
    :func:`nf4_stored_bytes` bytes (``shape.nf4_stored``), which every strategy holds as it holds a frozen
    parameter (:func:`frozen_param_bytes` at one byte an element, no cast): whole under single, ddp, scratch-ddp
    and ZeRO-0/1/2; ceil(bytes / W) a rank under fsdp and ZeRO-3 (on the host with ``offload_param``); this rank's
    own bytes under scratch-fsdp (plus the gathered whole at its stage 2). A pipeline stage holds its own layers'
    (``shape`` is then the stage's).
    """
    if not shape.nf4_stored:
        return 0, 0
    return frozen_param_bytes(ModelShape(shape.nf4_stored, shape.nf4_stored), variant, "fp32", world, rank,
                              element_bytes=1)


def trainable_state_bytes(shape: ModelShape, variant: Variant, precision: str, world: int, rank: int = 0
                          ) -> States:
    """Bytes of parameters, gradients and optimizer state (Adam(W): two fp32 moments, fp32 master weights where
    the strategy keeps them, and a 4-byte ``step`` per state tensor) that ``rank`` of ``world`` holds: what
    the ``memory`` telemetry reports (distinct storages; gradients before the optimizer step, optimizer state
    after it). N = parameters, T = parameter tensors, b = 2 (bf16/fp16) or 4 (fp32) bytes.

    * single, ddp, scratch-ddp: the model stays fp32 (autocast computes in bf16/fp16): 4N + 4N (DDP: gradients
      are views of its buckets) + 8N + 4T. scratch-ddp with ``shard_optimizer``: the optimizer part only for the
      parameters this rank owns (greedy partition, :func:`_greedy_owned`).
    * deepspeed stage 0: fp32 like ddp (torch AdamW); bf16/fp16: bN + bN + 12N + 4T (fp32 master copy).
    * deepspeed stage 1 and 2 (identical here: 0.19's stage 1 already reduce-scatters): bN (flat, padded) +
      b(N/W + boundary-straddling gradients) + 12 N/W + 4 -- an fp32 master partition even for an fp32 model.
    * deepspeed stage 3: b N/W + b N/W + 12 N/W + 4, each parameter padded to a multiple of W.
    * fsdp (FSDP2): fp32 shards whatever the precision (MixedPrecisionPolicy casts per use): 4 N/W + 4 N/W +
      8 N/W + 4T, per-parameter dim-0 chunks (parameter and gradient shards padded to equal rows).
    * scratch-fsdp: every parameter sharded on dim 0 as FSDP2 does (rank r owns O of its elements, P padded per
      rank, as for fsdp): the fp32 gradient shards are views of each unit's reduce-scatter output, 4P; AdamW
      8 O + 4T; stage 3 holds only the fp32 master shards as its weights (4 O, each its own tensor; no unit is
      gathered when the trainer measures, after the step), stage 2 every full padded weight in the compute
      dtype (b P W) and the master shards beside them (4 O, counted as optimizer state).
    * deepspeed with ``offload_optimizer`` (DeepSpeedCPUAdam: ``step`` is no tensor): the fp32 master partition
      and Adam moments, 12 N/W, live in host memory, and so does an fp32 gradient partition, 4 N/W. Stages 1/2
      add two staging buffers of the largest parameter L in the model dtype (one on the host, one on the
      device): gradients 4 N/W + 2bL, no straddling term. Stage 3 keeps its device gradient partition too:
      gradients (4 + b) N/W. ``offload_param`` (stage 3) moves the parameter partition to the host as well.

    Derived from 2-rank runs (:data:`MEASURED`) and re-checked on every rank of 2-rank runs with odd sizes
    (d_model 48, vocabulary 509: paddings and boundaries) and of 4-rank runs (also with partitions that lie
    wholly inside the embedding): equal to the byte. Strategy options
    outside :class:`Variant` are taken at their defaults (ddp ``gradient_as_bucket_view = true``, DeepSpeed
    ``overlap_comm = false``); NVMe offload counts as host memory. fp16 was measured for ddp and fsdp (equal to
    the byte); DeepSpeed refuses fp16 on a CPU, so its fp16 figures are the bf16 formulas, not measured.

    With tensor parallelism, ``shape`` is one TP rank's shard (:func:`~torch_handle.plan.estimate_model.
    model_shape` of the split model) and ``world``/``rank`` are the data-parallel degree dp = world_size / tp and
    this rank's index among the dp replicas: each formula applies to the shard unchanged (FSDP2 shards every local
    tensor again on its dim 0 over dp; single and DDP keep it whole).

    Raises:
        ValueError: for a strategy that is not built in, or ``single`` with ``world > 1``.
    """
    n, t, b = shape.n_params, shape.n_tensors, _model_dtype_bytes(precision)
    s = States()
    name = variant.strategy
    if name == "single" and world != 1:
        raise ValueError("strategy 'single' runs one process")
    if name in ("single", "ddp", "scratch-ddp") or (name == "deepspeed" and variant.zero_stage == 0
                                                     and precision == "fp32"):
        s.param, s.grad, s.optimizer = 4 * n, 4 * n, 8 * n + 4 * t
        if name == "scratch-ddp" and variant.shard_optimizer:
            owned, owned_tensors = _greedy_owned(shape, world, rank)
            s.optimizer = 8 * owned + 4 * owned_tensors
        return s
    if name == "fsdp":
        padded, owned, tensors = _fsdp_local(shape, world, rank)
        s.param, s.grad, s.optimizer = 4 * padded, 4 * padded, 8 * owned + 4 * tensors
        return s
    if name == "scratch-fsdp":
        padded, owned, _ = _fsdp_local(shape, world, rank)
        s.param, s.grad, s.optimizer = 4 * owned, 4 * padded, 8 * owned + 4 * t
        if variant.zero_stage == 2:
            s.param, s.optimizer = b * padded * world, s.optimizer + 4 * owned
        return s
    if name != "deepspeed":
        raise ValueError(f"no memory model for strategy {name!r} (built in: {', '.join(BUILTIN)})")
    stage = variant.zero_stage
    if stage == 0:
        s.param, s.grad, s.optimizer = b * n, b * n, 12 * n + 4 * t
    elif stage in (1, 2):
        partition, outside = _ds12_partition(shape, world, rank)
        padded = partition * world
        s.param, s.grad, s.optimizer = b * padded, b * (partition + outside), 12 * partition + 4
        if variant.offload_optimizer != "none":
            # fp32 gradient partition on the host + two staging buffers of the largest parameter (host, device)
            largest = max(shape.numels, default=0)
            s.grad, s.optimizer = 4 * partition + 2 * b * largest, 12 * partition
            s.host_grad, s.host_optimizer = 4 * partition + b * largest, s.optimizer
    else:
        partition = _ds3_partition(shape, world)
        s.param, s.grad, s.optimizer = b * partition, b * partition, 12 * partition + 4
        if variant.offload_optimizer != "none":
            # fp32 gradient partition on the host beside the device's gradient partition; no step tensor
            s.grad, s.optimizer = (4 + b) * partition, 12 * partition
            s.host_grad, s.host_optimizer = 4 * partition, s.optimizer
        if variant.offload_param != "none":
            s.host_param = s.param
    return s


def preset_variant(preset: Preset) -> Variant:
    """The preset's own strategy as a :class:`Variant` (its options read by name)."""
    o = preset.strategy.options
    name = preset.strategy.name
    label = name
    if name == "deepspeed":
        label = f"zero{o.zero_stage}" + ("+offload" if o.offload_optimizer != "none" else "") + (
            "+param" if o.offload_param != "none" else "")
    elif name == "scratch-ddp" and getattr(o, "shard_optimizer", False):
        label = "scratch-ddp+zero1"
    elif name == "scratch-fsdp":
        label = f"scratch-zero{o.zero_stage}"
    return Variant(label, name, zero_stage=getattr(o, "zero_stage", 0),
                   offload_optimizer=getattr(o, "offload_optimizer", "none"),
                   offload_param=getattr(o, "offload_param", "none"),
                   shard_optimizer=bool(getattr(o, "shard_optimizer", False)))
