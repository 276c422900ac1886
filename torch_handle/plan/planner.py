"""``handle plan``: every dp x tp x pp layout of a preset on N ranks, the ones that cannot run dropped with the
reason, the rest ranked by a predicted step time.

Enumeration: every (dp, tp, pp) with dp·tp·pp = N (tp inside a node when there are several nodes); for pp > 1 the
schedules gpipe, 1f1b and interleaved-1f1b (v = 2), each with m = pp, 2pp and 4pp micro-batches where m divides
the replica's samples; activation checkpointing off and on; for a model with experts, every expert-parallel degree
ep > 1 that divides both dp and n_experts beside ep = 1 (ep ranks are drawn from the dp ones: the experts split,
the batch does not); for a preset that asks for context parallelism (``parallel.cp > 1``), every cp > 1 that
divides dp·cp with pp = 1 and ep = 1 (what cp composes with: :mod:`torch_handle.config.context_parallel`), each with
the preset's ``cp_impl`` or, for ``auto``, each of ring, allgather and ulysses, beside cp = 1 (cp ranks share their
samples: the batch splits over dp alone). The loader drops those whose ``seq_len`` 2·cp·tp does not divide, or
whose heads cp·tp does not divide for Ulysses, with its own line. The global batch stays the preset's
(micro_batch_size x grad_accum x its own dp), split over each layout's dp replicas as ``bench scaling --strong``
splits it (:func:`~torch_handle.plan.bench_scaling.strong_batch`). The data-parallel strategy is the preset's,
``ddp`` when the preset's is ``single`` and dp > 1, and ``single`` when dp = 1.

Validity is ``handle run``'s own: each layout's preset goes through the loader's validation
(:func:`~torch_handle.config.loader.preset_from_dict`: the ``[parallel]`` checks and every plugin's
``check_preset``), so a layout the trainer learns to run is planned with no change here. A preset whose
``parallel.tp_impl`` is ``auto`` (the default) gets it chosen again for each layout (DTensor where it runs, by hand
elsewhere: :mod:`torch_handle.config.tp_impl`); an explicit one is kept in every layout. Memory is
:func:`~torch_handle.plan.estimate_layout.estimate_layout`'s largest rank against the device memory. Time is
:mod:`torch_handle.plan.plan_cost`'s model. Nothing is allocated: models are built on the meta device or on fake
tensors. torch is imported inside the functions.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch_handle.common.units import fmt_bytes
from torch_handle.plan import plan_cost
from torch_handle.plan.bench_scaling import preset_strategy_label, strong_batch
from torch_handle.plan.estimate_moe import MoEShape, all_to_all_bytes, preset_moe

if TYPE_CHECKING:
    from torch_handle.config.schema import Preset
    from torch_handle.registry import PluginRegistry

PP_SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))
"""(schedule, stages per rank v) tried for every pp > 1."""
MICROBATCH_FACTORS = (1, 2, 4)
"""m = factor x pp micro-batches per step."""


@dataclass(frozen=True)
class Candidate:
    """One way to run the preset on ``dp·tp·pp`` ranks: a layout (``common.parallel_dims.ParallelDims``' degrees) with the
    settings that go with it (schedule, micro-batches, checkpointing, strategy)."""

    dp: int
    tp: int
    pp: int
    schedule: str | None = None
    """The pipeline schedule (None when pp = 1)."""
    v: int = 1
    """Pipeline stages per rank."""
    microbatches: int = 0
    """m, pipeline micro-batches per step (0 when pp = 1)."""
    activation_checkpointing: bool = False
    strategy: str = "single"
    """The ``[strategy] name`` (``single`` when dp = 1)."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts split over ep of the dp ranks."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks (pp = 1, ep = 1)."""
    cp_impl: str | None = None
    """``parallel.cp_impl`` with cp > 1: ring, allgather or ulysses."""

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def mesh(self) -> str:
        """``dp 2 × tp 1 × pp 2``, ``dp 4 × tp 1 × pp 1 (ep 2)``, ``dp 1 × cp 2 × tp 1 × pp 1``"""
        cp = f" × cp {self.cp}" if self.cp > 1 else ""
        return f"dp {self.dp}{cp} × tp {self.tp} × pp {self.pp}" + (f" (ep {self.ep})" if self.ep > 1 else "")

    @property
    def label(self) -> str:
        """``dp 1 × tp 1 × pp 4, 1f1b m 8, ac``, ``dp 2 × cp 2 × tp 1 × pp 1, ring`` -- the mesh, the schedule and
        m or the context-parallel attention, activation checkpointing."""
        parts = [self.mesh] + ([self.cp_impl] if self.cp > 1 and self.cp_impl else [])
        if self.pp > 1:
            parts.append(f"{self.schedule}{f' v {self.v}' if self.v > 1 else ''} m {self.microbatches}")
        if self.activation_checkpointing:
            parts.append("ac")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "mesh": self.mesh, "dp": self.dp, "tp": self.tp, "pp": self.pp,
                "schedule": self.schedule, "v": self.v, "microbatches": self.microbatches,
                "activation_checkpointing": self.activation_checkpointing, "strategy": self.strategy, "ep": self.ep,
                "cp": self.cp, "cp_impl": self.cp_impl}


@dataclass(frozen=True)
class Batch:
    """How a layout splits the global batch: per replica ``micro_batch_size`` x ``grad_accum`` samples."""

    micro_batch_size: int
    grad_accum: int


def layout_overrides(layout: Candidate, batch: Batch, nproc_per_node: int, nnodes: int) -> list[str]:
    """The ``--set`` overrides that run ``layout`` (``handle run PRESET --set ...``)."""
    out = [f"launch.nproc_per_node={nproc_per_node}", f"launch.nnodes={nnodes}", f"strategy.name={layout.strategy}",
           f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}",
           f"training.micro_batch_size={batch.micro_batch_size}", f"training.grad_accum={batch.grad_accum}",
           f"model.activation_checkpointing={str(layout.activation_checkpointing).lower()}"]
    if layout.pp > 1:
        out += [f"parallel.pp_schedule={layout.schedule}", f"parallel.pp_stages_per_rank={layout.v}",
                f"parallel.pp_microbatches={layout.microbatches}"]
    if layout.ep > 1:
        out.append(f"parallel.ep={layout.ep}")
    if layout.cp > 1:
        out += [f"parallel.cp={layout.cp}", f"parallel.cp_impl={layout.cp_impl}"]
    return out


def adapted_overrides(base: Preset, layout: Candidate) -> list[str]:
    """The preset's ``[parallel]`` choices that cannot run ``layout``, set to what can, as the resume rules do
    (docs/resume.md): ``sequence_parallel`` off where tp = 1 (no TP group to split over), and ``pp_impl`` native
    for a schedule the hand-written pipeline does not have, and ``cp`` 1 for a layout without context parallelism.
    Without them those layouts were dropped for the preset's setting alone, never tried."""
    from torch_handle.config.schema import PP_SCRATCH

    par, out = base.parallel, []
    if layout.tp == 1 and par.sequence_parallel:
        out.append("parallel.sequence_parallel=false")
    if layout.pp > 1 and par.pp_impl == "scratch" and layout.schedule not in PP_SCRATCH:
        out.append("parallel.pp_impl=native")
    if layout.ep == 1 and par.ep > 1:
        out.append("parallel.ep=1")
    if layout.cp == 1 and par.cp > 1:
        out.append("parallel.cp=1")
    return out


@dataclass
class Row:
    """A layout that fits, with its prediction."""

    layout: Candidate
    batch: Batch
    estimate: Any
    """The :class:`~torch_handle.plan.estimate_layout.LayoutEstimate`."""
    cost: plan_cost.StepCost
    tokens_per_step: int
    overrides: list[str]
    tp_impl: str | None = None
    """The tensor-parallel implementation the layout runs (``parallel.tp_impl`` as its preset resolved it; None
    with tp = 1)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.cost.step_s

    def as_dict(self) -> dict[str, Any]:
        largest = self.estimate.largest
        return {**self.layout.as_dict(), "micro_batch_size": self.batch.micro_batch_size,
                "grad_accum": self.batch.grad_accum, "largest_rank": largest.rank,
                "largest_bytes": largest.total_bytes, "largest_state_bytes": _states(largest),
                "largest_activation_bytes": largest.activations_bytes,
                "largest_saved_activation_bytes": max(telemetry_saved_bytes(r, self.layout.pp)
                                                      for r in self.estimate.ranks),
                "ranks": [_rank_dict(r) for r in self.estimate.ranks],
                "predicted_tokens_per_s": self.tokens_per_s, **self.cost.as_dict(), "tp_impl": self.tp_impl,
                "overrides": self.overrides}


@dataclass
class Plan:
    """What ``handle plan`` prints: the ranked layouts, the dropped ones, and where its figures come from."""

    nproc: int
    nnodes: int
    device_memory: int
    global_batch: int
    seq_len: int
    flops_per_token: float
    peak_flops: float
    peak_source: str
    links: plan_cost.Links
    rows: list[Row] = field(default_factory=list)
    dropped: list[tuple[Candidate, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        links = self.links
        return {"nproc": self.nproc, "nnodes": self.nnodes, "ranks_per_node": self.nproc // self.nnodes,
                "device_memory_bytes": self.device_memory, "global_batch": self.global_batch,
                "seq_len": self.seq_len, "tokens_per_step": self.global_batch * self.seq_len,
                "flops_per_token": self.flops_per_token,
                "peak": {"flops_per_s": self.peak_flops, "source": self.peak_source},
                "links": {"backend": links.backend, "intra_gbps": links.intra_gbps, "inter_gbps": links.inter_gbps,
                          "latency_s": links.latency_s, "measured": links.measured, "source": links.source},
                "layouts": [r.as_dict() for r in self.rows],
                "dropped": [{**layout.as_dict(), "reason": reason} for layout, reason in self.dropped],
                "notes": self.notes}


def telemetry_saved_bytes(rank: Any, pp: int) -> int:
    """The saved activation bytes a run's telemetry reports for ``rank`` (a
    :class:`~torch_handle.plan.estimate_layout.RankMemory`), for ``--measure`` to compare: with a pipeline its peak
    of micro-batches in flight (``activation_peak_bytes``), which counts the weights FSDP gathers for each and not
    what the loss saves; else one micro-batch with the gathered weights (``activation_saved_bytes``)."""
    if pp > 1:
        return rank.activation_saved_bytes + rank.in_flight[0] * (rank.activation_gathered_bytes
                                                                  - rank.activation_loss_bytes)
    return rank.microbatch_saved_bytes[0] + rank.activation_gathered_bytes


def _states(rank: Any) -> int:
    return rank.params_bytes + rank.grads_bytes + rank.optimizer_bytes


def _rank_dict(rank: Any) -> dict[str, Any]:
    return rank.as_dict()


def factorizations(n: int) -> list[tuple[int, int, int]]:
    """Every ``(dp, tp, pp)`` with dp·tp·pp = n: pp, then tp, ascending."""
    return [(n // (tp * pp), tp, pp) for pp in range(1, n + 1) if n % pp == 0
            for tp in range(1, n // pp + 1) if (n // pp) % tp == 0]


def expert_degrees(dp: int, n_experts: int) -> list[int]:
    """The ep tried with ``dp`` replicas of a model with ``n_experts`` experts per MoE layer: 1, and every ep > 1
    dividing both (none but 1 for a dense model)."""
    return [1] + [ep for ep in range(2, dp + 1) if n_experts and dp % ep == 0 and n_experts % ep == 0]


def context_degrees(dp: int, pp: int, cp_impls: tuple[str, ...]) -> list[tuple[int, str | None]]:
    """The ``(cp, cp_impl)`` tried where ``dp`` ranks are left after tp and pp: ``(1, None)``, and with pp = 1
    every cp > 1 dividing ``dp`` with each of ``cp_impls`` (none when it is empty: a preset without cp)."""
    more = [(cp, impl) for cp in range(2, dp + 1) if pp == 1 and dp % cp == 0 for impl in cp_impls]
    return [(1, None), *more]


def candidate_layouts(n: int, strategy: str, samples: Callable[[int], int | None], n_experts: int = 0,
                      cp_impls: tuple[str, ...] = ()) -> list[Candidate]:
    """Every layout tried on ``n`` ranks; ``samples(dp)`` is a replica's samples per step (None: the global batch
    does not divide over dp, the layout is still listed to be dropped); ``n_experts``: E of a model with experts,
    whose layouts are tried with every ep of :func:`expert_degrees` too; ``cp_impls``: the context-parallel
    attentions tried at every cp of :func:`context_degrees` (ep = 1 there)."""
    out = []
    for ranks, tp, pp in factorizations(n):
        for cp, impl in context_degrees(ranks, pp, cp_impls):
            out += _layouts(ranks // cp, tp, pp, cp, impl, strategy, samples, n_experts if cp == 1 else 0)
    return out


def _layouts(dp: int, tp: int, pp: int, cp: int, cp_impl: str | None, strategy: str,
             samples: Callable[[int], int | None], n_experts: int) -> list[Candidate]:
    """The candidates of one ``dp × cp × tp × pp`` mesh: its schedules, m, ep and checkpointing."""
    out = []
    name = "single" if dp * cp == 1 else strategy
    pipes: list[tuple[str | None, int, int]] = [(None, 1, 0)]
    if pp > 1:
        s = samples(dp)
        ms = sorted({f * pp for f in MICROBATCH_FACTORS if s is None or s % (f * pp) == 0}) or [pp]
        pipes = [(sched, v, m) for sched, v in PP_SCHEDULES for m in ms]
    for ep in expert_degrees(dp, n_experts):
        for sched, v, m in pipes:
            for ac in (False, True):
                out.append(Candidate(dp, tp, pp, sched, v, m, ac, name, ep, cp, cp_impl))
    return out


def plan_layouts(base: Preset, registry: PluginRegistry, *, nproc: int, nnodes: int, device_memory: int,
                 peak_flops: float, peak_source: str, links: plan_cost.Links, contention: float = 1.0,
                 estimate: Callable[[Preset, PluginRegistry], Any] | None = None) -> Plan:
    """The plan of ``base`` on ``nproc`` ranks over ``nnodes`` nodes of ``device_memory`` bytes each rank, ranked
    fastest first by predicted tokens/s. ``peak_flops``: one rank's matmul FLOP/s in the preset's precision;
    ``contention``: the share of it a rank gets when ranks outnumber cores (1.0 on GPUs). ``estimate``: the
    memory estimate (default :func:`~torch_handle.plan.estimate_layout.estimate_layout`).

    Raises:
        ValueError: nproc not a multiple of nnodes (one line).
        PresetError: a model ``handle estimate`` cannot size.
    """
    from torch_handle.config.loader import preset_from_dict, preset_to_dict
    from torch_handle.config.tp_impl import requested_tp_impl
    from torch_handle.errors import PresetError

    if estimate is None:
        from torch_handle.plan.estimate_layout import estimate_layout as estimate
    if nproc % nnodes:
        raise ValueError(f"--nproc {nproc} is not a multiple of --nnodes {nnodes}")
    per_node = nproc // nnodes
    t, par = base.training, base.parallel
    base_dp = max(1, base.world_size // (par.tp * par.pp * par.cp))
    global_batch = t.micro_batch_size * t.grad_accum * base_dp
    seq_len = int(getattr(base.data.options, "seq_len", 0) or 0)
    flops_per_token = model_flops_per_token(base, registry)
    moe = preset_moe(base, registry)
    own = preset_strategy_label(base.strategy.name, getattr(base.strategy.options, "zero_stage", None))
    strategy = "ddp" if base.strategy.name == "single" else base.strategy.name
    plan = Plan(nproc, nnodes, device_memory, global_batch, seq_len, flops_per_token, peak_flops * contention,
                peak_source, links)
    plan.notes.append(f"global batch {global_batch} samples x {seq_len} tokens per step (the preset's), split "
                      f"over each layout's dp replicas; strategy {strategy} (the preset's {own}) where dp > 1, "
                      "single where dp = 1")
    data = preset_to_dict(base)
    tp_impl = data["parallel"]["tp_impl"] = requested_tp_impl(base)  # "auto": chosen again for each layout
    plan.notes.append("tensor parallelism: " + ("tp_impl auto, DTensor where it runs (single or fsdp, pp = 1), by "
                                                "hand elsewhere" if tp_impl == "auto" else
                                                f"tp_impl {tp_impl} (the preset's) in every layout"))

    if moe is not None:
        plan.notes.append(f"experts: {moe.n_experts} per MoE layer in {moe.moe_layers} layer(s), "
                          f"{moe.active_params:,} of {moe.params:,} parameters active per token (the FLOPs'); ep "
                          f"tried where it divides dp and {moe.n_experts}; EP comm: 4 all-to-alls per MoE layer "
                          f"and micro-batch, uniform routing")

    cp_impls = context_impls(base)
    if cp_impls:
        plan.notes.append(f"context parallelism (the preset's cp {par.cp}): cp tried at every divisor of the ranks "
                          f"left after tp, with pp = 1 and ep = 1, cp_impl {', '.join(cp_impls)}; seq_len "
                          f"{seq_len} must divide by 2 x cp x tp, heads by cp x tp for ulysses; activations of "
                          "seq_len / cp tokens plus one layer's CP buffers, CP comm per layer and micro-batch")

    def samples(dp: int) -> int | None:
        return global_batch // dp if global_batch % dp == 0 else None

    for layout in candidate_layouts(nproc, strategy, samples, moe.n_experts if moe else 0, cp_impls):
        if nnodes > 1 and per_node % layout.tp:
            plan.dropped.append((layout, f"tp {layout.tp} spans nodes ({per_node} ranks per node): tensor "
                                         "parallelism stays inside a node"))
            continue
        if samples(layout.dp) is None:
            plan.dropped.append((layout, f"the global batch of {global_batch} samples does not divide over "
                                         f"dp {layout.dp} replicas"))
            continue
        mbs, ga = strong_batch(global_batch, t.micro_batch_size, t.grad_accum, layout.dp)
        batch = Batch(mbs, ga)
        overrides = layout_overrides(layout, batch, per_node, nnodes) + adapted_overrides(base, layout)
        try:
            preset = preset_from_dict(_apply(data, overrides), registry, source=base.source)
        except PresetError as e:  # its first problem, structure first: the layout's own reason
            problems = getattr(e, "problems", [e])
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            plan.dropped.append((layout, _one_line(problems[0]) + more))
            continue
        try:
            est = estimate(preset, registry)
        except ValueError as e:  # a layout validation accepts but the estimate cannot size: dropped, said why
            plan.dropped.append((layout, f"the memory estimate: {_one_line(e)}"))
            continue
        largest = est.largest
        if largest.total_bytes > device_memory:
            plan.dropped.append((layout, f"largest rank needs {fmt_bytes(largest.total_bytes)} > "
                                         f"{fmt_bytes(device_memory)} (rank {largest.rank})"))
            continue
        cost = step_cost(layout, batch, preset, est, flops_per_token, plan.peak_flops, links, per_node,
                         global_batch * seq_len, moe)
        plan.rows.append(Row(layout, batch, est, cost, global_batch * seq_len, overrides,
                             preset.parallel.tp_impl if layout.tp > 1 else None))
    plan.rows.sort(key=lambda r: (-r.tokens_per_s, r.estimate.largest.total_bytes))
    if cp_impls:
        plan.notes.append(choice_note(plan))
    return plan


def context_impls(base: Preset) -> tuple[str, ...]:
    """The ``cp_impl`` values a plan of ``base`` tries at cp > 1: none when the preset does not ask for context
    parallelism (``parallel.cp = 1``: it only pays at long sequences), its own when it names one, and the three
    hand-written attentions for ``auto`` (``native`` is named to be refused: the loader's line says why)."""
    from torch_handle.config.context_parallel import IMPLS

    par = base.parallel
    if par.cp == 1:
        return ()
    return IMPLS if par.cp_impl == "auto" else (par.cp_impl,)


def choice_note(plan: Plan) -> str:
    """Why the plan's first layout was chosen, against the fastest one of the other context-parallel degree (cp 1
    against cp > 1): which fits the memory, and by how many tokens/s."""
    if not plan.rows:
        return "chose nothing: no layout fits (the dropped lines say why)"
    first = plan.rows[0]
    others = [r for r in plan.rows if (r.layout.cp > 1) != (first.layout.cp > 1)]
    cp = first.layout.cp
    said = (f"chose {first.layout.label}: the fastest predicted ({first.tokens_per_s:,.0f} tokens/s, largest rank "
            f"{fmt_bytes(first.estimate.largest.total_bytes)}" + (f", CP comm {fmt_bytes(first.cost.cp_bytes)} "
                                                                  f"{first.cost.cp_s * 1e3:,.1f} ms" if cp > 1 else "")
            + ")")
    if others:
        other = others[0]
        return (f"{said}; the fastest {'without' if cp > 1 else 'with'} cp, {other.layout.label}, "
                f"{other.tokens_per_s:,.0f} tokens/s")
    kind = "without cp" if cp > 1 else "with cp > 1"
    memory = [reason for layout, reason in plan.dropped if (layout.cp > 1) != (cp > 1)
              and reason.startswith("largest rank needs")]
    return f"{said}; no layout {kind} fits" + (f" ({len(memory)} too large for the memory, e.g. {memory[0]})"
                                                 if memory else "")


def step_cost(layout: Candidate, batch: Batch, preset: Preset, est: Any, flops_per_token: float, peak_flops: float,
              links: plan_cost.Links, per_node: int, tokens: int, moe: MoEShape | None = None
              ) -> plan_cost.StepCost:
    """The :class:`~torch_handle.plan.plan_cost.StepCost` of ``layout`` (module docstring of
    :mod:`~torch_handle.plan.plan_cost` for the formulas); ``moe``: the experts, for the all-to-alls of ep > 1."""
    from torch_handle.parallel.tensor.mappings import step_volume
    from torch_handle.plan.estimate_cp import cp_step_volume

    options = preset.model.options
    d_model, n_layers = int(getattr(options, "d_model", 0)), int(getattr(options, "n_layers", 0))
    seq_len = int(getattr(preset.data.options, "seq_len", 0) or 0)
    element = 4 if preset.training.precision == "fp32" else 2
    compute = plan_cost.compute_seconds(flops_per_token, tokens, layout.world_size, peak_flops,
                                        layout.activation_checkpointing)
    bubble, bubble_s = plan_cost.bubble_seconds(compute, layout.schedule, layout.pp, layout.microbatches, layout.v)
    tp_bytes, tp_s = 0, 0.0
    if layout.tp > 1:
        volume = step_volume(n_layers=-(-n_layers // layout.pp), micro_batch_size=batch.micro_batch_size,
                             seq_len=seq_len, d_model=d_model, grad_accum=batch.grad_accum,
                             sequence_parallel=preset.parallel.sequence_parallel, element_bytes=element)
        tp_bytes, tp_s = volume["bytes"], plan_cost.tp_seconds(volume, layout.tp, links)
    grad_bytes = max(_grad_bytes(r, preset) for r in est.ranks)
    replicas = layout.dp * layout.cp  # the strategy reduces (and shards) over dp x cp
    dp_s = plan_cost.dp_seconds(grad_bytes, replicas, _strategy_label(preset), links,
                                plan_cost.crosses_nodes(replicas, layout.tp, per_node))
    pp_bytes, pp_s = 0, 0.0
    if layout.pp > 1:
        samples = batch.micro_batch_size * batch.grad_accum
        sends = 2 * layout.v * layout.microbatches
        pp_bytes = 2 * layout.v * samples * seq_len * d_model * element
        pp_s = plan_cost.pp_seconds(pp_bytes, sends, links,
                                    plan_cost.crosses_nodes(layout.pp, layout.tp * layout.dp, per_node))
    ep_bytes, ep_s = 0, 0.0
    if moe is not None and layout.ep > 1:  # a pipeline rank runs 1/pp of the MoE layers for every micro-batch
        per_step = all_to_all_bytes(moe, batch.micro_batch_size * seq_len, layout.ep, element) * batch.grad_accum
        ep_bytes = per_step // layout.pp
        calls = 5 * -(-moe.moe_layers // layout.pp) * batch.grad_accum  # 4 all-to-alls + the counts, per layer
        ep_s = plan_cost.pp_seconds(ep_bytes, calls, links, plan_cost.crosses_nodes(layout.ep, layout.tp, per_node))
    cp_bytes, cp_s = 0, 0.0
    if layout.cp > 1:
        cp_volume = cp_step_volume(preset, element, batch.micro_batch_size, batch.grad_accum)
        cp_bytes = cp_volume["bytes"]
        cp_s = plan_cost.pp_seconds(cp_bytes, cp_volume["calls"], links,
                                    plan_cost.crosses_nodes(layout.cp, layout.tp, per_node))
    return plan_cost.StepCost(compute, bubble, bubble_s, tp_bytes, tp_s, grad_bytes if replicas > 1 else 0, dp_s,
                              pp_bytes, pp_s, ep_bytes, ep_s, cp_bytes, cp_s)


def _strategy_label(preset: Preset) -> str:
    label = preset_strategy_label(preset.strategy.name, getattr(preset.strategy.options, "zero_stage", None))
    return "scratch-zero3" if label == "scratch-fsdp" and preset.strategy.options.zero_stage == 3 else label


def _grad_bytes(rank: Any, preset: Preset) -> int:
    """The gradient bytes ``rank`` synchronises over dp: its parameters before dp sharding, in the dtype gradients
    are reduced in (fp32 but for DeepSpeed's 16-bit models)."""
    deepspeed16 = preset.strategy.name == "deepspeed" and preset.training.precision != "fp32"
    return rank.params * (2 if deepspeed16 else 4)


def model_flops_per_token(preset: Preset, registry: PluginRegistry) -> float:
    """Training FLOPs per token of the preset's model (its ``flops_per_token(seq_len)``, built on the meta device).

    Raises:
        ValueError: a model without ``flops_per_token``.
    """
    import dataclasses

    import torch

    from torch_handle.plan.estimate_model import build_model, model_build

    build = model_build(preset, registry)
    with torch.device("meta"):
        model = build_model(dataclasses.replace(build, tp=1))
    if not hasattr(model, "flops_per_token"):
        raise ValueError(f"model {preset.model.name!r} has no flops_per_token: handle plan cannot time it")
    return float(model.flops_per_token(build.max_len))


def _apply(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    from torch_handle.config.overrides import parse_override

    out = copy.deepcopy(data)
    for text in overrides:
        keys, value = parse_override(text)
        table = out.setdefault(keys[0], {})
        if keys[0] == "strategy" and keys[1] == "name" and table.get("name") != value:
            table.clear()  # another plugin: its own options' defaults
        table[keys[1]] = value
    return out


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
