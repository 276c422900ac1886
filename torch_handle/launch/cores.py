"""How the ranks of one node share its CPU cores: the cores this process may use, the intra-op threads the launcher
gives each rank, and the warning ``handle run`` prints when ranks x threads exceed the cores (oversubscription).

On a CPU each rank computes with ``OMP_NUM_THREADS`` intra-op threads; the launcher sets it to cores // ranks (at
least 1) unless the environment sets it (:class:`torch_handle.launch.supervisor.Launch`). With more ranks than
cores every rank still runs one thread, so the operating system time-slices them: each rank gets a share of a
core, and a collective waits for the slowest rank to be scheduled (``bench comm`` measured 3.8 ms for the
smallest all-reduce of 4 ranks on 2 cores, docs/planning.md). Standard library only.

And how a CPU rank allocates: :func:`allocator_env`, glibc malloc settings that keep a training step's large buffers
in the process instead of handing them back to the kernel after every step.
"""

from __future__ import annotations

import os
from typing import Any

from torch_handle.common.procs import usable_cores


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
"""glibc's malloc tunables for CPU workers (``mallopt(3)``): blocks up to 32 MiB (the largest threshold glibc takes on
64-bit) come from the heap instead of a fresh ``mmap``, and up to 1 GiB of freed heap is kept, not trimmed."""


def allocator_env(environ: dict[str, str]) -> dict[str, str]:
    """The variables of :data:`MALLOC_ENV` a CPU worker should get, given the launcher's ``environ``: none when it
    sets either itself or preloads another allocator (``LD_PRELOAD``: jemalloc, tcmalloc).

    Why: a step frees and allocates the same activations, gradients and logits again (each MiB-sized). glibc serves
    blocks over 128 KiB with ``mmap`` and unmaps them on free, so every step faults their pages in anew, zeroed by
    the kernel: 6,400 page faults a step for presets/llama.toml on one rank, and about 10 % of its step time
    (docs/performance.md). PyTorch's CPU tuning guide recommends jemalloc or tcmalloc for the same reason
    (https://docs.pytorch.org/tutorials/recipes/recipes/tuning_guide.html); these two settings get the same reuse
    from glibc with nothing installed. The cost: freed memory stays with the process (RSS keeps its peak)."""
    if environ.get("LD_PRELOAD") or any(name in environ for name in MALLOC_ENV):
        return {}
    return dict(MALLOC_ENV)


def threads_per_rank(nproc: int, cores: int, omp_num_threads: str | None) -> int:
    """Intra-op threads each of ``nproc`` ranks gets: ``OMP_NUM_THREADS`` when set (a positive integer), else what
    the launcher gives (``cores // nproc``, at least 1)."""
    try:
        if omp_num_threads and int(omp_num_threads) > 0:
            return int(omp_num_threads)
    except ValueError:
        pass
    return max(1, cores // max(1, nproc))


def oversubscribed(nproc: int, cores: int, omp_num_threads: str | None) -> bool:
    """True when ``nproc`` ranks times their threads (:func:`threads_per_rank`) exceed ``cores``."""
    return nproc * threads_per_rank(nproc, cores, omp_num_threads) > cores


def oversubscription_warning(nproc: int, cores: int, omp_num_threads: str | None) -> str | None:
    """The one line (without ``warning:``) ``handle run`` prints on a CPU when ``nproc`` ranks on this node times
    their threads exceed its ``cores``, or None when they fit: what it costs and how to reduce it."""
    if not oversubscribed(nproc, cores, omp_num_threads):
        return None
    threads = threads_per_rank(nproc, cores, omp_num_threads)
    if nproc > cores:
        return (f"{nproc} ranks on {cores} CPU core(s): oversubscribed, one thread per rank and each rank about "
                f"{cores / nproc:.2g} of a core, so expect slow steps (a collective waits for every rank to be "
                f"scheduled); launch.nproc_per_node <= {cores} runs faster here")
    return (f"{nproc} ranks x {threads} threads (OMP_NUM_THREADS) on {cores} CPU core(s): oversubscribed, expect "
            f"slow steps; unset OMP_NUM_THREADS (the launcher gives {max(1, cores // nproc)} per rank) or lower it")


def node_warning(preset: Any) -> str | None:
    """:func:`oversubscription_warning` for the ranks ``preset`` starts on this node (``launch.nproc_per_node``,
    the threads of this environment's ``OMP_NUM_THREADS``), when they compute on the CPU; None on GPUs (a rank
    drives its GPU and needs little of a core) and when they fit."""
    from torch_handle.launch.precision import target_device

    if target_device(preset) != "cpu":
        return None
    return oversubscription_warning(preset.launch.nproc_per_node, usable_cores(), os.environ.get("OMP_NUM_THREADS"))
