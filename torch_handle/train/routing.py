"""Routing telemetry of a mixture-of-experts model: every step event's ``moe`` object (docs/run-directory.md).

Each MoE layer counts its own routing on the device while it trains (``MoEFeedForward.stats``: assignments per
expert after capacity, dropped assignments, the aux and z losses, micro-batches; with expert parallelism its
all-to-all bytes and waits). The step's figures of the whole model are those counts summed over the data-parallel
ranks, each of which routed its own tokens; the ranks of one tensor-parallel group routed the same tokens and
count once; a pipeline stage holds only its own layers, while rank 0, which writes the events, needs them all.

One collective does it, and not a new one: :meth:`RoutingTelemetry.attach` appends a (layers, E + S) table to the
trainer's step vector ``[loss · tokens, tokens, stop]`` before its one all-reduce over every rank, each rank
filling only the rows of the layers it holds (a row per MoE layer of the whole model, in module order: every rank
knows them all from the model built before the pipeline split) and multiplying by 0 on tp ranks other than 0. The
sum is then the dp sum of every layer, on every rank; :meth:`RoutingTelemetry.fields` reads it back. float64
holds the counts exactly (below 2^53). A dense model adds nothing: no row, no field.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from torch_handle.model.moe import MoEFeedForward, layer_stats
from torch_handle.observe.fields import (MOE, MOE_A2A_WAIT_MS, MOE_AUX_LOSS, MOE_DROPPED_TOKENS, MOE_LAYERS,
                                         MOE_MAX_LOAD_RATIO, MOE_TOKENS_PER_EXPERT, MOE_TOP_K, MOE_Z_LOSS)

STEP_VECTOR = 3
"""Length of the trainer's own step vector: the table starts after it."""
RENAMED = {"dropped": MOE_DROPPED_TOKENS, "aux_loss": MOE_AUX_LOSS, "z_loss": MOE_Z_LOSS}
MEAN_OVER_MICRO_BATCHES = ("aux_loss", "z_loss")
"""Counters that hold a sum of per-micro-batch values: the event gives their mean."""


def _scalar(value: Any, device: torch.device) -> Tensor:
    """A counter as a float64 0-d tensor on ``device`` (no host read; a counter kept on the host, as
    ``a2a_wait_s`` is, goes to the device)."""
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
        moe = [(name, m) for name, m in model.named_modules() if isinstance(m, MoEFeedForward)]
        self.rows = {name: i for i, (name, _) in enumerate(moe)}
        self.n_experts = moe[0][1].n_experts if moe else 0
        self.top_k = moe[0][1].top_k if moe else 0
        # the scalar counters after the E counts, in the layers' own order (the same on every rank)
        self.keys = [k for k in layer_stats(moe[0][1]) if k != "tokens_per_expert"] if moe else []
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
            self._held = [(self.rows[name], m) for name, m in model.named_modules()
                          if isinstance(m, MoEFeedForward) and name in self.rows]
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
            table[row] = torch.cat([s["tokens_per_expert"].to(device, torch.float64),
                                    torch.stack([_scalar(s.get(k, 0.0), device) for k in self.keys])])
            layer.reset_stats()
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
        out: dict[str, Any] = {MOE_LAYERS: [name.removesuffix(".ff") for name in self.rows], MOE_TOP_K: self.top_k,
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
