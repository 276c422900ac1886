"""What every rank of a dp x tp x pp layout holds: ``handle estimate`` for any layout with a pipeline, and the
memory model a layout planner ranks layouts with (issue 21).

Ranks are laid out as :class:`torch_handle.common.parallel_dims.ParallelDims` says (rank = (pp_rank · dp + dp_rank) · tp +
tp_rank). A rank holds the layers of its pipeline stages (:func:`torch_handle.model.pipeline.split_layers`: the
embedding on the first stage, the final norm and the head on the last, a tied embedding on both), each split by
the model's tensor-parallel plan (:mod:`torch_handle.plan.estimate_model`: column- and row-parallel weights and
the vocabulary-split embedding and head at 1/tp, LayerNorms and row-parallel biases whole), and of that the share
its ``[strategy]`` keeps over the dp ranks of its stage (:func:`torch_handle.plan.model_states.model_state_bytes`:
single/ddp/scratch-ddp replicate, scratch-ddp ``shard_optimizer`` shards the optimizer state, fsdp/scratch-fsdp
shard parameters, gradients and optimizer state; torchtitan applies FSDP per pipeline stage the same way).

Activations: the bytes one micro-batch saves in each stage (its parts' share of one forward of the tp-split model
on fake tensors, :class:`~torch_handle.plan.estimate_activations.PartSaved`: the embedding, each layer, the head,
the loss) times the micro-batches the schedule keeps in flight (:func:`torch_handle.plan.estimate_pipeline.
in_flight_peak`), plus the loss path's fp32 logits buffers on the last stage and, with checkpointing, one
recomputed block. What is split by tp is measured on the split model: without sequence parallelism a TP region's
input is full size on every TP rank, only the split layers' own tensors are 1/tp. With context parallelism (cp > 1; in a pipeline, each stage) a
rank's activations are those of ``seq_len / cp`` tokens plus one layer's CP buffers
(:mod:`~torch_handle.plan.estimate_cp`), and its model states the strategy's over the dp x cp ranks.

The model is measured (on the meta device and on fake tensors: nothing is allocated) once per model and tp, at
2 and 4 samples per micro-batch and on 3 of its layers, and cached; each layout is arithmetic on those numbers,
equal to measuring it whole to the byte (``tests/test_estimate_layout.py``), so a planner can ask for hundreds.

torch is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from torch_handle.config.layout import microbatch_problem, pipeline_microbatches
from torch_handle.plan.estimate_activations import ActivationBytes, PartSaved, compute_mode, fake_activations
from torch_handle.plan.estimate_model import ModelBuild, ModelShape, model_build, rows_per_sample
from torch_handle.plan.estimate_moe import rank_state_bytes
from torch_handle.plan.model_states import BUILTIN, States, Variant, preset_variant

if TYPE_CHECKING:
    from torch_handle.config.schema import Preset
    from torch_handle.registry import PluginRegistry

__all__ = ["LayoutEstimate", "RankMemory", "estimate_layout", "with_layout"]


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at its peak. ``params_bytes``, ``grads_bytes`` and ``optimizer_bytes`` are what the
    ``memory`` telemetry reports (offloaded parts included: ``host_bytes`` says how much of them is in host
    memory); ``activations_bytes`` is the peak of the micro-batches in flight plus the logits buffer and the
    recomputed block."""

    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    stages: tuple[int, ...]
    """Pipeline stages this rank runs (``(0,)`` without a pipeline)."""
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    host_bytes: int = 0
    params: int = 0
    """Parameters (count) of this rank's stages and TP shard, before dp sharding."""
    microbatch_saved_bytes: tuple[int, ...] = ()
    """Bytes one micro-batch saves for backward in each of ``stages`` (the telemetry's
    ``activation_saved_bytes`` is the first's)."""
    in_flight: tuple[int, ...] = ()
    """The most micro-batches alive at once in each of ``stages`` under the schedule."""
    activation_saved_bytes: int = 0
    """The most saved bytes alive at once (a pipeline's ``activation_peak_bytes``)."""
    activation_logits_bytes: int = 0
    activation_recompute_bytes: int = 0
    activation_loss_bytes: int = 0
    """On the last stage: what the loss saves for backward per micro-batch (the fp32 log-probabilities), part of
    ``microbatch_saved_bytes``; a pipeline's telemetry counts the stage's forward without it."""
    activation_gathered_bytes: int = 0
    """Under fsdp and ZeRO-3: the parameters of this rank's stages that autograd saves (a linear's weight), which
    the strategy gathers to full size (its TP shard) for the forward. A micro-batch's saved tensors reference
    them, so the memory telemetry's ``activation_saved_bytes`` counts them; the strategy frees them after the
    forward and gathers them again for the backward, so ``activations_bytes`` leaves them out (0 for strategies
    that keep whole parameters: there they are model state)."""
    frozen_params_bytes: int = 0
    """A fine-tuning run's frozen base on this rank (QLoRA's NF4 weights included), part of ``params_bytes``."""
    nf4_bytes: int = 0
    """QLoRA's NF4 weights of this rank's stages, part of ``frozen_params_bytes``."""

    @property
    def total_bytes(self) -> int:
        """What must fit on the device: every part above but what is offloaded to the host."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes - self.host_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "stages": list(self.stages),
                "microbatch_saved_bytes": list(self.microbatch_saved_bytes), "in_flight": list(self.in_flight),
                "total_bytes": self.total_bytes}


@dataclass(frozen=True)
class LayoutEstimate:
    """A layout's memory, per rank. ``ranks`` has one row per (pp_rank, tp_rank), for the dp rank that holds the
    most (dp ranks differ only by partition boundaries: FSDP's row chunks, a sharded optimizer's partition; TP
    ranks hold the same by construction: a vocabulary tp does not divide is estimated rounded up), every rank with
    ``estimate_layout(..., every_rank=True)``."""

    world_size: int
    dp: int
    tp: int
    pp: int
    schedule: str | None
    """``parallel.pp_schedule`` with a pipeline, else None."""
    microbatches: int
    """m: pipeline micro-batches per step (1 without a pipeline: micro-batches run one after the other)."""
    activation_checkpointing: bool
    strategy: str
    """The strategy variant's label (``fsdp``, ``scratch-ddp+zero1``, ...)."""
    ranks: list[RankMemory]
    precision: str = "fp32"
    params: int = 0
    """Parameters of the whole model (count)."""
    stages_per_rank: int = 1
    microbatch_size: int = 0
    """Samples of one micro-batch through the model: micro_batch_size, or micro_batch_size · grad_accum / m with a
    pipeline."""
    sequence_parallel: bool = False
    tp_shard_params: int = 0
    """Parameters of one TP rank's shard of the whole model (= ``params`` when tp = 1)."""
    ep: int = 1
    """Expert-parallel degree (each MoE layer's experts split over ep of the dp ranks)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks, the model states sharded over dp x cp."""
    cp_impl: str | None = None
    cp_buffer_bytes: int = 0
    """One layer's transient context-parallel buffers (:func:`~torch_handle.plan.estimate_cp.cp_buffer_bytes`),
    part of every rank's ``activations_bytes``."""

    @property
    def largest(self) -> RankMemory:
        """The rank with the most device bytes (the lowest rank among equals)."""
        return max(self.ranks, key=lambda r: (r.total_bytes, -r.rank))

    def label(self) -> str:
        """``dp 2 x tp 2 x pp 2``."""
        return f"dp {self.dp} x tp {self.tp} x pp {self.pp}"

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "ranks"}
        return {**out, "largest_rank": self.largest.rank, "largest_bytes": self.largest.total_bytes,
                "ranks": [r.as_dict() for r in self.ranks]}


def with_layout(preset: Preset, *, nproc_per_node: int | None = None, nnodes: int | None = None,
                **parallel: Any) -> Preset:
    """A copy of ``preset`` with another world size and ``[parallel]`` fields (``tp=2, pp=2, pp_schedule=...``),
    unchecked: what a planner estimates. Raises TypeError for a field ``[parallel]`` does not have."""
    launch = dataclasses.replace(preset.launch, **{k: v for k, v in (("nproc_per_node", nproc_per_node),
                                                                     ("nnodes", nnodes)) if v is not None})
    return dataclasses.replace(preset, launch=launch, parallel=dataclasses.replace(preset.parallel, **parallel))


# ---------------------------------------------------------------------------------------------------------------
# Per model: the parameters and activations of each part, cached
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Params:
    """One TP rank's parameters by part: part 0 the embedding, 1 .. L the layers, L + 1 the final norm and head
    (a tied head: the embedding's matrix again). Each entry is ``(numel, dim0)`` in registration order."""

    parts: tuple[tuple[tuple[int, int], ...], ...]
    whole: ModelShape
    """The whole split model (tied weights once): what pp = 1 holds."""
    tied: frozenset[int] = frozenset()
    """Positions in the head part of the embedding's tied matrix."""
    split_counts: tuple[int, int, int] = (0, 0, 0)
    """(one layer's, the embedding's, the head's parameters; the head 0 when tied): what ``pp_split = "params"``
    balances, as :func:`torch_handle.plan.estimate_pipeline._ranges` counts them."""
    experts: tuple[tuple[bool, ...], ...] = ()
    """Beside ``parts``: whether each entry holds routed experts (empty for a model without experts)."""
    frozen: tuple[tuple[tuple[int, int], ...], ...] = ()
    """A fine-tuning model's frozen parameters by part, as ``parts`` (empty without ``[finetune]``)."""
    frozen_tied: frozenset[int] = frozenset()
    """Positions in the head part of ``frozen`` of the embedding's tied (frozen) matrix."""
    nf4: tuple[tuple[tuple[int, int, int], ...], ...] = ()
    """QLoRA's NF4 weights by part: ``(numel, dim0, stored bytes)`` each (empty without QLoRA)."""

    def shape(self, parts: set[int]) -> ModelShape:
        """The parameters of ``parts`` (a pipeline rank's shard, in the order it registers them): a tied embedding
        counts once on a rank that runs both the first and the last stage, twice in a pipeline that puts them on
        two ranks."""
        parts = {p for p in parts if p < len(self.parts)}  # the loss (part L + 2) has no parameters
        if not self.parts or len(parts) == len(self.parts):
            return self.whole
        head = len(self.parts) - 1
        keep = [(i, j) for i in sorted(parts) for j in range(len(self.parts[i]))
                if not (i == head and j in self.tied and 0 in parts)]
        chosen = [self.parts[i][j] for i, j in keep]
        frozen = [x for i in sorted(parts) for j, x in enumerate(self.frozen[i] if self.frozen else ())
                  if not (i == head and j in self.frozen_tied and 0 in parts)]
        nf4 = [x for i in sorted(parts) for x in (self.nf4[i] if self.nf4 else ())]
        return ModelShape(tuple(n for n, _ in chosen), tuple(d for _, d in chosen),
                          tuple(self.experts[i][j] for i, j in keep) if self.experts else (),
                          tuple(n for n, _ in frozen), tuple(d for _, d in frozen), sum(b for *_, b in nf4),
                          tuple(b for *_, b in nf4))


def _build_key(build: ModelBuild) -> tuple:
    return (build.factory, repr(build.options), build.vocab_size, build.pad_id, build.max_len, build.kind, build.tp,
            build.sequence_parallel, build.finetune)


_BUILDS: dict[tuple, ModelBuild] = {}


def _cached_build(build: ModelBuild) -> tuple:
    key = _build_key(build)
    _BUILDS.setdefault(key, build)
    return key


@lru_cache(maxsize=64)
def _params(key: tuple) -> _Params:
    import torch

    from torch_handle.finetune.nf4 import NF4Linear, nf4_storage
    from torch_handle.model.moe import GroupedExperts
    from torch_handle.plan.estimate_model import build_model

    with torch.device("meta"):
        model = build_model(_BUILDS[key])
    whole = ModelShape.of(model)
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(model, "lm_head"):
        return _Params((), whole)
    n = len(layers)

    def part_of(name: str) -> int:
        head = name.split(".")[0]
        return int(name.split(".")[1]) + 1 if head == "layers" else n + 1 if head in ("final_norm", "lm_head") else 0

    parts: list[list[tuple[int, int]]] = [[] for _ in range(n + 2)]
    frozen: list[list[tuple[int, int]]] = [[] for _ in range(n + 2)]
    flags: list[list[bool]] = [[] for _ in range(n + 2)]
    routed = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    seen: set[int] = set()
    tied, frozen_tied = set(), set()
    storage = {id(t) for t in nf4_storage(model)}  # QLoRA's NF4 weights: priced apart (nf4 below)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in storage:
            continue
        part, into = part_of(name), parts if p.requires_grad else frozen
        if id(p) in seen:
            if part != n + 1:
                continue
            (tied if p.requires_grad else frozen_tied).add(len(into[part]))
        seen.add(id(p))
        into[part].append((p.numel(), p.shape[0] if p.dim() else 1))
        if p.requires_grad:
            flags[part].append(id(p) in routed)
    nf4: list[list[tuple[int, int, int]]] = [[] for _ in range(n + 2)]
    for name, m in model.named_modules():
        if isinstance(m, NF4Linear):
            stored = m.weight_nf4.numel()  # uint8
            nf4[part_of(name)].append((m.in_features * m.out_features, m.out_features, stored))
    head = 0 if model.args.tie_embeddings else model.lm_head.weight.numel()
    counts = (sum(p.numel() for p in layers[0].parameters()), model.embed.weight.numel(), head)
    return _Params(tuple(tuple(x) for x in parts), whole, frozenset(tied), counts,
                   tuple(tuple(x) for x in flags) if routed else (),
                   tuple(tuple(x) for x in frozen) if any(frozen) else (), frozenset(frozen_tied),
                   tuple(tuple(x) for x in nf4) if any(nf4) else ())


@dataclass(frozen=True)
class _Activations:
    whole: ActivationBytes
    """One micro-batch through the whole (tp-split) model."""
    parts: PartSaved | None
    """Its saved bytes by part (decoders only)."""


@lru_cache(maxsize=256)
def _measured(key: tuple, batch: int, seq_len: int, precision: str, mode: str, checkpointing: bool
              ) -> _Activations:
    """A decoder's are measured on 3 of its layers (first, middle, last) and extended to all of them
    (:meth:`PartSaved.extended`), forward only: what a planner asks for hundreds of times is then cheap. Other
    models, and a decoder whose storages do not extend, run whole."""
    build = _BUILDS[key]
    n_layers = getattr(build.options, "n_layers", None)
    if build.kind == "lm" and isinstance(n_layers, int) and n_layers > 3:
        small = dataclasses.replace(build, options=dataclasses.replace(build.options, n_layers=3))
        parts = PartSaved()
        whole = fake_activations(small, batch, seq_len, precision, mode, checkpointing, parts, backward=False)
        extended = parts.extended(n_layers)
        if extended is not None:
            saved = extended.stage_bytes(0, n_layers + 2)
            return _Activations(dataclasses.replace(whole, saved=saved), extended)
    parts = PartSaved() if build.kind == "lm" else None
    whole = fake_activations(build, batch, seq_len, precision, mode, checkpointing, parts, backward=False)
    return _Activations(whole, parts)


def _activations(key: tuple, batch: int, seq_len: int, precision: str, mode: str, checkpointing: bool
                 ) -> _Activations:
    """One micro-batch of ``batch`` samples: measured at 2 and 4 samples and interpolated (every saved storage has
    the batch dimension or does not depend on it, so bytes are affine in it), measured at ``batch`` itself where
    the two do not fit such a line. A planner varying m then measures each model and tp twice."""
    if batch <= 4:
        return _measured(key, batch, seq_len, precision, mode, checkpointing)
    two, four = (_measured(key, b, seq_len, precision, mode, checkpointing) for b in (2, 4))
    line = _affine(two, four, batch)
    return line if line is not None else _measured(key, batch, seq_len, precision, mode, checkpointing)


def _affine(two: _Activations, four: _Activations, batch: int) -> _Activations | None:
    """The figures at ``batch`` samples on the line through those at 2 and 4; None where a figure shrinks or its
    per-sample bytes are not whole."""
    def at(a: int, b: int) -> int:
        if b < a or (b - a) % 2:
            raise ArithmeticError
        return a + (b - a) // 2 * (batch - 2)

    def table(a: dict[frozenset[int], int], b: dict[frozenset[int], int]) -> dict[frozenset[int], int]:
        return {k: at(a.get(k, 0), b.get(k, 0)) for k in {*a, *b}}

    try:
        whole = ActivationBytes(*(at(getattr(two.whole, f), getattr(four.whole, f))
                                  for f in ("saved", "logits", "recompute")))
        if two.parts is None or four.parts is None:
            return _Activations(whole, None)
        parts = PartSaved()
        parts.n_layers = two.parts.n_layers
        parts.saved, parts.params = table(two.parts.saved, four.parts.saved), table(two.parts.params,
                                                                                    four.parts.params)
    except ArithmeticError:
        return None
    return _Activations(whole, parts)


# ---------------------------------------------------------------------------------------------------------------
# Per layout: arithmetic
# ---------------------------------------------------------------------------------------------------------------


def _stage_parts(preset: Preset, params: _Params, n_stages: int) -> list[tuple[int, int]]:
    """(first part, last part) of every stage, as a run splits the layers (counts of the un-split model); the
    last stage's last part is the loss."""
    from torch_handle.model.pipeline import split_layers

    par, n_layers = preset.parallel, len(params.parts) - 2
    layer, embed, head = params.split_counts
    ranges = split_layers(n_layers, n_stages, par.pp_layers, by=par.pp_split, layer_params=layer,
                          embed_params=embed, head_params=head)
    out = []
    for s, r in enumerate(ranges):
        first = 0 if s == 0 else r.start + 1
        last = n_layers + 2 if s == n_stages - 1 else r.stop
        out.append((first, last))
    return out


def _dp_states(shape: ModelShape, variant: Variant, precision: str, dp: int, every_rank: bool, ep: int = 1
               ) -> list[tuple[int, States]]:
    """(dp_rank, model states) of every dp rank holding ``shape``, or only of the one with the most device bytes
    (the lowest among equals); with ``ep`` > 1 each holds E / ep experts (:mod:`torch_handle.plan.estimate_moe`)."""
    out = []
    for dp_rank in range(dp):
        out.append((dp_rank, rank_state_bytes(shape, variant, precision, dp, dp_rank, ep)))
        if variant.strategy in ("single", "ddp") or (variant.strategy == "scratch-ddp" and not variant.shard_optimizer):
            out += [(r, out[0][1]) for r in range(1, dp)]  # every dp rank holds the same
            break
    if every_rank:
        return out
    return [max(out, key=lambda x: (x[1].param + x[1].grad + x[1].optimizer - x[1].host, -x[0]))]


def estimate_layout(preset: Preset, registry: PluginRegistry, *, every_rank: bool = False,
                    variant: Variant | None = None) -> LayoutEstimate:
    """The memory of every rank of ``preset``'s layout: world size ``launch.nproc_per_node`` x ``launch.nnodes``,
    ``parallel.tp`` / ``pp`` / ``pp_schedule`` / ``pp_microbatches`` (0 = ``training.grad_accum``) /
    ``pp_stages_per_rank`` / ``pp_layers`` / ``pp_split`` / ``sequence_parallel``, ``model.activation_checkpointing``,
    the ``[strategy]`` (single, ddp, fsdp, scratch-ddp, scratch-fsdp, deepspeed: how it shards over dp) and
    ``training.precision``. Whether the plugins run the layout is the preset loader's check, not this function's.

    ``every_rank``: one :class:`RankMemory` per global rank (default: per (pp_rank, tp_rank), the largest dp rank).
    ``variant``: another strategy configuration than the preset's (``handle estimate --compare``).

    Raises:
        ValueError: one line: tp x pp does not divide the world size, a strategy without a memory model (or
            ``single`` with dp > 1), more stages than layers, micro-batches the step's samples or the schedule do
            not allow, a pipeline of a model without a split, a split tp does not divide.
        PresetError: a dataset without ``vocab_size``/``seq_len`` options.
    """
    from torch_handle.common.parallel_dims import ParallelDims
    from torch_handle.parallel.pipeline.schedules import stage_ranks
    from torch_handle.plan.estimate_cp import preset_cp_buffer_bytes
    from torch_handle.plan.estimate_pipeline import in_flight_peak

    par, t = preset.parallel, preset.training
    layout = ParallelDims(preset.world_size, par.tp, par.pp, cp=par.cp)
    dp, tp, pp, cp = layout.dp_cp, par.tp, par.pp, par.cp  # dp: the ranks states shard over, dp x cp
    variant = variant or preset_variant(preset)
    if variant.strategy not in BUILTIN:
        raise ValueError(f"strategy {variant.strategy!r} has no memory model (built in: {', '.join(BUILTIN)})")
    if variant.strategy == "single" and dp != 1:
        raise ValueError(f"strategy 'single' runs one replica: dp = world size / (tp x pp) = {dp} must be 1")
    v = par.pp_stages_per_rank if pp > 1 else 1
    m = pipeline_microbatches(preset) if pp > 1 else 1
    if pp > 1:
        samples = t.micro_batch_size * t.grad_accum
        problem = (f"{m} micro-batches do not divide micro_batch_size x grad_accum = {samples} samples"
                   if samples % m else microbatch_problem(par.pp_schedule, pp, v, m))
        if problem:
            raise ValueError(f"parallel.pp_microbatches: {problem}")
    batch = t.micro_batch_size * t.grad_accum // m if pp > 1 else t.micro_batch_size
    checkpointing = bool(getattr(preset.model.options, "activation_checkpointing", False))
    mode = compute_mode(variant.strategy, t.precision)
    key = _cached_build(model_build(preset, registry))
    params = _params(key)
    # a DPO pair: its chosen and rejected rows in one forward
    acts = _activations(key, batch * rows_per_sample(preset), preset.data.options.seq_len // cp, t.precision, mode,
                        checkpointing)
    cp_buffers, cp_impl = preset_cp_buffer_bytes(preset, mode) if cp > 1 else (0, None)
    whole_params = _params(_cached_build(dataclasses.replace(_BUILDS[key], tp=1, sequence_parallel=False)))

    if pp == 1:
        stage_parts = [(0, len(params.parts))]
        saved = [acts.whole.saved]
        peaks = [(acts.whole.saved, [1])]
        owner = [0]
    else:
        if not params.parts or acts.parts is None:
            raise ValueError(f"model {preset.model.name!r} has no pipeline split (the decoder has one)")
        n_layers = len(params.parts) - 2
        if n_layers < pp * v:
            raise ValueError(f"{n_layers} layers cannot fill pp x pp_stages_per_rank = {pp * v} pipeline stages")
        stage_parts = _stage_parts(preset, whole_params, pp * v)
        saved = [acts.parts.stage_bytes(a, b) for a, b in stage_parts]
        peaks = in_flight_peak(par.pp_schedule, pp, v, m, saved)
        owner = stage_ranks(pp, v, par.pp_schedule)

    rows = []
    for pp_rank in range(pp):
        stages = tuple(s for s, r in enumerate(owner) if r == pp_rank)
        shape = params.shape({p for s in stages for p in range(stage_parts[s][0], stage_parts[s][1] + 1)})
        last = pp * v - 1 in stages
        gathered, loss = 0, 0
        if last and acts.parts:
            loss = acts.parts.stage_bytes(acts.parts.n_layers + 2, acts.parts.n_layers + 2)
        if variant.strategy == "fsdp" or (variant.strategy == "deepspeed" and variant.zero_stage == 3):
            gathered = sum(acts.parts.stage_bytes(*stage_parts[x], params=True) for x in stages) if acts.parts else 0
        logits = acts.whole.logits if last else 0
        act_saved = peaks[pp_rank][0]
        act = act_saved + logits + acts.whole.recompute + cp_buffers
        for dp_rank, s in _dp_states(shape, variant, t.precision, dp, every_rank, par.ep):
            for tp_rank in range(tp):
                rows.append(RankMemory(
                    # dp_rank counts the dp x cp ranks a strategy holds, cp inside dp (ParallelDims' order)
                    layout.rank(pp_rank, dp_rank // cp, tp_rank, dp_rank % cp), pp_rank, dp_rank, tp_rank, stages,
                    s.param, s.grad,
                    s.optimizer, act, s.host, shape.n_params, tuple(saved[x] for x in stages),
                    tuple(peaks[pp_rank][1]), act_saved, logits, acts.whole.recompute, loss, gathered,
                    s.frozen_param, s.nf4))
    rows.sort(key=lambda r: r.rank)
    return LayoutEstimate(preset.world_size, dp // cp, tp, pp, par.pp_schedule if pp > 1 else None, m, checkpointing,
                          variant.label, rows, t.precision, whole_params.whole.n_params, v, batch,
                          par.sequence_parallel, params.whole.n_params, par.ep, cp, cp_impl, cp_buffers)
