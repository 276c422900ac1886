"""Routing statistics of a mixture-of-experts model, in one home: the training code reads, reduces and resets what
the MoE layers count, counts expert parallelism's all-to-alls, and moves the expert biases; the model only computes
(``torch_handle.model.moe``, ``torch_handle.model.router``).

* ``routing_stats`` / ``layer_stats`` -- the layers' own counts (``MoEFeedForward.stats``: assignments per expert
  after capacity, dropped assignments, the aux and z losses, micro-batches), read and reset.
* ``AllToAllTraffic`` -- expert parallelism's all-to-alls of one layer: bytes handed to the collective and seconds
  in it (``a2a_bytes``, ``a2a_wait_s``), told by the dispatch and combine (``torch_handle.parallel.expert``).
* ``uncounted`` -- forwards that are not part of a training step leave every count as it was.
* ``update_expert_biases`` / ``register_expert_bias_updates`` -- DeepSeek-V3's auxiliary-loss-free bias update after
  each optimizer step (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts",
  Algorithm 1; DeepSeek-V3 §2.1.2), from the assignments the routers recorded, summed over the dp ranks.
* ``RoutingTelemetry`` -- every step event's ``moe`` object (docs/run-directory.md).

The step's figures of the whole model are the layers' counts summed over the data-parallel ranks, each of which
routed its own tokens; the ranks of one tensor-parallel group routed the same tokens and count once; a pipeline stage
holds only its own layers, while rank 0, which writes the events, needs them all.

One collective does it, and not a new one: :meth:`RoutingTelemetry.attach` appends a (layers, E + S) table to the
trainer's step vector ``[loss · tokens, tokens, stop]`` before its one all-reduce over every rank, each rank
filling only the rows of the layers it holds (a row per MoE layer of the whole model, in module order: every rank
knows them all from the model built before the pipeline split) and multiplying by 0 on tp ranks other than 0. The
sum is then the dp sum of every layer, on every rank; :meth:`RoutingTelemetry.fields` reads it back. float64
holds the counts exactly (below 2^53). A dense model adds nothing: no row, no field.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torch_handle.model.moe import ROUTING_COUNTS, MoEFeedForward, in_backward, moe_layers, named_moe_layers
from torch_handle.model.router import TopKRouter
from torch_handle.observe.fields import (MOE, MOE_A2A_WAIT_MS, MOE_AUX_LOSS, MOE_DROPPED_TOKENS, MOE_LAYERS,
                                         MOE_MAX_LOAD_RATIO, MOE_TOKENS_PER_EXPERT, MOE_TOP_K, MOE_Z_LOSS)

STEP_VECTOR = 3
"""Length of the trainer's own step vector: the table starts after it."""
COUNTERS = (*ROUTING_COUNTS[1:], "a2a_bytes", "a2a_wait_s")
"""The scalar counters of a layer's table row, after its E assignment counts: the layer's own, then its all-to-alls'
(zero without expert parallelism)."""
RENAMED = {"dropped": MOE_DROPPED_TOKENS, "aux_loss": MOE_AUX_LOSS, "z_loss": MOE_Z_LOSS}
MEAN_OVER_MICRO_BATCHES = ("aux_loss", "z_loss")
"""Counters that hold a sum of per-micro-batch values: the event gives their mean."""


# -- what the layers count ---------------------------------------------------------------------------------------
class AllToAllTraffic:
    """Expert parallelism's all-to-alls of rows of one MoE layer: ``bytes`` this rank handed to the collective and
    ``wait_s`` seconds in it, in training forwards and backwards; an activation checkpoint's recomputed forward (a
    forward inside backward) is not counted again. Host numbers: no device work per call.

    ``record`` is the ``Record`` the dispatch and combine are given (:mod:`torch_handle.parallel.expert.scratch`);
    :func:`attach_traffic` hangs one on each layer (``layer.traffic``).
    """

    def __init__(self, layer: MoEFeedForward) -> None:
        self.layer = layer
        self.bytes, self.wait_s = 0, 0.0

    def record(self, nbytes: int, seconds: float, backward: bool) -> None:
        if self.layer.training and (backward or not in_backward()):
            self.bytes += nbytes
            self.wait_s += seconds

    def reset(self) -> None:
        self.bytes, self.wait_s = 0, 0.0


def attach_traffic(layer: MoEFeedForward) -> AllToAllTraffic:
    """The layer's all-to-all counters (``layer.traffic``), made on first use."""
    if getattr(layer, "traffic", None) is None:
        layer.traffic = AllToAllTraffic(layer)
    return layer.traffic


def layer_stats(layer: MoEFeedForward) -> dict[str, Any]:
    """The layer's counts since the last reset: ``assignments`` (E,) int64 per expert, then ``dropped``, ``aux_loss``,
    ``z_loss``, ``micro_batches`` (0-d tensors on the layer's device; zeros before the first training forward) and
    ``a2a_bytes`` (int), ``a2a_wait_s`` (float): the keys ``("assignments", *COUNTERS)``."""
    traffic = getattr(layer, "traffic", None)
    return {**(layer.stats or layer.empty_stats()), "a2a_bytes": traffic.bytes if traffic else 0,
            "a2a_wait_s": traffic.wait_s if traffic else 0.0}


def reset_stats(layer: MoEFeedForward) -> None:
    """Forget the layer's counts (its all-to-alls' too): None until the next training forward."""
    layer.stats = None
    if getattr(layer, "traffic", None) is not None:
        layer.traffic.reset()


def routing_stats(model: nn.Module, reset: bool = True) -> dict | None:
    """The routing since the last reset, over all MoE layers, as plain numbers (one host read); None without MoE
    layers.

    Returns:
        ``tokens_per_expert``: one list of E counts per MoE layer (assignments computed, after capacity; they sum to
        N·k - dropped per micro-batch); ``dropped_tokens``: assignments dropped, all layers; ``aux_loss`` and
        ``z_loss``: the losses' values (without coefficients) averaged over micro-batches and summed over layers;
        ``micro_batches``; expert parallelism's ``a2a_bytes`` and ``a2a_wait_s``, one float per layer.
    """
    layers = moe_layers(model)
    if not layers:
        return None
    stats = [layer_stats(m) for m in layers]
    counts = torch.stack([s["assignments"] for s in stats]).tolist()
    seen = int(stats[0]["micro_batches"])
    out = {"tokens_per_expert": counts, "dropped_tokens": int(sum(s["dropped"] for s in stats)),
           "aux_loss": float(sum(s["aux_loss"] for s in stats)) / max(seen, 1),
           "z_loss": float(sum(s["z_loss"] for s in stats)) / max(seen, 1), "micro_batches": seen}
    for key in ("a2a_bytes", "a2a_wait_s"):
        out[key] = [float(s[key]) for s in stats]
    if reset:
        for m in layers:
            reset_stats(m)
    return out


@contextlib.contextmanager
def uncounted(module: nn.Module) -> Iterator[None]:
    """Forwards of ``module`` that are not part of a training step: every MoE layer's counts, all-to-all counters and
    pending load are as they were after them. torch's pipeline stages infer their shapes with a real forward of the
    stage on uninitialised tensors in the first step (``PipelineStage._forward_metadata_inference``, torch 2.13):
    counted, it added a micro-batch of routing to step 1 and, now and then, NaN losses from the garbage."""
    saved = []
    for layer in moe_layers(module):
        traffic = getattr(layer, "traffic", None)
        stats = None if layer.stats is None else {k: v.clone() for k, v in layer.stats.items()}
        pending = None if layer.gate.pending_load is None else layer.gate.pending_load.clone()
        saved.append((layer, stats, pending, (traffic.bytes, traffic.wait_s) if traffic else None))
    try:
        yield
    finally:
        for layer, stats, pending, traffic in saved:
            layer.stats, layer.gate.pending_load = stats, pending
            if traffic is not None:
                layer.traffic.bytes, layer.traffic.wait_s = traffic


# -- auxiliary-loss-free balancing ------------------------------------------------------------------------------
@torch.no_grad()
def update_expert_bias(router: TopKRouter, load: Tensor | None = None) -> None:
    """bᵢ += γ · sign(mean load − loadᵢ): an overloaded expert's bias falls, an underloaded one's rises (Wang et
    al. 2024, Algorithm 1; DeepSeek-V3 §2.1.2; γ = ``router.bias_update_rate``). ``load`` (E,): the assignments per
    expert of the step, summed over the data-parallel ranks; default the router's pending load of this process.
    Forgets the pending load. Nothing for a router without ``expert_bias``."""
    if router.expert_bias is None:
        return
    load = _pending(router) if load is None else load
    router.expert_bias += router.bias_update_rate * torch.sign(load.mean() - load)
    router.pending_load = None


def _pending(router: TopKRouter) -> Tensor:
    """The assignments per expert (E,) fp32 the router recorded since the last update."""
    return router.pending_load if router.pending_load is not None else torch.zeros_like(router.expert_bias)


def update_expert_biases(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Move the expert bias of every auxiliary-loss-free router in ``model`` once (:func:`update_expert_bias`),
    from the assignments of the micro-batches since the last call, summed over ``group``'s ranks by one
    all-reduce of (routers, E) counts when a process group is initialised: the ranks hold the same biases after."""
    routers = [m for m in model.modules() if isinstance(m, TopKRouter) and m.expert_bias is not None]
    if not routers:
        return
    load = torch.stack([_pending(r) for r in routers])  # (layers, E)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(load, group=group)
    for router, layer_load in zip(routers, load):
        update_expert_bias(router, layer_load)


def register_expert_bias_updates(model: nn.Module, optimizer: torch.optim.Optimizer,
                                 group: dist.ProcessGroup | None = None) -> object | None:
    """Run ``update_expert_biases(model, group)`` before every ``optimizer.step()`` -- after the step's last
    backward, once per step whatever the gradient accumulation (torchtitan's ``register_step_pre_hook``, likewise).
    A step skipped for a non-finite loss moves no bias; its load counts towards the next. Returns the hook's handle,
    or None when ``model`` has no auxiliary-loss-free router (nothing registered).

    Raises:
        TypeError: an optimizer without step hooks (not a ``torch.optim.Optimizer``) while the model needs one.
    """
    if not any(isinstance(m, TopKRouter) and m.expert_bias is not None for m in model.modules()):
        return None
    if not hasattr(optimizer, "register_step_pre_hook"):
        raise TypeError(f"{type(optimizer).__name__} has no step hooks: balance = 'aux_free' cannot update the "
                        f"expert biases")
    return optimizer.register_step_pre_hook(lambda *_: update_expert_biases(model, group))


# -- the step events -------------------------------------------------------------------------------------------
def _scalar(value: Any, device: torch.device) -> Tensor:
    """A counter as a float64 0-d tensor on ``device`` (no host read; a counter kept on the host, as the
    all-to-alls' are, goes to the device)."""
    if isinstance(value, Tensor):
        return value.detach().to(device, torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64, device=device)


class RoutingTelemetry:
    """The ``moe`` field of the step events, for ``model`` (the whole model, before any pipeline split).

    Args:
        model: the built model; its ``MoEFeedForward`` modules, by name, are the table's rows.
        tp_rank: this rank's tensor-parallel index (only tp rank 0's counts are added).
        dp_size: the data-parallel degree (``a2a_wait_ms`` is the mean over those ranks).
    """

    def __init__(self, model: nn.Module, tp_rank: int = 0, dp_size: int = 1):
        moe = named_moe_layers(model)
        self.rows = {name: i for i, (name, _) in enumerate(moe)}
        self.n_experts = moe[0][1].n_experts if moe else 0
        self.top_k = moe[0][1].top_k if moe else 0
        self.keys = list(COUNTERS) if moe else []  # the scalar counters after the E counts
        self.once = 1.0 if tp_rank == 0 else 0.0
        self.dp_size = dp_size
        self._held: list[tuple[int, MoEFeedForward]] | None = None

    @property
    def width(self) -> int:
        """Numbers per layer row: E counts and the scalar counters."""
        return self.n_experts + len(self.keys)

    def held(self, model: nn.Module) -> list[tuple[int, MoEFeedForward]]:
        """(row, layer) of the MoE layers this rank runs: those of ``model`` (this rank's trained model, a pipeline
        stage's shard, unwrapped), found by name once."""
        if self._held is None:
            self._held = [(self.rows[name], m) for name, m in named_moe_layers(model) if name in self.rows]
        return self._held

    def attach(self, step_vector: Tensor, model: nn.Module) -> Tensor:
        """``step_vector`` with this rank's share of the routing table appended (and the layers' counters reset for
        the next step); ``step_vector`` itself for a dense model. On the device: no host read.

        Args:
            step_vector: (3,) float64, the trainer's ``[loss · tokens, tokens, stop]``.
            model: this rank's trained model (``Strategy.unwrapped()``).

        Returns:
            (3 + layers · width,) float64.
        """
        if not self.rows:
            return step_vector
        device = step_vector.device
        table = torch.zeros(len(self.rows), self.width, dtype=torch.float64, device=device)
        for row, layer in self.held(model):
            s = layer_stats(layer)
            table[row] = torch.cat([s["assignments"].to(device, torch.float64),
                                    torch.stack([_scalar(s.get(k, 0.0), device) for k in self.keys])])
            reset_stats(layer)
        return torch.cat([step_vector, table.flatten() * self.once])

    def fields(self, reduced: Tensor) -> dict[str, Any]:
        """The step event's ``{"moe": {...}}`` from the all-reduced vector (on the host; ``{}`` for a dense model):
        per layer, ``tokens_per_expert`` (E counts), ``dropped_tokens``, ``aux_loss`` and ``z_loss`` (means over
        the micro-batches of every dp rank), ``max_load_ratio`` (the busiest expert's count over the mean count),
        and any further counter summed (``a2a_bytes``), ``a2a_wait_s`` as ``a2a_wait_ms`` per dp rank."""
        if not self.rows:
            return {}
        table = reduced[STEP_VECTOR:].view(len(self.rows), self.width).tolist()
        E, keys = self.n_experts, self.keys
        out: dict[str, Any] = {MOE_LAYERS: list(self.rows), MOE_TOP_K: self.top_k,
                               MOE_TOKENS_PER_EXPERT: [[round(x) for x in row[:E]] for row in table]}
        scalars = [dict(zip(keys, row[E:])) for row in table]
        for key in keys:
            if key == "micro_batches":
                continue
            if key in MEAN_OVER_MICRO_BATCHES:
                out[RENAMED[key]] = [round(s[key] / max(s["micro_batches"], 1.0), 6) for s in scalars]
            elif key == "a2a_wait_s":
                out[MOE_A2A_WAIT_MS] = [round(s[key] * 1000 / self.dp_size, 3) for s in scalars]
            else:  # counts: dropped assignments, bytes
                out[RENAMED.get(key, key)] = [round(s[key]) for s in scalars]
        out[MOE_MAX_LOAD_RATIO] = [round(max(c) * E / sum(c), 4) if sum(c) else None
                                   for c in out[MOE_TOKENS_PER_EXPERT]]
        return {MOE: out}
