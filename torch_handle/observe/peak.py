"""This device's dense matrix-product peak, measured (never a datasheet figure), for MFU.

MFU (model FLOPs utilisation, Chowdhery et al. 2022, PaLM appendix B) divides the FLOP/s a model achieves by
what the hardware can do. A hard-coded peak is wrong on every other machine (nanoGPT reported 104% MFU on an
H100 because it assumed an A100's 312 TFLOP/s), so handle measures the peak here: square matrix products of a
few sizes in each dtype, the best sustained FLOP/s of any size (2·n³ FLOPs per product), with the thread count
the caller runs with (a torchrun worker has one thread per rank on a CPU by default).

Results are cached as JSON in the user cache (``$XDG_CACHE_HOME/torch-handle/peak.json``, else
``~/.cache/torch-handle/peak.json``), keyed by device, thread count, torch version and, on a CPU, the environment
variables that change its kernels (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``, ...:
:data:`torch_handle.common.precision.ISA_ENV`); ``HANDLE_PEAK_CACHE`` names another file. The same file holds
the probe behind ``training.precision = "auto"`` (:func:`torch_handle.launch.precision.probe_cpu`). torch is
imported inside the functions.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

from torch_handle.common.fsio import write_json_atomic
from torch_handle.common.precision import PRECISIONS, isa_env, torch_dtype

DTYPES = PRECISIONS
SIZES = (512, 1024, 2048)
"""Matrix sizes tried on a CPU; the largest product (2048³·2 = 17 GFLOP) takes ~50 ms in fp32 on one CPU core."""
CUDA_SIZES = (2048, 4096, 8192)
"""Matrix sizes tried on a GPU: an H100 reached 408 TFLOP/s in bf16 at 2048 (41% of its datasheet's dense 989) and
about 800 at 8192 (docs/gpu.md); the smaller products measure launch overhead, not the tensor cores."""


SIZES_V1 = list(SIZES)
"""The sizes of an entry cached before entries recorded theirs (every device measured :data:`SIZES` then)."""


def peak_sizes(device: Any) -> tuple[int, ...]:
    """The matrix sizes :func:`measure_peak` tries on ``device``: :data:`CUDA_SIZES` on a GPU, else :data:`SIZES`."""
    import torch

    return CUDA_SIZES if torch.device(device).type == "cuda" else SIZES

log = logging.getLogger("torch_handle")


def cache_path() -> Path:
    if os.environ.get("HANDLE_PEAK_CACHE"):
        return Path(os.environ["HANDLE_PEAK_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "torch-handle" / "peak.json"


def device_key(device: Any, threads: int) -> str:
    """``cuda:NVIDIA H100 80GB HBM3|torch 2.x`` or ``cpu:<processor>x<threads>|torch 2.x``, on a CPU followed by
    ``|ONEDNN_MAX_CPU_ISA=AVX2`` when such a variable is set (it changes which kernels run: bf16 emulated or not),
    else by ``|default ISA``. The suffix is always there so that entries from versions that did not key the ISA
    (one measured under ``ONEDNN_MAX_CPU_ISA=AVX2`` gave native-bf16 runs an MFU of 300-600%) are never read."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}|torch {torch.__version__}"
    isa = isa_env()
    name = f"{platform.machine()} {_cpu_model()} x{threads} threads"
    return f"{dev.type}:{name}|torch {torch.__version__}|{isa or 'default ISA'}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def measure_peak(device: Any = "cpu", dtypes: tuple[str, ...] = DTYPES, sizes: tuple[int, ...] | None = None,
                 seconds_per_size: float = 0.3) -> dict[str, float | None]:
    """Best dense matmul FLOP/s per dtype on ``device`` with the current ``torch.get_num_threads()``.

    Returns ``{"fp32": flops_per_s, ...}``; a dtype the device cannot multiply gives None. Takes about
    ``len(dtypes) * len(sizes) * seconds_per_size`` seconds; ``sizes`` None: :func:`peak_sizes`. The global RNG is left as it was (a run measured on
    a cold cache trains as one on a warm cache).
    """
    import torch

    dev = torch.device(device)
    sizes = peak_sizes(dev) if sizes is None else sizes
    gen = torch.Generator(device=dev).manual_seed(0)  # not the global RNG: a worker measures after seeding it
    out: dict[str, float | None] = {}
    for name in dtypes:
        best = 0.0
        for n in sizes:
            # a dtype without a fast kernel here (fp16 on most CPUs) would take minutes at the larger sizes
            if best and 2 * n**3 / best > max(2.0, 10 * seconds_per_size):
                break
            try:
                a = torch.randn(n, n, device=dev, generator=gen).to(torch_dtype(name))
                b = torch.randn(n, n, device=dev, generator=gen).to(torch_dtype(name))
                torch.mm(a, b)  # warm-up: kernel selection, first touch of the output
                _sync(dev)
                reps, start = 0, time.perf_counter()
                while True:
                    torch.mm(a, b)
                    reps += 1
                    _sync(dev)
                    elapsed = time.perf_counter() - start
                    if elapsed >= seconds_per_size:
                        break
                best = max(best, 2 * n**3 * reps / elapsed)
            except (RuntimeError, TypeError):  # e.g. no matmul kernel for this dtype on this device
                break
        out[name] = best or None
    return out


def _sync(dev: Any) -> None:
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize(dev)


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def peak_flops(device: Any = "cpu", *, refresh: bool = False, dtypes: tuple[str, ...] = DTYPES) -> dict[str, Any]:
    """The cached peak of ``device`` at the current thread count for each of ``dtypes``, measuring (and caching)
    the ones missing; a cached entry keeps the dtypes measured earlier.

    Returns ``{"key", "device", "threads", <dtype>: FLOP/s ..., "measured_at", "cached"}``. A cache that cannot be
    written is not an error: the figures are returned all the same.
    """
    import torch

    threads = torch.get_num_threads()
    key = device_key(device, threads)
    entry = _read_cache(cache_path()).get(key)
    sizes = list(peak_sizes(device))
    # an entry measured on other sizes (a GPU's before CUDA_SIZES) is measured again
    entry = entry if isinstance(entry, dict) and not refresh and entry.get("sizes", SIZES_V1) == sizes else {}
    missing = tuple(d for d in dtypes if d not in entry)
    if not missing:
        return {**entry, "key": key, "cached": True}
    entry = {**entry, "device": str(torch.device(device)), "threads": threads, "sizes": sizes,
             **measure_peak(device, missing),
             "measured_at": round(time.time(), 3)}
    store(key, entry)
    return {**entry, "key": key, "cached": False}


def store(key: str, entry: dict[str, Any]) -> None:
    """Write ``entry`` under ``key`` into the cache file, re-read first (another rank or run may have written
    meanwhile). A cache that cannot be written is not an error: the caller has its figures all the same."""
    path = cache_path()
    cache = _read_cache(path)
    cache[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, cache)
    except OSError:
        pass


def cached_peak(device: Any, precision: str, threads: int) -> float | None:
    """The cached peak FLOP/s for ``precision`` on ``device`` at ``threads`` threads, or None (never measures)."""
    entry = _read_cache(cache_path()).get(device_key(device, threads))
    value = entry.get(precision) if isinstance(entry, dict) else None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def peak_for_mfu(device: Any, precision: str, threads: int) -> tuple[float | None, str]:
    """``(FLOP/s, message)``: the ``precision`` matmul peak of ``device`` at ``threads`` threads per rank, from the
    cache or measured now (~1 s, once per device, thread count and torch version); None when there is no
    such peak (the message then says that step events carry no mfu). The message is also logged."""
    value = cached_peak(device, precision, threads)
    how = "cached"
    if value is None:
        log.info("measuring the %s matmul peak of %s with %d threads (for MFU)", precision, device, threads)
        entry = peak_flops(device, dtypes=(precision,))  # not the others: an emulated bf16 takes seconds
        value, how = entry.get(precision), "measured"
        value = float(value) if isinstance(value, (int, float)) and value > 0 else None
    if value is None:
        message = f"no {precision} matmul peak for {device}: step events carry no mfu"
        log.warning(message)
        return None, message
    message = f"peak {value / 1e12:.3f} TFLOP/s ({precision} matmul, {how}, {threads} threads per rank) for mfu"
    log.info(message)
    return value, message
