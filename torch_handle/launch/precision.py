"""``training.precision = "auto"``: the concrete precision (fp32, bf16 or fp16) a run gets on this machine, and why.

The launcher resolves it once, before the workers start (:func:`torch_handle.launch.run.prepare_run`), so that
the run's ``preset.toml`` holds the concrete precision and run.json its ``precision`` and ``precision_reason``.

* CUDA: bf16 on compute capability >= 8.0 (Ampere and newer have bf16 tensor cores; NVIDIA, "NVIDIA A100 Tensor
  Core GPU Architecture", 2020). ``torch.cuda.is_bf16_supported()`` is not asked: it says True on pre-Ampere GPUs,
  which emulate bf16. Older GPUs get fp16 with dynamic loss scaling where the strategy scales the loss (its options
  class declares ``fp16_loss_scaling = True``) and the layout allows it (no pipeline: the schedules apply no
  loss scale, :func:`torch_handle.config.layout.check_parallel`), else fp32.
* CPU: a measured probe (:func:`probe_cpu`), one thread, a bf16 and an fp32 square matmul of :data:`PROBE_N`;
  bf16 only when it multiplies at least :data:`BF16_MIN_SPEEDUP` times as fast as fp32. CPUs without
  AVX512-BF16 or AMX (or any CPU under ``ONEDNN_MAX_CPU_ISA=AVX2``) run bf16 matmuls in a scalar fallback 30-100x
  slower than fp32; with them, bf16 is 2-6x faster here. The figure is cached (:mod:`torch_handle.observe.peak`'s
  file, keyed by CPU model, the ISA environment variables and the torch version), so a later launch imports no
  torch.

No torch import at module level.
"""

from __future__ import annotations

import copy
import importlib.metadata
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch_handle.common.precision import AUTO, isa_env

if TYPE_CHECKING:
    from torch_handle.config.loader import Preset

BF16_MIN_SPEEDUP = 1.25
"""bf16 is chosen on a CPU only when its matmul is at least this many times as fast as fp32's. A training step is
more than its matmuls (autocast's casts of the weights, element-wise ops that bf16 does not speed up on a CPU), so
a tie or a small gain would not pay for bf16's coarser rounding. The measured ratios are far from it on either
side: 0.015-0.03 where bf16 is emulated, 2-6 with AVX512-BF16/AMX (benchmarks/precision_probe.py)."""
PROBE_N = 256
"""Side of the probe's square matrices: 2·256³ = 34 MFLOP a product, ~0.4 ms in fp32 on one core, ~25 ms in
emulated bf16. At 128 call overheads hide bf16's gain (1.25x measured where 256 gives 2x)."""
PROBE_BUDGET_S = 0.05
"""The probe repeats its products (fp32 and bf16 in turn) for at least this long, and at least 3 of each."""
PROBE_MAX_S = 1.0
"""... and stops after this long whatever the count (an emulated bf16 product takes tens of milliseconds)."""


@dataclass(frozen=True)
class Resolution:
    """A preset's concrete precision and the one-line reason (``auto → fp32: bf16 matmul 0.02× fp32 on this
    CPU``); ``ratio``: the CPU probe's bf16/fp32 matmul speed ratio when one was measured, else None."""

    precision: str
    reason: str
    ratio: float | None = None


def torch_version() -> str:
    """The installed torch's version, without importing it (its distribution metadata)."""
    if "torch" in sys.modules:
        return str(sys.modules["torch"].__version__)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def probe_key() -> str:
    """The cache key of the CPU probe: machine, CPU model, the ISA environment and the torch version."""
    from torch_handle.observe.peak import _cpu_model

    return f"precision-probe:{platform.machine()} {_cpu_model()}|{isa_env() or 'default ISA'}|torch {torch_version()}"


def measure_cpu_probe(n: int = PROBE_N, budget_s: float = PROBE_BUDGET_S, max_s: float = PROBE_MAX_S
                      ) -> dict[str, float]:
    """One thread's fp32 and bf16 matmul speed on this CPU (``torch.set_num_threads(1)``, restored after).

    The products alternate between the dtypes, and each dtype's fastest one counts (another process on a shared
    machine only slows some of them down). Returns ``{"fp32": FLOP/s, "bf16": FLOP/s, "ratio": bf16/fp32,
    "seconds": the probe's wall time}``; a bf16 matmul that raises counts as 0 FLOP/s.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        gen = torch.Generator().manual_seed(0)  # the global RNG is left alone
        mats = {name: [torch.randn(n, n, generator=gen).to(dtype) for _ in range(2)]
                for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        best = {name: float("inf") for name in mats}
        reps = 0
        try:
            for a, b in mats.values():
                torch.mm(a, b)  # warm-up: kernel selection, first touch of the output
        except RuntimeError:
            best["bf16"] = float("nan")
        while True:
            for name, (a, b) in mats.items():
                if best[name] != best[name]:  # nan: no bf16 matmul here
                    continue
                t0 = time.perf_counter()
                torch.mm(a, b)
                best[name] = min(best[name], time.perf_counter() - t0)
            reps += 1
            elapsed = time.perf_counter() - start
            if (reps >= 3 and elapsed >= budget_s) or elapsed >= max_s:
                break
    finally:
        torch.set_num_threads(threads)
    flops = {name: (2 * n**3 / t if t == t and t > 0 else 0.0) for name, t in best.items()}
    return {**flops, "ratio": flops["bf16"] / flops["fp32"], "seconds": time.perf_counter() - start}


def probe_cpu(*, refresh: bool = False) -> dict[str, Any]:
    """The CPU probe (:func:`measure_cpu_probe`), from the cache when it holds this machine's (:func:`probe_key`),
    else measured and cached (``HANDLE_PEAK_CACHE`` names the file; see :mod:`torch_handle.observe.peak`). A cache
    that cannot be written is not an error. Returns the probe's figures plus ``key`` and ``cached``."""
    from torch_handle.observe.peak import _read_cache, cache_path, store

    key = probe_key()
    entry = _read_cache(cache_path()).get(key)
    if not refresh and isinstance(entry, dict) and isinstance(entry.get("ratio"), (int, float)):
        return {**entry, "key": key, "cached": True}
    entry = {**measure_cpu_probe(), "n": PROBE_N, "measured_at": round(time.time(), 3)}
    store(key, entry)
    return {**entry, "key": key, "cached": False}


def _cuda_possible() -> bool:
    """False where no CUDA device can exist (Linux without an NVIDIA or WSL device node), without importing
    torch; True where torch must be asked."""
    if sys.platform != "linux":
        return sys.platform != "darwin"
    return Path("/dev/nvidiactl").exists() or Path("/dev/dxg").exists()


def target_device(preset: Preset) -> str:
    """``"cuda"`` or ``"cpu"``: what the workers will compute on, as
    :func:`torch_handle.launch.probe.select_backend` chooses (nccl when CUDA has a device for every local
    process)."""
    backend = preset.launch.backend
    if backend == "gloo":
        return "cpu"
    if backend == "nccl":
        return "cuda"
    if not _cuda_possible():
        return "cpu"
    import torch

    available = torch.cuda.is_available() and torch.cuda.device_count() >= preset.launch.nproc_per_node
    return "cuda" if available else "cpu"


def fp16_loss_scaling(preset: Preset) -> bool:
    """Whether this preset's strategy and layout train fp16 with dynamic loss scaling: the strategy's options class
    declares ``fp16_loss_scaling = True`` (single, ddp, scratch-ddp, scratch-fsdp with ``GradScaler`` or its own
    scaler, deepspeed with its fp16 section; FSDP2 has no scaler) and ``parallel.pp`` is 1."""
    return bool(getattr(type(preset.strategy.options), "fp16_loss_scaling", False)) and preset.parallel.pp == 1


def resolve_cuda(preset: Preset, capability: tuple[int, int]) -> Resolution:
    """``auto`` on a GPU of compute ``capability`` (the lowest of the node's)."""
    cc = f"{capability[0]}.{capability[1]}"
    if tuple(capability) >= (8, 0):
        return Resolution("bf16", f"auto → bf16: CUDA compute capability {cc}")
    if fp16_loss_scaling(preset):
        return Resolution("fp16", f"auto → fp16: CUDA compute capability {cc} has no bf16 tensor cores; fp16 with "
                                  f"loss scaling ({preset.strategy.name})")
    why = "parallel.pp > 1" if preset.parallel.pp > 1 else f"{preset.strategy.name} has no fp16 loss scaling"
    return Resolution("fp32", f"auto → fp32: CUDA compute capability {cc} has no bf16 tensor cores and {why}")


def resolve_cpu(probe: dict[str, Any]) -> Resolution:
    """``auto`` on a CPU whose probe (:func:`probe_cpu`) measured ``probe["ratio"]`` = bf16/fp32 matmul speed."""
    ratio = float(probe["ratio"])
    choice = "bf16" if ratio >= BF16_MIN_SPEEDUP else "fp32"
    return Resolution(choice, f"auto → {choice}: bf16 matmul {fmt_ratio(ratio)}× fp32 on this CPU", ratio)


def fmt_ratio(ratio: float) -> str:
    """``2.05``, ``0.93``, ``0.015``: two decimals, or two significant digits below 0.1."""
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.2g}"


def cuda_capability(preset: Preset) -> tuple[int, int]:
    """The lowest compute capability of the GPUs the node's workers use (devices 0 .. nproc_per_node - 1)."""
    import torch

    count = min(torch.cuda.device_count(), preset.launch.nproc_per_node) or 1
    return min(tuple(torch.cuda.get_device_capability(i)) for i in range(count))


def resolve(preset: Preset) -> Resolution:
    """The concrete precision of ``preset`` on this machine: ``training.precision`` itself unless it is ``auto``
    (reason ``"set in the preset"``), else by device (module docstring). Measures the CPU once per machine, ISA
    environment and torch version (~0.1 s, plus torch's import), cached after."""
    precision = preset.training.precision
    if precision != AUTO:
        return Resolution(precision, "set in the preset")
    if target_device(preset) == "cuda":
        return resolve_cuda(preset, cuda_capability(preset))
    return resolve_cpu(probe_cpu())


def concrete(preset: Preset) -> tuple[Preset, Resolution]:
    """``(a copy of preset with training.precision resolved, the resolution)``; ``preset`` itself when it is not
    ``auto``."""
    resolution = resolve(preset)
    if preset.training.precision == resolution.precision:
        return preset, resolution
    out = copy.deepcopy(preset)
    out.training.precision = resolution.precision
    return out, resolution


def emulated_bf16_warning(preset: Preset) -> str | None:
    """One warning line when an explicit ``training.precision = "bf16"`` runs on a CPU whose bf16 matmul is not
    faster than fp32 (the probe's cached ratio below :data:`BF16_MIN_SPEEDUP`), else None."""
    if preset.training.precision != "bf16" or target_device(preset) != "cpu":
        return None
    ratio = float(probe_cpu()["ratio"])
    if ratio >= BF16_MIN_SPEEDUP:
        return None
    return (f"training.precision = \"bf16\" on a CPU that emulates it: bf16 matmul {fmt_ratio(ratio)}× fp32 here "
            f"(training.precision = \"auto\" or \"fp32\" would be faster)")


def resolve_for_run(preset: Preset, join_dir: Path | None = None) -> tuple[Preset, dict[str, str]]:
    """The launcher's resolution of a new run: ``(preset with a concrete training.precision, run.json fields)``.

    The fields are ``precision``, ``precision_reason`` and, when an explicit bf16 runs on a CPU that emulates it,
    ``precision_warning`` (:func:`emulated_bf16_warning`). ``join_dir``: a multi-node run's shared directory that
    another node may have created already; when its ``preset.toml`` names a concrete precision, an ``auto`` here
    takes that one (every node trains in one precision, and the joining node's preset must equal the run's).
    """
    if preset.training.precision == AUTO and join_dir is not None:
        theirs = _shared_precision(Path(join_dir))
        if theirs is not None:
            out = copy.deepcopy(preset)
            out.training.precision = theirs
            return out, {"precision": theirs, "precision_reason": f"auto → {theirs}: as the run's shared "
                                                                  f"preset.toml (the node that created it chose)"}
    out, resolution = concrete(preset)
    fields = {"precision": resolution.precision, "precision_reason": resolution.reason}
    warning = emulated_bf16_warning(out) if preset.training.precision != AUTO else None
    if warning:
        fields["precision_warning"] = warning
    return out, fields


def _shared_precision(run_dir: Path) -> str | None:
    """``training.precision`` of ``run_dir/preset.toml`` when it is a concrete one, else None."""
    from torch_handle.common.fsio import read_toml
    from torch_handle.common.precision import PRECISIONS
    from torch_handle.rundir import PRESET_FILE

    training = (read_toml(run_dir / PRESET_FILE) or {}).get("training")
    value = training.get("precision") if isinstance(training, dict) else None
    return value if value in PRECISIONS else None
