"""Checks of the ``[parallel]`` layout that span tables: the world size, the plugins, the batch (run before
anything starts; each problem is one line naming its key).

Each check is a generator of its problems that reads only what it needs (:data:`LAYOUT_CHECKS`): the validation
walk (:mod:`torch_handle.config.problems`) runs every one of them, also on a preset with problems elsewhere, and a
check that reads a value with a problem of its own ends there (the value is not there to check against)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch_handle.config.context_parallel import context_parallel_problems
from torch_handle.config.loss_impl import chunked_loss_problem
from torch_handle.config.schema import PLUGIN_TABLES, PP_V_SHAPED, Preset
from torch_handle.config.tp_impl import native_tp_problem
from torch_handle.errors import PresetError


def microbatch_problem(schedule: str, pp: int, v: int, n_microbatches: int) -> str | None:
    """Why pipeline ``schedule`` cannot run ``n_microbatches`` micro-batches on ``pp`` ranks with ``v`` stages
    each, or None.

    1F1B with fewer micro-batches than stages never reaches its steady state (torch refuses it; torchtitan #775 is
    the hang it caused before); DualPipeV needs as many as stages; torch's interleaved schedules run in rounds of
    ``pp`` micro-batches and need m to be a multiple of the number of rounds (m // pp)."""
    m = n_microbatches
    need = {"1f1b": pp, "dualpipev": pp * v}.get(schedule, 1)
    if m < need:
        return f"{m} micro-batches are fewer than the {need} stages {schedule} needs"
    if schedule in ("interleaved-1f1b", "interleaved-zb") and m % max(1, m // pp):
        return (f"{m} is not a multiple of its rounds of {pp} micro-batches ({schedule} needs m <= {pp} or a "
                f"multiple of m // {pp}, e.g. {pp * (m // pp)})")
    return None


def valid_microbatches(schedule: str, pp: int, v: int, samples: int) -> list[int]:
    """The pipeline micro-batch counts m, ascending, that split ``samples`` (micro_batch_size x grad_accum per
    replica) evenly and that ``schedule`` can run on ``pp`` ranks with ``v`` stages each: every value that passes
    both of :func:`check_parallel`'s micro-batch checks."""
    return [m for m in range(1, samples + 1) if samples % m == 0 and microbatch_problem(schedule, pp, v, m) is None]


def pipeline_microbatches(preset: Preset) -> int:
    """m: ``parallel.pp_microbatches``, or ``training.grad_accum`` when it is 0."""
    return preset.parallel.pp_microbatches or preset.training.grad_accum


def _supports(registry: Any, kind: str, attribute: str) -> list[str]:
    return sorted(n for n, r in registry.registrations[kind].items() if getattr(r.config_cls, attribute, False))


def _world_size(preset: Preset, registry: Any) -> Iterator[PresetError]:
    """tp x pp divides the world size (the rest is the data-parallel degree)."""
    par = preset.parallel
    if par.tp * par.pp > 1 and preset.world_size % (par.tp * par.pp):
        world = preset.world_size
        name, other = ("tp", par.pp) if par.pp == 1 else ("pp", par.tp)
        valid = ", ".join(str(d) for d in range(1, world + 1) if world % (d * other) == 0) or "none"
        yield PresetError(f"tp x pp = {par.tp} x {par.pp} does not divide the world size {world} "
                          f"(launch.nproc_per_node x launch.nnodes); the data-parallel degree is world size / "
                          f"(tp x pp) (valid {name}: {valid})", key=f"parallel.{name}")


def _plugin_supports(table: str) -> Callable[[Preset, Any], Iterator[PresetError]]:
    """The check that the ``table`` (model or strategy) plugin supports each kind of split: its options class says
    so with a class attribute ``tensor_parallel = True`` / ``pipeline_parallel = True``. One problem naming both."""

    def check(preset: Preset, registry: Any) -> Iterator[PresetError]:
        par, section = preset.parallel, getattr(preset, table)
        missing = [(name, degree, attribute) for degree, attribute, name in
                   ((par.tp, "tensor_parallel", "tp"), (par.pp, "pipeline_parallel", "pp"))
                   if degree > 1 and not getattr(type(section.options), attribute, False)]
        if missing:
            what = " nor ".join(f"parallel.{name} = {degree} (valid with {name} > 1: "
                                f"{', '.join(_supports(registry, PLUGIN_TABLES[table], attribute)) or 'none'})"
                                for name, degree, attribute in missing)
            yield PresetError(f"{section.name!r} does not support {what}", key=f"{table}.name")

    return check


def _native_tp(preset: Preset, registry: Any) -> Iterator[PresetError]:
    """An explicit ``tp_impl = "native"`` where DTensor cannot run the layout (``"auto"`` is resolved before the
    checks: :mod:`torch_handle.config.tp_impl`)."""
    par = preset.parallel
    problem = native_tp_problem(preset) if par.tp > 1 and par.tp_impl == "native" else None
    if problem:
        yield PresetError(f"{problem}: set parallel.tp_impl = \"scratch\" (by hand) or \"auto\" (DTensor where it "
                          f"runs, else by hand)", key="parallel.tp_impl")


def _tied_v_shape(preset: Preset, registry: Any) -> Iterator[PresetError]:
    par = preset.parallel
    if par.pp > 1 and par.pp_schedule in PP_V_SHAPED and not preset.world_size % (par.tp * par.pp):
        dp = preset.world_size // (par.tp * par.pp)
        if dp > 1 and getattr(preset.model.options, "tie_embeddings", False):
            yield PresetError(f"{par.pp_schedule} runs the first and the last stage on one rank, whose tied "
                              f"embedding would be two data-parallel units there (dp = {dp}): set "
                              f"model.tie_embeddings = false or use a looped schedule (gpipe, 1f1b, interleaved-1f1b)",
                              key="parallel.pp_schedule")


def _pipeline_precision(preset: Preset, registry: Any) -> Iterator[PresetError]:
    if preset.parallel.pp > 1 and preset.training.precision == "fp16":
        yield PresetError("fp16 needs loss scaling, which the pipeline schedules do not apply: use bf16 or fp32 "
                          "with parallel.pp > 1", key="training.precision")


def _microbatches(preset: Preset, registry: Any) -> Iterator[PresetError]:
    """A pipeline's micro-batches split the step's batch evenly and are enough for its schedule; the valid list
    (:func:`valid_microbatches`) names only counts that pass both."""
    par, t = preset.parallel, preset.training
    if par.pp == 1:
        return
    m, samples = pipeline_microbatches(preset), t.micro_batch_size * t.grad_accum
    ok = valid_microbatches(par.pp_schedule, par.pp, par.pp_stages_per_rank, samples)
    if m in ok:
        return
    notes = [] if par.pp_microbatches else [f"0 is training.grad_accum = {t.grad_accum}"]
    if samples % m:
        why = f"{m} does not divide the step's micro_batch_size x grad_accum = {samples} samples per replica"
        notes.append("each pipeline micro-batch takes an equal share")
    else:
        why = microbatch_problem(par.pp_schedule, par.pp, par.pp_stages_per_rank, m)
    notes.append(f"valid: {', '.join(map(str, ok))}, e.g. --set parallel.pp_microbatches={ok[0]}" if ok else
                 f"valid: none for {par.pp_schedule} on {par.pp} stages: raise training.grad_accum or "
                 f"training.micro_batch_size")
    yield PresetError(f"{why} ({'; '.join(notes)})", key="parallel.pp_microbatches")


def _expert_parallel(preset: Preset, registry: Any) -> Iterator[PresetError]:
    """ep > 1: MoE layers whose n_experts it divides, a data-parallel degree it divides (EP ranks are drawn from the
    data-parallel ones: docs/expert-parallel.md), and a strategy that leaves the experts to it."""
    par = preset.parallel
    if par.ep == 1:
        return
    n_experts = getattr(preset.model.options, "n_experts", 0) or 0
    if not n_experts:
        yield PresetError(f"parallel.ep = {par.ep} splits the experts of mixture-of-experts layers, and the model has "
                          f"none (set model.n_experts > 0, or parallel.ep = 1)", key="parallel.ep")
        return
    if preset.world_size % (par.tp * par.pp):
        return  # _world_size's problem: no data-parallel degree to check against
    dp = preset.world_size // (par.tp * par.pp)
    valid = ", ".join(str(d) for d in range(1, dp + 1) if dp % d == 0 and n_experts % d == 0)
    for what, degree in ((f"model.n_experts = {n_experts}", n_experts),
                         (f"the data-parallel degree {dp} (world size / (tp x pp); EP ranks are drawn from the "
                          f"data-parallel ones)", dp)):
        if degree % par.ep:
            yield PresetError(f"parallel.ep = {par.ep} does not divide {what} (valid ep: {valid})", key="parallel.ep")
    if not getattr(type(preset.strategy.options), "expert_parallel", False):
        strategies = ", ".join(_supports(registry, "strategy", "expert_parallel")) or "none"
        yield PresetError(f"strategy {preset.strategy.name!r} does not support parallel.ep > 1 (valid with ep > 1: "
                          f"{strategies})", key="strategy.name")


def _finetune(preset: Preset, registry: Any) -> Iterator[PresetError]:
    """What LoRA adapts (the from-scratch Transformer) and the layouts it runs under (docs/lora.md)."""
    if preset.finetune.method == "none":
        return
    if preset.model.name != "transformer":
        yield PresetError(f"finetune.method = {preset.finetune.method!r} adapts the from-scratch 'transformer' "
                          f"(model.name = {preset.model.name!r})", key="model.name")
    if preset.finetune.method == "qlora" and preset.parallel.tp > 1:
        yield PresetError("QLoRA's NF4 base is not split by parallel.tp (valid: 1): its quantisation blocks run "
                          "along the rows of the whole weight, which tp cuts by columns (docs/qlora.md; "
                          "finetune.method = 'lora' is split)", key="parallel.tp")


def _objective(preset: Preset, registry: Any) -> Iterator[PresetError]:
    """``finetune.objective = "sft"`` or ``"dpo"``: conversations prepared with ``handle data prepare --chat`` or
    pairs prepared with ``--preference`` (the ``tokens`` dataset), for a decoder (dpo); every layout (dp with any
    strategy, tp, pp) takes the global batch's mean."""
    objective = preset.finetune.objective
    if objective not in ("sft", "dpo"):
        return
    flag = "--chat" if objective == "sft" else "--preference"
    if preset.data.name != "tokens":
        yield PresetError(f"finetune.objective = {objective!r} trains on data prepared with `handle data prepare "
                          f"{flag}` (data.name = 'tokens'), not data.name = {preset.data.name!r}", key="data.name")
    if objective == "dpo" and getattr(preset.model.options, "kind", "decoder") != "decoder":
        yield PresetError("finetune.objective = 'dpo' tunes a decoder-only model (valid: model.kind = 'decoder')",
                          key="model.kind")


COPY_SHARDED = {"single": "a plain copy", "ddp": "a plain copy on every rank", "scratch-ddp": "a plain copy on "
                "every rank", "deepspeed": "a plain copy: ZeRO-1/2 keep every parameter", "fsdp": "fully_shard"}
"""The strategies under which ``[finetune.preference] reference = "copy"`` runs, and how the copy is held."""


def reference_copy_problem(preset: Preset) -> tuple[str, str] | None:
    """(what, the key) when ``preset`` cannot keep a frozen reference copy (``reference = "copy"``): a layout with
    tp, pp or ep > 1, ZeRO-3 or scratch-fsdp (their sharding is the engine's own); None when it can."""
    if preset.finetune.objective != "dpo" or preset.finetune.preference.reference != "copy":
        return None
    instead = "reference = 'precomputed', no reference model"
    for dim in ("tp", "pp", "ep"):
        if getattr(preset.parallel, dim) > 1:
            return f"reference = 'copy' is not split over parallel.{dim} > 1 (valid: {instead})", f"parallel.{dim}"
    name, stage = preset.strategy.name, getattr(preset.strategy.options, "zero_stage", 0)
    if name not in COPY_SHARDED or (name == "deepspeed" and stage == 3):
        which = f"strategy {name!r}" + (" with zero_stage 3" if name == "deepspeed" else "")
        return (f"reference = 'copy' under {which}: not sharded as that strategy shards (valid strategies: "
                f"{', '.join(COPY_SHARDED)} with ZeRO-1/2; or {instead})"), "strategy.name"
    return None


def _reference_copy(preset: Preset, registry: Any) -> Iterator[PresetError]:
    """``[finetune.preference] reference = "copy"`` where the layout cannot hold it (:func:`reference_copy_problem`)."""
    problem = reference_copy_problem(preset)
    if problem is not None:
        yield PresetError(f"finetune.preference.{problem[0]}", key=problem[1])


def _loss_impl(preset: Preset, registry: Any) -> Iterator[PresetError]:
    """``training.loss_impl = "chunked"`` where the layout cannot run it (:mod:`torch_handle.config.loss_impl`)."""
    if preset.training.loss_impl == "chunked":
        problem = chunked_loss_problem(preset)
        if problem:
            yield PresetError(f"\"chunked\" {problem}; use \"auto\" or \"full\"", key="training.loss_impl")


LAYOUT_CHECKS: tuple[Callable[[Preset, Any], Iterator[PresetError]], ...] = (
    _world_size, _plugin_supports("model"), _plugin_supports("strategy"), _native_tp, _tied_v_shape,
    _pipeline_precision, _microbatches, _expert_parallel, _finetune, _objective, _loss_impl, _reference_copy,
    context_parallel_problems)
"""The ``[parallel]`` checks, structure first; each ``check(preset, registry)`` yields its problems."""


def check_parallel(preset: Preset, registry: Any) -> list[PresetError]:
    """Every problem of the ``[parallel]`` layout against the world size, the plugins and the batch
    (:data:`LAYOUT_CHECKS`) of a preset whose tables are valid. The model's own limits (heads, widths, layers) are
    its plugin's ``check_preset``."""
    return [problem for check in LAYOUT_CHECKS for problem in check(preset, registry)]
