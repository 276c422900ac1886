"""What a mixture-of-experts model adds to ``handle estimate`` and ``handle plan``: total against active
parameters, the routed experts split over the expert-parallel ranks, the all-to-all traffic and the token buffers.

* **Parameters.** A token passes through k of the E routed experts of each MoE layer: the active parameters are the
  total less (E - k) experts' worth per MoE layer (``MoEFeedForward.inactive_params``), what the training FLOPs and
  MFU count (``DecoderLM.flops_per_token``).
* **Model states with ep.** ``[parallel] ep`` ranks, drawn from the data-parallel ones (torchtitan: the ep group is
  ep consecutive dp ranks; the dp / ep ranks that hold the same experts form the expert-data-parallel group), split
  each MoE layer's experts: a rank holds E / ep of them. The routed-expert tensors (E stacked on dim 0) count at
  1/ep and the strategy's formula (:func:`~torch_handle.plan.model_states.model_state_bytes`) applies to them over
  the dp / ep ranks of that group, to every other tensor over all dp ranks as before: under DDP a rank holds the
  dense model plus E / ep experts' parameters, gradients and optimizer state; under FSDP2 both parts are sharded
  again (torchtitan's dp_shard_in_ep). With ep = 1 the whole model goes through the formula at once, as without
  experts (to the byte what the memory telemetry reports).
* **All-to-all.** With ep > 1 each MoE layer sends its tokens' rows to the experts' ranks and back: two all-to-alls
  in forward (dispatch, combine) and their two transposes in backward, each moving the M dispatched rows of d_model
  elements, M = N·k for N tokens (dropless; with a capacity factor at most E · ceil(cf · N·k / E)), of which the
  share (ep - 1) / ep leaves the rank when the routing is uniform; plus the exchange of the E per-expert counts
  (int64) that sets the split sizes, once per layer and micro-batch (Megatron-LM's and torchtitan's token dispatch).
* **Token buffers.** Per MoE layer and micro-batch the expert-sorted rows into and out of the experts, 2 · M ·
  d_model elements: what the dispatch and combine hold (and, with ep > 1, the all-to-alls receive: the same size
  under uniform routing). They are part of the measured activations, which run the model's own dispatch on fake
  tensors, dropless (the most a capacity allows: a capacity's drops depend on the routing, unknown before a run).

torch is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from torch_handle.plan.estimate_model import ModelBuild, ModelShape
    from torch_handle.plan.model_states import States, Variant

__all__ = ["MoEShape", "all_to_all_bytes", "dispatched_rows", "dropless", "expert_param_bytes",
           "fake_grouped_matmuls", "moe_shape", "moe_step", "preset_moe", "rank_state_bytes",
           "split_experts", "token_buffer_bytes"]

COUNT_BYTES = 8
"""Bytes of one per-expert count exchanged before the dispatch (int64)."""


@dataclass(frozen=True)
class MoEShape:
    """The experts of a built model."""

    n_experts: int
    """E, routed experts per MoE layer."""
    top_k: int
    moe_layers: int
    """MoE layers of the model (every ``moe_every``-th)."""
    d_model: int
    params: int
    """Parameters of the whole model, each tensor once."""
    active_params: int
    """Parameters one token passes through: ``params`` less (E - k) experts per MoE layer."""
    expert_params: int
    """Routed-expert parameters of the whole model (all E experts of every MoE layer; shared experts and routers are
    dense)."""
    capacity_factor: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def moe_shape(model: torch.nn.Module) -> MoEShape | None:
    """The :class:`MoEShape` of a built model (on the meta device is enough), None without MoE layers."""
    from torch_handle.model.moe import moe_layers

    layers = moe_layers(model)
    if not layers:
        return None
    first = layers[0]
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for m in layers for p in m.experts.parameters())
    return MoEShape(first.n_experts, first.top_k, len(layers), first.gate.weight.shape[1], params,
                    params - sum(m.inactive_params for m in layers), experts, first.capacity_factor)


def dropless(build: ModelBuild) -> ModelBuild:
    """``build`` without a capacity factor, for the fake-tensor measurement of activations: a capacity cuts the
    dispatched rows to a size the routing decides (a data-dependent shape fake tensors cannot have); dropless is
    the most it allows."""
    if getattr(build.options, "capacity_factor", None) is None:
        return build
    return dataclasses.replace(build, options=dataclasses.replace(build.options, capacity_factor=None))


def fake_grouped_matmuls(model: torch.nn.Module) -> None:
    """Let ``model``'s grouped experts run on fake tensors in any dtype: the meta kernel of ``torch._grouped_mm``
    takes bf16 only (CUDA's constraint; the CPU kernel, what a run uses, takes fp32 too). Outside bf16 each grouped
    matmul becomes a dense one of the same shapes that saves the same storages (the M sorted rows, the stacked
    weights cast to the compute dtype): what the activation count sees. For a model on fake tensors only."""
    import types

    import torch
    from torch.nn import functional as F

    from torch_handle.model.moe import GroupedExperts

    def grouped(self: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        if dtype == torch.bfloat16:
            return type(self)._grouped(self, x, counts)

        def linear(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # (M, in) x (E, out, in)[0] -> (M, out)
            return F.linear(h.to(dtype), w.to(dtype)[0])

        return self._mlp(x, linear)

    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m._grouped = types.MethodType(grouped, m)


def split_experts(shape: ModelShape, ep: int) -> tuple[ModelShape, ModelShape]:
    """(the dense tensors, one ep rank's share of the routed-expert tensors: numel and dim 0 at 1/ep) of ``shape``.
    Both keep registration order; their ``scratch-fsdp`` units are their tensors.

    Raises:
        ValueError: ep does not divide an expert tensor's dim 0 (n_experts).
    """
    from torch_handle.plan.estimate_model import ModelShape

    flags = shape.experts or (False,) * shape.n_tensors
    dense = [(n, d) for n, d, e in zip(shape.numels, shape.dim0, flags) if not e]
    experts = [(n, d) for n, d, e in zip(shape.numels, shape.dim0, flags) if e]
    if any(d % ep for _, d in experts):
        raise ValueError(f"parallel.ep = {ep} does not divide n_experts = {experts[0][1]}")
    local = [(n // ep, d // ep) for n, d in experts]
    return (ModelShape(tuple(n for n, _ in dense), tuple(d for _, d in dense)),
            ModelShape(tuple(n for n, _ in local), tuple(d for _, d in local), (True,) * len(local)))


def rank_state_bytes(shape: ModelShape, variant: Variant, precision: str, dp: int, dp_rank: int, ep: int = 1
                     ) -> States:
    """Model-state bytes of data-parallel rank ``dp_rank`` of ``dp`` with ``ep`` expert-parallel ranks: with ep = 1
    (or no experts) :func:`~torch_handle.plan.model_states.model_state_bytes` of the whole ``shape``; else that of
    the dense tensors over dp plus that of this rank's E / ep experts over the dp / ep ranks of its expert group
    (index dp_rank // ep).

    Raises:
        ValueError: ep does not divide dp or n_experts; a strategy without a memory model.
    """
    from torch_handle.plan.model_states import States, model_state_bytes

    if ep == 1 or not any(shape.experts):
        return model_state_bytes(shape, variant, precision, dp, dp_rank)
    if dp % ep:
        raise ValueError(f"parallel.ep = {ep} does not divide the data-parallel degree {dp}")
    dense, experts = split_experts(shape, ep)
    a = model_state_bytes(dense, variant, precision, dp, dp_rank)
    b = model_state_bytes(experts, variant, precision, dp // ep, dp_rank // ep)
    return States(*(getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(States)))


def expert_param_bytes(shape: ModelShape, variant: Variant, precision: str, dp: int, dp_rank: int, ep: int = 1
                       ) -> int:
    """Parameter bytes of the routed experts one rank holds: its E / ep experts under the strategy's formula over
    its expert group (the whole of them under DDP: 4 bytes each in fp32)."""
    from torch_handle.plan.model_states import model_state_bytes

    if not any(shape.experts):
        return 0
    _, experts = split_experts(shape, ep)
    return model_state_bytes(experts, variant, precision, max(1, dp // ep), dp_rank // ep).param


def dispatched_rows(moe: MoEShape, tokens: int) -> int:
    """M, the rows one MoE layer dispatches for ``tokens`` tokens: N·k, or with a capacity factor at most E ·
    ceil(cf · N·k / E) (``model.moe.expert_capacity``)."""
    rows = tokens * moe.top_k
    if moe.capacity_factor is None:
        return rows
    return min(rows, moe.n_experts * math.ceil(moe.capacity_factor * rows / moe.n_experts))


def all_to_all_bytes(moe: MoEShape, tokens: int, ep: int, element_bytes: int) -> int:
    """Bytes one rank sends to the other ep ranks for one micro-batch of ``tokens`` tokens (forward and backward):
    per MoE layer 4 all-to-alls of M rows x d_model elements of which (ep - 1)/ep leave the rank, and the E counts
    (int64) of the split sizes. 0 with ep = 1."""
    if ep == 1:
        return 0
    rows = 4 * dispatched_rows(moe, tokens) * moe.d_model * element_bytes + moe.n_experts * COUNT_BYTES
    return moe.moe_layers * rows * (ep - 1) // ep


def token_buffer_bytes(moe: MoEShape, tokens: int, element_bytes: int) -> int:
    """Bytes of the expert-sorted token rows, into and out of the experts, of every MoE layer for one micro-batch:
    moe_layers · 2 · M · d_model elements (with ep > 1 the all-to-alls' receive buffers, the same size under
    uniform routing)."""
    return moe.moe_layers * 2 * dispatched_rows(moe, tokens) * moe.d_model * element_bytes


def preset_moe(preset: Any, registry: Any) -> MoEShape | None:
    """The :class:`MoEShape` of ``preset``'s whole model (built on the meta device), None without MoE layers.

    Raises:
        PresetError: a dataset without ``vocab_size``/``seq_len`` options.
    """
    import torch

    from torch_handle.plan.estimate_model import build_model, model_build

    build = dataclasses.replace(model_build(preset, registry), tp=1, sequence_parallel=False)
    with torch.device("meta"):
        return moe_shape(build_model(build))


def moe_step(moe: MoEShape, preset: Any, tokens: int | None = None) -> dict[str, int]:
    """The MoE figures of one rank for ``preset``'s layout: ``all_to_all_bytes`` of one optimizer step
    (grad_accum micro-batches of micro_batch_size x seq_len tokens, or ``tokens`` per micro-batch) and
    ``token_buffer_bytes`` of one micro-batch, in the precision's activation dtype (fp32: 4 bytes, else 2)."""
    t = preset.training
    element = 4 if t.precision == "fp32" else 2
    if tokens is None:
        tokens = t.micro_batch_size * int(getattr(preset.data.options, "seq_len", 0) or 0)
    ep = preset.parallel.ep
    return {"all_to_all_bytes": t.grad_accum * all_to_all_bytes(moe, tokens, ep, element),
            "token_buffer_bytes": token_buffer_bytes(moe, tokens, element)}
