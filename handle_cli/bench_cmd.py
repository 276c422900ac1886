"""``handle bench``: benchmarks run through torchrun. ``bench comm``: collective bandwidth in the spirit of
nccl-tests (the worker is ``torch_handle.bench_comm``).

Process hygiene as ``handle env --check-dist``: torchrun runs in its own session and dies with this process
(PR_SET_PDEATHSIG); every process of its tree that was seen is terminated at the end, on a timeout and on
Ctrl-C. Click, the standard library and torch-free project modules only at import: rich, plotext, psutil and
torch are imported inside the command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from torch_handle.bench_comm import (DTYPES, ERROR_MARKER, MARKER, OPS, check_size, fmt_bytes, gloo_note, parse_ops,
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
    """


# ---------------------------------------------------------------------------------------------------------------
# supervision of one torchrun (the approach of `handle env --check-dist`)
# ---------------------------------------------------------------------------------------------------------------


def run_torchrun(cmd: list[str], log_path: Path, timeout_s: float, on_line: Callable[[str], None],
                 env: dict[str, str] | None = None) -> tuple[int | None, bool, float]:
    """Run ``cmd`` (a torchrun command line) with its output in ``log_path``, handing every complete output line
    to ``on_line`` as it arrives; never leaves a process behind.

    Returns ``(returncode, timed_out, wall_s)``; the return code is torchrun's own, or None after a timeout.

    Raises:
        KeyboardInterrupt: on Ctrl-C, after every process of the tree was stopped.
    """
    import psutil

    from torch_handle.launch import die_with_parent

    seen: dict[int, psutil.Process] = {}
    t0 = time.perf_counter()
    timed_out = False
    with open(log_path, "wb") as log, open(log_path, "rb") as reader:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, preexec_fn=die_with_parent)
        pending = b""

        def drain(final: bool = False) -> None:
            nonlocal pending
            pending += reader.read()
            *lines, pending = pending.split(b"\n")
            if final and pending:
                lines, pending = [*lines, pending], b""
            for line in lines:
                on_line(line.decode("utf-8", "replace").rstrip("\r"))

        try:
            while proc.poll() is None:
                try:
                    parent = psutil.Process(proc.pid)
                    for p in [parent, *parent.children(recursive=True)]:
                        seen.setdefault(p.pid, p)
                except psutil.Error:
                    pass
                drain()
                if time.perf_counter() - t0 > timeout_s:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            _kill_all(proc, seen)
        drain(final=True)
    return (None if timed_out else proc.returncode), timed_out, time.perf_counter() - t0


def _kill_all(proc: subprocess.Popen, seen: dict) -> None:
    """SIGTERM torchrun's whole tree, SIGKILL what is left after 5 s; reap torchrun."""
    import psutil

    from torch_handle.launch import terminate

    try:
        for p in psutil.Process(proc.pid).children(recursive=True):
            seen.setdefault(p.pid, p)
    except psutil.Error:
        pass
    terminate(list(seen.values()), grace_s=5.0)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover
        proc.kill()
        proc.wait()


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
           "--monitor_interval=0.5", "-m", "torch_handle.bench_comm", "--ops", ",".join(ops),
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
