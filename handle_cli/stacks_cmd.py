"""``handle stacks``: the Python stacks of a live run's workers, on demand (the logic: torch_handle.observe.stacks)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("stacks")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object: path, ranks (rank, pid, host, step, phase, source, call, where, summary, "
                   "error), remote.")
def stacks(run_dir: Path, as_json: bool) -> None:
    """Dump the Python stacks of every rank of the running RUN_DIR into RUN_DIR/logs/stacks-<UTC time>.txt, then
    print that path and where each rank is: the call it waits in and the run's own line that made it.

    Each worker answers SIGUSR1 with its stacks (faulthandler, every thread); with `py-spy` on PATH, `py-spy dump
    --native` is used instead (native frames too; HANDLE_PY_SPY=0 turns it off). The run goes on untouched.
    Ranks on another host (a run directory on a shared filesystem) are listed: run the command there.
    A run that is not running: one-line error, exit code 2.

    \b
    Examples:
      handle stacks runs/zero2-20260105-080000
      handle stacks runs/zero2-20260105-080000 --json | jq -r '.ranks[].summary'
    """
    from torch_handle.common.text import clean
    from torch_handle.observe.stacks import stacks_of_run

    report = stacks_of_run(run_dir)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
        return
    click.echo(f"stacks: {report.path}")
    for s in report.stacks:
        click.echo(clean(s.summary, 500))
    for b in report.remote:
        click.echo(f"rank {b.rank}: on host {clean(b.host, 100)} (run handle stacks there)")
