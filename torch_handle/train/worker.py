"""Entry point of one worker process: ``python -m torch_handle.train.worker RUN_DIR``, started by torchrun.

Each rank: checks torchrun's environment, sends its output to ``logs/rank<N>.log``, ties its life to its
parent (so no worker outlives torchrun), starts its heartbeat and its SIGUSR1 stack dump
(:mod:`torch_handle.observe.heartbeat`), initialises the process group (gloo on CPU, nccl with CUDA), builds
and runs the :class:`~torch_handle.train.trainer.Trainer`, and exits 0 when the run finished or was stopped.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import traceback
from pathlib import Path

USAGE = ("torch_handle.train.worker is started by torchrun, not by hand (RANK/WORLD_SIZE/LOCAL_RANK are not set).\n"
         "Start a run with:  handle run PRESET    (for example: handle run presets/zero2.toml)")

TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _redirect_output(log_path: Path) -> None:
    """Point fds 1 and 2 at the rank's log (so C++/NCCL/DeepSpeed output lands there too)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """The rendezvous store of this attempt, namespaced by torchrun's restart count.

    torchrun's agent keeps one TCPStore across restarts, and the process group's keys (each rank's gloo
    address) are not namespaced by attempt: after a restart the ranks would read their peers' dead addresses
    from the previous attempt and fail with "connection refused". A prefix per attempt fixes that.
    """
    from torch.distributed import PrefixStore, TCPStore

    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                     is_master=not agent_store and rank == 0, timeout=timeout, multi_tenant=not agent_store)
    return PrefixStore(f"handle/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(backend_choice: str, timeout_s: int):
    """Initialise the default process group from torchrun's environment and return a DistContext."""
    import torch.distributed as dist

    from torch_handle.launch.probe import select_backend
    from torch_handle.train.strategy import DistContext

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    backend, device = select_backend(backend_choice)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, timeout=timeout, store=_attempt_store(rank, world_size, timeout),
                            rank=rank, world_size=world_size,
                            **({"device_id": device} if device.type == "cuda" else {}))
    return DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device, backend=backend)


def agree_on_precision(preset) -> None:
    """A run on several nodes trains in rank 0's ``training.precision``: nodes with run directories of their own
    each resolved ``auto`` on their own hardware (:mod:`torch_handle.launch.precision`; a node joining a shared
    directory took its preset's already), so every rank takes rank 0's, with a warning where it differs. One
    broadcast at start-up; nothing on one node."""
    if preset.launch.nnodes == 1:
        return
    import torch.distributed as dist

    theirs = [preset.training.precision]
    dist.broadcast_object_list(theirs, src=0)
    if theirs[0] != preset.training.precision:
        logging.getLogger("torch_handle").warning("training.precision: %s here, %s on rank 0: this rank trains in "
                                                  "rank 0's", preset.training.precision, theirs[0])
        preset.training.precision = theirs[0]


def _log_resume_changes(trainer, run_dir: Path, registry) -> None:
    """Rank 0 of a resume with ``--set`` changes: one ``log`` event listing them (``key old -> new``)."""
    from torch_handle.config.loader import load_preset
    from torch_handle.observe.fields import Kind, Level
    from torch_handle.checkpoint.resume import RESUME_PRESET, diff

    try:
        changes = diff(load_preset(run_dir / "preset.toml", registry=registry),
                       load_preset(run_dir / RESUME_PRESET, registry=registry))
    except Exception as e:  # noqa: BLE001 - a history line must not fail the run
        logging.getLogger("torch_handle").warning("cannot list the resume's changes: %s", e)
        return
    if changes:
        text = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
        trainer.events.emit(Kind.LOG, level=Level.INFO, message=f"resume at step {trainer.step} changed {text}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing or len(argv) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    rank = int(os.environ["RANK"])
    from torch_handle.common.procs import die_with_parent

    die_with_parent(signal.SIGKILL)  # torchrun's agent dies -> this worker dies, even when the agent is SIGKILLed
    _redirect_output(run_dir / "logs" / f"rank{rank}.log")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("torch_handle")
    log.info("worker pid %d rank %d/%s restart %d", os.getpid(), rank, os.environ["WORLD_SIZE"], restart)
    from torch_handle.observe.heartbeat import beat, beat_interval, start_heartbeat
    # before anything slow: the launcher's watchdog reads this rank's progress, SIGUSR1 dumps its stacks
    heartbeat = start_heartbeat(run_dir, rank, int(os.environ["LOCAL_RANK"]), int(os.environ.get("GROUP_RANK", "0")),
                                interval_s=0.25)

    from torch_handle.config.loader import load_preset
    from torch_handle.observe.fields import Status
    from torch_handle.registry import get_registry
    from torch_handle.train.trainer import NonFiniteLoss, Trainer

    from torch_handle.checkpoint.resume import RESUME_PRESET, active_preset_path

    registry = get_registry()
    preset = load_preset(active_preset_path(run_dir), registry=registry)  # preset.resume.toml: a changed resume
    heartbeat.interval_s = beat_interval(preset.launch.hang_timeout_s)
    beat("init")
    ctx = init_distributed(preset.launch.backend, preset.launch.timeout_s)
    agree_on_precision(preset)
    trainer = Trainer(preset, run_dir, ctx, registry)
    status, message, code = Status.FAILED, "", 1
    try:
        beat("build")
        trainer.build()
        beat("resume")
        trainer.maybe_resume()
        if rank == 0 and (run_dir / RESUME_PRESET).exists():
            _log_resume_changes(trainer, run_dir, registry)
        status = trainer.train()
        code = 0
    except NonFiniteLoss as e:
        message = str(e)
        log.error("%s", message)
    except Exception as e:
        message = f"rank {rank}: {type(e).__name__}: {e}".splitlines()[0]
        traceback.print_exc()
        log.error("%s", message)
    finally:
        # A failure on another rank surfaces here as a collective error; rank 0 records the run as failed
        # only when this is the last attempt (torchrun may restart the group).
        beat("close")
        heartbeat.write()  # the last state, whatever the writer thread's timing (os._exit ends it)
        final = status if code == 0 else Status.FAILED
        last_attempt = restart >= preset.launch.max_restarts
        if code == 0 or last_attempt:
            trainer.close(final, message)
        else:
            trainer.close(Status.RESTARTING, message)
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                if code == 0:
                    dist.barrier()  # nobody tears down while a peer is still in a collective
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        heartbeat.stop()  # before os._exit: a half-written beat would stay as heartbeats/.rank<R>.json.*.tmp
    return code


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip C++ static destructors: DeepSpeed's CPU communication op can abort ("terminate called without an
    # active exception") while tearing down its threads after a run that completed. Everything we own is
    # closed and flushed by now.
    os._exit(exit_code)
