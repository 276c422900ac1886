"""How many bytes each rank holds for a preset, before running it: ``handle estimate``.

Two parts, each measured rather than guessed:

* **Model states** (parameters, gradients, optimizer state incl. fp32 master copies) follow the ZeRO accounting
  (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", table 1: 2+2+12
  bytes per parameter under mixed precision, divided by the world size for what a stage partitions), made exact
  for what each built-in strategy really allocates here. Every term was read off the ``memory`` telemetry of real
  2-rank runs (``tensor_bytes``: distinct storages; see :data:`MEASURED`) and is computed from the parameter
  list of the model built on the meta device -- its partitions, paddings and boundary-straddling parameters
  included -- so rank 0's figure matches the telemetry to the byte for the strategies measured.
* **Activations** for one micro-batch, measured by running the model's forward and backward on fake tensors
  (:mod:`torch_handle.plan.estimate_activations`).

With tensor parallelism (``[parallel] tp > 1``, dp = world_size / tp replicas of tp ranks each) both are those of
one TP rank: the model is split by its own plan on the meta device (:mod:`torch_handle.plan.estimate_model`: split
tensors count 1/tp, replicated ones whole), and the data-parallel strategy's formula applies to that shard over
the dp ranks of its data-parallel group (FSDP2 shards each local tensor again on dim 0; single and DDP keep it
whole). Nothing is allocated, so a 1B-parameter model estimates in seconds.

Not included, and said so in every output: allocator fragmentation and caching, communication buffers (DDP's
all-reduce, ZeRO's gather/reduce buckets, FSDP's all-gathered block, TP's collectives), temporaries of the backward
pass (gradients of activations in flight), the CUDA context and kernels' workspaces.

torch is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from torch_handle.plan.estimate_activations import ActivationBytes, activation_bytes, compute_mode, loss_impl_of
from torch_handle.plan.estimate_cp import cp_activation_bytes
from torch_handle.plan.estimate_layout import estimate_layout, with_layout
from torch_handle.plan.estimate_model import model_shape
from torch_handle.plan.estimate_moe import MoEShape, expert_param_bytes, moe_step, preset_moe, rank_state_bytes
from torch_handle.plan.estimate_reference import reference_bytes
from torch_handle.plan.model_states import (BUILTIN, COMPARE_VARIANTS, MEASURED, States, Variant, model_state_bytes,
                                            preset_variant, shards_parameters)

if TYPE_CHECKING:
    from torch_handle.config.schema import Preset
    from torch_handle.registry import PluginRegistry

__all__ = ["BUILTIN", "COMPARE_VARIANTS", "MEASURED", "Estimate", "States", "Variant", "estimate_preset",
           "model_state_bytes", "preset_variant", "smallest_fit", "supports_pipeline_parallel",
           "supports_tensor_parallel"]

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
    """Parameters of the whole model (count)."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation: ActivationBytes
    """In ``as_dict``: ``activation_bytes`` (the total) and its parts, ``activation_saved_bytes`` (what the memory
    telemetry reports), ``activation_logits_bytes``, ``activation_recompute_bytes``, and ``loss_impl`` (the loss
    path priced: the logits part is two fp32 logits-sized buffers for ``"full"``, one chunk for ``"chunked"``)."""
    device_bytes: int
    """Everything above that is not in host memory: what must fit on the accelerator."""
    host_bytes: int
    """Model states offloaded to host memory (CPU offload)."""
    fits: bool | None = None
    """``device_bytes <= device memory`` when one was given."""
    options: dict[str, Any] = field(default_factory=dict)
    tp: int = 1
    """Tensor-parallel degree: every figure above is one TP rank's; ``as_dict`` adds ``dp`` = world_size / tp."""
    tp_shard_params: int | None = None
    """Parameters of one TP rank's shard (split tensors at 1/tp, replicated ones whole) when tp > 1."""
    sequence_parallel: bool = False
    pp: int = 1
    """Pipeline degree: with pp > 1 each row is one pipeline rank's (:mod:`torch_handle.plan.estimate_layout`)."""
    pp_rank: int | None = None
    pp_stages: list[int] | None = None
    """The stages this pipeline rank runs."""
    pp_microbatches: int | None = None
    """m: micro-batches of a step through the pipeline."""
    pp_microbatch_saved_bytes: list[int] | None = None
    """Bytes one pipeline micro-batch saves for backward in each of ``pp_stages``."""
    pp_in_flight: list[int] | None = None
    """The most micro-batches alive at once in each of ``pp_stages`` under the schedule."""
    largest: bool | None = None
    """With pp > 1: whether this pipeline rank holds the most device bytes of its (strategy, world size)."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts split over ep of the dp ranks."""
    moe: MoEShape | None = None
    """The experts (None for a dense model); ``as_dict`` gives ``active_params``, ``expert_params``, ``n_experts``,
    ``top_k`` and ``moe_layers``, and then the three figures below."""
    expert_param_bytes: int | None = None
    """Routed-expert parameter bytes of this rank (part of ``param_bytes``): E / ep experts per MoE layer."""
    all_to_all_bytes: int | None = None
    """Bytes this rank sends by all-to-all in one step (0 with ep = 1): :mod:`torch_handle.plan.estimate_moe`."""
    token_buffer_bytes: int | None = None
    """The expert-sorted token rows of one micro-batch, every MoE layer (part of the activations)."""
    frozen_param_bytes: int | None = None
    """A fine-tuning preset's (``[finetune]`` LoRA or QLoRA) frozen base on this rank, part of ``param_bytes``;
    ``as_dict`` puts ``trainable_param_bytes`` and it after ``param_bytes``, as the memory telemetry names them.
    None (and absent from ``as_dict``) for a full training run."""
    nf4_bytes: int | None = None
    """A QLoRA preset's NF4 weights on this rank (codes, absmax codes, scales, means), part of
    ``frozen_param_bytes``; None otherwise."""
    nf4_layout: str | None = None
    """How ``nf4_bytes`` was priced: ``"whole"`` (every rank holds the whole NF4 base: what a run holds today),
    ``"stage"`` (a pipeline stage's own layers), ``"sharded"`` (fsdp, scratch-fsdp, ZeRO-3: each NF4 weight a
    frozen uint8 parameter cut on dim 0 like any other)."""
    finetune_runs: bool | None = None
    """Whether ``handle run`` runs the preset's ``[finetune]`` method under this row's strategy and layout today
    (QLoRA: every strategy, without tp); rows it refuses are priced as it would hold them."""
    finetune: dict[str, Any] | None = None
    """A fine-tuning preset's ``finetune_method``, ``trainable_params``, ``frozen_params`` (parameters; QLoRA's
    NF4 storage counted by neither, as the run's ``model_params`` leaves it out) and
    ``flops_per_token`` (training FLOPs, what the run's tflops and MFU count: :func:`~torch_handle.finetune.lora.
    lora_flops_per_token`); ``as_dict`` gives them as top-level keys. None for a full training run."""
    reference: str | None = None
    """A DPO preset's reference (``none``, ``adapters_off``, ``copy`` or ``precomputed``:
    :mod:`~torch_handle.plan.estimate_reference`); None (and absent from ``as_dict``) for another objective."""
    reference_bytes: int | None = None
    """What that reference holds on this rank, part of ``device_bytes``: a copy's parameters (sharded like the
    policy's, no gradients or optimizer state), the precomputed table, or 0."""
    cp: int = 1
    """Context-parallel degree: the activations are one cp rank's (T/cp tokens of each sequence); absent from
    ``as_dict`` with cp = 1 (:mod:`torch_handle.plan.estimate_cp`)."""
    cp_impl: str | None = None
    cp_buffer_bytes: int | None = None
    """The context-parallel attention's transient buffers of one layer (part of ``device_bytes``)."""

    @property
    def trainable_param_bytes(self) -> int | None:
        return None if self.frozen_param_bytes is None else self.param_bytes - self.frozen_param_bytes

    @property
    def activation_bytes(self) -> int:
        return self.activation.total

    @property
    def dp(self) -> int:
        """Data-parallel degree: model replicas, world_size / (tp x pp x cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ActivationBytes):
                out.update(value.as_fields())
                out["loss_impl"] = value.loss_impl
            elif f.name == "moe":
                if value is not None:
                    out.update({k: v for k, v in value.as_dict().items() if k not in ("d_model", "params")})
            elif (self.moe is None and f.name in _MOE_FIELDS) or f.name == "frozen_param_bytes" or (
                    f.name in _FINETUNE_FIELDS and value is None) or (self.cp == 1 and f.name.startswith("cp")):
                continue
            elif f.name == "finetune":
                out.update(value or {})
            elif not ((f.name.startswith("pp_") or f.name == "largest") and self.pp == 1):
                out[f.name] = dict(value) if isinstance(value, dict) else value
            if f.name == "world_size":
                out["dp"] = self.dp
            if f.name == "param_bytes" and self.frozen_param_bytes is not None:
                out["trainable_param_bytes"] = self.trainable_param_bytes
                out["frozen_param_bytes"] = self.frozen_param_bytes
        return out


_MOE_FIELDS = ("ep", "expert_param_bytes", "all_to_all_bytes", "token_buffer_bytes")
_FINETUNE_FIELDS = ("nf4_bytes", "nf4_layout", "finetune_runs", "reference", "reference_bytes")


def supports_tensor_parallel(registry: PluginRegistry, strategy: str) -> bool:
    """Whether the strategy plugin declares that it runs with ``[parallel] tp > 1`` (its options class has
    ``tensor_parallel = True``, what the preset loader checks)."""
    registration = registry.registrations["strategy"].get(strategy)
    return registration is not None and bool(getattr(registration.config_cls, "tensor_parallel", False))


def estimate_preset(preset: Preset, registry: PluginRegistry, world_sizes: Sequence[int],
                    variants: Sequence[Variant] | None = None, device_memory: int | None = None,
                    rank: int | None = None) -> list[Estimate]:
    """Estimates for every variant (default: the preset's strategy) at every world size, ordered by variant then
    world size, for the preset's ``[parallel]`` layout: with tp > 1, world sizes that tp does not divide are
    left out, and each row is one TP rank's, its strategy's formula applied to the TP shard over dp = world_size /
    tp ranks. ``single`` is estimated where dp = 1 only (world size 1, or tp). With experts and ``[parallel] ep``,
    world sizes whose dp ep does not divide are left out, and each rank holds E / ep experts of each MoE layer
    (:func:`~torch_handle.plan.estimate_moe.rank_state_bytes`). A ``[finetune]`` preset (LoRA, QLoRA) is sized as
    its run builds the model: gradients and optimizer state for the adapters alone, the frozen base at its storage
    bytes under the strategy's sharding (``frozen_param_bytes``: :func:`~torch_handle.plan.model_states.
    frozen_param_bytes`), QLoRA's NF4 weights apart (``nf4_bytes``: cut on dim 0 under the strategies that shard
    parameters, whole under the others, ``nf4_layout`` says which). Layouts the run refuses (QLoRA with tp) are
    priced as the model would be held, with ``finetune_runs`` False.

    ``rank``: the (global) rank to report (default: the one with the largest device total; ranks differ by a
    partition boundary at most; the TP ranks of a replica hold the same).

    Raises:
        ValueError: a strategy that is not built in (no measured memory model), one that does not run with tp > 1
            when tp > 1, an empty ``world_sizes``, ep not dividing n_experts.
        PresetError: a dataset without ``vocab_size``/``seq_len`` options.
    """
    if not world_sizes:
        raise ValueError("no world sizes to estimate")
    variants = list(variants) if variants else [preset_variant(preset)]
    tp = preset.parallel.tp
    for v in variants:
        if v.strategy not in BUILTIN:
            raise ValueError(f"strategy {v.strategy!r} has no memory model (built in: {', '.join(BUILTIN)})")
        if tp > 1 and not supports_tensor_parallel(registry, v.strategy):
            raise ValueError(f"strategy {v.strategy!r} does not run with parallel.tp = {tp}")
    if preset.parallel.pp > 1:
        return _pipeline_rows(preset, registry, world_sizes, variants, device_memory)
    whole = model_shape(preset, registry, tp=1)
    shape = model_shape(preset, registry) if tp > 1 else whole
    precision = preset.training.precision
    ep, moe, cp = preset.parallel.ep, preset_moe(preset, registry), preset.parallel.cp
    extra = moe_step(moe, preset) if moe is not None else {}
    finetune = _finetune_info(preset, registry, whole)
    acts: dict[tuple[str, str], tuple[ActivationBytes, int, str | None]] = {}
    rows = []
    for v in variants:
        mode = compute_mode(v.strategy, precision)
        loss_impl = loss_impl_of(preset, registry, v.strategy, v.zero_stage)
        if (mode, loss_impl) not in acts:
            acts[mode, loss_impl] = (cp_activation_bytes(preset, registry, v.strategy, loss_impl) if cp > 1 else
                                     (activation_bytes(preset, registry, v.strategy, loss_impl), 0, None))
        act, cp_buffers, cp_impl = acts[mode, loss_impl]
        for world in world_sizes:
            dp = world // tp  # the ranks the strategy holds the model over: dp x cp
            if world % (tp * cp) or (v.strategy == "single" and dp != 1) or dp % ep:
                continue
            ranks = [rank] if rank is not None else range(0, world, tp)
            best: tuple[int, int, States] | None = None
            for r in ranks:
                s = rank_state_bytes(shape, v, precision, dp, r // tp, ep)
                device = s.param + s.grad + s.optimizer - s.host + act.total + cp_buffers
                if best is None or device > best[0]:
                    best = (device, r, s)
                if v.strategy in ("single", "ddp") or (v.strategy == "scratch-ddp" and not v.shard_optimizer):
                    break  # every rank holds the same
            device, r, s = best
            reference, held = reference_bytes(preset, s.param)  # DPO: a copy's parameters, or the table
            device += held or 0
            params = whole.n_params + sum(whole.frozen_numels)
            rows.append(Estimate(v.label, world, r, precision, params, s.param, s.grad, s.optimizer, act,
                                 device, s.host, None if device_memory is None else device <= device_memory,
                                 {k: val for k, val in asdict(v).items() if k not in ("label",)}, tp,
                                 shape.n_params if tp > 1 else None, preset.parallel.sequence_parallel))
            rows[-1].reference, rows[-1].reference_bytes = reference, held
            if cp > 1:
                rows[-1].cp, rows[-1].cp_impl, rows[-1].cp_buffer_bytes = cp, cp_impl, cp_buffers
            if finetune is not None:
                _set_finetune(rows[-1], preset, v, s, finetune)
            if moe is not None:
                rows[-1].ep, rows[-1].moe = ep, moe
                rows[-1].expert_param_bytes = expert_param_bytes(shape, v, precision, dp, r // tp, ep)
                rows[-1].all_to_all_bytes, rows[-1].token_buffer_bytes = extra["all_to_all_bytes"], extra[
                    "token_buffer_bytes"]
    return rows


def _finetune_info(preset: Preset, registry: PluginRegistry, whole: Any) -> dict[str, Any] | None:
    """:attr:`Estimate.finetune` of the preset (``whole``: the shape of its untouched-by-tp model), or None."""
    if preset.finetune.method == "none":
        return None
    from torch_handle.plan.planner import model_flops_per_token

    try:
        flops: float | None = model_flops_per_token(preset, registry)
    except ValueError:  # a model without flops_per_token
        flops = None
    return {"finetune_method": preset.finetune.method, "trainable_params": whole.n_params,
            "frozen_params": sum(whole.frozen_numels), "flops_per_token": flops}


def _finetune_runs_under(preset: Preset, variant: Variant) -> bool:
    """Whether the preset's ``[finetune]`` method runs under the variant's strategy and the preset's tp and pp
    (config/layout.py's rule: QLoRA under every strategy, without tp; LoRA everywhere)."""
    return preset.finetune.method != "qlora" or preset.parallel.tp == 1


def _set_finetune(row: Estimate, preset: Preset, variant: Variant, s: States, finetune: dict[str, Any]) -> None:
    """The fine-tuning fields of ``row`` from its model states ``s``."""
    row.frozen_param_bytes, row.finetune = s.frozen_param, finetune
    row.finetune_runs = _finetune_runs_under(preset, variant)
    if preset.finetune.method == "qlora":
        row.nf4_bytes = s.nf4
        row.nf4_layout = "stage" if preset.parallel.pp > 1 else "sharded" if shards_parameters(variant) else "whole"


def supports_pipeline_parallel(registry: PluginRegistry, strategy: str) -> bool:
    """Whether the strategy plugin runs with ``[parallel] pp > 1`` (``pipeline_parallel = True`` on its options
    class, what the preset loader checks)."""
    registration = registry.registrations["strategy"].get(strategy)
    return registration is not None and bool(getattr(registration.config_cls, "pipeline_parallel", False))


def _pipeline_rows(preset: Preset, registry: PluginRegistry, world_sizes: Sequence[int], variants: list[Variant],
                   device_memory: int | None) -> list[Estimate]:
    """One row per pipeline rank (its stages' model states, split by tp when tp > 1, and activations in flight;
    :func:`~torch_handle.plan.estimate_layout.estimate_layout`; with cp > 1 a stage's at T/cp tokens plus one
    layer's cp buffers) per variant and world size that tp x pp x cp divides (``single``: dp = 1 only).
    ``largest`` marks the rank with the most device bytes of each (variant, world)."""
    par = preset.parallel
    split = par.tp * par.pp * par.cp
    for v in variants:
        if not supports_pipeline_parallel(registry, v.strategy):
            raise ValueError(f"strategy {v.strategy!r} does not run with parallel.pp = {par.pp}")
    finetune = _finetune_info(preset, registry, model_shape(preset, registry, tp=1))
    rows = []
    for v in variants:
        for world in world_sizes:
            if world % split or (v.strategy == "single" and world != split):
                continue
            est = estimate_layout(with_layout(preset, nproc_per_node=world, nnodes=1), registry, variant=v)
            largest = est.largest
            for r in est.ranks:
                if r.tp_rank:
                    continue  # the TP ranks of a stage hold the same
                act = ActivationBytes(r.activation_saved_bytes, r.activation_logits_bytes,
                                      r.activation_recompute_bytes)
                rows.append(Estimate(
                    v.label, world, r.rank, est.precision, est.params, r.params_bytes, r.grads_bytes,
                    r.optimizer_bytes, act, r.total_bytes, r.host_bytes,
                    None if device_memory is None else r.total_bytes <= device_memory,
                    {k: val for k, val in asdict(v).items() if k not in ("label",)}, par.tp,
                    est.tp_shard_params if par.tp > 1 else None, par.sequence_parallel, par.pp, r.pp_rank,
                    list(r.stages), est.microbatches, list(r.microbatch_saved_bytes), list(r.in_flight),
                    r.pp_rank == largest.pp_rank))
                if est.cp > 1:
                    rows[-1].cp, rows[-1].cp_impl, rows[-1].cp_buffer_bytes = est.cp, est.cp_impl, est.cp_buffer_bytes
                if finetune is not None:
                    _set_finetune(rows[-1], preset, v, States(frozen_param=r.frozen_params_bytes, nf4=r.nf4_bytes),
                                  finetune)
    return rows


def smallest_fit(rows: Sequence[Estimate]) -> dict[str, int | None]:
    """Per strategy label: the smallest world size whose device bytes fit on every rank listed (None: none of
    those estimated)."""
    fits: dict[tuple[str, int], bool] = {}
    for row in rows:
        fits[row.strategy, row.world_size] = fits.get((row.strategy, row.world_size), True) and bool(row.fits)
    out: dict[str, int | None] = {}
    for (label, world), ok in fits.items():
        out.setdefault(label, None)
        if ok and (out[label] is None or world < out[label]):
            out[label] = world
    return out
