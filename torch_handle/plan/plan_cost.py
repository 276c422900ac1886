"""The step-time model of ``handle plan``: how long one optimizer step of a dp x tp x pp layout takes, from the
model's FLOPs, a matmul peak and the bandwidth of the links (an alpha-beta model: every collective costs a latency
alpha plus its bytes over the bus bandwidth). Standard library only.

step = compute + bubble + TP, DP, pipeline, EP and CP communication, with

* compute = FLOPs per token x tokens per step / (world size x peak FLOP/s per rank), x 4/3 with activation
  checkpointing (the forward runs twice: 8N instead of 6N FLOPs per token; Chen et al. 2016, Korthikanti et al.
  2022 §5) -- the model FLOPs of :func:`torch_handle.model.flops.training_flops_per_token`;
* bubble = compute x b / (1 - b), b the schedule's idle fraction (p - 1) / (v·m + p - 1)
  (:func:`torch_handle.parallel.pipeline.schedules.theoretical_bubble`), i.e. (p - 1) / (v·m) of compute;
* TP: the collectives of :func:`torch_handle.parallel.tensor.mappings.step_volume` for the layers of one stage,
  each an all-reduce moving 2(t - 1)/t of its bytes over the bus (nccl-tests' busbw convention);
* DP: one gradient synchronisation per step of the largest rank's (unsharded) gradients: 2(n - 1)/n for an
  all-reduce (ddp, ZeRO-1/2's reduce-scatter + all-gather), 3(n - 1)/n for strategies that shard the parameters
  (fsdp, ZeRO-3: the all-gathers of forward and backward and a reduce-scatter), one latency per 25 MiB bucket;
* pipeline: each of a rank's v stages sends its output activation forward and receives its gradient back for every
  micro-batch, 2·v·m messages of (samples / m) x seq_len x d_model elements;
* EP (models with experts, ep > 1): per MoE layer and micro-batch the dispatch and combine all-to-alls and their
  transposes in backward, the bytes that leave the rank (:func:`torch_handle.plan.estimate_moe.all_to_all_bytes`:
  (ep - 1)/ep of N·k rows of d_model under uniform routing) over the link, one latency per all-to-all and per
  exchange of the split sizes (nccl-tests' alltoall busbw is algbw·(n - 1)/n: the same bytes);
* CP (cp > 1): per layer and micro-batch the context-parallel attention's passes, all-gathers, reduce-scatters or
  all-to-alls, the bytes that leave the rank (:func:`torch_handle.plan.estimate_cp.cp_step_volume`) over the link,
  one latency per call. The ring overlaps its passes with the block's compute; the model does not.

Nothing overlaps in the model (DDP's bucketed all-reduce really hides behind backward), so the step time is an upper
bound on what the communication costs and a lower bound on compute (the matmul peak is the best case).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch_handle.parallel.pipeline.schedules import theoretical_bubble

PARAM_SHARDING = ("fsdp", "zero3", "scratch-zero3")
"""Strategy labels that shard parameters over dp (a third collective per step)."""
BUCKET_BYTES = 25 << 20
"""Gradient bytes per DP collective (DDP's default bucket)."""
DEFAULT_LINKS = {
    "gloo": (1.0, 0.6, 150e-6),
    "nccl": (150.0, 20.0, 20e-6),
}
"""Assumed (intra-node GB/s, inter-node GB/s, seconds per collective) when no ``handle bench comm`` result is
saved: gloo's all-reduce bus bandwidth on this 2-core machine was 1.27 GB/s at 16 MiB (docs/learn.md) and 0.58-0.76
GB/s between two launches standing in for nodes; nccl: a conservative NVLink busbw and a 200 Gb/s InfiniBand NIC."""


@dataclass(frozen=True)
class Links:
    """Bandwidths and latency of one backend's collectives, GB/s (10^9 bytes per second) of bus bandwidth."""

    backend: str
    intra_gbps: float
    """All-reduce bus bandwidth between ranks of one node."""
    inter_gbps: float
    """Between nodes (the slowest link of a group that spans nodes)."""
    latency_s: float
    """Seconds of one collective or send, whatever its size."""
    source: str
    """Where the figures come from: ``measured: <file> ...`` or ``assumed: ...``."""
    measured: bool

    def gbps(self, crosses_nodes: bool) -> float:
        return self.inter_gbps if crosses_nodes else self.intra_gbps


def default_links(backend: str) -> Links:
    """The assumed :data:`DEFAULT_LINKS` of ``backend`` (gloo's for any other)."""
    intra, inter, latency = DEFAULT_LINKS.get(backend, DEFAULT_LINKS["gloo"])
    return Links(backend, intra, inter, latency, f"assumed: {backend} defaults ({intra:g} GB/s in a node, "
                                                 f"{inter:g} GB/s across, {latency * 1e6:.0f} us a collective)",
                 False)


def links_from_bench(path: Path, nnodes: int = 1) -> Links | None:
    """:class:`Links` from a ``handle bench comm`` ``results.jsonl``: the best all_reduce busbw (its large messages)
    and the smallest all_reduce time (its latency). That run was on one node, so the inter-node figure stays the
    assumed default when ``nnodes > 1``. None when the file has no correct all_reduce record."""
    records = []
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line) if line.strip() else None
            if isinstance(rec, dict) and rec.get("op") == "all_reduce" and rec.get("correct") is not False:
                records.append(rec)
    except (OSError, ValueError):
        return None
    usable = [r for r in records if isinstance(r.get("busbw_gbps"), (int, float)) and r["busbw_gbps"] > 0
              and isinstance(r.get("time_us"), (int, float))]
    if not usable:
        return None
    backend = str(usable[0].get("backend", "gloo"))
    busbw = max(r["busbw_gbps"] for r in usable)
    latency = min(r["time_us"] for r in usable) * 1e-6
    inter = default_links(backend).inter_gbps if nnodes > 1 else busbw
    world = usable[0].get("world_size")
    source = (f"measured: {path} ({backend}, {world} ranks: all_reduce busbw {busbw:g} GB/s, latency "
              f"{latency * 1e6:.0f} us)" + (f"; across nodes assumed {inter:g} GB/s" if nnodes > 1 else ""))
    return Links(backend, busbw, inter, latency, source, True)


def newest_bench_comm(parent: Path, backend: str) -> Path | None:
    """The newest ``parent/comm-*/results.jsonl`` that ``handle bench comm`` wrote for ``backend``, or None."""
    found = []
    for results in parent.glob("comm-*/results.jsonl"):
        try:
            meta = json.loads((results.parent / "bench.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("backend") == backend:
            found.append((results.stat().st_mtime, results))
    return max(found)[1] if found else None


@dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one optimizer step and the bytes each dimension moves per rank."""

    compute_s: float
    bubble: float
    """The schedule's idle fraction of the step's compute time (0 without a pipeline)."""
    bubble_s: float
    tp_bytes: int
    tp_s: float
    dp_bytes: int
    dp_s: float
    pp_bytes: int
    pp_s: float
    ep_bytes: int = 0
    ep_s: float = 0.0
    cp_bytes: int = 0
    cp_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_s + self.dp_s + self.pp_s + self.ep_s + self.cp_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "step_s": self.step_s}


def ring_factor(n: int) -> float:
    """2(n - 1)/n: the share of its bytes an all-reduce moves over each rank's link (1 rank: nothing)."""
    return 2 * (n - 1) / n if n > 1 else 0.0


def compute_seconds(flops_per_token: float, tokens: int, world: int, peak_flops: float,
                    activation_checkpointing: bool) -> float:
    """Seconds of one step's FLOPs split evenly over ``world`` ranks at ``peak_flops`` FLOP/s each."""
    recompute = 4 / 3 if activation_checkpointing else 1.0
    return flops_per_token * tokens * recompute / (world * peak_flops)


def bubble_seconds(compute_s: float, schedule: str | None, pp: int, m: int, v: int) -> tuple[float, float]:
    """``(bubble fraction, seconds)`` of a pipeline step whose busy time is ``compute_s``."""
    if pp == 1 or schedule is None:
        return 0.0, 0.0
    b = theoretical_bubble(schedule, pp, m, v)
    return b, compute_s * b / (1 - b)


def tp_seconds(volume: dict[str, int], tp: int, links: Links) -> float:
    """Seconds of a step's TP collectives (:func:`~torch_handle.parallel.tensor.mappings.step_volume`'s calls and
    bytes) inside a node."""
    if tp == 1:
        return 0.0
    return volume["bytes"] * ring_factor(tp) / (links.intra_gbps * 1e9) + volume["calls"] * links.latency_s


def dp_seconds(grad_bytes: int, dp: int, strategy: str, links: Links, crosses_nodes: bool) -> float:
    """Seconds of one step's gradient synchronisation of ``grad_bytes`` over ``dp`` replicas."""
    if dp == 1:
        return 0.0
    factor = ring_factor(dp) * (1.5 if strategy in PARAM_SHARDING else 1.0)
    calls = max(1, math.ceil(grad_bytes / BUCKET_BYTES)) * (2 if strategy in PARAM_SHARDING else 1)
    return grad_bytes * factor / (links.gbps(crosses_nodes) * 1e9) + calls * links.latency_s


def pp_seconds(pp_bytes: int, sends: int, links: Links, crosses_nodes: bool) -> float:
    """Seconds of a pipeline rank's ``sends`` point-to-point messages of ``pp_bytes`` in all (and of an
    expert-parallel rank's all-to-alls: the bytes that leave it)."""
    if sends == 0:
        return 0.0
    return pp_bytes / (links.gbps(crosses_nodes) * 1e9) + sends * links.latency_s


def crosses_nodes(size: int, stride: int, ranks_per_node: int) -> bool:
    """Whether a group of ``size`` ranks ``stride`` apart (rank order pp, dp, tp with tp fastest) spans nodes."""
    return size > 1 and (size - 1) * stride >= ranks_per_node


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation of two equally long lists (average ranks for ties); None for fewer than 2
    values or a constant list."""
    if len(a) != len(b) or len(a) < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va and vb else None


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks
