"""``handle plan``: which dp x tp x pp layout to run a preset with on N ranks (the planner:
:mod:`torch_handle.plan.planner`), and with ``--measure`` how its predictions hold up in short real runs through
``handle run``'s launcher (as ``bench scaling`` runs them). Click, the standard library and torch-free project modules
only at import; torch, rich and plotext are imported when the command runs."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from handle_cli.bench_cmd import DEFAULT_OUTPUT_DIR, int_option, new_dir, output_parent
from handle_cli.common import EXIT_STOPPED, fail
from torch_handle.common.units import fmt_bytes, parse_bytes

DEFAULT_MEASURE_STEPS = 6
MEASURE_SKIP = 2


@click.command("plan")
@click.argument("preset")
@click.option("--nproc", required=True, metavar="N", help="Ranks in all (world size).")
@click.option("--nnodes", default="1", show_default=True, metavar="K", help="Nodes the ranks are spread over.")
@click.option("--device-memory", default=None, metavar="BYTES",
              help="Memory of one rank's device, e.g. 80GiB (default: this GPU's, or on CPU the RAM / ranks per "
                   "node).")
@click.option("--set", "overrides", multiple=True, metavar="TABLE.KEY=VALUE",
              help="Override a preset key (repeatable), as in handle run.")
@click.option("--measure", "measure", default=None, metavar="TOP",
              help="Run the TOP best layouts for a few steps each and print predicted beside measured.")
@click.option("--steps", default=str(DEFAULT_MEASURE_STEPS), show_default=True, metavar="N",
              help=f"Steps of each --measure run (the first {MEASURE_SKIP} are warm-up, left out).")
@click.option("--peak-tflops", default=None, metavar="X",
              help="One rank's matmul peak in TFLOP/s (default: measured here and cached, in the preset's "
                   "precision); for a cluster you are not on.")
@click.option("--comm", "comm_path", type=click.Path(path_type=Path), default=None, metavar="RESULTS",
              help="A handle bench comm results.jsonl for the bandwidths (default: the newest under "
                   f"{DEFAULT_OUTPUT_DIR}/comm-*/ for the backend, else assumed defaults, said so).")
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), default=None,
              help="Whose bandwidths to use (default: the preset's launch.backend; auto = nccl with CUDA).")
@click.option("--top", "top_rows", default=None, metavar="N",
              help="Print the N fastest layouts only (numbered as in the full table; --json keeps every one).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout, nothing else.")
@click.option("--output-dir", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="--measure: keep the runs under DIR/plan-<UTC time>/ (default: a temporary directory, removed).")
def plan(preset: str, nproc: str, nnodes: str, device_memory: str | None, overrides: tuple[str, ...],
         measure: str | None, steps: str, peak_tflops: str | None, comm_path: Path | None, backend: str | None,
         top_rows: str | None, as_json: bool, output_dir: Path | None) -> None:
    """Rank every dp x tp x pp layout of PRESET on N ranks by predicted speed, before running anything.

    Layouts: every dp x tp x pp = N (tp inside a node), for pp > 1 the schedules gpipe, 1f1b and
    interleaved-1f1b (2 stages per rank) with m = pp, 2pp, 4pp micro-batches, activation checkpointing off and
    on; the preset's global batch split over dp. A layout is dropped, with the reason, when handle run's
    validation rejects it or its largest rank (handle estimate's figures) does not fit --device-memory.

    Predicted step time = compute (model FLOPs / the measured matmul peak; x 4/3 with activation checkpointing)
    + pipeline bubble ((p-1)/(v·m) of compute) + TP, DP and pipeline communication (bytes / handle bench comm's
    bus bandwidth + a latency per collective). The header says which figures were measured and which assumed.
    Nothing is allocated: models are sized on the meta device.

    --measure TOP runs the TOP first layouts for --steps steps each (fp32 on CPU), then prints predicted and
    measured tokens/s and memory, their rank correlation (Spearman) and the fastest. Exit code: 0, 1 a measured
    run failed, 2 bad input (nothing started), 130 stopped by Ctrl-C.

    \b
    Examples:
      handle plan presets/ddp.toml --nproc 4
      handle plan presets/moe.toml --nproc 4 --top 12        # the 12 fastest, numbered 1-12
      handle plan presets/gpt2-small.toml --nproc 8 --device-memory 80GiB --peak-tflops 408 --backend nccl
      handle plan presets/ddp.toml --nproc 4 --measure 3 --set training.micro_batch_size=4
    """
    n = int_option("--nproc", nproc, 1, 4096)
    k = int_option("--nnodes", nnodes, 1, 4096)
    if n % k:
        fail(f"--nproc: {n} ranks do not spread evenly over {k} nodes (use a multiple of --nnodes)")
    memory = _bytes_option("--device-memory", device_memory) if device_memory is not None else None
    top = int_option("--measure", measure, 1, 64) if measure is not None else None
    shown = int_option("--top", top_rows, 1, 100_000) if top_rows is not None else None
    n_steps = int_option("--steps", steps, MEASURE_SKIP + 1, 10_000)
    peak = _tflops_option(peak_tflops) if peak_tflops is not None else None
    if comm_path is not None and not comm_path.is_file():
        fail(f"--comm: {comm_path} is not a file (a handle bench comm results.jsonl)")
    parent = output_parent(output_dir) if output_dir is not None else None
    from handle_cli.presets_cmd import resolve_preset_spec

    preset = resolve_preset_spec(preset)
    made, user = _plan(preset, list(overrides), n, k, memory, peak, comm_path, backend, measuring=top is not None)
    if top is None:
        _report(made, None, as_json, shown)
        return
    records, stopped = _measure(preset, user, made, top, n_steps, parent, as_json)
    _report(made, records, as_json, shown)
    if stopped:
        sys.exit(EXIT_STOPPED)
    failed = [r for r in records if r["status"] != "finished"]
    if failed:
        fail(f"plan: {failed[0]['label']} failed: {failed[0]['message'] or failed[0]['status']}; see "
             f"{failed[0]['run_dir']}", code=1)


def _bytes_option(name: str, text: str) -> int:
    try:
        return parse_bytes(text, whole=True)
    except ValueError as e:
        fail(f"{name}: {e} (expected a size such as 80GiB or 16G)")


def _tflops_option(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        fail(f"--peak-tflops: {text!r} is not a positive number of TFLOP/s")
    return value * 1e12


def _plan(preset: str, user: list[str], n: int, k: int, memory: int | None, peak: float | None,
          comm_path: Path | None, backend: str | None, measuring: bool):
    """Load the preset, find the peak, the links and the device memory, and plan: ``(Plan, overrides used)``."""
    from torch_handle.config.loader import load_preset
    from torch_handle.errors import USER_ERRORS
    from torch_handle.plan import plan_cost
    from torch_handle.common.procs import usable_cores
    from torch_handle.launch.cores import threads_per_rank
    from torch_handle.plan.planner import plan_layouts
    from torch_handle.registry import get_registry

    import torch

    cuda = torch.cuda.is_available()
    notes = []
    try:
        base = load_preset(preset, user)
        if base.training.precision == "auto":  # what a run here trains in (launch/precision.py)
            from torch_handle.launch.precision import concrete

            base, resolution = concrete(base)
            notes.append(f"training.precision: {resolution.reason}")
        if measuring:
            from torch_handle.launch.run import check_inputs

            check_inputs(base)
    except USER_ERRORS as e:
        fail(str(e))
    per_node = n // k
    backend = backend or (base.launch.backend if base.launch.backend != "auto" else ("nccl" if cuda else "gloo"))
    cores = usable_cores()
    threads = threads_per_rank(per_node, cores, os.environ.get("OMP_NUM_THREADS"))
    contention = 1.0
    if peak is not None:
        peak_flops, peak_source = peak, f"assumed: --peak-tflops {peak / 1e12:g}"
    else:
        peak_flops, peak_source = _measured_peak(cuda, base.training.precision, threads)
        if not cuda:
            contention = min(1.0, cores / (per_node * threads))
            if contention < 1:
                peak_source += (f"; {per_node} ranks x {threads} thread(s) on {cores} cores: each rank gets "
                                f"{contention:.2f} of it (oversubscribed)")
    if memory is None:
        memory = _device_memory(cuda, per_node)
    links = None
    found = comm_path or plan_cost.newest_bench_comm(DEFAULT_OUTPUT_DIR, backend)
    if found is not None:
        links = plan_cost.links_from_bench(found, k)
        if links is None and comm_path is not None:
            fail(f"--comm: {comm_path} has no correct all_reduce measurement")
    links = links or plan_cost.default_links(backend)
    try:
        made = plan_layouts(base, get_registry(), nproc=n, nnodes=k, device_memory=memory, peak_flops=peak_flops,
                            peak_source=peak_source, links=links, contention=contention)
    except (ValueError, *USER_ERRORS) as e:
        fail(" ".join(str(e).split()))
    made.notes[:0] = notes
    return made, user


def _measured_peak(cuda: bool, precision: str, threads: int) -> tuple[float, str]:
    import torch

    from torch_handle.observe.peak import peak_for_mfu

    device = "cuda" if cuda else "cpu"
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        value, message = peak_for_mfu(device, precision, threads)
    finally:
        torch.set_num_threads(before)
    if value is None:
        fail(f"no {precision} matmul peak on {device}: give --peak-tflops")
    return value, f"measured: {message.removesuffix(' for mfu')}"


def _device_memory(cuda: bool, per_node: int) -> int:
    if cuda:
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    import psutil

    return psutil.virtual_memory().total // per_node


def _measure(preset: str, user: list[str], made, top: int, steps: int, parent: Path | None,
             as_json: bool) -> tuple[list[dict[str, Any]], bool]:
    """The first ``top`` layouts, each a ``steps``-step run through handle run's launcher:
    ``(records, stopped by Ctrl-C)``."""
    from handle_cli.bench_scaling_cmd import _run_one
    from torch_handle.common.procs import usable_cores
    from torch_handle.launch.cores import oversubscribed
    from torch_handle.plan.plan_measured import measured_record

    directory = new_dir(parent, "plan") if parent is not None else Path(tempfile.mkdtemp(prefix="handle-plan-"))
    rows = made.rows[:top]
    per_node = made.nproc // made.nnodes
    if oversubscribed(per_node, usable_cores(), os.environ.get("OMP_NUM_THREADS")):
        made.notes.append(f"measured with {per_node} ranks on {usable_cores()} cores: oversubscribed, the "
                          "ranks share cores")
    if made.nnodes > 1:
        fail("--measure runs on this machine only (--nnodes 1)")
    click.echo(f"plan: measuring {len(rows)} layouts, {steps} steps each (median of steps {MEASURE_SKIP + 1}.."
               f"{steps}), runs under {directory}", err=True)
    records, stopped = [], False
    try:
        for i, row in enumerate(rows, 1):
            name = f"layout-{i}"
            run = {"run_name": name, "overrides": [*user, *row.overrides, f"training.steps={steps}",
                                                    "launch.max_restarts=0", f"run.name={name}",
                                                    "training.eval_every=0", "training.checkpoint_every=0"]}
            try:
                rc, info, events, wall = _run_one(preset, run, directory)
            except KeyboardInterrupt:
                stopped = True
                break
            status = info.get("status") or "failed"
            record = measured_record(row.as_dict(), status, info.get("message"), events, MEASURE_SKIP,
                                     str(directory / name))
            record["wall_s"] = round(wall, 1)
            records.append(record)
            tps = record["tokens_per_s"]
            click.echo(f"[{i}/{len(rows)}] {row.layout.label}: {status} in {wall:.1f} s"
                       + (f", {tps:,.0f} tokens/s measured, {row.tokens_per_s:,.0f} predicted" if tps else ""),
                       err=True)
            if rc == EXIT_STOPPED:
                stopped = True
                break
    finally:
        if parent is None:
            shutil.rmtree(directory, ignore_errors=True)
            for r in records:
                r["run_dir"] = None
    return records, stopped


def _report(made, records: list[dict[str, Any]] | None, as_json: bool, shown: int | None = None) -> None:
    from torch_handle.plan.plan_measured import comparison

    out = made.as_dict()
    if records is not None:
        out["measured"] = records
        out["comparison"] = comparison(records)
    if as_json:
        click.echo(json.dumps(out))
        return
    from rich.console import Console
    from rich.text import Text

    tty = sys.stdout.isatty()
    console = Console(highlight=False, width=None if tty else 200)
    for line in header_lines(out):
        console.print(line, markup=False)
    # a file or a pipe: every column (however wide); a terminal: the columns that fit, every cell whole
    table = plan_table(out["layouts"][:shown], width=console.width if tty else None)
    narrow = console.width
    console.width = 10_000
    console.print(table)
    console.width = narrow
    if shown is not None and shown < len(out["layouts"]):
        console.print(f"(the {shown} fastest of {len(out['layouts'])} layouts; --top {len(out['layouts'])} or no "
                      f"--top for every one)", markup=False)
    for line in dropped_lines(out["dropped"]):
        console.print(line, markup=False)
    if records:
        console.print(measured_table(records))
        c = out["comparison"]
        rho = "n/a" if c["spearman"] is None else f"{c['spearman']:+.2f}"
        ratio = "n/a" if c["first_choice_ratio"] is None else f"{c['first_choice_ratio']:.0%}"
        console.print(f"fastest measured: {c['fastest']}; the planner's first choice ({c['first_choice']}) ran at "
                      f"{ratio} of it; Spearman rank correlation of predicted and measured tokens/s: {rho}",
                      markup=False)
        plot = measured_plot(records, width=max(60, min(console.width, 110)), color=tty)
        console.print(Text.from_ansi(plot) if tty else plot, markup=False, highlight=False, soft_wrap=True)


def header_lines(out: dict[str, Any]) -> list[str]:
    """What the plan assumed and measured, one line each."""
    links = out["links"]
    return [f"plan: {out['nproc']} ranks on {out['nnodes']} node(s), {fmt_bytes(out['device_memory_bytes'])} per "
            f"rank; {len(out['layouts'])} layouts fit, {len(out['dropped'])} dropped",
            f"compute: {out['flops_per_token'] / 1e6:,.1f} MFLOP per token, peak {out['peak']['flops_per_s'] / 1e12:.3g} "
            f"TFLOP/s per rank ({out['peak']['source']})",
            f"links: {links['source']}", *out["notes"]]


def _comm(nbytes: int, seconds: float) -> str:
    return "-" if not nbytes else f"{fmt_bytes(nbytes)} {seconds * 1e3:,.1f} ms"


_DROP_FIRST = ("CP comm", "EP comm", "PP comm", "DP comm", "TP comm", "bubble", "step ms", "mbs×ga", "strategy", "largest rank")
"""The columns a terminal too narrow for the whole table leaves out, in this order (# and layout, which name a
row, and tokens/s, which ranks it, always stay)."""


def plan_table(rows: list[dict[str, Any]], width: int | None = None):
    """The ranked layouts as a rich Table, every cell whole: with ``width`` (a terminal's columns), the columns of
    :data:`_DROP_FIRST` are left out, in that order, until it fits (a caption names them)."""
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    ep = any(r.get("ep", 1) > 1 for r in rows)  # the all-to-alls' column only where a layout has them
    cp = any(r.get("cp", 1) > 1 for r in rows)
    cells: dict[str, tuple[str, list[str]]] = {
        "#": ("right", [str(i) for i in range(1, len(rows) + 1)]), "layout": ("left", [r["label"] for r in rows]),
        "strategy": ("left", [r["strategy"] + (f", tp {r['tp_impl']}" if r.get("tp_impl") else "") for r in rows]),
        "mbs×ga": ("right", [f"{r['micro_batch_size']}×{r['grad_accum']}" for r in rows]),
        "largest rank": ("right", [f"{fmt_bytes(r['largest_bytes'])} (r{r['largest_rank']})" for r in rows]),
        "tokens/s": ("right", [f"{r['predicted_tokens_per_s']:,.0f}" for r in rows]),
        "step ms": ("right", [f"{r['step_s'] * 1e3:,.1f}" for r in rows]),
        "bubble": ("right", ["-" if r["pp"] == 1 else f"{r['bubble']:.0%}" for r in rows]),
        **{f"{d.upper()} comm": ("right", [_comm(r[f"{d}_bytes"], r[f"{d}_s"]) for r in rows])
           for d in ("tp", "dp", "pp", *(("ep",) if ep else ()), *(("cp",) if cp else ()))}}
    left_out: list[str] = []
    while True:
        table = Table(header_style="bold")
        names = [n for n in cells if n not in left_out]
        for name in names:
            table.add_column(name, justify=cells[name][0], no_wrap=True)
        for i in range(len(rows)):
            table.add_row(*(cells[name][1][i] for name in names))
        if left_out:
            table.caption = f"left out to fit {width} columns: {', '.join(left_out)} (--json has every field)"
        if width is None or len(left_out) == len(_DROP_FIRST):
            return table
        console = Console(width=10_000)
        if Measurement.get(console, console.options, table).maximum <= width:
            return table
        left_out.append(next(n for n in _DROP_FIRST if n in cells and n not in left_out))


def dropped_lines(dropped: list[dict[str, Any]]) -> list[str]:
    """The dropped layouts grouped by reason: ``dropped (6): <reason>: dp 2 × tp 2 × pp 1, ...``."""
    groups: dict[str, list[str]] = {}
    for d in dropped:
        groups.setdefault(d["reason"], [])
        if d["mesh"] not in groups[d["reason"]]:
            groups[d["reason"]].append(d["mesh"])
    counts = {reason: sum(d["reason"] == reason for d in dropped) for reason in groups}
    return [f"dropped ({counts[reason]}): {reason} [{'; '.join(meshes)}]" for reason, meshes in groups.items()]


def measured_table(records: list[dict[str, Any]]):
    from rich.table import Table

    table = Table(header_style="bold", title="predicted vs measured (largest rank)")
    for name in ("layout", "status", "tokens/s pred", "tokens/s meas", "err", "states pred", "states meas", "err",
                 "saved act. pred", "saved act. meas", "err"):
        table.add_column(name, justify="left" if name in ("layout", "status") else "right", no_wrap=name != "layout")

    def err(x: float | None) -> str:
        return "-" if x is None else f"{x:+.0%}"

    for r in records:
        tps = r["tokens_per_s"]
        table.add_row(r["label"], r["status"], f"{r['predicted_tokens_per_s']:,.0f}",
                      "-" if tps is None else f"{tps:,.0f}", err(r["error_tokens_per_s"]),
                      fmt_bytes(r["predicted_state_bytes"]), fmt_bytes(r["state_bytes"]), err(r["error_state_bytes"]),
                      fmt_bytes(r["predicted_activation_bytes"]), fmt_bytes(r["activation_bytes"]),
                      err(r["error_activation_bytes"]))
    return table


def measured_plot(records: list[dict[str, Any]], width: int = 100, height: int = 16, color: bool = False) -> str:
    """A plotext bar chart: predicted and measured tokens/s of each measured layout."""
    import plotext as plt

    ok = [r for r in records if r.get("tokens_per_s")]
    plt.clear_figure()
    plt.limitsize(False, False)
    plt.plotsize(width, height)
    plt.theme("pro" if color else "clear")
    if ok:
        plt.multiple_bar([f"#{i}" for i in range(1, len(ok) + 1)],
                         [[r["predicted_tokens_per_s"] for r in ok], [r["tokens_per_s"] for r in ok]],
                         labels=["predicted", "measured"])
    plt.title("tokens/s per layout, in the planner's order (#1 = its first choice)")
    text = plt.build()
    plt.clear_figure()
    return text if color else plt.uncolorize(text)
