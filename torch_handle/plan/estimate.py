"""How many bytes each rank holds for a preset, before running it: ``handle estimate``.

Two parts, each measured rather than guessed:

* **Model states** (parameters, gradients, optimizer state incl. fp32 master copies) follow the ZeRO accounting
  (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", table 1: 2+2+12
  bytes per parameter under mixed precision, divided by the world size for what a stage partitions), made exact
  for what each built-in strategy really allocates here. Every term was read off the ``memory`` telemetry of real
  2-rank runs (``tensor_bytes``: distinct storages; see :data:`MEASURED`) and is computed from the parameter
  list of the model built on the meta device -- its partitions, paddings and boundary-straddling parameters
  included -- so rank 0's figure matches the telemetry to the byte for the strategies measured.
* **Activations** for one micro-batch: one forward and backward of the real model on fake tensors
  (``torch._subclasses.fake_tensor.FakeTensorMode``: shapes and dtypes only, no memory), counting the distinct
  storages autograd saves for backward (:class:`~torch_handle.observe.activations.SavedTensorCounter`) at the
  preset's precision, sequence length, micro-batch size and activation checkpointing (``activation_saved_bytes``);
  plus the fp32 logits buffer (``activation_logits_bytes``), and with checkpointing the largest block's
  activations recomputed during backward (``activation_recompute_bytes``); ``activation_bytes`` is their total.
  The same counter on real tensors is :func:`saved_activation_bytes`, what the memory telemetry reports as
  ``activation_saved_bytes``. Like torchtitan's memory estimator (which runs the train step under
  ``FakeTensorMode`` and tracks allocations), nothing is allocated, so a 1B-parameter model estimates in seconds.

Not included, and said so in every output: allocator fragmentation and caching, communication buffers (DDP's
all-reduce, ZeRO's gather/reduce buckets, FSDP's all-gathered block), temporaries of the backward pass
(gradients of activations in flight), the CUDA context and kernels' workspaces.

torch is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from torch_handle.common.precision import torch_dtype
from torch_handle.observe.activations import SavedTensorCounter
from torch_handle.observe.fields import (ACTIVATION_BYTES, ACTIVATION_LOGITS_BYTES, ACTIVATION_RECOMPUTE_BYTES,
                                         ACTIVATION_SAVED_BYTES)

if TYPE_CHECKING:
    import torch

    from torch_handle.registry import PluginRegistry
    from torch_handle.config.schema import Preset

__all__ = ["COMPARE_VARIANTS", "MEASURED", "ActivationBytes", "Estimate", "ModelShape", "Variant", "activation_bytes",
           "estimate_preset", "model_shape", "model_state_bytes", "preset_variant",
           "saved_activation_bytes", "smallest_fit"]

# ---------------------------------------------------------------------------------------------------------------
# What is estimated
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One strategy configuration: the ``[strategy]`` options that change what a rank holds."""

    label: str
    """Short name in tables, e.g. ``"zero3+offload"``."""
    strategy: str
    """The registered strategy name: single, ddp, deepspeed, fsdp, scratch-ddp."""
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
)
"""Every built-in strategy, as ``handle estimate --compare`` lists them (offload = to the CPU)."""

BUILTIN = ("single", "ddp", "deepspeed", "fsdp", "scratch-ddp")

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
# The model, on the meta device
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The trainable parameters of a model, each tensor once (tied weights once), in registration order."""

    numels: tuple[int, ...]
    """Elements of each parameter tensor."""
    dim0: tuple[int, ...]
    """Size of each tensor's first dimension (FSDP2 shards on it); 1 for a scalar."""

    @property
    def n_params(self) -> int:
        return sum(self.numels)

    @property
    def n_tensors(self) -> int:
        return len(self.numels)

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        params = [p for p in model.parameters() if p.requires_grad]
        return cls(tuple(p.numel() for p in params), tuple(p.shape[0] if p.dim() else 1 for p in params))


@dataclass(frozen=True)
class _Build:
    factory: Callable[..., Any]
    options: Any
    vocab_size: int
    pad_id: int
    max_len: int
    kind: str  # "lm" or "translation": the model's forward arguments


def _model_build(preset: Preset, registry: PluginRegistry) -> _Build:
    from torch_handle.data.datasets import PAD_ID
    from torch_handle.errors import PresetError

    data = preset.data.options
    vocab, seq_len = getattr(data, "vocab_size", None), getattr(data, "seq_len", None)
    if not isinstance(vocab, int) or not isinstance(seq_len, int):
        raise PresetError(f"dataset {preset.data.name!r} has no vocab_size/seq_len options: cannot size the model",
                          file=preset.source, key="data")
    task = getattr(data, "task", "lm")
    factory = registry.get("model", preset.model.name).factory
    return _Build(factory, preset.model.options, vocab, PAD_ID, seq_len + 1 if task == "translation" else seq_len,
                  task)


def model_shape(preset: Preset, registry: PluginRegistry) -> ModelShape:
    """The preset's model built on the meta device (no memory, no initialisation cost): its parameter list.

    The vocabulary is ``[data] vocab_size`` (the tokenizer's actual vocabulary can only be smaller).
    """
    import torch

    b = _model_build(preset, registry)
    with torch.device("meta"):
        model = b.factory(b.options, b.vocab_size, b.pad_id, b.max_len)
    return ModelShape.of(model)


# ---------------------------------------------------------------------------------------------------------------
# Model states: the per-strategy formulas
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class States:
    """Bytes of model states one rank holds; ``host_*`` is the part of each that lives in host memory."""

    param: int = 0
    grad: int = 0
    optimizer: int = 0
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


# ---------------------------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------------------------




def saved_activation_bytes(run_forward_backward: Callable[[], Any], model: torch.nn.Module | None = None) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``run_forward_backward()`` (one
    micro-batch's forward, loss and backward), on real tensors: the telemetry's ``activation_saved_bytes``.

    ``model``: its parameters and buffers are left out (model state), and with activation checkpointing
    (``model.args.activation_checkpointing``) its ``blocks()``' inputs count in place of what the checkpointed
    blocks would have saved. The function adds nothing to the memory held: tensors are saved unchanged.

    This is the ``saved`` part of :class:`ActivationBytes` (the estimate adds the fp32 logits buffer and the
    recomputed block). ``model`` may be wrapped (DDP, a DeepSpeed engine: its ``.module`` is used). Under ZeRO-3
    and FSDP2 the parameters gathered for a block are other storages than the shards, so weights that autograd
    saves (e.g. for a matmul's backward) count here too, at their gathered size, although the strategy may free
    or reshard them between forward and backward.
    """
    from torch_handle.model.parallelize import checkpointed_blocks

    exclude = [*model.parameters(), *model.buffers()] if model is not None else []
    with SavedTensorCounter(exclude, checkpointed_blocks(model) if model is not None else []) as counter:
        run_forward_backward()
    return counter.bytes


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes of one micro-batch on one rank."""

    saved: int
    """Distinct storages autograd saves in forward (inputs of checkpointed blocks included): held until backward
    frees them."""
    logits: int
    """One fp32 (B, T, V) buffer: the logits in forward, their gradient in backward, beside the saved
    log-probabilities."""
    recompute: int
    """With activation checkpointing: the largest block's saved tensors, rebuilt in backward; else 0."""

    @property
    def total(self) -> int:
        return self.saved + self.logits + self.recompute

    def as_fields(self) -> dict[str, int]:
        """The parts and their total under the names the memory telemetry uses
        (:mod:`torch_handle.observe.fields`): ``activation_bytes`` is the total, ``activation_saved_bytes`` what
        the trainer measures."""
        return {ACTIVATION_BYTES: self.total, ACTIVATION_SAVED_BYTES: self.saved,
                ACTIVATION_LOGITS_BYTES: self.logits, ACTIVATION_RECOMPUTE_BYTES: self.recompute}


def _compute_mode(strategy: str, precision: str) -> str:
    """How the strategy computes: ``fp32``; ``autocast`` (single, ddp, scratch-ddp: fp32 weights, bf16/fp16
    autocast); ``cast`` (deepspeed and fsdp: the weights themselves are bf16/fp16 during compute)."""
    if precision == "fp32":
        return "fp32"
    return "autocast" if strategy in ("single", "ddp", "scratch-ddp") else "cast"


def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` for floating parameters and buffers, tied weights kept tied; works on fake tensors
    (where ``Module.to`` refuses to swap them)."""
    import torch

    cast: dict[int, Any] = {}
    for module in model.modules():
        for table, make in ((module._parameters, torch.nn.Parameter), (module._buffers, lambda t: t)):
            for name, t in table.items():
                if t is not None and t.is_floating_point():
                    if id(t) not in cast:
                        cast[id(t)] = make(t.detach().to(dtype))
                    table[name] = cast[id(t)]


def _fake_activations(build: _Build, batch: int, seq_len: int, precision: str, mode: str, checkpointing: bool
                      ) -> ActivationBytes:
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch_handle.model.parallelize import checkpointed_blocks, model_blocks, set_activation_checkpointing

    dtype = torch_dtype(precision)
    with FakeTensorMode(allow_non_fake_inputs=False):
        model = build.factory(build.options, build.vocab_size, build.pad_id, build.max_len)
        model.train()
        if mode == "cast":
            _cast_parameters(model, dtype)
        ids = torch.randint(4, build.vocab_size, (batch, seq_len))
        inputs = {"input_ids": ids} if build.kind == "lm" else {"src_ids": ids, "tgt_ids": ids.clone()}
        labels = torch.randint(4, build.vocab_size, (batch, seq_len))
        autocast = torch.autocast("cpu", dtype=dtype) if mode == "autocast" else contextlib.nullcontext()
        exclude = [*model.parameters(), *model.buffers()]
        per_block: list[int] = []

        def step(counter: SavedTensorCounter, blocks: list[Any]) -> None:
            before: list[int] = []
            handles = [b.register_forward_pre_hook(lambda *_: before.append(counter.bytes)) for b in blocks]
            handles += [b.register_forward_hook(lambda *_: per_block.append(counter.bytes - before.pop()))
                        for b in blocks]
            try:
                with counter:
                    with autocast:
                        logits = model(**inputs)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
                    loss.backward()
            finally:
                for h in handles:
                    h.remove()

        counter = SavedTensorCounter(exclude, checkpointed_blocks(model))
        step(counter, [])
        recompute = 0
        if checkpointing:  # what one block saves, measured on the same model without checkpointing
            set_activation_checkpointing(model, False)
            step(SavedTensorCounter(exclude), model_blocks(model))
            recompute = max(per_block, default=0)
        return ActivationBytes(counter.bytes, batch * seq_len * build.vocab_size * 4, recompute)


def activation_bytes(preset: Preset, registry: PluginRegistry, strategy: str | None = None) -> ActivationBytes:
    """Activation bytes of one micro-batch (``training.micro_batch_size`` x ``data.seq_len``) of ``preset``'s
    model under ``strategy``'s way of computing (default: the preset's), measured on fake tensors.

    Encoder-decoder models take source and target of ``seq_len`` tokens each (an upper bound: batches are
    padded to their longest sentence).
    """
    build = _model_build(preset, registry)
    mode = _compute_mode(strategy or preset.strategy.name, preset.training.precision)
    seq = preset.data.options.seq_len
    return _fake_activations(build, preset.training.micro_batch_size, seq, preset.training.precision, mode,
                             bool(getattr(preset.model.options, "activation_checkpointing", False)))


# ---------------------------------------------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Estimate:
    """One (strategy variant, world size) row: bytes of the rank that holds the most (the one that must fit)."""

    strategy: str
    """The variant's label (e.g. ``zero3+offload``)."""
    world_size: int
    rank: int
    precision: str
    params: int
    """Parameters of the model (count)."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation: ActivationBytes
    """In ``as_dict``: ``activation_bytes`` (the total) and its parts, ``activation_saved_bytes`` (what the memory
    telemetry reports), ``activation_logits_bytes``, ``activation_recompute_bytes``."""
    device_bytes: int
    """Everything above that is not in host memory: what must fit on the accelerator."""
    host_bytes: int
    """Model states offloaded to host memory (CPU offload)."""
    fits: bool | None = None
    """``device_bytes <= device memory`` when one was given."""
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def activation_bytes(self) -> int:
        return self.activation.total

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ActivationBytes):
                out.update(value.as_fields())
            else:
                out[f.name] = dict(value) if isinstance(value, dict) else value
        return out


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
    return Variant(label, name, zero_stage=getattr(o, "zero_stage", 0),
                   offload_optimizer=getattr(o, "offload_optimizer", "none"),
                   offload_param=getattr(o, "offload_param", "none"),
                   shard_optimizer=bool(getattr(o, "shard_optimizer", False)))


def estimate_preset(preset: Preset, registry: PluginRegistry, world_sizes: Sequence[int],
                    variants: Sequence[Variant] | None = None, device_memory: int | None = None,
                    rank: int | None = None) -> list[Estimate]:
    """Estimates for every variant (default: the preset's strategy) at every world size, ordered by variant then
    world size. ``single`` is estimated at world size 1 only.

    ``rank``: the rank to report (default: the one with the largest device total; ranks differ by a partition
    boundary at most).

    Raises:
        ValueError: a strategy that is not built in (no measured memory model), or an empty ``world_sizes``.
        PresetError: a dataset without ``vocab_size``/``seq_len`` options.
    """
    if not world_sizes:
        raise ValueError("no world sizes to estimate")
    variants = list(variants) if variants else [preset_variant(preset)]
    for v in variants:
        if v.strategy not in BUILTIN:
            raise ValueError(f"strategy {v.strategy!r} has no memory model (built in: {', '.join(BUILTIN)})")
    shape = model_shape(preset, registry)
    precision = preset.training.precision
    acts: dict[str, ActivationBytes] = {}
    rows = []
    for v in variants:
        mode = _compute_mode(v.strategy, precision)
        if mode not in acts:
            acts[mode] = activation_bytes(preset, registry, v.strategy)
        act = acts[mode]
        for world in world_sizes:
            if v.strategy == "single" and world != 1:
                continue
            ranks = [rank] if rank is not None else range(world)
            best: tuple[int, int, States] | None = None
            for r in ranks:
                s = model_state_bytes(shape, v, precision, world, r)
                device = s.param + s.grad + s.optimizer - s.host + act.total
                if best is None or device > best[0]:
                    best = (device, r, s)
                if v.strategy in ("single", "ddp") or (v.strategy == "scratch-ddp" and not v.shard_optimizer):
                    break  # every rank holds the same
            device, r, s = best
            rows.append(Estimate(v.label, world, r, precision, shape.n_params, s.param, s.grad, s.optimizer, act,
                                 device, s.host, None if device_memory is None else device <= device_memory,
                                 {k: val for k, val in asdict(v).items() if k not in ("label",)}))
    return rows


def smallest_fit(rows: Sequence[Estimate]) -> dict[str, int | None]:
    """Per strategy label: the smallest world size whose device bytes fit (None: none of those estimated)."""
    out: dict[str, int | None] = {}
    for row in rows:
        out.setdefault(row.strategy, None)
        if row.fits and (out[row.strategy] is None or row.world_size < out[row.strategy]):
            out[row.strategy] = row.world_size
    return out
