"""``handle bench``: benchmarks run through torchrun, one module per command: ``bench comm``
(:mod:`handle_cli.bench_comm_cmd`, collective bandwidth in the spirit of nccl-tests) and ``bench scaling``
(:mod:`handle_cli.bench_scaling_cmd`, short real training runs per strategy and world size). This module holds the
group and what both commands share: option checks and the output directory.

Process hygiene as ``handle env --check-dist``: torchrun runs in its own session and dies with this process
(PR_SET_PDEATHSIG); every process of its tree that was seen is terminated at the end, on a timeout and on
Ctrl-C. Click, the standard library and torch-free project modules only at import: rich, plotext, psutil and
torch are imported inside the commands.
"""

from __future__ import annotations

from pathlib import Path

import click

from handle_cli.common import fail

DEFAULT_OUTPUT_DIR = Path("runs") / "bench"


@click.group("bench", context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks run with torchrun on this machine.

    \b
    Example:
      handle bench comm --nproc 2                      # all_reduce, all_gather, reduce_scatter, broadcast
      handle bench scaling presets/ddp.toml --nproc 1,2 --strategies ddp,zero2,fsdp
    """


def int_option(name: str, text: str, lo: int, hi: int) -> int:
    """``text`` as an integer in ``lo..hi``; a one-line error (exit 2) naming option ``name`` otherwise."""
    try:
        value = int(text)
    except ValueError:
        fail(f"{name}: {text!r} is not an integer")
    if not lo <= value <= hi:
        fail(f"{name}: {value} is out of range ({lo} to {hi})")
    return value


def output_parent(output_dir: Path | None) -> Path:
    """``--output-dir`` (default :data:`DEFAULT_OUTPUT_DIR`), checked before anything starts."""
    parent = output_dir if output_dir is not None else DEFAULT_OUTPUT_DIR
    if parent.exists() and not parent.is_dir():
        fail(f"--output-dir: {parent} is not a directory")
    return parent


def new_dir(parent: Path, prefix: str) -> Path:
    """``parent/<prefix>-<UTC timestamp>`` (``-2``, ``-3`` ... when taken), created; a one-line error (exit 2)
    when it cannot be."""
    from torch_handle.rundir import utc_stamp

    try:
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
    except OSError as e:
        fail(f"--output-dir: cannot create a directory in {parent}: {e.strerror or e}")
