"""Start and supervise ``torchrun`` for a run directory.

``Launch`` starts ``python -m torch.distributed.run ... -m torch_handle.train.worker RUN_DIR`` in its own session, so
a Ctrl-C in the terminal reaches only ``handle run``, which then decides: the first one asks the workers to
finish their step, checkpoint and exit (the STOP file); a second one terminates them. No worker outlives the
launcher: torchrun gets SIGTERM if the launcher dies (PR_SET_PDEATHSIG), each worker gets SIGKILL if torchrun
dies, and the launcher kills any process of the tree it has seen that is still alive at the end.

While torchrun runs, ``poll()`` also watches the workers' heartbeats (:mod:`torch_handle.launch.hang`): when no local
rank advanced for ``launch.hang_timeout_s``, it writes every rank's stacks to ``logs/stacks-<time>.txt``, asks
NCCL's flight recorder for its dump, appends a ``hang`` event to ``events.jsonl`` and, with ``launch.on_hang =
"stop"``, terminates the tree (the run then ends ``failed`` with the hang message).

No torch import here: the CLI stays instant.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from torch_handle.common.procs import TORCHRUN_MONITOR_S, die_with_parent, usable_cores
from torch_handle.config.loader import Preset
from torch_handle.launch.cores import allocator_env, threads_per_rank
from torch_handle.launch.hang import HangWatchdog, Stall, flight_recorder_env, hang_message, trigger_flight_recorder
from torch_handle.launch.precision import target_device
from torch_handle.observe.fields import Kind, Status
from torch_handle.observe.heartbeat import RankBeat, read_heartbeats
from torch_handle.observe.stacks import take_stacks
from torch_handle.observe.telemetry import EVENTS_FILE, append_event
from torch_handle.rundir import HEARTBEAT_S, STOP_FILE, modify_run_info, read_run_info, touch_heartbeat

WATCH_EVERY_S = 0.5
"""How often ``Launch.poll`` reads the heartbeats."""


def torchrun_command(preset: Preset, run_dir: Path, python: str = sys.executable) -> list[str]:
    """The torchrun command line for ``preset`` (see ``torchrun --help``).

    One node: the c10d rendezvous on a free port. Several nodes: the static rendezvous at ``rdzv_endpoint``,
    hosted by node 0's torchrun, so that ``node_rank`` decides the global ranks (node R holds ranks
    R * nproc_per_node ...): global rank 0, which writes the events, runs on node 0. (The c10d rendezvous ignores
    ``--node_rank`` and numbers the nodes by host name and pid.) A failed worker still restarts the group on every
    node, up to ``max_restarts``: its peers fail at their next collective and each node's torchrun restarts its
    workers.
    """
    launch = preset.launch
    cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={launch.nproc_per_node}",
           f"--nnodes={launch.nnodes}", f"--node_rank={launch.node_rank}", f"--max_restarts={launch.max_restarts}"]
    if launch.nnodes == 1 and not launch.rdzv_endpoint:
        # a free port chosen by torchrun: two runs on one machine never collide
        cmd += ["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", f"--rdzv_id={Path(run_dir).name}"]
    elif launch.nnodes == 1:
        cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint={launch.rdzv_endpoint}", f"--rdzv_id={preset.run.name}"]
    else:
        cmd += ["--rdzv_backend=static", f"--rdzv_endpoint={launch.rdzv_endpoint}", f"--rdzv_id={preset.run.name}"]
    cmd += [f"--monitor_interval={TORCHRUN_MONITOR_S}", "-m", "torch_handle.train.worker", str(run_dir)]
    return cmd


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
        # The cores shared out, one thread per worker at least: with nproc_per_node processes on few cores,
        # oversubscribing intra-op threads is slower. Users may override OMP_NUM_THREADS.
        self.env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(preset.launch.nproc_per_node, usable_cores(),
                                                                    None)))
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        if target_device(preset) == "cpu":  # a step's buffers reused, not faulted in anew (cores.allocator_env)
            self.env.update(allocator_env(self.env))
        if preset.launch.backend != "gloo":  # NCCL's flight recorder (read by ProcessGroupNCCL only)
            self.env.update(flight_recorder_env(self.run_dir, self.env))
        self.proc: subprocess.Popen | None = None
        self.seen: dict[int, psutil.Process] = {}
        self.stop_requested = False
        self.killed = False
        self.last_beat = 0.0
        self.watchdog = HangWatchdog(preset.launch.hang_timeout_s)
        self.last_watch = 0.0
        self.hangs: list[dict[str, Any]] = []
        """The ``hang`` events this launcher wrote."""
        self.hang_stop: str | None = None
        """The hang message once ``on_hang = "stop"`` terminated the workers."""

    @property
    def log_path(self) -> Path:
        """torchrun's output: ``logs/launcher.log``; ``logs/launcher-node<R>.log`` for node R > 0 (a shared run
        directory holds every node's)."""
        node = self.preset.launch.node_rank
        return self.run_dir / "logs" / ("launcher.log" if node == 0 else f"launcher-node{node}.log")

    def owns_run_info(self, info: dict[str, Any]) -> bool:
        """Whether this launcher settles run.json (launcher fields, the final status when the workers could not).
        On one node, always. On several: the launcher recorded in it, which is node 0's, or the node that created
        a run directory that node 0 never joined (each node's own directory when they share no filesystem)."""
        launch = self.preset.launch
        if launch.nnodes == 1:
            return True
        return info.get("launcher_node_rank", 0) == launch.node_rank and info.get("launcher_pid") == os.getpid()

    def start(self) -> None:
        (self.run_dir / STOP_FILE).unlink(missing_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"$ {' '.join(self.cmd)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True, preexec_fn=die_with_parent)
        log.close()
        touch_heartbeat(self.run_dir)
        self.last_beat = time.monotonic()
        if self.preset.launch.node_rank > 0:
            return  # node 0's launcher owns run.json; a node's own directory recorded its launcher at creation
        record = {"status": Status.RUNNING, "launcher_pid": os.getpid(), "torchrun_pid": self.proc.pid,
                  "launcher_create_time": psutil.Process().create_time(), "launcher_node_rank": 0, "end_time": None}
        modify_run_info(self.run_dir, lambda info: {**info, **record,
                                                    "start_time": info.get("start_time") or time.time()})

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
        if self.hang_stop is None and time.monotonic() - self.last_watch >= WATCH_EVERY_S:
            self.last_watch = time.monotonic()
            self.watch()
        return self.proc.poll()

    def local_beats(self) -> list[RankBeat]:
        """The heartbeats of this launcher's live workers (stale files of an earlier attempt or run, and another
        node's ranks in a shared run directory, are left out)."""
        out = []
        for b in read_heartbeats(self.run_dir).values():
            p = self.seen.get(b.pid)
            if p is not None and b.local() and is_alive(p) and abs(p.create_time() - b.create_time) < 1.0:
                out.append(b)
        return out

    def watch(self) -> dict[str, Any] | None:
        """One look at the heartbeats; on a hang: stacks, flight recorder, the ``hang`` event, and with
        ``on_hang = "stop"`` the tree terminated. Returns the hang event, if one was written."""
        try:
            beats = self.local_beats()
        except psutil.Error:
            return None
        stall = self.watchdog.observe(beats)
        if stall is None:
            return None
        return self.on_hang(stall)

    def on_hang(self, stall: Stall) -> dict[str, Any]:
        launch = self.preset.launch
        reason = (f"watchdog: no local rank advanced for {stall.stalled_s:.1f} s (launch.hang_timeout_s = "
                  f"{launch.hang_timeout_s:g}, on_hang = {launch.on_hang})")
        try:
            report = take_stacks(self.run_dir, stall.ranks, reason)
            stacks_path, summaries = str(report.path.relative_to(self.run_dir)), [s.summary for s in report.stacks]
            ranks = [s.to_json() for s in report.stacks]
        except OSError as e:  # a full disk: the event still says which ranks hang
            stacks_path, summaries = f"(not written: {e.strerror or e})", []
            ranks = [{"rank": b.rank, "pid": b.pid, "step": b.step, "phase": b.phase} for b in stall.ranks]
        traces = trigger_flight_recorder(self.env, [b.rank for b in stall.ranks])
        message = hang_message(stall.stalled_s, launch.hang_timeout_s, summaries, stacks_path)
        fields: dict[str, Any] = {"message": message, "ranks": ranks, "stacks": stacks_path,
                                  "stalled_s": round(stall.stalled_s, 1), "timeout_s": launch.hang_timeout_s,
                                  "action": launch.on_hang, "node_rank": launch.node_rank,
                                  "step": max((b.step for b in stall.ranks), default=0)}
        if traces:
            fields["flight_recorder"] = [str(p.relative_to(self.run_dir)) if p.is_relative_to(self.run_dir)
                                         else str(p) for p in traces]
        try:
            event = append_event(self.run_dir / EVENTS_FILE, Kind.HANG, **fields)
        except OSError:
            event = {"kind": Kind.HANG, **fields}
        self.hangs.append(event)
        with open(self.log_path, "a", encoding="utf-8") as log:  # this node's torchrun log
            log.write(f"handle: {message}\n")
        if launch.on_hang == "stop":
            self.hang_stop = f"{message}; the run was stopped (launch.on_hang = \"stop\")"
            terminate(list(self.seen.values()), grace_s=5.0)
        return event

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
        """Settle run.json after torchrun exited: the worker's own status, or failed with the cause. Decided on the
        current run.json under its lock (:func:`torch_handle.rundir.modify_run_info`), so a worker's final status
        is never overwritten by an older view.

        Raises:
            RunDirError: when the run directory is gone.
            OSError: when run.json cannot be written.
        """
        (self.run_dir / STOP_FILE).unlink(missing_ok=True)
        info = read_run_info(self.run_dir)
        if not self.owns_run_info(info):
            return self._outcome_elsewhere(returncode, info)
        return modify_run_info(self.run_dir, lambda current: self._settled(current, returncode))

    def _settled(self, info: dict[str, Any], returncode: int) -> dict[str, Any] | None:
        """run.json ``info`` with its final status, or None when the workers' own final status stands."""
        if self.hang_stop is not None:  # the watchdog ended it: that is the cause, whatever a worker recorded
            return {**info, "status": Status.FAILED, "message": self.hang_stop, "end_time": time.time()}
        status = info.get("status")
        if status in Status.FINAL and not (status == Status.FINISHED and returncode != 0):
            return None
        if self.killed:
            status, message = Status.STOPPED, "stopped by user (workers terminated)"
        else:
            status, message = Status.FAILED, failure_message(self.run_dir) or f"torchrun exited with code {returncode}"
        return {**info, "status": status, "message": message, "end_time": time.time()}

    def _outcome_elsewhere(self, returncode: int, info: dict[str, Any], wait_s: float = 5.0) -> dict[str, Any]:
        """The run's outcome for a launcher that does not own run.json (node R > 0 in a shared run directory):
        the status global rank 0 wrote (``info``, read again for up to ``wait_s`` until it shows on a shared
        filesystem after a clean exit), else this node's own view; nothing is written."""
        if self.hang_stop is not None:  # this node's watchdog ended it
            return {**info, "status": Status.FAILED, "message": self.hang_stop}
        deadline = time.monotonic() + wait_s
        while returncode == 0 and info.get("status") not in Status.FINAL and time.monotonic() < deadline:
            time.sleep(0.2)
            info = read_run_info(self.run_dir)
        status = info.get("status")
        if status in Status.FINAL and not (status == Status.FINISHED and returncode != 0):
            return info
        if self.killed:
            return {**info, "status": Status.STOPPED, "message": "stopped by user (workers terminated)"}
        return {**info, "status": Status.FAILED,
                "message": failure_message(self.run_dir) or f"torchrun exited with code {returncode}"}


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
    for launcher_log in sorted((Path(run_dir) / "logs").glob("launcher*.log")):  # launcher-node<R>.log: node R
        killed = _torchrun_signal_death(launcher_log)
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
