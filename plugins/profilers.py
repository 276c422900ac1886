"""Profiler plugins: ``none`` and ``torch`` (torch.profiler with a wait/warmup/active schedule).

``torch`` writes one directory per profiled rank, ``traces/rank<R>/``, each holding the Chrome trace JSON that
``tensorboard_trace_handler`` writes (``rank<R>.<ms>.pt.trace.json``; Perfetto, chrome://tracing and
TensorBoard's profiler open it), so ranks never overwrite each other. ``handle profile RUN`` summarises them.
While it records, the model's own ``record_function`` ranges (``decoder.layer<i>``, ``attention``,
``feed_forward``) and the trainer's (``handle/data|forward|backward|comm|optimizer``) appear in the trace; they
open only while a profiler records (``torch.autograd._profiler_enabled()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch_handle.api import hookimpl, param


@dataclass
class NoProfilerConfig:
    """``[profiler]`` with ``name = "none"``: no options."""


class NullProfiler:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self) -> None:
        pass


@dataclass
class TorchProfilerConfig:
    """``[profiler]`` options of ``torch``: torch.profiler with a schedule; one Chrome trace per cycle and rank
    in ``traces/rank<R>/`` (see https://pytorch.org/docs/stable/profiler.html; summary: ``handle profile``)."""

    wait: int = param(2, ge=0)
    """Steps skipped at the start of each cycle."""
    warmup: int = param(2, ge=0)
    """Steps profiled but discarded (profiler warm-up)."""
    active: int = param(3, ge=1)
    """Steps recorded."""
    repeat: int = param(1, ge=0)
    """Cycles (0 = until the end)."""
    record_shapes: bool = True
    """Record input shapes of operators."""
    profile_memory: bool = True
    """Track tensor allocations (memory timeline; ``handle profile`` reports the peak)."""
    with_stack: bool = False
    """Record Python stacks (large traces)."""
    ranks: list[int] = param(default_factory=lambda: [0])
    """Ranks that profile."""


def build_none(options, trace_dir: Path, rank: int):
    return NullProfiler()


def build_torch(options: TorchProfilerConfig, trace_dir: Path, rank: int):
    """torch.profiler for ``rank`` if it is in ``options.ranks`` (else a no-op); traces in ``trace_dir/rank<R>``."""
    if rank not in options.ranks:
        return NullProfiler()
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    rank_dir = Path(trace_dir) / f"rank{rank}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    return profile(
        activities=activities,
        schedule=schedule(wait=options.wait, warmup=options.warmup, active=options.active, repeat=options.repeat),
        on_trace_ready=tensorboard_trace_handler(str(rank_dir), worker_name=f"rank{rank}"),
        record_shapes=options.record_shapes, profile_memory=options.profile_memory, with_stack=options.with_stack)


@hookimpl
def handle_register_profilers(register):
    register("none", NoProfilerConfig, build_none, "no profiling")
    register("torch", TorchProfilerConfig, build_torch,
             "torch.profiler: Chrome traces in traces/rank<R>/ (handle profile RUN)")
