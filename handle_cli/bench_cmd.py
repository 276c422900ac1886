"""``handle bench``: benchmarks run through torchrun. ``bench comm``: collective bandwidth in the spirit of
nccl-tests (the worker is ``torch_handle.plan.bench_comm``). ``bench scaling``: short real training runs per
strategy and world size through ``handle run``'s own launcher (the figures: ``torch_handle.plan.bench_scaling``).

Process hygiene as ``handle env --check-dist``: torchrun runs in its own session and dies with this process
(PR_SET_PDEATHSIG); every process of its tree that was seen is terminated at the end, on a timeout and on
Ctrl-C. Click, the standard library and torch-free project modules only at import: rich, plotext, psutil and
torch are imported inside the command.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from torch_handle.plan import bench_scaling as scaling_math
from torch_handle.plan.bench_comm import (DTYPES, ERROR_MARKER, MARKER, OPS, check_size, fmt_bytes, gloo_note, parse_ops,
                                     parse_sizes)

from handle_cli.common import EXIT_FAILED, EXIT_STOPPED, fail

DEFAULT_SIZES = "1K:64M"
DEFAULT_OUTPUT_DIR = Path("runs") / "bench"
BACKENDS = ("auto", "gloo", "nccl")


@click.group("bench", context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks run with torchrun on this machine.

    \b
    Example:
      handle bench comm --nproc 2                      # all_reduce, all_gather, reduce_scatter, broadcast
      handle bench scaling presets/ddp.toml --nproc 1,2 --strategies ddp,zero2,fsdp
    """


def _new_dir(parent: Path, prefix: str) -> Path:
    """``parent/<prefix>-<UTC timestamp>`` (``-2``, ``-3`` ... when taken), created."""
    from torch_handle.rundir import utc_stamp

    parent.mkdir(parents=True, exist_ok=True)
    base = parent / f"{prefix}-{utc_stamp()}"
    path, n = base, 1
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")


# ---------------------------------------------------------------------------------------------------------------
# handle bench comm
# ---------------------------------------------------------------------------------------------------------------


def _resolve_backend(backend: str, nproc: int) -> str:
    """auto -> nccl with one visible GPU per process, else gloo; nccl without enough GPUs is bad input."""
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = dist.is_available() and dist.is_nccl_available()
    if backend == "auto":
        return "nccl" if nccl and gpus >= nproc else "gloo"
    if backend == "nccl" and not (nccl and gpus >= nproc):
        why = "this torch has no NCCL" if not nccl else f"{gpus} CUDA device(s) visible"
        fail(f"--backend nccl needs one CUDA device per process ({nproc}); {why} (use --backend gloo)")
    if not (dist.is_available() and dist.is_gloo_available()):
        fail("--backend gloo: this torch has no gloo backend")
    return backend


def _check_memory(sizes: list[int], nproc: int) -> None:
    """gloo on CPU: each rank holds about 8x the largest message at peak (buffers, gloo's reduce_scatter copy,
    the float64 check); refuse what cannot fit in the available memory."""
    import psutil

    need = 8 * max(sizes) * nproc
    avail = psutil.virtual_memory().available
    if need > avail:
        fail(f"--sizes: {fmt_bytes(max(sizes))} on {nproc} processes needs about {need / 2**30:.1f} GiB of memory, "
             f"{avail / 2**30:.1f} GiB available (lower MAX)")


def results_table(records: list[dict[str, Any]]):
    """A rich Table of the measurements: op, size, count, iterations, time (µs), algbw and busbw (GB/s), check."""
    from rich.table import Table

    table = Table(title=None, header_style="bold")
    for name, justify in (("op", "left"), ("size", "right"), ("count", "right"), ("iters", "right"),
                          ("time (µs)", "right"), ("algbw (GB/s)", "right"), ("busbw (GB/s)", "right"),
                          ("check", "left")):
        table.add_column(name, justify=justify)
    last = None
    for r in records:
        if last is not None and r["op"] != last:
            table.add_section()
        last = r["op"]
        table.add_row(r["op"], fmt_bytes(r["bytes"]), f"{r['count']:,}", str(r["iters"]), f"{r['time_us']:,.1f}",
                      f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}",
                      "ok" if r["correct"] else f"[bold red]WRONG[/] (rel. error {r['max_rel_error']:.3g})")
    return table


def bandwidth_plot(records: list[dict[str, Any]], width: int = 100, height: int = 20, color: bool = False) -> str:
    """busbw (GB/s) against message size (log2 axis), one line per op, drawn by plotext into a string."""
    import math

    import plotext as plt

    plt.clear_figure()
    plt.limitsize(False, False)  # the size asked for, not the terminal's (which may be none: a pipe)
    plt.plotsize(width, height)
    plt.theme("pro" if color else "clear")
    ops = [op for op in OPS if any(r["op"] == op for r in records)]
    xs: set[int] = set()
    for op in ops:
        marker = dict(zip(OPS, "*o+x"))[op]
        rows = sorted((r for r in records if r["op"] == op), key=lambda r: r["bytes"])
        x = [math.log2(r["bytes"]) for r in rows]
        xs.update(r["bytes"] for r in rows)
        plt.plot(x, [r["busbw_gbps"] for r in rows], label=op, marker="braille" if color else marker)
    ticks = sorted(xs)
    step = max(1, math.ceil(len(ticks) / 9))
    ticks = ticks[::step]
    plt.xticks([math.log2(b) for b in ticks], [fmt_bytes(b) for b in ticks])
    plt.title("bus bandwidth (GB/s) by message size")
    plt.xlabel("message size (bytes, log2)")
    text = plt.build()
    plt.clear_figure()
    return text if color else plt.uncolorize(text)


@bench.command("comm")
@click.option("--ops", "ops_spec", default="all", show_default=True, metavar="OP[,OP...]",
              help=f"Collectives to time: {', '.join(OPS)} (or all).")
@click.option("--sizes", "sizes_spec", default=DEFAULT_SIZES, show_default=True, metavar="MIN:MAX|S1,S2,...",
              help="Message sizes in bytes (K, M, G = 2^10, 2^20, 2^30): MIN:MAX doubles from MIN to MAX "
                   "(nccl-tests -b MIN -e MAX -f 2), MIN:MAX:F multiplies by F, or a comma list.")
@click.option("--nproc", default="2", show_default=True, metavar="N", help="Processes (ranks) on this machine.")
@click.option("--backend", default="auto", show_default=True, metavar="|".join(BACKENDS),
              help="auto = nccl with one GPU per process, else gloo.")
@click.option("--dtype", default="fp32", show_default=True, metavar="|".join(DTYPES), help="Element type.")
@click.option("--iters", default="20", show_default=True, metavar="N",
              help="Timed calls per op and size (fewer where they would exceed --budget).")
@click.option("--warmup", default="5", show_default=True, metavar="N", help="Untimed calls before timing.")
@click.option("--budget", default="1.0", show_default=True, metavar="SECONDS",
              help="Most time spent in the timed calls of one op and size (0: always --iters).")
@click.option("--timeout", "timeout_s", default="600", show_default=True, metavar="SECONDS",
              help="Give up (and stop every process) after this long.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per measurement per line, nothing else.")
@click.option("--output-dir", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help=f"Results go to DIR/comm-<UTC time>/ (default DIR: {DEFAULT_OUTPUT_DIR}).")
def comm(ops_spec: str, sizes_spec: str, nproc: str, backend: str, dtype: str, iters: str, warmup: str,
         budget: str, timeout_s: str, as_json: bool, output_dir: Path | None) -> None:
    """Time collectives over a range of message sizes and check every result, like nccl-tests.

    For each op and size: WARMUP untimed calls, then ITERS timed calls between barriers; the time is the slowest
    rank's mean (µs), algbw = bytes / time and busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather,
    reduce_scatter) or 1 (broadcast), in GB/s, as nccl-tests' doc/PERFORMANCE.md. Bytes: the buffer for
    all_reduce and broadcast, the whole output of all_gather, the whole input of reduce_scatter. After timing,
    one more call on known per-rank inputs (rank + 1) is checked against the exact result.

    Prints a table and a bandwidth-by-size plot (--json: JSON lines) and writes results.jsonl, bench.json and
    torchrun.log under DIR/comm-<UTC time>/. Exit code: 0 all correct, 1 a wrong result or a failed worker,
    2 bad input (nothing started), 130 stopped by Ctrl-C.

    \b
    Examples:
      handle bench comm --nproc 2                                   # every op, 1K to 64M, fp32
      handle bench comm --ops all_reduce --sizes 1M:1G --dtype bf16 --backend nccl --nproc 8
      handle bench comm --sizes 4K,1M,16M --iters 50 --json > comm.jsonl
    """
    # --- validate everything before anything starts (one line, exit 2) ---
    try:
        ops = parse_ops(ops_spec)
    except ValueError as e:
        fail(f"--ops: {e}")
    try:
        sizes = parse_sizes(sizes_spec)
    except ValueError as e:
        fail(f"--sizes: {e}")
    n_proc = _int_option("--nproc", nproc, 1, 1024)
    n_iters = _int_option("--iters", iters, 1, 100_000)
    n_warmup = _int_option("--warmup", warmup, 0, 100_000)
    n_timeout = _int_option("--timeout", timeout_s, 10, 86_400)
    try:
        budget_s = float(budget)
        if not 0 <= budget_s <= 3600:
            raise ValueError
    except ValueError:
        fail(f"--budget: {budget!r} is not a number of seconds between 0 and 3600")
    if backend not in BACKENDS:
        fail(f"--backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    if dtype not in DTYPES:
        fail(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    for size in sizes:
        why = check_size(size, dtype, n_proc)
        if why:
            fail(f"--sizes: {why}")
    backend = _resolve_backend(backend, n_proc)
    if backend == "gloo":
        _check_memory(sizes, n_proc)
    parent = output_dir if output_dir is not None else DEFAULT_OUTPUT_DIR
    if parent.exists() and not parent.is_dir():
        fail(f"--output-dir: {parent} is not a directory")
    try:
        directory = _new_dir(parent, "comm")
    except OSError as e:
        fail(f"--output-dir: cannot create a directory in {parent}: {e.strerror or e}")

    # --- run ---
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n_proc}",
           "--monitor_interval=0.5", "-m", "torch_handle.plan.bench_comm", "--ops", ",".join(ops),
           "--sizes", ",".join(str(s) for s in sizes), "--backend", backend, "--dtype", dtype,
           "--iters", str(n_iters), "--warmup", str(n_warmup), "--budget", str(budget_s),
           "--timeout", str(max(10, min(n_timeout, 300)))]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    meta: dict[str, Any] = {"kind": "comm", "status": "running", "ops": ops, "sizes": sizes, "nproc": n_proc,
                            "backend": backend, "dtype": dtype, "iters": n_iters, "warmup": n_warmup,
                            "budget_s": budget_s, "command": cmd, "start_time": time.time()}
    _write_json(directory / "bench.json", meta)
    results_path = directory / "results.jsonl"
    records: list[dict[str, Any]] = []
    worker_errors: list[str] = []
    interactive = not as_json and sys.stderr.isatty()
    total = len(ops) * len(sizes)

    with open(results_path, "w", encoding="utf-8") as results:
        def on_line(line: str) -> None:
            if line.startswith(MARKER):
                rec = json.loads(line[len(MARKER):])
                records.append(rec)
                results.write(json.dumps(rec) + "\n")
                results.flush()
                if as_json:
                    click.echo(json.dumps(rec))
                elif interactive:
                    click.echo(f"\r  {len(records)}/{total} {rec['op']} {fmt_bytes(rec['bytes'])}\033[K", err=True,
                               nl=False)
            elif line.startswith(ERROR_MARKER):
                worker_errors.append(line[len(ERROR_MARKER):])

        if interactive:
            click.echo(f"bench comm: {n_proc} processes, {backend}, {dtype}, {len(ops)} ops x {len(sizes)} sizes "
                       f"({fmt_bytes(sizes[0])}..{fmt_bytes(max(sizes))}); log: {directory / 'torchrun.log'}",
                       err=True)
        from torch_handle.launch.supervisor import run_torchrun

        try:
            rc, timed_out, wall = run_torchrun(cmd, directory / "torchrun.log", n_timeout, on_line, env=env)
        except KeyboardInterrupt:
            _finish(directory, meta, "stopped", "stopped by Ctrl-C (workers terminated)", None)
            if interactive:
                click.echo("", err=True)
            click.echo(f"bench comm: stopped; partial results in {results_path}", err=True)
            sys.exit(EXIT_STOPPED)
    if interactive:
        click.echo("\r\033[K", err=True, nl=False)

    wrong = [r for r in records if not r["correct"]]
    error = None
    if timed_out:
        error = f"timed out after {n_timeout} s (workers stopped); see {directory / 'torchrun.log'}"
    elif worker_errors:
        error = f"worker failed: {worker_errors[0]}"
    elif wrong:
        r = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        error = f"wrong result: {r['op']} at {fmt_bytes(r['bytes'])} ({r['dtype']}, {r['backend']}, " \
                f"{r['world_size']} ranks, relative error {r['max_rel_error']:.3g}){more}"
    elif rc != 0:
        error = f"torchrun exited {rc}; see {directory / 'torchrun.log'}"
    elif len(records) != total:
        error = f"{len(records)} of {total} measurements came back; see {directory / 'torchrun.log'}"
    _finish(directory, meta, "failed" if error else "finished", error, wall, len(records))

    if not as_json and records:
        _print_report(records, results_path, wall)
    elif as_json:
        click.echo(f"results: {results_path}", err=True)
    if error:
        fail(f"bench comm: {error}", code=EXIT_FAILED)


def _int_option(name: str, text: str, lo: int, hi: int) -> int:
    try:
        value = int(text)
    except ValueError:
        fail(f"{name}: {text!r} is not an integer")
    if not lo <= value <= hi:
        fail(f"{name}: {value} is out of range ({lo} to {hi})")
    return value


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def _finish(directory: Path, meta: dict[str, Any], status: str, message: str | None, wall: float | None,
            measurements: int | None = None) -> None:
    meta.update(status=status, message=message, end_time=time.time(),
                wall_s=round(wall, 3) if wall is not None else None, measurements=measurements)
    _write_json(directory / "bench.json", meta)


def _print_report(records: list[dict[str, Any]], results_path: Path, wall: float) -> None:
    from rich.console import Console
    from rich.text import Text

    tty = sys.stdout.isatty()
    console = Console(highlight=False, width=None if tty else 110)
    r0 = records[0]
    console.print(f"bench comm: {r0['world_size']} ranks, backend {r0['backend']} ({r0['device']}), {r0['dtype']}; "
                  "time = slowest rank's mean, GB/s = 10^9 B/s")
    console.print(results_table(records))
    notes = {gloo_note(r["op"]) for r in records if r["backend"] == "gloo" and gloo_note(r["op"])}
    for note in sorted(notes):
        console.print(f"note: {note}")
    width = max(60, min(console.width, 110))
    plot = bandwidth_plot(records, width=width, height=18, color=tty and console.color_system is not None)
    console.print(Text.from_ansi(plot) if tty else plot, markup=False, highlight=False, soft_wrap=True)
    console.print(f"results: {results_path} ({len(records)} measurements, {wall:.1f} s with torchrun start-up)")


# ---------------------------------------------------------------------------------------------------------------
# handle bench scaling
# ---------------------------------------------------------------------------------------------------------------

DEFAULT_STEPS = 20


def _scaling_plan(preset: str, overrides: tuple[str, ...], nprocs: list[int], labels: list[str] | None,
                  steps: int | None, skip: int, strong: bool) -> tuple[list[dict[str, Any]], list[str], Any]:
    """Validate every (strategy, world size) preset before anything starts: ``(runs, notes, base preset)``,
    each run ``{"spec", "nproc", "overrides", "preset", "micro_batch_size", "grad_accum"}``. Bad input: one
    line, exit 2."""
    from torch_handle.config.loader import load_preset
    from torch_handle.errors import USER_ERRORS
    from torch_handle.launch.run import check_data
    from torch_handle.registry import get_registry

    user = list(overrides)
    if steps is not None:
        user.append(f"training.steps={steps}")
    elif not any(o.replace(" ", "").startswith("training.steps=") for o in overrides):
        user.append(f"training.steps={DEFAULT_STEPS}")
    try:
        base = load_preset(preset, user)
        check_data(base)
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
    mbs0, ga0, n0 = base.training.micro_batch_size, base.training.grad_accum, nprocs[0]
    global_batch = mbs0 * ga0 * n0
    runs = []
    for spec in specs:
        for n in nprocs:
            if spec.single_rank_only and n > 1:
                notes.append(f"{spec.label} skipped at {n} ranks: it runs on world size 1 only")
                continue
            mbs, ga = mbs0, ga0
            if strong:
                try:
                    mbs, ga = scaling_math.strong_batch(global_batch, mbs0, ga0, n)
                except ValueError:
                    fail(f"--strong: the global batch of {global_batch} samples (micro_batch_size {mbs0} x "
                         f"grad_accum {ga0} x {n0} ranks) does not divide over {n} ranks (choose other --nproc "
                         f"or set training.micro_batch_size)")
            extra = [*spec.overrides, f"launch.nproc_per_node={n}", "launch.max_restarts=0",
                     f"run.name={spec.label}-n{n}", f"training.micro_batch_size={mbs}", f"training.grad_accum={ga}"]
            try:
                loaded = load_preset(preset, [*user, *extra])
            except USER_ERRORS as e:
                fail(f"{spec.label} on {_ranks(n)}: {e}")
            runs.append({"spec": spec, "nproc": n, "overrides": [*user, *extra], "preset": loaded,
                         "micro_batch_size": mbs, "grad_accum": ga})
    if not runs:
        fail("nothing to run: " + "; ".join(notes))
    return runs, notes, base


def _run_one(preset: str, run: dict[str, Any], directory: Path) -> tuple[int, dict[str, Any], list[dict], float]:
    """One run through ``handle run``'s launcher (prepare_run + supervise, quiet): ``(exit code, run.json,
    events, wall seconds)``. Ctrl-C is supervise's: the workers stop (a second one kills them), exit code 130."""
    from torch_handle.observe.tail import EventReader
    from torch_handle.rundir import read_run_info
    from torch_handle.observe.telemetry import EVENTS_FILE
    from torch_handle.launch.run import prepare_run

    from handle_cli.runner import supervise

    run_dir = directory / run["run_name"]
    t0 = time.perf_counter()
    loaded, run_dir = prepare_run(preset, (*run["overrides"], f"run.output_dir={directory}"), run_dir, None)
    rc = supervise(loaded, run_dir, quiet=True)
    wall = time.perf_counter() - t0
    return rc, read_run_info(run_dir), EventReader(run_dir / EVENTS_FILE).poll(), wall


def _scaling_record(run: dict[str, Any], rc: int, info: dict[str, Any], events: list[dict], wall: float, skip: int,
                    mode: str, cores: int, run_dir: Path) -> dict[str, Any]:
    spec, n = run["spec"], run["nproc"]
    summary = scaling_math.summarize(events, skip)
    status, message = info.get("status") or "failed", info.get("message") or None
    if rc == 0 and (not summary["measured_steps"] or summary["tokens_per_s"] is None):
        status, message = "failed", f"no step events after the first {skip} (see {run_dir}/events.jsonl)"
    omp = os.environ.get("OMP_NUM_THREADS")
    return {"strategy": spec.label, "plugin": spec.plugin, "nproc": n, "status": status, "message": message,
            "mode": mode, "micro_batch_size": run["micro_batch_size"], "grad_accum": run["grad_accum"],
            "global_batch": run["micro_batch_size"] * run["grad_accum"] * n, **summary,
            "efficiency": None, "base_nproc": None, "base_tokens_per_s": None,
            "threads_per_rank": scaling_math.threads_per_rank(n, cores, omp),
            "oversubscribed": scaling_math.oversubscribed(n, cores, omp), "wall_s": round(wall, 2),
            "run_dir": str(run_dir)}


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def scaling_table(records: list[dict[str, Any]]):
    """A rich Table: strategy, ranks, status, tokens/s, step time and phases (ms, medians), efficiency, and the
    largest per-rank memory peaks (rss, model state = param + grad + optimizer; CUDA max allocated if any)."""
    from rich.table import Table

    from torch_handle.common.text import fmt_bytes as fmt_mem

    cuda = any(m.get("cuda_max_allocated_bytes") is not None for r in records for m in r.get("memory") or [])
    table = Table(header_style="bold")
    columns = [("strategy", "left"), ("ranks", "right"), ("status", "left"), ("tokens/s", "right"),
               ("step ms", "right"), ("eff.", "right"), ("rss", "right"), ("state", "right")]
    columns += [("cuda", "right")] if cuda else []
    columns += [(label, "right") for label, _ in scaling_math.TABLE_PARTS]
    widest = max([8, *(len(r["strategy"]) for r in records)])
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True, min_width=widest if name == "strategy" else None)
    last = None
    for r in records:
        if last is not None and r["strategy"] != last:
            table.add_section()
        last = r["strategy"]
        memory = r.get("memory") or []
        eff = r.get("efficiency")
        status = "ok" if r["status"] == "finished" else f"[bold red]{r['status']}[/]"
        row = [r["strategy"], f"{r['nproc']}{'*' if r.get('oversubscribed') else ''}", status,
               "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}", _ms(r.get("step_time_s")),
               "-" if eff is None else f"{eff:.2f}",
               fmt_mem(scaling_math.peak_over_ranks(memory, "rss_bytes")),
               fmt_mem(scaling_math.peak_over_ranks(memory, "model_state_bytes"))]
        row += [fmt_mem(scaling_math.peak_over_ranks(memory, "cuda_max_allocated_bytes"))] if cuda else []
        row += [_ms(x) for x in scaling_math.table_parts(r)]
        table.add_row(*row)
    return table


def scaling_plots(records: list[dict[str, Any]], width: int = 100, height: int = 14, color: bool = False) -> str:
    """Two plotext plots drawn into a string: tokens/s and scaling efficiency against world size, one line per
    strategy (finished runs only)."""
    import plotext as plt

    ok = [r for r in records if r.get("tokens_per_s") is not None and r["status"] == "finished"]
    strategies = list(dict.fromkeys(r["strategy"] for r in ok))
    sizes = sorted({r["nproc"] for r in ok})
    out = []
    for key, title in (("tokens_per_s", "tokens/s (global) by world size"),
                       ("efficiency", "scaling efficiency by world size (1.0 = linear)")):
        plt.clear_figure()
        plt.limitsize(False, False)
        plt.plotsize(width, height)
        plt.theme("pro" if color else "clear")
        for i, label in enumerate(strategies):
            rows = sorted((r for r in ok if r["strategy"] == label and r.get(key) is not None),
                          key=lambda r: r["nproc"])
            if rows:
                plt.plot([r["nproc"] for r in rows], [r[key] for r in rows], label=label,
                         marker="braille" if color else "*o+x#@%&"[i % 8])
        if key == "efficiency":
            plt.ylim(0, max([1.1, *(r["efficiency"] * 1.1 for r in ok if r.get("efficiency"))]))
        plt.xticks(sizes, [str(s) for s in sizes])
        plt.title(title)
        plt.xlabel("world size (ranks)")
        text = plt.build()
        out.append(text if color else plt.uncolorize(text))
    plt.clear_figure()
    return "\n".join(out)


@bench.command("scaling")
@click.argument("preset")
@click.option("--set", "overrides", multiple=True, metavar="TABLE.KEY=VALUE",
              help="Override a preset key for every run (repeatable), as in handle run.")
@click.option("--nproc", "nproc_spec", default="1,2", show_default=True, metavar="N[,N...]",
              help="World sizes (ranks on this machine) to measure.")
@click.option("--strategies", "strategies_spec", default=None, metavar="S[,S...]",
              help=f"Strategies to compare: {', '.join(scaling_math.STRATEGY_NAMES)} (scratch-* only where that "
                   "plugin is registered); default: the preset's own.")
@click.option("--steps", default=None, metavar="N",
              help=f"Training steps per run (default {DEFAULT_STEPS}, or the preset's when --set training.steps "
                   "is given).")
@click.option("--skip", default="2", show_default=True, metavar="N",
              help="Warm-up steps left out of the medians.")
@click.option("--weak/--strong", "weak", default=True, show_default=True,
              help="weak: the per-rank batch stays fixed; strong: the global batch of the smallest world size "
                   "stays fixed (grad_accum, else micro_batch_size, adjusted).")
@click.option("--threads", default=None, metavar="N",
              help="Intra-op threads per rank in every run (OMP_NUM_THREADS); default: OMP_NUM_THREADS if set, "
                   "else the launcher's cores / ranks, which differs between world sizes.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per strategy and world size per line on stdout, nothing else.")
@click.option("--output-dir", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help=f"Runs and results go to DIR/scaling-<UTC time>/ (default DIR: {DEFAULT_OUTPUT_DIR}).")
def scaling(preset: str, overrides: tuple[str, ...], nproc_spec: str, strategies_spec: str | None,
            steps: str | None, skip: str, weak: bool, threads: str | None, as_json: bool,
            output_dir: Path | None) -> None:
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
    scratch-zero1 (where registered). Prints a table and plots (--json: JSON lines) and writes results.csv and
    results.json. Exit code: 0 every run finished, 1 a run failed (the others still run), 2 bad input
    (nothing started), 130 stopped by Ctrl-C (the current run's workers stopped).

    \b
    Examples:
      handle bench scaling presets/ddp.toml --nproc 1,2 --steps 12
      handle bench scaling presets/ddp.toml --strategies ddp,zero2,fsdp --strong
      handle bench scaling presets/zero2.toml --nproc 1,2,4 --json > scaling.jsonl
    """
    # --- validate everything before anything starts (one line, exit 2) ---
    try:
        nprocs = scaling_math.parse_nproc(nproc_spec)
    except ValueError as e:
        fail(f"--nproc: {e}")
    try:
        labels = scaling_math.parse_strategies(strategies_spec) if strategies_spec is not None else None
    except ValueError as e:
        fail(f"--strategies: {e}")
    n_steps = _int_option("--steps", steps, 1, 1_000_000) if steps is not None else None
    n_skip = _int_option("--skip", skip, 0, 1_000_000)
    n_threads = _int_option("--threads", threads, 1, 1024) if threads is not None else None
    parent = output_dir if output_dir is not None else DEFAULT_OUTPUT_DIR
    if parent.exists() and not parent.is_dir():
        fail(f"--output-dir: {parent} is not a directory")
    from handle_cli.presets_cmd import resolve_preset_spec

    preset = resolve_preset_spec(preset)
    runs, notes, base = _scaling_plan(preset, overrides, nprocs, labels, n_steps, n_skip, not weak)
    try:
        directory = _new_dir(parent, "scaling")
    except OSError as e:
        fail(f"--output-dir: cannot create a directory in {parent}: {e.strerror or e}")

    # --- header ---
    mode = "weak" if weak else "strong"
    cores = os.cpu_count() or 1
    if n_threads is not None:  # the launcher passes our environment on to every run's workers
        os.environ["OMP_NUM_THREADS"] = str(n_threads)
    omp = os.environ.get("OMP_NUM_THREADS")
    t = base.training
    if weak:
        how = (f"weak scaling: per-rank batch fixed (micro_batch_size {t.micro_batch_size} x grad_accum "
               f"{t.grad_accum}); the global batch grows with the world size")
    else:
        how = (f"strong scaling: global batch fixed at {t.micro_batch_size * t.grad_accum * nprocs[0]} samples (the "
               f"preset's at {_ranks(nprocs[0])}); grad_accum, else micro_batch_size, adjusted per world size")
    header = [(f"bench scaling: {preset}, {t.steps} steps per run, medians of steps {n_skip + 1}..{t.steps} "
               f"(first {n_skip} skipped); {len(runs)} runs under {directory}"), how,
              (f"efficiency = tokens/s at N / (N/B x tokens/s at B), B = each strategy's smallest world size "
               f"measured (here {nprocs[0]})")]
    per_rank = {n: scaling_math.threads_per_rank(n, cores, omp) for n in nprocs}
    if len(set(per_rank.values())) > 1:
        header.append("threads per rank: " + ", ".join(f"{k} at {_ranks(n)}" for n, k in per_rank.items())
                      + f" (the launcher's {cores} cores / ranks; --threads N keeps them equal)")
    else:
        header.append(f"threads per rank: {per_rank[nprocs[0]]} in every run"
                      + (" (OMP_NUM_THREADS)" if omp else ""))
    over = [n for n in nprocs if scaling_math.oversubscribed(n, cores, omp)]
    if over:
        header.append(f"warning: {', '.join(map(str, over))} ranks x "
                      f"{scaling_math.threads_per_rank(over[0], cores, omp)} thread(s) each exceed this machine's "
                      f"{cores} cores: oversubscribed, figures marked * show contention, not scaling")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5 * cores:
        header.append(f"note: this machine is busy (load average {load:.1f} on {cores} cores): other processes "
                      "compete with the runs and the figures")
    header += [f"note: {n}" for n in notes]
    for line in header:
        click.echo(line, err=as_json)
    meta: dict[str, Any] = {"kind": "scaling", "status": "running", "preset": preset, "overrides": list(overrides),
                            "mode": mode, "nproc": nprocs, "strategies": [r["spec"].label for r in runs],
                            "steps": t.steps, "skip": n_skip, "cores": cores, "omp_num_threads": omp,
                            "load_avg_1m": round(load, 2), "notes": notes, "header": header,
                            "start_time": time.time(), "results": []}

    # --- run ---
    records: list[dict[str, Any]] = []
    progress_tty = sys.stderr.isatty()
    stopped = False
    for i, run in enumerate(runs, 1):
        spec, n = run["spec"], run["nproc"]
        run["run_name"] = f"{spec.label}-n{n}"
        what = f"[{i}/{len(runs)}] {spec.label} on {_ranks(n)}"
        if progress_tty:
            click.echo(f"{what}: running ({directory / run['run_name']})", err=True, nl=False)
        run_load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        try:
            rc, info, events, wall = _run_one(preset, run, directory)
        except KeyboardInterrupt:  # between supervise's own handlers: nothing of this run is alive
            rc, info, events, wall = EXIT_STOPPED, {"status": "stopped", "message": "stopped by Ctrl-C"}, [], 0.0
        record = _scaling_record(run, rc, info, events, wall, n_skip, mode, cores, directory / run["run_name"])
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
        _write_json(directory / "results.json", meta)
        if rc == EXIT_STOPPED or record["status"] == "stopped":
            stopped = True
            break

    # --- results ---
    failed = [r for r in records if r["status"] not in ("finished", "stopped")]
    meta.update(status="stopped" if stopped else "failed" if failed else "finished", end_time=time.time(),
                results=records)
    _write_json(directory / "results.json", meta)
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
        fail(f"bench scaling: {r['strategy']} on {_ranks(r['nproc'])} failed: {r['message'] or r['status']}{more}; "
             f"see {r['run_dir']}/logs", code=EXIT_FAILED)


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
            console.print(f"{r['strategy']} on {_ranks(r['nproc'])} {r['status']}: {r['message']}", markup=False)
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
                  f"{directory}/<strategy>-n<N>", markup=False)
