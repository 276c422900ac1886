"""Read the Chrome traces of ``[profiler] name = "torch"`` and say where a step's time went. Torch-free: a trace
is JSON (``traces/rank<R>/rank<R>.<ms>.pt.trace.json``, as ``torch.profiler.tensorboard_trace_handler`` writes it).

What a CPU trace of a 2-rank gloo DDP run holds (torch 2.13), and how it is read here:

* ``cpu_op`` complete events (``ph: "X"``, ``ts``/``dur`` in microseconds) on the main thread: every aten op,
  nested; the comm launches ``c10d::allreduce_`` / ``c10d::broadcast_`` (and ``record_param_comms`` on nccl).
* ``user_annotation`` events: ``ProfilerStep#N`` (one per recorded step), ``record_function`` ranges -- the
  trainer's ``handle/data|forward|backward|optimizer|comm``, the model's ``decoder.layer<i>`` / ``attention`` /
  ``feed_forward``, torch's own ``enumerate(DataLoader)#...``, ``Optimizer.step#AdamW.step`` and
  ``DistributedDataParallel.forward`` -- and, on gloo's ``pt_gloo_runloop`` threads, the collectives doing the
  work: ``gloo:all_reduce``, ``gloo:broadcast``.
* ``kernel`` events on CUDA (NCCL kernels are named ``ncclDevKernel_...``).
* ``[memory]`` instant events with ``args["Total Allocated"]`` (bytes, per ``Device Type``) when
  ``profile_memory`` was on.

Everything here is interval arithmetic on those events: ``summarize`` returns one JSON-able dict.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch_handle.common.units import fmt_bytes

__all__ = ["TRACE_GLOBS", "TraceError", "find_traces", "load_trace", "summarize", "summarize_files", "format_summary",
           "union", "intersect", "subtract", "total", "is_comm", "PHASES"]

TRACE_GLOBS = ("*.pt.trace.json", "*.pt.trace.json.gz")
PHASES = ("compute", "communication", "data", "optimizer", "other")
"""The categories a step's wall time is split into (exclusive; they sum to the recorded steps' time)."""

Interval = tuple[float, float]

_COMM = re.compile(r"^(gloo:|nccl:|c10d::|record_param_comms$|ncclDevKernel|ncclKernel)|^handle/comm$", re.I)
_DATA = re.compile(r"^(handle/data$|enumerate\(DataLoader\))")
_OPTIMIZER = re.compile(r"^(handle/optimizer$|Optimizer\.(step|zero_grad)#)")
_COMPUTE_RANGE = re.compile(r"^handle/(forward|backward)$")


class TraceError(ValueError):
    """A trace that cannot be read: not JSON, or not a Chrome trace (no ``traceEvents`` list)."""


def is_comm(name: str) -> bool:
    """Whether an event name is communication: ``gloo:*``, ``nccl:*``, ``c10d::*``, ``record_param_comms``,
    NCCL kernels (``ncclDevKernel_*``) or the trainer's ``handle/comm`` range."""
    return bool(_COMM.search(name))


# -- intervals (sorted, disjoint lists of (start, end); microseconds) -------------------------------------------

def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge intervals into a sorted list of disjoint ones (touching intervals merge; empty ones vanish)."""
    out: list[list[float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two disjoint sorted interval lists (as ``union`` returns them)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """``a`` minus ``b``, both disjoint sorted interval lists."""
    out: list[Interval] = []
    j = 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def total(intervals: Iterable[Interval]) -> float:
    """Summed length of (disjoint) intervals."""
    return sum(e - s for s, e in intervals)


# -- reading ------------------------------------------------------------------------------------------------------

def find_traces(run_dir: Path, rank: int) -> list[Path]:
    """Trace files of ``rank`` in ``run_dir/traces/rank<R>/`` (or, from older runs, ``traces/rank<R>.*`` files
    directly in ``traces/``), oldest first by modification time. Empty when there are none."""
    traces = Path(run_dir) / "traces"
    found = [p for g in TRACE_GLOBS for p in (traces / f"rank{rank}").glob(g)]
    found += [p for g in TRACE_GLOBS for p in traces.glob(f"rank{rank}.{g}")]
    return sorted(set(found), key=lambda p: (p.stat().st_mtime, p.name))


def load_trace(path: Path) -> dict[str, Any]:
    """Parse one Chrome trace (``.json`` or ``.json.gz``).

    Raises:
        TraceError: unreadable, not JSON, or no ``traceEvents`` list.
    """
    try:
        raw = gzip.decompress(Path(path).read_bytes()) if str(path).endswith(".gz") else Path(path).read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError) as e:
        raise TraceError(f"{path}: not a readable Chrome trace ({type(e).__name__}: {e})") from None
    if isinstance(data, list):  # the JSON-array form of the format
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{path}: not a Chrome trace (no traceEvents list)")
    return data


# -- summarising --------------------------------------------------------------------------------------------------

def _span(e: dict) -> Interval:
    s = float(e.get("ts", 0.0))
    return s, s + float(e.get("dur", 0.0))


def _contains(starts: list[float], span: Interval) -> bool:
    """Whether one of the sorted ``starts`` lies inside ``span`` (its end excluded: a launch right after)."""
    i = bisect.bisect_left(starts, span[0])
    return i < len(starts) and starts[i] < span[1]


def _self_times(events: list[dict]) -> dict[str, list[float]]:
    """name -> [calls, self µs] for ``cpu_op`` events: duration minus that of the events directly nested in it
    (ops and ``record_function`` ranges on the same thread)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_thread: dict[Any, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and not str(e.get("name", "")).startswith("ProfilerStep#"):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        # equal spans: a record_function range encloses the operator it was opened around
        evs.sort(key=lambda e: (float(e.get("ts", 0)), -float(e.get("dur", 0)), e.get("cat") == "cpu_op"))
        stack: list[tuple[dict, float, list[float]]] = []  # (event, end, [child µs])

        def close(item: tuple[dict, float, list[float]]) -> None:
            ev, _, child = item
            if ev.get("cat") == "cpu_op":
                rec = out[ev["name"]]
                rec[0] += 1
                rec[1] += max(0.0, float(ev.get("dur", 0)) - child[0])

        for e in evs:
            s, end = _span(e)
            while stack and stack[-1][1] <= s:
                close(stack.pop())
            if stack:
                stack[-1][2][0] += end - s
            stack.append((e, end, [0.0]))
        while stack:
            close(stack.pop())
    return out


def _top(rows: dict[str, list[float]], n: int, what: str) -> dict[str, Any]:
    grand = sum(r[1] for r in rows.values()) or 1.0
    top = sorted(rows.items(), key=lambda kv: -kv[1][1])[:n]
    return {"basis": what, "total_ms": grand / 1e3 if rows else 0.0,
            "rows": [{"name": k, "calls": int(c), "self_ms": t / 1e3, "share": t / grand} for k, (c, t) in top]}


def summarize(trace: dict[str, Any], top: int = 10) -> dict[str, Any]:
    """Where the recorded steps' time went, from one parsed trace (``load_trace``).

    Returns a dict (times in milliseconds, shares in 0..1, bytes as integers):

    * ``steps``: recorded steps (``ProfilerStep#N`` ranges); ``step_ms``: their summed wall time on the main thread
      (the thread that holds them); with none, the main thread's whole span counts as one.
    * ``top_ops``: operators by self time -- CPU self time of ``cpu_op`` events, or, when the trace has CUDA
      kernels, kernel time (``basis`` says which).
    * ``split``: ``PHASES`` -> ms, exclusive, in this priority: communication (inside a comm op on the main thread,
      inside ``handle/comm``, or a collective running elsewhere while the main thread runs no operator), data
      (``handle/data`` or the DataLoader's ``enumerate``), optimizer (``handle/optimizer`` or ``Optimizer.step#``
      / ``zero_grad#``), compute (``handle/forward`` / ``handle/backward`` or any other operator), other (the
      rest: Python, logging, evaluation, waits). ``split_source``: ``"handle ranges"`` or ``"operators"`` (the
      trainer's ``handle/...`` ranges were not in the trace).
    * ``comm``: ``total_ms`` (union of collectives running anywhere), ``overlapped_ms`` and ``overlap`` (the share
      of it during which compute ran: on CPU the main thread inside a non-comm operator (not one that launches
      communication and waits for it, like a ring attention's autograd function: the operators inside it count)
      while gloo works on its own threads or an asynchronous send or receive the main thread posted is in flight
      (its ``gloo:send``/``gloo:recv`` range: ring attention's passes); on CUDA, NCCL kernels against other
      kernels), ``events`` (comm event names and counts).
    * ``memory_peak_bytes``: ``{"cpu": ..., "cuda:0": ...}`` the highest ``Total Allocated`` of ``[memory]``
      events, or None without memory events (``profile_memory`` off). On CUDA that is the caching allocator's
      allocated total; on CPU torch counts only the tensors allocated while the profiler records and still live
      (activations, temporaries, buffers made in the step), not what existed before it started (the weights).
    * ``ranges``: the model's and trainer's ``record_function`` ranges: name -> [calls, total ms].
    """
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict)]
    xs = [e for e in events if e.get("ph") == "X" and "name" in e]
    cpu = [e for e in xs if e.get("cat") in ("cpu_op", "user_annotation")]
    steps = [e for e in cpu if str(e["name"]).startswith("ProfilerStep#")]
    if steps:
        main = (steps[0].get("pid"), steps[0].get("tid"))
    else:
        counts: dict[Any, int] = defaultdict(int)
        for e in cpu:
            counts[(e.get("pid"), e.get("tid"))] += 1
        main = max(counts, key=counts.get) if counts else None
    on_main = [e for e in cpu if (e.get("pid"), e.get("tid")) == main]
    window = union(_span(e) for e in steps) or union([(min(_span(e)[0] for e in on_main),
                                                       max(_span(e)[1] for e in on_main))] if on_main else [])

    def spans(pred) -> list[Interval]:
        return union(_span(e) for e in on_main if pred(str(e["name"])))

    ops_main = [e for e in on_main if e.get("cat") == "cpu_op"]
    kernels = [e for e in xs if e.get("cat") == "kernel"]
    comm_events = [e for e in xs if is_comm(str(e["name"])) and e.get("cat") in ("cpu_op", "user_annotation", "kernel")]
    on_main_comm = [e for e in comm_events if (e.get("pid"), e.get("tid")) == main]
    # an operator that launches communication and waits for it (a ring attention's autograd function) is not
    # compute for the overlap: its own operators inside are
    launches = sorted(_span(e)[0] for e in on_main_comm)
    busy = union(_span(e) for e in ops_main if not is_comm(e["name"]) and not _contains(launches, _span(e)))
    # the main thread blocks in a comm operator (c10d::allreduce_, a launch); a comm range there (gloo:send,
    # gloo:recv of batch_isend_irecv) is an asynchronous operation's life, in flight like one on another thread
    comm_main = union(_span(e) for e in on_main_comm if e.get("cat") == "cpu_op")
    comm_elsewhere = union([*(_span(e) for e in comm_events if (e.get("pid"), e.get("tid")) != main
                              and e.get("cat") != "kernel"),
                            *(_span(e) for e in on_main_comm if e.get("cat") == "user_annotation")])
    has_handle = any(str(e["name"]).startswith("handle/") for e in on_main)

    comm = intersect(window, union([*comm_main, *subtract(comm_elsewhere, busy)]))
    data = subtract(intersect(window, spans(_DATA.search)), comm)
    optim = subtract(subtract(intersect(window, spans(_OPTIMIZER.search)), comm), data)
    compute_src = union([*spans(_COMPUTE_RANGE.search), *busy]) if has_handle else busy
    taken = union([*comm, *data, *optim])
    compute = subtract(intersect(window, compute_src), taken)
    other = subtract(window, union([*taken, *compute]))
    split = {"compute": total(compute), "communication": total(comm), "data": total(data),
             "optimizer": total(optim), "other": total(other)}

    if kernels:
        nccl = union(_span(e) for e in kernels if is_comm(str(e["name"])))
        comm_all = nccl
        overlapped = intersect(nccl, union(_span(e) for e in kernels if not is_comm(str(e["name"]))))
        rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for e in kernels:
            rows[e["name"]][0] += 1
            rows[e["name"]][1] += float(e.get("dur", 0))
        top_ops = _top(rows, top, "cuda kernel time")
        overlap_basis = "nccl kernels vs compute kernels"
    else:
        comm_all = union([*comm_main, *comm_elsewhere])
        overlapped = intersect(comm_elsewhere, busy)
        top_ops = _top(_self_times(xs), top, "cpu self time")
        overlap_basis = "collectives on other threads vs operators on the main thread"
    comm_all = intersect(comm_all, window) if window else comm_all
    overlapped = intersect(overlapped, window) if window else overlapped
    names: dict[str, int] = defaultdict(int)
    for e in comm_events:
        names[str(e["name"])] += 1

    peaks: dict[str, int] = {}
    for e in events:
        if e.get("name") == "[memory]" and isinstance(e.get("args"), dict):
            a = e["args"]
            dev = "cpu" if a.get("Device Type", 0) == 0 else f"cuda:{a.get('Device Id', 0)}"
            peaks[dev] = max(peaks.get(dev, 0), int(a.get("Total Allocated", 0)))

    ranges: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in on_main:
        if e.get("cat") == "user_annotation" and not str(e["name"]).startswith("ProfilerStep#"):
            ranges[e["name"]][0] += 1
            ranges[e["name"]][1] += float(e.get("dur", 0)) / 1e3
    ct, ov = total(comm_all), total(overlapped)
    return {"steps": len(steps), "step_ms": total(window) / 1e3, "top_ops": top_ops,
            "split": {k: split[k] / 1e3 for k in PHASES},
            "split_source": "handle ranges" if has_handle else "operators",
            "comm": {"total_ms": ct / 1e3, "overlapped_ms": ov / 1e3, "overlap": ov / ct if ct else None,
                     "basis": overlap_basis, "events": dict(sorted(names.items()))},
            "memory_peak_bytes": peaks or None,
            "ranges": {k: [int(c), t] for k, (c, t) in sorted(ranges.items())}}


def summarize_files(paths: list[Path], top: int = 10) -> dict[str, Any]:
    """``summarize`` over several traces of one rank, added up (steps, times, calls; memory: the highest peak;
    overlap recomputed from the sums). Adds ``files``: the paths read.

    Raises:
        TraceError: for a file ``load_trace`` refuses.
    """
    parts = [summarize(load_trace(p), top=max(top, 50)) for p in paths]
    out = parts[0]
    for s in parts[1:]:
        out["steps"] += s["steps"]
        out["step_ms"] += s["step_ms"]
        for k in PHASES:
            out["split"][k] += s["split"][k]
        for k in ("total_ms", "overlapped_ms"):
            out["comm"][k] += s["comm"][k]
        for k, v in s["comm"]["events"].items():
            out["comm"]["events"][k] = out["comm"]["events"].get(k, 0) + v
        rows = {r["name"]: r for r in out["top_ops"]["rows"]}
        for r in s["top_ops"]["rows"]:
            acc = rows.setdefault(r["name"], {"name": r["name"], "calls": 0, "self_ms": 0.0})
            acc["calls"] += r["calls"]
            acc["self_ms"] += r["self_ms"]
        out["top_ops"]["total_ms"] += s["top_ops"]["total_ms"]
        out["top_ops"]["rows"] = list(rows.values())
        for k, (c, t) in s["ranges"].items():
            prev = out["ranges"].get(k, [0, 0.0])
            out["ranges"][k] = [prev[0] + c, prev[1] + t]
        if s["memory_peak_bytes"]:
            peaks = out["memory_peak_bytes"] or {}
            for k, v in s["memory_peak_bytes"].items():
                peaks[k] = max(peaks.get(k, 0), v)
            out["memory_peak_bytes"] = peaks
        if s["split_source"] != out["split_source"]:
            out["split_source"] = "mixed"
    grand = out["top_ops"]["total_ms"] or 1.0
    rows = sorted(out["top_ops"]["rows"], key=lambda r: -r["self_ms"])[:top]
    out["top_ops"]["rows"] = [{**r, "share": r["self_ms"] / grand} for r in rows]
    ct = out["comm"]["total_ms"]
    out["comm"]["overlap"] = out["comm"]["overlapped_ms"] / ct if ct else None
    out["files"] = [str(p) for p in paths]
    return out


def format_summary(s: dict[str, Any], rank: int) -> str:
    """The human-readable report of ``summarize_files``' result for ``rank`` (plain text, lines <= 100 chars)."""
    head = (f"rank {rank}: {s['steps']} recorded step(s), {s['step_ms']:.1f} ms "
            f"({len(s.get('files', []))} trace file(s))")
    lines = [head]
    step = s["step_ms"] or 1.0
    src = "" if s["split_source"] == "handle ranges" else "  (no handle/... ranges in the trace: split by operators)"
    lines.append(f"time split{src}")
    for k in PHASES:
        lines.append(f"  {k:<14}{s['split'][k]:>10.2f} ms  {100 * s['split'][k] / step:5.1f}%")
    c = s["comm"]
    if c["total_ms"]:
        lines.append(f"communication {c['total_ms']:.2f} ms in collectives, {c['overlapped_ms']:.2f} ms of it "
                     f"overlapped compute ({100 * (c['overlap'] or 0):.0f}%; {c['basis']})")
        lines.append("  " + ", ".join(f"{k} x{v}" for k, v in c["events"].items()))
    else:
        lines.append("communication: none recorded")
    mem = s["memory_peak_bytes"]
    if mem:
        cpu_note = " (cpu: allocated while recording)" if "cpu" in mem else ""
        lines.append("memory peak: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in mem.items()) + cpu_note)
    else:
        lines.append("memory peak: not recorded (set profiler.profile_memory=true)")
    t = s["top_ops"]
    lines.append(f"top operators by {t['basis']} ({t['total_ms']:.1f} ms in all)")
    width = max([len(r["name"][:60]) for r in t["rows"]] + [8])
    for r in t["rows"]:
        lines.append(f"  {r['name'][:60]:<{width}}  {r['self_ms']:>9.3f} ms  {100 * r['share']:5.1f}%  x{r['calls']}")
    model = {k: v for k, v in s["ranges"].items() if not k.startswith(("handle/", "enumerate(", "Optimizer."))}
    if model:
        lines.append("ranges (calls, total ms): " + ", ".join(f"{k} x{c} {t:.1f}" for k, (c, t) in model.items()))
    return "\n".join(lines)
