"""Short torchrun jobs that report through marked lines of their output: ``handle env --check-dist`` (worker
``handle_cli.env_check``) and ``handle bench comm`` (worker ``torch_handle.plan.bench_comm``).

A worker joins the process group (:func:`init_group`), prints one line ``<NAME> {json}`` per record
(:func:`emit`), leaves the group (:func:`leave_group`) and, when it fails, prints one line ``<NAME>_ERROR rank R:
Type: message`` before its traceback (:func:`guarded`). The launcher builds the torchrun command
(:func:`torchrun_command`) and runs it under :func:`torch_handle.launch.supervisor.run_torchrun`, which never leaves
a process behind, collecting the records and the error lines as they arrive (:func:`run_job`). torch is imported
inside the worker's functions only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch_handle.common.procs import TORCHRUN_MONITOR_S
from torch_handle.common.text import one_line

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Marker:
    """The prefixes of a job's output lines: ``"HANDLE_ENV_CHECK"`` marks ``HANDLE_ENV_CHECK {json}`` (a record)
    and ``HANDLE_ENV_CHECK_ERROR rank 1: ...`` (a worker's failure)."""

    name: str

    @property
    def record(self) -> str:
        return f"{self.name} "

    @property
    def error(self) -> str:
        return f"{self.name}_ERROR "


# ---------------------------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """This worker's place in the job's default process group."""

    rank: int
    world_size: int
    backend: str
    """``gloo`` or ``nccl``."""
    device: torch.device
    init_s: float
    """Seconds ``init_process_group`` took (the rendezvous of every rank)."""


def init_group(backend: str, timeout_s: float) -> Group:
    """Initialise the default process group from torchrun's environment: ``backend`` = ``auto`` | ``gloo`` |
    ``nccl`` as :func:`select_backend` resolves it, collectives timing out after
    ``timeout_s`` seconds."""
    from datetime import timedelta

    import torch.distributed as dist


    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend, device = select_backend(backend)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    t0 = time.perf_counter()
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return Group(rank, world, backend, device, time.perf_counter() - t0)


def leave_group(ok: bool) -> int:
    """Wait for every rank, then leave the process group; the worker's exit code: 0 when ``ok``, else 1."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def emit(marker: Marker, record: dict[str, Any]) -> None:
    """Print ``record`` as one marked JSON line, flushed at once (the launcher reads it while the job runs)."""
    print(marker.record + json.dumps(record), flush=True)


def guarded(main: Callable[[], int], marker: Marker) -> int:
    """``main()``'s exit code; when it raises, first one marked line ``rank R: Type: message`` (what the launcher
    reports), then the exception itself (its traceback goes to the log)."""
    try:
        return main()
    except Exception as e:  # noqa: BLE001 - one line for the launcher, then the traceback for the log
        print(f"{marker.error}rank {os.environ.get('RANK', '?')}: {one_line(e)}"[:2000], flush=True)
        raise


# ---------------------------------------------------------------------------------------------------------------
# launcher side
# ---------------------------------------------------------------------------------------------------------------


def torchrun_command(module: str, nproc: int, args: Sequence[str], *, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: str = "", rdzv_id: str = "") -> list[str]:
    """``python -m torch.distributed.run ... -m MODULE ARGS`` for ``nproc`` processes on this node: standalone on
    one node; on ``nnodes > 1`` a static rendezvous at ``rdzv_endpoint`` (``host:port`` of node 0), as
    ``handle run`` uses."""
    if nnodes > 1:
        where = [f"--nnodes={nnodes}", f"--node_rank={node_rank}", "--rdzv_backend=static",
                 f"--rdzv_endpoint={rdzv_endpoint}", f"--rdzv_id={rdzv_id}"]
    else:
        where = ["--standalone"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={nproc}",
            f"--monitor_interval={TORCHRUN_MONITOR_S}", "-m", module, *args]


@dataclass
class JobOutput:
    """What a job printed and how it ended."""

    returncode: int | None
    """torchrun's exit code; None after a timeout."""
    timed_out: bool
    wall_s: float
    records: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """The workers' error lines, marker removed (``rank 1: RuntimeError: ...``)."""
    output: list[str] = field(default_factory=list)
    """Every line but the records (error lines included), for the tail of a failure message."""


def run_job(cmd: list[str], marker: Marker, log_path: Path, timeout_s: float,
            on_record: Callable[[dict[str, Any]], None] | None = None) -> JobOutput:
    """Run ``cmd`` (from :func:`torchrun_command`) with its output in ``log_path``; ``on_record`` gets each
    record as it arrives. Unbuffered output, one intra-op thread per worker unless ``OMP_NUM_THREADS`` says
    otherwise.

    Raises:
        KeyboardInterrupt: on Ctrl-C, after every process of the job was stopped (the records so far went to
            ``on_record``).
    """
    from torch_handle.launch import supervisor

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    out = JobOutput(None, False, 0.0)

    def on_line(line: str) -> None:
        if line.startswith(marker.record):
            record = json.loads(line[len(marker.record):])
            out.records.append(record)
            if on_record is not None:
                on_record(record)
            return
        if line.startswith(marker.error):
            out.errors.append(line[len(marker.error):])
        out.output.append(line)

    out.returncode, out.timed_out, out.wall_s = supervisor.run_torchrun(cmd, log_path, timeout_s, on_line, env=env)
    return out


def select_backend(choice: str):
    """``(backend, device)`` of this torchrun process for ``choice`` = ``auto`` | ``gloo`` | ``nccl``.

    ``auto`` is nccl when CUDA has a device for every local process (``LOCAL_WORLD_SIZE``), else gloo. With nccl the
    device is ``cuda:LOCAL_RANK`` and becomes the current CUDA device; otherwise the CPU. Used by the training
    workers, ``handle env --check-dist`` and ``handle bench comm``.
    """
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    backend = choice
    if backend == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        backend = "nccl" if gpus >= local_world and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return backend, device
    return backend, torch.device("cpu")
