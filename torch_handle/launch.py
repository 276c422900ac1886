"""Start and supervise ``torchrun`` for a run directory.

``Launch`` starts ``python -m torch.distributed.run ... -m torch_handle.worker RUN_DIR`` in its own session, so
a Ctrl-C in the terminal reaches only ``handle run``, which then decides: the first one asks the workers to
finish their step, checkpoint and exit (the STOP file); a second one terminates them. No worker outlives the
launcher: torchrun gets SIGTERM if the launcher dies (PR_SET_PDEATHSIG), each worker gets SIGKILL if torchrun
dies, and the launcher kills any process of the tree it has seen that is still alive at the end.

No torch import here: the CLI stays instant.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import psutil

from torch_handle.config import Preset
from torch_handle.events import Status
from torch_handle.rundir import HEARTBEAT_S, STOP_FILE, read_run_info, touch_heartbeat, update_run_info


def torchrun_command(preset: Preset, run_dir: Path, python: str = sys.executable) -> list[str]:
    """The torchrun command line for ``preset`` (see ``torchrun --help``)."""
    launch = preset.launch
    cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={launch.nproc_per_node}",
           f"--nnodes={launch.nnodes}", f"--node_rank={launch.node_rank}", f"--max_restarts={launch.max_restarts}"]
    if launch.nnodes == 1 and not launch.rdzv_endpoint:
        # a free port chosen by torchrun: two runs on one machine never collide
        cmd += ["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", f"--rdzv_id={Path(run_dir).name}"]
    else:
        cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint={launch.rdzv_endpoint}", f"--rdzv_id={preset.run.name}"]
    cmd += ["--monitor_interval=0.5", "-m", "torch_handle.worker", str(run_dir)]
    return cmd


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


def is_alive(p: psutil.Process) -> bool:
    """Running and not a zombie (a zombie has exited; it only waits to be reaped)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def terminate(procs: list[psutil.Process], grace_s: float = 5.0) -> None:
    """SIGTERM ``procs``, then SIGKILL whatever is still alive after ``grace_s``."""
    procs = [p for p in procs if is_alive(p)]
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=2)


class Launch:
    """One supervised torchrun."""

    def __init__(self, preset: Preset, run_dir: Path, env: dict[str, str] | None = None):
        self.preset, self.run_dir = preset, Path(run_dir)
        self.cmd = torchrun_command(preset, run_dir)
        self.env = {**os.environ, **(env or {})}
        # One thread per worker by default: with nproc_per_node processes on few cores, oversubscribing
        # intra-op threads is slower. Users may override OMP_NUM_THREADS.
        cores = os.cpu_count() or 1
        self.env.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(1, preset.launch.nproc_per_node))))
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc: subprocess.Popen | None = None
        self.seen: dict[int, psutil.Process] = {}
        self.stop_requested = False
        self.killed = False
        self.last_beat = 0.0

    def start(self) -> None:
        (self.run_dir / STOP_FILE).unlink(missing_ok=True)
        log = open(self.run_dir / "logs" / "launcher.log", "ab")
        log.write(f"$ {' '.join(self.cmd)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True, preexec_fn=die_with_parent)
        log.close()
        touch_heartbeat(self.run_dir)
        self.last_beat = time.monotonic()
        update_run_info(self.run_dir, status=Status.RUNNING, launcher_pid=os.getpid(), torchrun_pid=self.proc.pid,
                        launcher_create_time=psutil.Process().create_time(),
                        start_time=read_run_info(self.run_dir).get("start_time") or time.time(), end_time=None)

    def poll(self) -> int | None:
        """The exit code once torchrun has exited; meanwhile remembers every process of its tree and touches the
        run's heartbeat every ``HEARTBEAT_S`` seconds (what tells a live run from a lost one)."""
        assert self.proc is not None
        if time.monotonic() - self.last_beat >= HEARTBEAT_S:
            touch_heartbeat(self.run_dir)
            self.last_beat = time.monotonic()
        try:
            parent = psutil.Process(self.proc.pid)
            for p in [parent, *parent.children(recursive=True)]:
                self.seen.setdefault(p.pid, p)
        except psutil.Error:
            pass
        return self.proc.poll()

    def request_stop(self) -> None:
        """First Ctrl-C: workers finish the current step, write a checkpoint and exit."""
        self.stop_requested = True
        (self.run_dir / STOP_FILE).touch()

    def kill(self, grace_s: float = 5.0) -> None:
        """Second Ctrl-C (or a failure): SIGTERM the tree, SIGKILL whatever is left after ``grace_s``."""
        self.killed = True
        self.poll()
        terminate(list(self.seen.values()), grace_s)

    def reap(self) -> None:
        """After torchrun exited: make sure no process of its tree is left."""
        terminate(list(self.seen.values()), grace_s=2.0)  # not a user's kill: the status stays the workers' own

    def finish(self, returncode: int) -> dict[str, Any]:
        """Settle run.json after torchrun exited: the worker's own status, or failed with the cause."""
        (self.run_dir / STOP_FILE).unlink(missing_ok=True)
        info = read_run_info(self.run_dir)
        status = info.get("status")
        if status in Status.FINAL and not (status == Status.FINISHED and returncode != 0):
            return info
        if self.killed:
            status, message = Status.STOPPED, "stopped by user (workers terminated)"
        else:
            status, message = Status.FAILED, failure_message(self.run_dir) or f"torchrun exited with code {returncode}"
        return update_run_info(self.run_dir, status=status, message=message, end_time=time.time())


_ERROR_LINE = re.compile(r"^(\S+ \S+) rank(\d+) ERROR torch_handle: (.*)$")
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*")


def failure_message(run_dir: Path) -> str:
    """The first error any rank logged (later ones are usually the others noticing it), one line."""
    found: list[tuple[str, str]] = []
    fallback = ""
    for log in sorted((Path(run_dir) / "logs").glob("rank*.log")):
        try:
            lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if m := _ERROR_LINE.match(line):
                found.append((m.group(1), m.group(3)))
        if not fallback:
            exc = [ln for ln in lines if _EXC_LINE.match(ln)]
            if exc:
                fallback = f"{log.stem}: {exc[-1]}"
    # A peer's "connection closed" is a consequence; an error that is not about the collective is the cause.
    primary = [f for f in found if not re.search(r"Connection (closed|reset)|Broken pipe|gloo|NCCL|timed out", f[1])]
    if primary:
        return min(primary)[1][:500]
    killed = _torchrun_signal_death(Path(run_dir) / "logs" / "launcher.log")
    if killed:  # a rank killed by a signal leaves no Python error of its own
        return killed
    if found:
        return min(found)[1][:500]
    return fallback[:500]


def _torchrun_signal_death(path: Path) -> str:
    """From torchrun's last failure report: the first rank that died of a signal (SIGKILL, SIGSEGV, ...)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    _, _, report = text.rpartition("Failures:")
    for rank, code, rest in re.findall(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-\d+)([^\n]*)", report):
        sig = re.search(r"\((SIG\w+)\)", rest)
        return f"rank {rank} was killed by {sig.group(1) if sig else 'a signal'} (exit code {code})"
    return ""


def run_torchrun(cmd: list[str], log_path: Path, timeout_s: float, on_line: Callable[[str], None],
                 env: dict[str, str] | None = None) -> tuple[int | None, bool, float]:
    """Run ``cmd`` (a torchrun command line) with its output in ``log_path``, handing every complete output line
    to ``on_line`` as it arrives; never leaves a process behind.

    Returns ``(returncode, timed_out, wall_s)``; the return code is torchrun's own, or None after a timeout.

    Raises:
        KeyboardInterrupt: on Ctrl-C, after every process of the tree was stopped.
    """
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
            stop_tree(proc, seen)
        drain(final=True)
    return (None if timed_out else proc.returncode), timed_out, time.perf_counter() - t0


def stop_tree(proc: subprocess.Popen, seen: dict[int, psutil.Process]) -> None:
    """SIGTERM ``proc``'s whole tree (its children now, and every process in ``seen``), SIGKILL what is left after
    5 s; reap ``proc``."""
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
