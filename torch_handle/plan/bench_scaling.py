"""The pure half of ``handle bench scaling``: strategy names as preset overrides, the sweep over world sizes and
tensor-parallel degrees or over layouts (dp x tp x pp), the strong-scaling batch split, scaling efficiency, the
summary of a run's step events and the CSV/JSON rows (no torch, no processes).

A measurement is one short real run (``handle run``'s launcher) per strategy and world size, tp or layout; its
step events (:mod:`torch_handle.observe.fields`) after the first ``skip`` ones give the figures. Standard library
only.
"""

from __future__ import annotations

import csv
import io
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch_handle.observe.comm import DIMENSIONS, read_comm
from torch_handle.observe.fields import (BACKWARD_S, BREAKDOWN, COMM, COMM_S, CUDA_MAX_ALLOCATED_BYTES, DATA_S,
                                         FORWARD_S, GRAD_BYTES, OPTIMIZER_BYTES, OPTIMIZER_S, PARAM_BYTES, RSS_BYTES,
                                         SYNC_S, Kind)
from torch_handle.observe.tail import integer, number

MAX_NPROC = 256
"""Largest world size ``--nproc`` accepts (one machine)."""
TABLE_PARTS = (("data", (DATA_S,)), ("fwd", (FORWARD_S,)), ("bwd", (BACKWARD_S,)), ("opt", (OPTIMIZER_S,)),
               ("comm", (COMM_S, SYNC_S)))
"""The table's phase columns and the :data:`BREAKDOWN` fields each adds up; ``comm`` is the strategy's gradient
communication plus the trainer's loss/stop all-reduce, as in the dashboard."""
FIXED = {"ddp": ("ddp", ()), "fsdp": ("fsdp", ()), "single": ("single", ()),
         "scratch-ddp": ("scratch-ddp", ()), "scratch-zero1": ("scratch-ddp", ("strategy.shard_optimizer=true",))}
"""Strategy label -> (strategy plugin, extra ``--set`` overrides); ``zero0`` .. ``zero3`` are DeepSpeed stages."""
STRATEGY_NAMES = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp", "single", "scratch-ddp", "scratch-zero1")


@dataclass(frozen=True)
class StrategySpec:
    """One ``--strategies`` entry: its ``label`` (``zero2``), the ``plugin`` that runs it (``deepspeed``) and the
    ``--set`` overrides that select it (empty: the preset's own strategy, unchanged)."""

    label: str
    plugin: str
    overrides: tuple[str, ...]

    @property
    def single_rank_only(self) -> bool:
        return self.plugin == "single"


def strategy_spec(label: str) -> StrategySpec:
    """The overrides for a strategy label (``ddp``, ``zero0``..``zero3``, ``fsdp``, ``single``, ``scratch-ddp``,
    ``scratch-zero1``).

    Raises:
        ValueError: for an unknown label, naming the valid ones.
    """
    if label in FIXED:
        plugin, extra = FIXED[label]
        return StrategySpec(label, plugin, (f"strategy.name={plugin}", *extra))
    if len(label) == 5 and label.startswith("zero") and label[4] in "0123":
        return StrategySpec(label, "deepspeed", ("strategy.name=deepspeed", f"strategy.zero_stage={label[4]}"))
    raise ValueError(f"unknown strategy {label!r} (valid: {', '.join(STRATEGY_NAMES)})")


def preset_strategy_label(plugin: str, zero_stage: Any = None) -> str:
    """The label of a preset's own strategy: ``zero<stage>`` for deepspeed, else the plugin name."""
    return f"zero{zero_stage}" if plugin == "deepspeed" and zero_stage is not None else plugin


LAYOUT_FORMS = "dp<N>, tp<N>, pp<N>, or several joined by x such as dp2xtp2xpp2"


@dataclass(frozen=True)
class LayoutSpec:
    """One ``--layouts`` item: the data-, tensor- and pipeline-parallel degrees of a run on ``dp x tp x pp``
    ranks."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def nproc(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def label(self) -> str:
        """The canonical form: the degrees above 1 in the order dp, tp, pp (``dp2xpp2``); ``dp1`` for one rank."""
        return "x".join(f"{d}{getattr(self, d)}" for d in DIMENSIONS if getattr(self, d) > 1) or "dp1"


def parse_layout(item: str, limit: int = MAX_NPROC) -> LayoutSpec:
    """``dp2xtp2`` -> its :class:`LayoutSpec` (dimensions in any order, each at most once, the others 1).

    Raises:
        ValueError: naming ``item`` and the valid forms, for anything else or a product above ``limit``.
    """
    degrees: dict[str, int] = {}
    for part in item.strip().lower().split("x"):
        name, digits = part[:2], part[2:]
        if name not in DIMENSIONS or name in degrees or not (digits.isascii() and digits.isdigit()) or int(digits) < 1:
            raise ValueError(f"{item!r} is not a layout (valid: {LAYOUT_FORMS}; each dimension once, N >= 1)")
        degrees[name] = int(digits)
    layout = LayoutSpec(**degrees)
    if layout.nproc > limit:
        raise ValueError(f"{item!r} needs {layout.nproc} ranks (at most {limit})")
    return layout


def parse_layouts(text: str) -> list[LayoutSpec]:
    """``dp2,tp2,dp2xtp2`` -> the layouts, in order, duplicates (the same degrees) dropped.

    Raises:
        ValueError: for an empty list or an item :func:`parse_layout` refuses.
    """
    items = [s.strip() for s in text.split(",")]
    if not items or "" in items:
        raise ValueError(f"{text!r}: expected a comma list of layouts ({LAYOUT_FORMS})")
    return list(dict.fromkeys(parse_layout(item) for item in items))


@dataclass(frozen=True)
class ScalingRun:
    """One run of a sweep: ``spec`` on ``nproc`` ranks laid out as dp x tp x pp (dp = nproc / (tp x pp))."""

    label: str
    """The series the run belongs to (its efficiency base): the strategy's label, ``-tp<N>`` added for tp > 1
    in a ``--tp`` sweep."""
    spec: StrategySpec
    """The strategy as run: ``single`` for one tensor- or pipeline-parallel replica (dp = 1)."""
    nproc: int
    tp: int | None = None
    """None: the preset's own ``[parallel] tp``, not overridden (a sweep without ``--tp`` or ``--layouts``)."""
    pp: int | None = None
    """None: the preset's own ``[parallel] pp`` (a sweep without ``--layouts``)."""
    layout: str | None = None
    """The ``--layouts`` item (:attr:`LayoutSpec.label`) the run measures."""

    @property
    def dp(self) -> int:
        return self.nproc // ((self.tp or 1) * (self.pp or 1))

    @property
    def overrides(self) -> tuple[str, ...]:
        degrees = (("tp", self.tp), ("pp", self.pp))
        return (*self.spec.overrides, *(f"parallel.{d}={n}" for d, n in degrees if n is not None))


SINGLE = StrategySpec("single", "single", ("strategy.name=single",))


def sweep(spec: StrategySpec, nprocs: list[int], tps: list[int] | None = None) -> tuple[list[ScalingRun], list[str]]:
    """The runs of ``spec``: every world size of ``nprocs`` with every tp of ``tps`` that divides it (world size
    outer, tp inner), and notes on the pairs left out. With tp > 1 and dp = 1 the run is one tensor-parallel
    replica, run by ``single`` (in the strategy's series); ``single`` itself runs only where dp = 1. ``tps`` None
    (no ``--tp``): each world size once with the preset's own tp, ``single`` on world size 1 only."""
    runs, notes = [], []
    for n in nprocs:
        if tps is None:
            if spec.single_rank_only and n > 1:
                notes.append(f"{spec.label} skipped at {n} ranks: it runs on world size 1 only")
            else:
                runs.append(ScalingRun(spec.label, spec, n))
            continue
        for tp in tps:
            if n % tp:
                notes.append(f"tp {tp} skipped at {n} rank{'s' if n != 1 else ''}: it does not divide the world size")
            elif spec.single_rank_only and n != tp:
                notes.append(f"{spec.label} skipped at {n} ranks with tp {tp}: it runs one model replica "
                             f"(world size = tp)")
            else:
                as_run = SINGLE if tp > 1 and n == tp else spec
                runs.append(ScalingRun(spec.label if tp == 1 else f"{spec.label}-tp{tp}", as_run, n, tp))
    return runs, list(dict.fromkeys(notes))


def layout_runs(spec: StrategySpec, layouts: list[LayoutSpec]) -> tuple[list[ScalingRun], list[str]]:
    """The runs of ``spec`` over ``layouts`` (in their order, each on its product of ranks, ``parallel.tp`` and
    ``parallel.pp`` set), and notes on those left out. One replica (dp = 1) on more than one rank is run by
    ``single``, as in :func:`sweep`; ``single`` itself runs only where dp = 1."""
    runs, notes = [], []
    for layout in layouts:
        if spec.single_rank_only and layout.dp > 1:
            notes.append(f"{spec.label} skipped at {layout.label}: it runs one model replica (dp = 1)")
            continue
        as_run = SINGLE if layout.dp == 1 and layout.nproc > 1 else spec
        runs.append(ScalingRun(spec.label, as_run, layout.nproc, layout.tp, layout.pp, layout.label))
    return runs, notes


def parse_strategies(text: str) -> list[str]:
    """``ddp,zero2,fsdp`` -> the labels, in order, duplicates dropped (checked by :func:`strategy_spec`).

    Raises:
        ValueError: for an empty list or an unknown label.
    """
    labels = list(dict.fromkeys(s.strip() for s in text.split(",")))
    if not labels or "" in labels:
        raise ValueError(f"{text!r}: expected a comma list such as ddp,zero2,fsdp")
    for label in labels:
        strategy_spec(label)
    return labels


def parse_nproc(text: str, limit: int = MAX_NPROC) -> list[int]:
    """``1,2,4`` -> the world sizes, ascending, duplicates dropped.

    Raises:
        ValueError: for anything but a comma list of integers from 1 to ``limit``.
    """
    out = set()
    for part in text.split(","):
        part = part.strip()
        try:
            n = int(part)
        except ValueError:
            raise ValueError(f"{part!r} is not an integer (expected a comma list such as 1,2,4)") from None
        if not 1 <= n <= limit:
            raise ValueError(f"{n} is out of range (1 to {limit})")
        out.add(n)
    return sorted(out)


def strong_batch(global_batch: int, micro_batch_size: int, grad_accum: int, nproc: int) -> tuple[int, int]:
    """``(micro_batch_size, grad_accum)`` per rank that keep ``global_batch`` samples per optimizer step on
    ``nproc`` ranks: the micro-batch is kept and grad_accum adjusted when ``global_batch / nproc`` is a multiple
    of it; otherwise the largest micro-batch below ``micro_batch_size`` that divides the per-rank share.

    Raises:
        ValueError: when ``global_batch`` does not divide over ``nproc`` ranks.
    """
    if global_batch % nproc:
        raise ValueError(f"the global batch of {global_batch} samples does not divide over {nproc} ranks")
    per_rank = global_batch // nproc
    if per_rank % micro_batch_size == 0:
        return micro_batch_size, per_rank // micro_batch_size
    mbs = max(d for d in range(1, min(micro_batch_size, per_rank) + 1) if per_rank % d == 0)
    return mbs, per_rank // mbs


def efficiency(tokens_per_s: float, nproc: int, base_tokens_per_s: float, base_nproc: int) -> float:
    """Scaling efficiency (1.0 = linear): tokens/s at ``nproc`` ranks over ``nproc / base_nproc`` times the
    tokens/s at the base world size (with base 1: tokens/s at N ÷ (N × tokens/s at 1))."""
    if base_tokens_per_s <= 0 or nproc <= 0 or base_nproc <= 0:
        raise ValueError("tokens/s and world sizes must be positive")
    return tokens_per_s * base_nproc / (nproc * base_tokens_per_s)


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(events: Iterable[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Figures of one run from its events: medians over the step events after the first ``skip`` (global
    ``tokens_per_s``, ``step_time_s`` in seconds, each of :data:`BREAKDOWN` in seconds or None when no step
    has it), ``comm_dp_s``, ``comm_tp_s``, ``comm_pp_s`` (the events' ``comm`` per dimension, seconds, None
    where absent), ``measured_steps``, and per rank the peaks over every memory report (warm-up included), in bytes:
    ``rss_bytes``, ``model_state_bytes`` (param + grad + optimizer) and ``cuda_max_allocated_bytes`` (None
    off CUDA). Malformed events and fields are skipped."""
    steps = [e for e in events if e.get("kind") == Kind.STEP and integer(e.get("step")) is not None]
    steps.sort(key=lambda e: integer(e.get("step")))
    measured = steps[skip:]
    out: dict[str, Any] = {"measured_steps": len(measured),
                           "tokens_per_s": _median(number(e.get("tokens_per_s")) for e in measured),
                           "step_time_s": _median(number(e.get("step_time_s")) for e in measured)}
    for key in BREAKDOWN:
        out[key] = _median(number(e.get(key)) for e in measured)
    comms = [read_comm(e.get(COMM)) or {} for e in measured]
    for dim in DIMENSIONS:
        out[f"comm_{dim}_s"] = _median(c.get(dim) for c in comms)
    peaks: dict[int, dict[str, int | None]] = {}
    for e in steps:
        memory = e.get("memory")
        for m in memory if isinstance(memory, list) else []:
            rank = integer(m.get("rank")) if isinstance(m, dict) else None
            if rank is None:
                continue
            peak = peaks.setdefault(rank, {"rss_bytes": None, "model_state_bytes": None,
                                           "cuda_max_allocated_bytes": None})
            parts = [integer(m.get(k)) for k in (PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES)]
            state = sum(p for p in parts if p is not None) if any(p is not None for p in parts) else None
            for key, value in (("rss_bytes", integer(m.get(RSS_BYTES))), ("model_state_bytes", state),
                               ("cuda_max_allocated_bytes", integer(m.get(CUDA_MAX_ALLOCATED_BYTES)))):
                if value is not None and (peak[key] is None or value > peak[key]):
                    peak[key] = value
    out["memory"] = [{"rank": r, **peaks[r]} for r in sorted(peaks)]
    return out


def table_parts(record: dict[str, Any]) -> list[float | None]:
    """The :data:`TABLE_PARTS` of a :func:`summarize` record, seconds: the sum of each column's fields that have a
    value, None where none has."""
    out = []
    for _, keys in TABLE_PARTS:
        values = [record[k] for k in keys if record.get(k) is not None]
        out.append(sum(values) if values else None)
    return out


def peak_over_ranks(memory: list[dict[str, Any]], key: str) -> int | None:
    """The largest ``key`` of any rank in :func:`summarize`'s ``memory`` list (None when no rank has it)."""
    values = [m[key] for m in memory if m.get(key) is not None]
    return max(values) if values else None


def add_efficiency(records: list[dict[str, Any]]) -> None:
    """Set ``efficiency``, ``base_nproc`` and ``base_tokens_per_s`` on every record in place; the base of a
    strategy is its smallest world size that finished with a tokens/s figure (records without one get None)."""
    bases: dict[str, tuple[int, float]] = {}
    for r in sorted(records, key=lambda r: r["nproc"]):
        if r.get("status") == "finished" and r.get("tokens_per_s"):
            bases.setdefault(r["strategy"], (r["nproc"], r["tokens_per_s"]))
    for r in records:
        base = bases.get(r["strategy"])
        ok = base is not None and r.get("status") == "finished" and bool(r.get("tokens_per_s"))
        r["base_nproc"], r["base_tokens_per_s"] = (base if base else (None, None))
        r["efficiency"] = efficiency(r["tokens_per_s"], r["nproc"], base[1], base[0]) if ok else None


CSV_COLUMNS = ("strategy", "plugin", "nproc", "status", "message", "mode", "micro_batch_size", "grad_accum",
               "global_batch", "dp", "tp", "pp", "layout", "measured_steps", "tokens_per_s", "step_time_s",
               "efficiency", "base_nproc", *BREAKDOWN, "comm_dp_s", "comm_tp_s", "comm_pp_s", "peak_rss_bytes",
               "peak_model_state_bytes", "peak_cuda_max_allocated_bytes", "threads_per_rank", "oversubscribed",
               "load_avg_1m", "wall_s", "run_dir")
"""Columns of ``results.csv`` (the memory peaks: the largest of any rank; per rank in ``results.json``)."""


def csv_text(records: list[dict[str, Any]]) -> str:
    """``results.csv``: one row per record, :data:`CSV_COLUMNS`, empty cells for missing values."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in records:
        row = dict(r)
        memory = r.get("memory") or []
        row.update(peak_rss_bytes=peak_over_ranks(memory, "rss_bytes"),
                   peak_model_state_bytes=peak_over_ranks(memory, "model_state_bytes"),
                   peak_cuda_max_allocated_bytes=peak_over_ranks(memory, "cuda_max_allocated_bytes"))
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in CSV_COLUMNS})
    return buf.getvalue()
