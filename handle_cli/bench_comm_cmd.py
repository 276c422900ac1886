"""``handle bench comm``: time collectives over a range of message sizes on this machine and check every result,
in the spirit of nccl-tests. The worker and the formulas: :mod:`torch_handle.plan.bench_comm`; the torchrun job:
:mod:`torch_handle.launch.probe`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from handle_cli.bench_cmd import DEFAULT_OUTPUT_DIR, int_option, new_dir, output_parent
from handle_cli.common import EXIT_FAILED, EXIT_STOPPED, fail
from torch_handle.common.fsio import write_json_atomic
from torch_handle.common.units import size_label
from torch_handle.plan.bench_comm import DTYPES, MARKER, OPS, check_size, gloo_note, parse_ops, parse_sizes

if TYPE_CHECKING:
    from torch_handle.launch.probe import JobOutput

DEFAULT_SIZES = "1K:64M"
BACKENDS = ("auto", "gloo", "nccl")
WORKER = "torch_handle.plan.bench_comm"


@dataclass(frozen=True)
class CommJob:
    """The validated options of one ``bench comm``."""

    ops: list[str]
    sizes: list[int]
    nproc: int
    backend: str
    """Resolved: ``gloo`` or ``nccl``."""
    dtype: str
    iters: int
    warmup: int
    budget_s: float
    timeout_s: int
    directory: Path
    """``DIR/comm-<UTC time>/``, created."""

    @property
    def total(self) -> int:
        """Measurements expected: one per op and size."""
        return len(self.ops) * len(self.sizes)


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
        fail(f"--sizes: {size_label(max(sizes))} on {nproc} processes needs about {need / 2**30:.1f} GiB of "
             f"memory, {avail / 2**30:.1f} GiB available (lower MAX)")


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
        table.add_row(r["op"], size_label(r["bytes"]), f"{r['count']:,}", str(r["iters"]), f"{r['time_us']:,.1f}",
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
    plt.xticks([math.log2(b) for b in ticks], [size_label(b) for b in ticks])
    plt.title("bus bandwidth (GB/s) by message size")
    plt.xlabel("message size (bytes, log2)")
    text = plt.build()
    plt.clear_figure()
    return text if color else plt.uncolorize(text)


@click.command("comm")
@click.option("--ops", "ops_spec", default="all", show_default=True, metavar="OP[,OP...]",
              help=f"Collectives to time: {', '.join(OPS)} (or all).")
@click.option("--sizes", "sizes_spec", default=DEFAULT_SIZES, show_default=True, metavar="MIN:MAX|S1,S2,...",
              help="Message sizes in bytes (K, M, G or KiB, MiB, GiB = 2^10, 2^20, 2^30; KB, MB, GB = 10^3, 10^6, "
                   "10^9): MIN:MAX doubles from MIN to MAX (nccl-tests -b MIN -e MAX -f 2), MIN:MAX:F multiplies "
                   "by F, or a comma list.")
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
    job = _validate(ops_spec, sizes_spec, nproc, backend, dtype, iters, warmup, budget, timeout_s, output_dir)
    interactive = not as_json and sys.stderr.isatty()
    if interactive:
        _header(job)
    out, meta = _run(job, as_json, interactive)
    _results(job, out, meta, as_json)


def _validate(ops_spec: str, sizes_spec: str, nproc: str, backend: str, dtype: str, iters: str, warmup: str,
              budget: str, timeout_s: str, output_dir: Path | None) -> CommJob:
    """Every option checked before anything starts (a one-line error, exit 2), then the output directory."""
    try:
        ops = parse_ops(ops_spec)
    except ValueError as e:
        fail(f"--ops: {e}")
    try:
        sizes = parse_sizes(sizes_spec)
    except ValueError as e:
        fail(f"--sizes: {e}")
    n_proc = int_option("--nproc", nproc, 1, 1024)
    n_iters = int_option("--iters", iters, 1, 100_000)
    n_warmup = int_option("--warmup", warmup, 0, 100_000)
    n_timeout = int_option("--timeout", timeout_s, 10, 86_400)
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
    directory = new_dir(output_parent(output_dir), "comm")
    return CommJob(ops, sizes, n_proc, backend, dtype, n_iters, n_warmup, budget_s, n_timeout, directory)


def _header(job: CommJob) -> None:
    click.echo(f"bench comm: {job.nproc} processes, {job.backend}, {job.dtype}, {len(job.ops)} ops x "
               f"{len(job.sizes)} sizes ({size_label(job.sizes[0])}..{size_label(max(job.sizes))}); log: "
               f"{job.directory / 'torchrun.log'}", err=True)


def _run(job: CommJob, as_json: bool, interactive: bool) -> tuple[JobOutput, dict[str, Any]]:
    """The torchrun job, each measurement appended to ``results.jsonl`` as it arrives (and printed with
    ``--json``); ``bench.json`` says it is running. Ctrl-C: ``bench.json`` says stopped, exit 130."""
    from torch_handle.launch.probe import run_job, torchrun_command

    args = ["--ops", ",".join(job.ops), "--sizes", ",".join(str(s) for s in job.sizes), "--backend", job.backend,
            "--dtype", job.dtype, "--iters", str(job.iters), "--warmup", str(job.warmup), "--budget",
            str(job.budget_s), "--timeout", str(max(10, min(job.timeout_s, 300)))]
    cmd = torchrun_command(WORKER, job.nproc, args)
    meta: dict[str, Any] = {"kind": "comm", "status": "running", "ops": job.ops, "sizes": job.sizes,
                            "nproc": job.nproc, "backend": job.backend, "dtype": job.dtype, "iters": job.iters,
                            "warmup": job.warmup, "budget_s": job.budget_s, "command": cmd,
                            "start_time": time.time()}
    write_json_atomic(job.directory / "bench.json", meta)
    results_path = job.directory / "results.jsonl"
    done = 0

    with open(results_path, "w", encoding="utf-8") as results:
        def on_record(rec: dict[str, Any]) -> None:
            nonlocal done
            done += 1
            results.write(json.dumps(rec) + "\n")
            results.flush()
            if as_json:
                click.echo(json.dumps(rec))
            elif interactive:
                click.echo(f"\r  {done}/{job.total} {rec['op']} {size_label(rec['bytes'])}\033[K", err=True,
                           nl=False)

        try:
            out = run_job(cmd, MARKER, job.directory / "torchrun.log", job.timeout_s, on_record)
        except KeyboardInterrupt:
            _finish(job.directory, meta, "stopped", "stopped by Ctrl-C (workers terminated)", None)
            if interactive:
                click.echo("", err=True)
            click.echo(f"bench comm: stopped; partial results in {results_path}", err=True)
            sys.exit(EXIT_STOPPED)
    if interactive:
        click.echo("\r\033[K", err=True, nl=False)
    return out, meta


def _results(job: CommJob, out: JobOutput, meta: dict[str, Any], as_json: bool) -> None:
    """``bench.json`` finished or failed, the report (table and plot; with ``--json`` only where the results
    are), and the exit: 1 with the first problem found."""
    records, log = out.records, job.directory / "torchrun.log"
    wrong = [r for r in records if not r["correct"]]
    error = None
    if out.timed_out:
        error = f"timed out after {job.timeout_s} s (workers stopped); see {log}"
    elif out.errors:
        error = f"worker failed: {out.errors[0]}"
    elif wrong:
        r = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        error = f"wrong result: {r['op']} at {size_label(r['bytes'])} ({r['dtype']}, {r['backend']}, " \
                f"{r['world_size']} ranks, relative error {r['max_rel_error']:.3g}){more}"
    elif out.returncode != 0:
        error = f"torchrun exited {out.returncode}; see {log}"
    elif len(records) != job.total:
        error = f"{len(records)} of {job.total} measurements came back; see {log}"
    _finish(job.directory, meta, "failed" if error else "finished", error, out.wall_s, len(records))

    results_path = job.directory / "results.jsonl"
    if not as_json and records:
        _print_report(records, results_path, out.wall_s)
    elif as_json:
        click.echo(f"results: {results_path}", err=True)
    if error:
        fail(f"bench comm: {error}", code=EXIT_FAILED)


def _finish(directory: Path, meta: dict[str, Any], status: str, message: str | None, wall: float | None,
            measurements: int | None = None) -> None:
    meta.update(status=status, message=message, end_time=time.time(),
                wall_s=round(wall, 3) if wall is not None else None, measurements=measurements)
    write_json_atomic(directory / "bench.json", meta)


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
