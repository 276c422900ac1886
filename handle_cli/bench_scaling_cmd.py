"""``handle bench scaling``: how training throughput scales with the world size, per strategy, measured with
short real runs through ``handle run``'s own launcher. The figures (medians, efficiency, strategy specs):
:mod:`torch_handle.plan.bench_scaling`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from handle_cli.bench_cmd import DEFAULT_OUTPUT_DIR, int_option, new_dir, output_parent
from handle_cli.common import EXIT_FAILED, EXIT_STOPPED, fail
from torch_handle.common.fsio import write_json_atomic
from torch_handle.common.run_layout import RunLayout
from torch_handle.common.units import fmt_bytes
from torch_handle.common.procs import usable_cores
from torch_handle.launch import cores as cores_math
from torch_handle.plan import bench_scaling as scaling_math

DEFAULT_STEPS = 20


@dataclass(frozen=True)
class ScalingPlan:
    """The validated options and the runs of one ``bench scaling``."""

    preset: str
    """The preset's path."""
    base: Any
    """The preset as loaded with the user's overrides (``Preset``)."""
    runs: list[dict[str, Any]]
    """One per (strategy, world size, tp), as :func:`_scaling_plan` makes them."""
    notes: list[str]
    nprocs: list[int]
    skip: int
    weak: bool
    threads: int | None
    overrides: tuple[str, ...]
    directory: Path
    """``DIR/scaling-<UTC time>/``, created."""


def _scaling_plan(preset: str, overrides: tuple[str, ...], nprocs: list[int], labels: list[str] | None,
                  steps: int | None, skip: int, strong: bool, tps: list[int] | None = None,
                  layouts: list[scaling_math.LayoutSpec] | None = None) -> tuple[list[dict[str, Any]], list[str], Any]:
    """Validate every (strategy, world size, tp or layout) preset before anything starts: ``(runs, notes, base
    preset)``, each run ``{"label", "layout", "layout_label" (the run's as run), "name", "spec", "nproc", "dp", "tp",
    "pp", "overrides", "preset", "micro_batch_size", "grad_accum", "global_batch"}`` (the sweep:
    :func:`torch_handle.plan.bench_scaling.sweep` or :func:`~torch_handle.plan.bench_scaling.layout_runs`). A layout the
    preset's validation refuses is left out with its reason as a note. Bad input: one line, exit 2."""
    from torch_handle.config.loader import load_preset
    from torch_handle.errors import USER_ERRORS, PresetError
    from torch_handle.launch.run import check_inputs
    from torch_handle.registry import get_registry

    user = list(overrides)
    if steps is not None:
        user.append(f"training.steps={steps}")
    elif not any(o.replace(" ", "").startswith("training.steps=") for o in overrides):
        user.append(f"training.steps={DEFAULT_STEPS}")
    try:
        base = load_preset(preset, user)
        check_inputs(base)
    except USER_ERRORS as e:
        fail(str(e))
    if base.launch.nnodes != 1:
        fail(f"{preset}: launch.nnodes = {base.launch.nnodes}: bench scaling runs on this machine only (nnodes 1)")
    if base.training.steps <= skip:
        fail(f"--skip {skip} leaves none of the {base.training.steps} steps to measure (raise --steps)")
    if labels is None:
        own = scaling_math.preset_strategy_label(base.strategy.name, getattr(base.strategy.options, "zero_stage", None))
        specs = [scaling_math.StrategySpec(own, base.strategy.name, ())]
    else:
        specs = [scaling_math.strategy_spec(label) for label in labels]
    notes: list[str] = []
    registered = set(get_registry().names("strategy"))
    for spec in [s for s in specs if s.plugin not in registered]:
        notes.append(f"{spec.label} skipped: strategy plugin {spec.plugin!r} is not registered "
                     f"(available: {', '.join(sorted(registered))})")
    specs = [s for s in specs if s.plugin in registered]
    sweeps = []
    for spec in specs:
        if layouts is None:
            spec_runs, spec_notes = scaling_math.sweep(spec, nprocs, tps)
        else:
            spec_runs, spec_notes = scaling_math.layout_runs(spec, layouts)
        sweeps += spec_runs
        notes += [n for n in spec_notes if n not in notes]
    mbs0, ga0 = base.training.micro_batch_size, base.training.grad_accum
    dp0 = sweeps[0].dp if sweeps else nprocs[0]  # the strong-scaling base: the first run's replicas
    global_batch = mbs0 * ga0 * dp0
    runs = []
    for run in sweeps:
        n, dp = run.nproc, run.dp
        mbs, ga = mbs0, ga0
        if strong:
            try:
                mbs, ga = scaling_math.strong_batch(global_batch, mbs0, ga0, dp)
            except ValueError:
                unit = "replicas" if any(r.dp != r.nproc for r in sweeps) else "ranks"  # dp = ranks without TP/PP
                fail(f"--strong: the global batch of {global_batch} samples (micro_batch_size {mbs0} x "
                     f"grad_accum {ga0} x {dp0} {unit}) does not divide over {dp} {unit} (choose other "
                     f"--nproc or set training.micro_batch_size)")
        name = f"{run.label}-{run.layout}" if run.layout else f"{run.label}-n{n}"
        extra = [*run.overrides, f"launch.nproc_per_node={n}", "launch.max_restarts=0",
                 f"run.name={name}", f"training.micro_batch_size={mbs}", f"training.grad_accum={ga}"]
        chosen = _pipeline_microbatches(base, run.pp, mbs, ga) if run.layout and (run.pp or 1) > 1 else None
        if chosen is not None:
            extra.append(f"parallel.pp_microbatches={chosen[0]}")
        try:
            loaded = load_preset(preset, [*user, *extra])
        except USER_ERRORS as e:
            if run.layout is None:
                fail(f"{run.label} on {_ranks(n)}: {e}")
            reason = f"{e.key}: {e.message}" if isinstance(e, PresetError) and e.key else str(e)  # the first
            if len(getattr(e, "problems", ())) > 1:
                reason += f" (and {len(e.problems) - 1} more)"
            notes.append(f"{run.label} {run.layout} skipped: {reason}")
            continue
        if chosen is not None:
            notes.append(f"{run.label} {run.layout}: {chosen[1]}")
        dp = n // (loaded.parallel.tp * loaded.parallel.pp)
        runs.append({"label": run.label, "layout": run.layout, "layout_label": RunLayout.from_preset(loaded).label(),
                     "name": name, "spec": run.spec, "nproc": n,
                     "dp": dp, "tp": loaded.parallel.tp, "pp": loaded.parallel.pp, "overrides": [*user, *extra],
                     "preset": loaded, "micro_batch_size": mbs, "grad_accum": ga, "global_batch": mbs * ga * dp})
    if not runs:
        fail("nothing to run: " + "; ".join(notes))
    return runs, notes, base


def _pipeline_microbatches(base: Any, pp: int, mbs: int, ga: int) -> tuple[int, str] | None:
    """For a ``--layouts`` row with ``pp`` > 1: ``(m, note)`` when the preset's pipeline micro-batches (m =
    ``parallel.pp_microbatches``, or grad_accum when 0) cannot split this row's ``mbs`` x ``ga`` samples per
    replica or are too few for its schedule; m is the smallest count that passes every check, so the row runs with
    the same micro_batch_size and grad_accum (the same global batch) as the others. None: the preset's m is
    valid, or no count is (the row is then skipped with the checks' reason)."""
    from torch_handle.config.layout import microbatch_problem, valid_microbatches

    par, samples = base.parallel, mbs * ga
    m = par.pp_microbatches or ga
    if samples % m == 0 and microbatch_problem(par.pp_schedule, pp, par.pp_stages_per_rank, m) is None:
        return None
    valid = valid_microbatches(par.pp_schedule, pp, par.pp_stages_per_rank, samples)
    if not valid:
        return None
    return valid[0], (f"parallel.pp_microbatches = {valid[0]} chosen ({par.pp_schedule} on {pp} stages cannot run "
                      f"{m} micro-batch{'es' if m != 1 else ''}; the step's {mbs} x {ga} = {samples} samples per "
                      f"replica split into {valid[0]} of {samples // valid[0]}; micro_batch_size and grad_accum "
                      f"as in the other rows)")


def _run_one(preset: str, run: dict[str, Any], directory: Path) -> tuple[int, dict[str, Any], list[dict], float]:
    """One run through ``handle run``'s launcher (prepare_run + supervise, quiet): ``(exit code, run.json,
    events, wall seconds)``. Ctrl-C is supervise's: the workers stop (a second one kills them), exit code 130."""
    from handle_cli.runner import supervise
    from torch_handle.launch.run import prepare_run
    from torch_handle.observe.tail import EventReader
    from torch_handle.observe.telemetry import EVENTS_FILE
    from torch_handle.rundir import read_run_info

    run_dir = directory / run["run_name"]
    t0 = time.perf_counter()
    loaded, run_dir = prepare_run(preset, (*run["overrides"], f"run.output_dir={directory}"), run_dir, None)
    rc = supervise(loaded, run_dir, quiet=True)
    wall = time.perf_counter() - t0
    return rc, read_run_info(run_dir), EventReader(run_dir / EVENTS_FILE).poll(), wall


def _scaling_record(run: dict[str, Any], rc: int, info: dict[str, Any], events: list[dict], wall: float, skip: int,
                    mode: str, cores: int, run_dir: Path) -> dict[str, Any]:
    n = run["nproc"]
    summary = scaling_math.summarize(events, skip)
    status, message = info.get("status") or "failed", info.get("message") or None
    if rc == 0 and (not summary["measured_steps"] or summary["tokens_per_s"] is None):
        status, message = "failed", f"no step events after the first {skip} (see {run_dir}/events.jsonl)"
    omp = os.environ.get("OMP_NUM_THREADS")
    return {"strategy": run["label"], "plugin": run["spec"].plugin, "layout": run["layout"],
            "layout_label": run["layout_label"], "nproc": n,
            "dp": run["dp"], "tp": run["tp"], "pp": run["pp"],
            "status": status, "message": message, "mode": mode, "micro_batch_size": run["micro_batch_size"],
            "grad_accum": run["grad_accum"], "global_batch": run["global_batch"], **summary,
            "efficiency": None, "base_nproc": None, "base_tokens_per_s": None,
            "threads_per_rank": cores_math.threads_per_rank(n, cores, omp),
            "oversubscribed": cores_math.oversubscribed(n, cores, omp), "wall_s": round(wall, 2),
            "run_dir": str(run_dir)}


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _what(r: dict[str, Any]) -> str:
    """How a run or record is named in messages: ``ddp on 2 ranks``, ``ddp dp2xtp2 on 4 ranks``."""
    label = r.get("label") or r["strategy"]
    return f"{label}{' ' + r['layout'] if r.get('layout') else ''} on {_ranks(r['nproc'])}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def scaling_table(records: list[dict[str, Any]]):
    """A rich Table: strategy (the series, the efficiency base), layout (each run's as run, the line every view shows:
    ``dp 1 × tp 2 (tp scratch)`` for a tp2 run of the ddp series, which ``single`` runs), ranks, status, tokens/s, step
    time and phases (ms, medians), efficiency, and the largest per-rank memory peaks (rss, model state = param + grad +
    optimizer; CUDA max allocated if any)."""
    from rich.table import Table

    cuda = any(m.get("cuda_max_allocated_bytes") is not None for r in records for m in r.get("memory") or [])
    table = Table(header_style="bold")
    layouts = any(r.get("layout") or r.get("layout_label") for r in records)
    columns = [("strategy", "left"), *([("layout", "left")] if layouts else []), ("ranks", "right"),
               ("status", "left"), ("tokens/s", "right"),
               ("step ms", "right"), ("eff.", "right"), ("rss", "right"), ("state", "right")]
    columns += [("cuda", "right")] if cuda else []
    columns += [(label, "right") for label, _ in scaling_math.TABLE_PARTS]
    widest = max([8, *(len(r["strategy"]) for r in records)])
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name != "layout",  # a long layout wraps, not the figures
                         min_width=widest if name == "strategy" else None)
    last = None
    for r in records:
        if last is not None and r["strategy"] != last:
            table.add_section()
        last = r["strategy"]
        memory = r.get("memory") or []
        eff = r.get("efficiency")
        status = "ok" if r["status"] == "finished" else f"[bold red]{r['status']}[/]"
        row = [r["strategy"], *([r.get("layout_label") or r.get("layout") or "-"] if layouts else []),
               f"{r['nproc']}{'*' if r.get('oversubscribed') else ''}", status,
               "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}", _ms(r.get("step_time_s")),
               "-" if eff is None else f"{eff:.2f}",
               fmt_bytes(scaling_math.peak_over_ranks(memory, "rss_bytes")),
               fmt_bytes(scaling_math.peak_over_ranks(memory, "model_state_bytes"))]
        row += [fmt_bytes(scaling_math.peak_over_ranks(memory, "cuda_max_allocated_bytes"))] if cuda else []
        row += [_ms(x) for x in scaling_math.table_parts(r)]
        table.add_row(*row)
    return table


def scaling_plots(records: list[dict[str, Any]], width: int = 100, height: int = 14, color: bool = False) -> str:
    """Two plotext plots drawn into a string: tokens/s and scaling efficiency against world size, one line per
    strategy (finished runs only); with layouts, one bar per run instead."""
    import plotext as plt

    ok = [r for r in records if r.get("tokens_per_s") is not None and r["status"] == "finished"]
    layouts = any(r.get("layout") for r in ok)
    titles = (("tokens/s (global) by layout", "scaling efficiency by layout (1.0 = linear in ranks)") if layouts
              else ("tokens/s (global) by world size", "scaling efficiency by world size (1.0 = linear)"))
    out = []
    for key, title in zip(("tokens_per_s", "efficiency"), titles):
        plt.clear_figure()
        plt.limitsize(False, False)
        plt.plotsize(width, height)
        plt.theme("pro" if color else "clear")
        (_draw_bars if layouts else _draw_lines)(plt, ok, key, color)
        plt.title(title)
        text = plt.build()
        out.append(text if color else plt.uncolorize(text))
    plt.clear_figure()
    return "\n".join(out)


def _draw_lines(plt: Any, ok: list[dict[str, Any]], key: str, color: bool) -> None:
    """``key`` against the world size, one line per strategy."""
    sizes = sorted({r["nproc"] for r in ok})
    for i, label in enumerate(dict.fromkeys(r["strategy"] for r in ok)):
        rows = sorted((r for r in ok if r["strategy"] == label and r.get(key) is not None), key=lambda r: r["nproc"])
        if rows:
            plt.plot([r["nproc"] for r in rows], [r[key] for r in rows], label=label,
                     marker="braille" if color else "*o+x#@%&"[i % 8])
    if key == "efficiency":
        plt.ylim(0, max([1.1, *(r["efficiency"] * 1.1 for r in ok if r.get("efficiency"))]))
    plt.xticks(sizes, [str(s) for s in sizes])
    plt.xlabel("world size (ranks)")


def _draw_bars(plt: Any, ok: list[dict[str, Any]], key: str, color: bool) -> None:
    """``key`` of each run, one bar per layout (``strategy layout`` with several strategies)."""
    one = len({r["strategy"] for r in ok}) == 1
    plt.bar([r["layout"] if one else f"{r['strategy']} {r['layout']}" for r in ok], [r.get(key) or 0.0 for r in ok],
            width=0.5)


@click.command("scaling")
@click.argument("preset")
@click.option("--set", "overrides", multiple=True, metavar="TABLE.KEY=VALUE",
              help="Override a preset key for every run (repeatable), as in handle run.")
@click.option("--nproc", "nproc_spec", default=None, metavar="N[,N...]",
              help="World sizes (ranks on this machine) to measure  [default: 1,2].")
@click.option("--strategies", "strategies_spec", default=None, metavar="S[,S...]",
              help=f"Strategies to compare: {', '.join(scaling_math.STRATEGY_NAMES)} (scratch-* only where that "
                   "plugin is registered); default: the preset's own.")
@click.option("--steps", default=None, metavar="N",
              help=f"Training steps per run (default {DEFAULT_STEPS}, or the preset's when --set training.steps "
                   "is given).")
@click.option("--skip", default="2", show_default=True, metavar="N",
              help="Warm-up steps left out of the medians.")
@click.option("--tp", "tp_spec", default=None, metavar="N[,N...]",
              help="Tensor-parallel degrees to sweep: each world size runs with each N that divides it (--set "
                   "parallel.tp=N; strategy single where dp = world / N is 1); default: the preset's own.")
@click.option("--layouts", "layouts_spec", default=None, metavar="L[,L...]",
              help=f"Layouts to measure instead of --nproc/--tp: {scaling_math.LAYOUT_FORMS}; each runs on its "
                   "product of ranks (dp2xtp2: 4) with parallel.tp and parallel.pp set.")
@click.option("--weak/--strong", "weak", default=True, show_default=True,
              help="weak: the per-rank batch stays fixed; strong: the global batch of the smallest world size "
                   "stays fixed (grad_accum, else micro_batch_size, adjusted).")
@click.option("--threads", default=None, metavar="N",
              help="Intra-op threads per rank in every run (OMP_NUM_THREADS); default: OMP_NUM_THREADS if set, "
                   "else the launcher's cores / ranks, which differs between world sizes.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per run (strategy and world size or layout) per line on stdout, nothing else.")
@click.option("--output-dir", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help=f"Runs and results go to DIR/scaling-<UTC time>/ (default DIR: {DEFAULT_OUTPUT_DIR}).")
def scaling(preset: str, overrides: tuple[str, ...], nproc_spec: str | None, strategies_spec: str | None,
            tp_spec: str | None, layouts_spec: str | None, steps: str | None, skip: str, weak: bool,
            threads: str | None, as_json: bool, output_dir: Path | None) -> None:
    """Measure how training throughput scales with the world size, per strategy, with short real runs.

    Each (strategy, world size) is one run of PRESET through handle run's launcher, a run directory under
    DIR/scaling-<UTC time>/ (open any with handle tui). From its step events after the first --skip: the
    median global tokens/s and step time, the phase times where the events carry them (data, forward,
    backward, optimizer, comm), and per rank the peak rss and model-state bytes (CUDA max allocated on GPU).
    Efficiency = tokens/s at N / (N/B x tokens/s at B), B = the strategy's smallest world size measured.

    Threads: each rank gets the launcher's cores / ranks intra-op threads unless --threads (or
    OMP_NUM_THREADS) fixes them; on a loaded machine a rank with several threads can be far slower than its
    share, so compare with --threads 1 before reading efficiency above 1 as real.

    Strategies: ddp, zero0..zero3 (DeepSpeed stages), fsdp, single (world size 1), scratch-ddp and
    scratch-zero1 (where registered). With --tp each world size also runs with each tensor-parallel degree
    that divides it, as the series <strategy>-tp<N> (dp = world / N replicas; global batch and --strong
    count replicas, not ranks). With --layouts each item is one run on dp x tp x pp ranks (parallel.tp and
    parallel.pp set; single where dp = 1), a layout column in the table, efficiency against the strategy's
    smallest run; a pp row whose pipeline micro-batches the schedule refuses runs with the smallest valid
    parallel.pp_microbatches (the same batch; a note says so), and a layout the preset's checks still refuse
    is skipped with their reason. Prints a table and plots
    (--json: JSON lines) and writes results.csv and results.json. Exit code: 0 every run finished, 1 a run
    failed (the others still run), 2 bad input (nothing started), 130 stopped by Ctrl-C (the current run's
    workers stopped).

    \b
    Examples:
      handle bench scaling presets/ddp.toml --nproc 1,2 --steps 12
      handle bench scaling presets/ddp.toml --nproc 2,4 --tp 1,2 --steps 12
      handle bench scaling presets/ddp.toml --layouts dp1,dp2,tp2,pp2,dp2xtp2 --steps 12 \\
        --set parallel.tp_impl=scratch --set training.grad_accum=2
    """
    plan = _validate(preset, overrides, nproc_spec, strategies_spec, tp_spec, layouts_spec, steps, skip, weak,
                     threads, output_dir)
    meta = _header(plan, as_json)
    records, stopped = _run(plan, meta, as_json)
    _results(plan, meta, records, stopped, as_json)


def _validate(preset: str, overrides: tuple[str, ...], nproc_spec: str | None, strategies_spec: str | None,
              tp_spec: str | None, layouts_spec: str | None, steps: str | None, skip: str, weak: bool,
              threads: str | None, output_dir: Path | None) -> ScalingPlan:
    """Every option and every run's preset checked before anything starts (a one-line error, exit 2), then the
    output directory."""
    layouts = None
    if layouts_spec is not None:
        if nproc_spec is not None or tp_spec is not None:
            fail("--layouts sets each run's world size and tp: leave out --nproc and --tp")
        try:
            layouts = scaling_math.parse_layouts(layouts_spec)
        except ValueError as e:
            fail(f"--layouts: {e}")
    try:
        nprocs = scaling_math.parse_nproc(nproc_spec or "1,2")
    except ValueError as e:
        fail(f"--nproc: {e}")
    try:
        labels = scaling_math.parse_strategies(strategies_spec) if strategies_spec is not None else None
    except ValueError as e:
        fail(f"--strategies: {e}")
    try:
        tps = scaling_math.parse_nproc(tp_spec) if tp_spec is not None else None
    except ValueError as e:
        fail(f"--tp: {e}")
    n_steps = int_option("--steps", steps, 1, 1_000_000) if steps is not None else None
    n_skip = int_option("--skip", skip, 0, 1_000_000)
    n_threads = int_option("--threads", threads, 1, 1024) if threads is not None else None
    parent = output_parent(output_dir)
    from handle_cli.presets_cmd import resolve_preset_spec

    preset = resolve_preset_spec(preset)
    runs, notes, base = _scaling_plan(preset, overrides, nprocs, labels, n_steps, n_skip, not weak, tps, layouts)
    if layouts is not None:
        nprocs = sorted({r["nproc"] for r in runs})
    return ScalingPlan(preset, base, runs, notes, nprocs, n_skip, weak, n_threads, overrides,
                       new_dir(parent, "scaling"))


def _header(plan: ScalingPlan, as_json: bool) -> dict[str, Any]:
    """Print what will be measured and how (on stderr with ``--json``); the results' metadata, to be filled."""
    nprocs, n_skip, directory = plan.nprocs, plan.skip, plan.directory
    mode = "weak" if plan.weak else "strong"
    cores = usable_cores()
    if plan.threads is not None:  # the launcher passes our environment on to every run's workers
        os.environ["OMP_NUM_THREADS"] = str(plan.threads)
    omp = os.environ.get("OMP_NUM_THREADS")
    t = plan.base.training
    if plan.weak:
        how = (f"weak scaling: per-rank batch fixed (micro_batch_size {t.micro_batch_size} x grad_accum "
               f"{t.grad_accum}); the global batch grows with the world size")
    else:
        how = (f"strong scaling: global batch fixed at {plan.runs[0]['global_batch']} samples (the preset's at "
               f"{_ranks(plan.runs[0]['nproc'])}); grad_accum, else micro_batch_size, adjusted per world size")
    header = [(f"bench scaling: {plan.preset}, {t.steps} steps per run, medians of steps {n_skip + 1}..{t.steps} "
               f"(first {n_skip} skipped); {len(plan.runs)} runs under {directory}"), how,
              (f"efficiency = tokens/s at N / (N/B x tokens/s at B), B = each strategy's smallest world size "
               f"measured (here {nprocs[0]})")]
    tps = sorted({r["tp"] for r in plan.runs})
    if plan.runs[0]["layout"]:
        header.append(f"layouts: {', '.join(dict.fromkeys(r['layout'] for r in plan.runs))}, each on dp x tp x pp "
                      f"ranks (single where dp = 1); the global batch counts replicas (dp)")
    elif tps[-1] > 1:
        header.append(f"tensor parallel: tp {', '.join(map(str, tps))}, series <strategy>-tp<N> on dp = world size / "
                      f"N replicas (single where dp = 1); the global batch counts replicas")
    per_rank = {n: cores_math.threads_per_rank(n, cores, omp) for n in nprocs}
    if len(set(per_rank.values())) > 1:
        header.append("threads per rank: " + ", ".join(f"{k} at {_ranks(n)}" for n, k in per_rank.items())
                      + f" (the launcher's {cores} cores / ranks; --threads N keeps them equal)")
    else:
        header.append(f"threads per rank: {per_rank[nprocs[0]]} in every run"
                      + (" (OMP_NUM_THREADS)" if omp else ""))
    over = [n for n in nprocs if cores_math.oversubscribed(n, cores, omp)]
    if over:
        header.append(f"warning: {', '.join(map(str, over))} ranks x "
                      f"{cores_math.threads_per_rank(over[0], cores, omp)} thread(s) each exceed this machine's "
                      f"{cores} cores: oversubscribed, figures marked * show contention, not scaling")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5 * cores:
        header.append(f"note: this machine is busy (load average {load:.1f} on {cores} cores): other processes "
                      "compete with the runs and the figures")
    header += [f"note: {n}" for n in plan.notes]
    for line in header:
        click.echo(line, err=as_json)
    return {"kind": "scaling", "status": "running", "preset": plan.preset, "overrides": list(plan.overrides),
            "mode": mode, "nproc": nprocs, "strategies": [r["label"] for r in plan.runs],
            "layouts": [r["layout"] for r in plan.runs if r["layout"]] or None, "steps": t.steps,
            "skip": n_skip, "cores": cores, "omp_num_threads": omp, "load_avg_1m": round(load, 2),
            "notes": plan.notes, "header": header, "start_time": time.time(), "results": []}


def _run(plan: ScalingPlan, meta: dict[str, Any], as_json: bool) -> tuple[list[dict[str, Any]], bool]:
    """The runs one after the other, each one's record printed (``--json``) and saved to ``results.json`` as it
    ends: ``(records, stopped by Ctrl-C)``."""
    directory, mode, cores = plan.directory, meta["mode"], meta["cores"]
    records: list[dict[str, Any]] = []
    progress_tty = sys.stderr.isatty()
    stopped = False
    for i, run in enumerate(plan.runs, 1):
        run["run_name"] = run["name"]
        what = f"[{i}/{len(plan.runs)}] {_what(run)}"
        if progress_tty:
            click.echo(f"{what}: running ({directory / run['run_name']})", err=True, nl=False)
        run_load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        try:
            rc, info, events, wall = _run_one(plan.preset, run, directory)
        except KeyboardInterrupt:  # between supervise's own handlers: nothing of this run is alive
            rc, info, events, wall = EXIT_STOPPED, {"status": "stopped", "message": "stopped by Ctrl-C"}, [], 0.0
        record = _scaling_record(run, rc, info, events, wall, plan.skip, mode, cores, directory / run["run_name"])
        record["load_avg_1m"] = None if run_load is None else round(run_load, 2)
        records.append(record)
        scaling_math.add_efficiency(records)
        tps, eff = record["tokens_per_s"], record["efficiency"]
        done = f"{what}: {record['status']} in {wall:.1f} s" + (f", {tps:,.0f} tokens/s" if tps else "") + \
            (f", efficiency {eff:.2f} (base {record['base_nproc']})" if eff is not None else "")
        if record["status"] != "finished" and record["message"]:
            done += f": {record['message']}"
        click.echo(("\r\033[K" if progress_tty else "") + done, err=True)
        if as_json and record["status"] != "stopped":
            click.echo(json.dumps(record))
        meta["results"] = records
        write_json_atomic(directory / "results.json", meta)
        if rc == EXIT_STOPPED or record["status"] == "stopped":
            stopped = True
            break
    return records, stopped


def _results(plan: ScalingPlan, meta: dict[str, Any], records: list[dict[str, Any]], stopped: bool,
             as_json: bool) -> None:
    """``results.json`` and ``results.csv``, the report (table and plots; with ``--json`` only where the results
    are), and the exit: 130 when stopped, 1 with the first failed run."""
    directory = plan.directory
    failed = [r for r in records if r["status"] not in ("finished", "stopped")]
    meta.update(status="stopped" if stopped else "failed" if failed else "finished", end_time=time.time(),
                results=records)
    write_json_atomic(directory / "results.json", meta)
    (directory / "results.csv").write_text(scaling_math.csv_text(records), encoding="utf-8")
    if not as_json and records:
        _print_scaling_report(records, directory)
    elif as_json:
        click.echo(f"results: {directory / 'results.csv'} {directory / 'results.json'}", err=True)
    if stopped:
        click.echo(f"bench scaling: stopped; results of the finished runs in {directory}", err=True)
        sys.exit(EXIT_STOPPED)
    if failed:
        r = failed[0]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        fail(f"bench scaling: {_what(r)} failed: {r['message'] or r['status']}{more}; see {r['run_dir']}/logs",
             code=EXIT_FAILED)


def _print_scaling_report(records: list[dict[str, Any]], directory: Path) -> None:
    from rich.console import Console
    from rich.text import Text

    tty = sys.stdout.isatty()
    console = Console(highlight=False, width=None if tty else 130)
    console.print(scaling_table(records))
    console.print("status ok: finished; tokens/s: median global tokens/s; step ms and data/fwd/bwd/opt/comm: "
                  "median ms per step ('-': not in the events); rss, state (param + grad + optimizer bytes)"
                  + (", cuda (max allocated)" if any(m.get("cuda_max_allocated_bytes") is not None
                                                     for r in records for m in r.get("memory") or []) else "")
                  + ": peak per rank, the largest rank's", markup=False)
    for r in records:
        if r["status"] != "finished" and r.get("message"):
            console.print(f"{_what(r)} {r['status']}: {r['message']}", markup=False)
    superlinear = [r for r in records if (r.get("efficiency") or 0) > 1.1]
    if superlinear:
        loads = sorted({r["load_avg_1m"] for r in records if r.get("load_avg_1m") is not None})
        console.print("note: efficiency above 1 at " + ", ".join(f"{r['strategy']} {r['nproc']} ranks"
                                                                  for r in superlinear)
                      + ": the base run was slower per rank (other load on the machine"
                      + (f", load average {loads[0]:.1f}-{loads[-1]:.1f}" if loads else "")
                      + ("; or its threads per rank: --threads 1 keeps them equal"
                         if len({r.get("threads_per_rank") for r in records}) > 1 else "") + ")", markup=False)
    if any(r["status"] == "finished" and r.get("tokens_per_s") for r in records):
        width = max(60, min(console.width, 110))
        plots = scaling_plots(records, width=width, height=14, color=tty and console.color_system is not None)
        console.print(Text.from_ansi(plots) if tty else plots, markup=False, highlight=False, soft_wrap=True)
    console.print(f"results: {directory / 'results.csv'}, {directory / 'results.json'}; runs: handle tui "
                  f"{directory}/<strategy>-{'<layout>' if records[0].get('layout') else 'n<N>'}", markup=False)
