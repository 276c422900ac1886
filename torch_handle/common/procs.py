"""Process helpers the launcher and the data preparation share: the usable cores, a child that dies with its
parent, whether a pid is alive. Standard library only."""

from __future__ import annotations

import ctypes
import os
import signal

TORCHRUN_MONITOR_S = 0.1
"""``torchrun --monitor_interval``: how often its agent looks at its workers. torch's default (0.1 s; 0.5 s here
before) also decides how long a finished run waits for torchrun to notice: 0.4 s less per run at 0.1 s, measured
on 2 cores (the agent's check is a ``waitpid`` per worker)."""


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity mask (``os.sched_getaffinity``, which ``taskset``,
    cgroup cpusets and Slurm's ``--cpus-per-task`` narrow), else ``os.cpu_count()``; at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        return max(1, os.cpu_count() or 1)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: have the kernel send ``sig`` to this process when its parent dies, even by SIGKILL
    (``prctl(PR_SET_PDEATHSIG)``, see prctl(2)); a no-op where libc has no prctl. Safe between fork and exec
    (``preexec_fn``). A process that calls it after its parent is already gone exits at once."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, sig)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # orphaned before the call: no signal will come
        os._exit(1)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
