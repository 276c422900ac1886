"""An sbatch script that runs one ``handle run`` per node of a Slurm allocation (``handle slurm``).

The script (see :func:`sbatch_script`) follows the usual recipe for torchrun under Slurm (one task per node, the
first node of the allocation hosts the rendezvous):

- ``#SBATCH`` lines: ``--nodes``, ``--ntasks-per-node=1`` (torchrun starts the per-GPU processes itself),
  ``--gpus-per-node``, ``--partition``, ``--time``, ``--account``, ``--signal=TERM@120`` (two minutes before the time
  limit every ``handle run`` gets SIGTERM: the workers checkpoint after their current step), and ``--output`` =
  ``slurm-<job name>-<job id>.out`` in the submission directory, where Slurm users look for it (each line prefixed
  with its node by ``srun --label``);
- the rendezvous endpoint: the first host of ``scontrol show hostnames "$SLURM_JOB_NODELIST"`` and a port;
- ``srun --ntasks-per-node=1`` runs, on every node, ``python -m handle_cli run`` with ``launch.node_rank =
  $SLURM_NODEID`` (expanded on that node) and one run directory on the shared filesystem (the shared layout of
  docs/multi-node.md: node 0 creates it, the others join it);
- a requeued job (same ``$SLURM_JOB_ID``) finds its run directory and continues it with ``--resume`` on every node
  (or, when the run finished, says so and exits 0).

Standard library only; nothing here runs Slurm.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

DEFAULT_PORT = 29400
"""torchrun's usual rendezvous port, on the first node of the allocation."""
SET_BY_SLURM = ("launch.nnodes", "launch.node_rank", "launch.rdzv_endpoint")
"""Preset keys the script sets itself (from ``--nodes``, ``$SLURM_NODEID`` and the first node)."""


@dataclass
class SlurmJob:
    """What :func:`sbatch_script` needs; paths absolute (every node runs the script's commands)."""

    preset: str
    """The preset file (on the shared filesystem)."""
    name: str
    """Job name (``#SBATCH --job-name``) and the run directory's prefix: ``run.name``."""
    output_dir: str
    """``run.output_dir`` made absolute: the run directory is ``<output_dir>/<name>-slurm-<job id>``."""
    workdir: str
    """Where the job runs (``#SBATCH --chdir``): the submission directory."""
    nodes: int
    gpus_per_node: int | None = None
    """GPUs per node; each node then runs that many processes (``launch.nproc_per_node``). None: CPUs."""
    partition: str | None = None
    time: str | None = None
    """Time limit as sbatch reads it (``HH:MM:SS``, ``D-HH:MM``, minutes)."""
    account: str | None = None
    overrides: list[str] = field(default_factory=list)
    """The user's ``--set TABLE.KEY=VALUE`` overrides, already validated."""
    port: int = DEFAULT_PORT
    python: str = sys.executable
    """The Python of the environment that has torch-handle, at the same path on every node."""


def _word(text: str) -> str:
    return shlex.quote(str(text))


def sbatch_script(job: SlurmJob, generated: datetime | None = None) -> str:
    """The text of the sbatch script for ``job`` (bash; ``bash -n`` accepts it).

    The per-node command lines sit in quoted here-documents, so ``$SLURM_NODEID`` is expanded by the shell that
    srun starts on each node, not once by the batch shell on the first node.
    """
    generated = generated or datetime.now(timezone.utc)
    sbatch = [f"--job-name={job.name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
              f"--chdir={job.workdir}", "--output=slurm-%x-%j.out", "--signal=TERM@120"]
    if job.gpus_per_node:
        sbatch.append(f"--gpus-per-node={job.gpus_per_node}")
    for option, value in (("partition", job.partition), ("time", job.time), ("account", job.account)):
        if value:
            sbatch.append(f"--{option}={value}")
    handle = f"exec {_word(job.python)} -m handle_cli run"
    node = ('--set launch.node_rank="$SLURM_NODEID" --set launch.rdzv_endpoint="$HEAD_NODE:$RDZV_PORT"')
    sets = [*job.overrides, f"launch.nnodes={job.nodes}"]
    if job.gpus_per_node:
        sets.append(f"launch.nproc_per_node={job.gpus_per_node}")
    start = " ".join([handle, _word(job.preset), '--run-dir "$RUN_DIR"', *[f"--set {_word(s)}" for s in sets], node])
    resume = f'{handle} --resume "$RUN_DIR" {node}'
    lines = [
        "#!/bin/bash",
        (f"# Written by `handle slurm` on {generated:%Y-%m-%d %H:%M} UTC: one `handle run` per node, the "
         "rendezvous on the first node,"),
        "# one run directory on the shared filesystem (see docs/multi-node.md). Submit with: sbatch THIS_FILE",
        *[f"#SBATCH {s}" for s in sbatch],
        "",
        "set -euo pipefail",
        'NODE_LIST=$(scontrol show hostnames "$SLURM_JOB_NODELIST")  # one host a line, in allocation order',
        'HEAD_NODE=$(head -n1 <<<"$NODE_LIST")  # (no pipe from scontrol: pipefail would catch its SIGPIPE)',
        f"RDZV_PORT=${{HANDLE_RDZV_PORT:-{job.port}}}",
        f'RUN_DIR=${{HANDLE_RUN_DIR:-{_word(job.output_dir)}/{_word(job.name)}-slurm-"$SLURM_JOB_ID"}}',
        "export HEAD_NODE RDZV_PORT RUN_DIR",
        "",
        "# the command each node runs ($SLURM_NODEID is expanded there); a requeued job continues its run",
        "START=$(cat <<'HANDLE_NODE'",
        start,
        "HANDLE_NODE",
        ")",
        "RESUME=$(cat <<'HANDLE_NODE'",
        resume,
        "HANDLE_NODE",
        ")",
        'if [ ! -e "$RUN_DIR/run.json" ]; then NODE_CMD=$START',
        # a requeue of a job whose run finished: nothing is left to train (its --resume would be refused, exit 2)
        (f"elif {_word(job.python)} -c 'import json, sys; sys.exit(json.load(open(sys.argv[1])).get(\"status\") "
         f"!= \"finished\")' \"$RUN_DIR/run.json\"; then"),
        '  echo "handle: $RUN_DIR finished already: nothing to train"; exit 0',
        "else NODE_CMD=$RESUME; fi",
        "",
        ('echo "handle: job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES node(s), rendezvous $HEAD_NODE:$RDZV_PORT, '
         'run directory $RUN_DIR"'),
        'srun --ntasks-per-node=1 --label bash -c "$NODE_CMD"',
        "",
    ]
    return "\n".join(lines)


def default_script_path(output_dir: str | Path, name: str, now: datetime | None = None) -> Path:
    """``<output_dir>/slurm/<name>-<UTC timestamp>.sbatch``."""
    now = now or datetime.now(timezone.utc)
    return Path(output_dir) / "slurm" / f"{name}-{now:%Y%m%d-%H%M%S}.sbatch"
