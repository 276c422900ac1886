"""Checks of the ``[parallel]`` layout that span tables: the world size, the plugins, the batch (run once every
table is valid, before anything starts; each problem is one line naming its key)."""

from __future__ import annotations

from typing import Any

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
        return f"{m} micro-batches are fewer than the {need} stages {schedule} needs (use >= {need}, or gpipe)"
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


def check_parallel(preset: Preset, registry: Any) -> PresetError | None:
    """The ``[parallel]`` layout against the world size, the plugins and the batch: tp x pp must divide the world
    size (the rest is the data-parallel degree); the model and strategy plugins must support each kind of split
    (their options class says so with a class attribute ``tensor_parallel = True`` / ``pipeline_parallel = True``);
    a pipeline's micro-batches must split the step's batch evenly and be enough for its schedule
    (:func:`valid_microbatches` lists the counts that do both). The model's own limits (heads, widths, layers) are its
    plugin's ``check_preset``."""
    par, world = preset.parallel, preset.world_size
    if par.tp == 1 and par.pp == 1:
        return None
    if world % (par.tp * par.pp):
        name, other = ("tp", par.pp) if par.pp == 1 else ("pp", par.tp)
        valid = ", ".join(str(d) for d in range(1, world + 1) if world % (d * other) == 0) or "none"
        return PresetError(f"tp x pp = {par.tp} x {par.pp} does not divide the world size {world} "
                           f"(launch.nproc_per_node x launch.nnodes); the data-parallel degree is world size / "
                           f"(tp x pp) (valid {name}: {valid})", key=f"parallel.{name}")
    for degree, attribute, name in ((par.tp, "tensor_parallel", "tp"), (par.pp, "pipeline_parallel", "pp")):
        if degree == 1:
            continue
        for table in ("model", "strategy"):
            section = getattr(preset, table)
            if not getattr(type(section.options), attribute, False):
                valid = _supports(registry, PLUGIN_TABLES[table], attribute)
                return PresetError(f"{section.name!r} does not support parallel.{name} = {degree} (valid with "
                                   f"{name} > 1: {', '.join(valid) or 'none'})", key=f"{table}.name")
    native_problem = native_tp_problem(preset) if par.tp > 1 and par.tp_impl == "native" else None
    if native_problem:
        return PresetError(f"{native_problem}: set parallel.tp_impl = \"scratch\" (by hand) or \"auto\" (DTensor "
                           f"where it runs, else by hand)", key="parallel.tp_impl")
    if par.pp > 1:
        dp = world // (par.tp * par.pp)
        if dp > 1 and par.pp_schedule in PP_V_SHAPED and getattr(preset.model.options, "tie_embeddings", False):
            return PresetError(f"{par.pp_schedule} runs the first and the last stage on one rank, whose tied embedding "
                               f"would be two data-parallel units there (dp = {dp}): set model.tie_embeddings = false "
                               f"or use a looped schedule (gpipe, 1f1b, interleaved-1f1b)", key="parallel.pp_schedule")
        t = preset.training
        if t.precision == "fp16":
            return PresetError("fp16 needs loss scaling, which the pipeline schedules do not apply: use bf16 or fp32 "
                               "with parallel.pp > 1", key="training.precision")
        m, samples = pipeline_microbatches(preset), t.micro_batch_size * t.grad_accum
        if samples % m:
            ok = valid_microbatches(par.pp_schedule, par.pp, par.pp_stages_per_rank, samples)
            valid = ", ".join(map(str, ok)) or (f"none for {par.pp_schedule} on {par.pp} stages: raise "
                                                f"training.grad_accum or training.micro_batch_size")
            return PresetError(f"{m} does not divide the step's micro_batch_size x grad_accum = {samples} samples "
                               f"per replica (each pipeline micro-batch takes an equal share; valid: {valid})",
                               key="parallel.pp_microbatches")
        problem = microbatch_problem(par.pp_schedule, par.pp, par.pp_stages_per_rank, m)
        if problem:
            return PresetError(problem, key="parallel.pp_microbatches")
    return None
