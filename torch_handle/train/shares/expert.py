"""What a training process does differently when ``parallel.ep > 1``: its experts of every MoE layer, the
all-to-alls around them, the expert gradients reduced over the expert-data-parallel ranks with the one-process
scale, the gradient norm over every rank's experts, and checkpoints that join the experts by name.

EP ranks are drawn from the data-parallel ranks (torchtitan's layout, :mod:`torch_handle.parallel.mesh`): within the
dp ranks of a (pp, tp) coordinate, ``dp_rank = edp_rank · ep + ep_rank``, so ep consecutive dp ranks split the
experts between them and the edp = dp / ep such groups hold the same experts. Every rank still reads its own
micro-batches (the data order is the data-parallel one), routes its own tokens and computes the dense layers on them.

Gradients. A dense parameter's gradient is averaged over the dp ranks by the strategy (DDP), as without experts.
An expert's gradient on its rank already holds the contributions of the tokens of every rank of its EP group (the
all-to-all's backward brought them), each from that rank's own loss; the edp ranks that hold the same expert hold
the contributions of their EP groups. Summed over the edp group, the gradient has the contribution of every dp
rank's loss, and the strategy's average over dp is a division by dp: so expert gradients are all-reduced (sum)
over the edp group and divided by dp = ep · edp -- exactly the one-process gradient of the same samples
(micro-batches of dp ranks as gradient accumulation). DDP is told to leave the expert parameters alone
(``expert_names`` for ``_set_params_and_buffers_to_ignore_for_model``); this share reduces them once a step,
after the last backward (:meth:`ExpertParallel.before_step`).

The trainer uses this share as it uses the TP and PP ones: its state is saved and loaded here (the portable form,
each expert tensor gathered along the experts' dimension to its (E, ...) one-process shape, and cut again on load,
so a checkpoint of any ep resumes on any other); the pipeline's share calls :meth:`sync_grads`, :meth:`norm_args`,
:meth:`gather_state` and :meth:`cut_state` for its stages (pp × ep).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_handle.checkpoint.convert import load_schedule, read_portable, write_portable
from torch_handle.model.moe import moe_layers, named_moe_layers
from torch_handle.parallel.tensor.checkpoint import full_model_state, full_optimizer_state, load_full_state
from torch_handle.train.grad_norm import clip_, local, mesh_grad_norm
from torch_handle.train.routing import attach_traffic
from torch_handle.train.shares.contract import UNSPLIT_TP, PortableShare


def _heartbeat_label(name: str, ordinal: int) -> str:
    """``3`` for the MoE layer named ``layers.3`` or ``decoder.layers.3`` (``named_moe_layers``: the decoder layer
    it sits in), else its ordinal among them."""
    index = name.rpartition(".")[2]
    return index if index.isdigit() else str(ordinal)


def _by_hand(param: torch.Tensor) -> bool:
    """Whether the expert tensor ``param`` is a hand-written slice of the experts (scratch EP: a plain tensor, or
    FSDP's DTensor over "edp" of one) rather than a DTensor that carries its "ep" placement (native EP)."""
    return "ep" not in (getattr(getattr(param, "device_mesh", None), "mesh_dim_names", None) or ())


def apply_expert_parallel(model: nn.Module, impl: str, ep_mesh: Any) -> list[nn.Parameter]:
    """Split every MoE layer's experts of ``model`` (same weights on every rank) over ``ep_mesh`` in place: this
    rank keeps experts [ep_rank · E/ep, (ep_rank + 1) · E/ep), and the experts' module gets the dispatch and combine
    (``impl`` ``"scratch"``: :class:`~torch_handle.parallel.expert.scratch.ScratchExpertParallel`, plain tensors;
    ``"native"``: :class:`~torch_handle.parallel.expert.native.NativeExpertParallel`, ``Shard(0)`` DTensors). Each
    layer's all-to-alls are counted in its ``traffic`` (:class:`~torch_handle.train.routing.AllToAllTraffic`).
    Returns the experts' parameters.

    Raises:
        ValueError: an unknown ``impl``, or an MoE layer whose n_experts the ep degree does not divide."""
    if impl not in ("scratch", "native"):
        raise ValueError(f"unknown expert-parallel implementation {impl!r}; expected 'scratch' or 'native'")
    params: list[nn.Parameter] = []
    for ordinal, (name, layer) in enumerate(named_moe_layers(model)):
        if layer.n_experts % ep_mesh.size():
            raise ValueError(f"parallel.ep = {ep_mesh.size()} does not divide n_experts = {layer.n_experts}")
        label, record = _heartbeat_label(name, ordinal), attach_traffic(layer).record
        if impl == "scratch":
            from torch_handle.parallel.expert.scratch import ScratchExpertParallel

            ScratchExpertParallel(ep_mesh.get_group(), label, record).apply(layer.experts)
        else:
            from torch_handle.parallel.expert.native import NativeExpertParallel

            NativeExpertParallel(label, record).apply(layer.experts, ep_mesh)
        params.extend(layer.experts.parameters())
    return params


class ExpertParallel(PortableShare):
    """One process's share of expert parallelism (``parallel.ep > 1``), for the trainer and the strategy; ``ctx`` is
    the rank's ``DistContext`` with its layout (``attach_layout``), ``impl`` ``parallel.ep_impl``.

    Built with the run's other shares (:func:`~torch_handle.train.shares.compose.build_shares`) and handed to the
    strategy (``ctx.ep_share``), which leaves the experts to it when it wraps the model; the trainer uses it as the
    run's :class:`~torch_handle.train.shares.contract.ParallelShare`, unless a pipeline is that share (which calls this
    one for its experts)."""

    def __init__(self, ctx: Any, impl: str) -> None:
        self.ctx, self.impl, self.mesh, self.ep_mesh = ctx, impl, ctx.mesh, ctx.ep_mesh["ep"]
        self.ep, self.dp = ctx.layout.ep, ctx.layout.dp
        self.ep_group, self.edp_group = self.ep_mesh.get_group(), ctx.ep_mesh["edp"].get_group()
        self.ep_rank = dist.get_rank(self.ep_group)
        self.model: nn.Module | None = None
        self.strategy: Any = None
        self.reduces_grads = True
        """Whether :meth:`sync_grads` reduces the expert gradients over "edp"; FSDP turns it off (it shards the
        experts over "edp" and reduce-scatters their gradients there, divided by dp)."""

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Split ``model``'s experts (:func:`apply_expert_parallel`) in place. Returns ``model``."""
        apply_expert_parallel(model, self.impl, self.ep_mesh)
        self.model = model
        return model

    @property
    def params(self) -> list[nn.Parameter]:
        """This rank's expert parameters, read from the model each time: ``fully_shard`` replaces them."""
        return [p for layer in moe_layers(self.model) for p in layer.experts.parameters()]

    def expert_names(self, module: nn.Module) -> list[str]:
        """The names, in ``module``, of the expert parameters it holds (what DDP must leave alone)."""
        ids = {id(p) for p in self.params}
        return [n for n, p in module.named_parameters() if id(p) in ids]

    # -- gradients -----------------------------------------------------------------------------------------------
    def sync_grads(self) -> None:
        """After a step's last backward: each expert gradient summed over the edp group and divided by dp (see the
        module: the one-process scale). One all-reduce of every expert gradient together (none when edp = 1); none
        at all when FSDP reduce-scatters them over "edp" itself (``reduces_grads`` off)."""
        if not self.reduces_grads:
            return
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        if grads and self.dp // self.ep > 1:
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat, group=self.edp_group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        for g in grads:
            g.div_(self.dp)

    def norm_args(self, module: nn.Module) -> dict[str, Any]:
        """``mesh_grad_norm``'s arguments for the experts of ``module``: their names and the EP group (each rank's
        experts are its own: their squares are summed over it; and over "edp" too when FSDP shards them there)."""
        sharded = any(hasattr(p, "to_local") and "edp" in (p.device_mesh.mesh_dim_names or ()) for p in self.params)
        groups = (self.ep_group, self.edp_group) if sharded and self.dp > self.ep else self.ep_group
        return {"experts": set(self.expert_names(module)), "ep_group": groups}

    def before_step(self, max_norm: float) -> float:
        """Reduce the expert gradients (:meth:`sync_grads`), then clip every gradient by the one-process norm
        (the dense ones counted once, each expert once). Returns the norm before clipping."""
        self.sync_grads()
        model = self.strategy.unwrapped()
        named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
        norm = mesh_grad_norm(named, self.mesh, **self.norm_args(model))
        clip_((p for _, p in named), norm, max_norm)
        return norm

    def step_stats(self, timeline: bool = False) -> dict[str, Any]:
        return {"layout": self.ctx.layout.describe()}

    # -- checkpoints: experts joined by name ----------------------------------------------------------------------
    def _full(self, value: torch.Tensor) -> torch.Tensor:
        """The (E, ...) tensor of this rank's (E/ep, ...) slice (FSDP's shard of it over "edp" gathered first):
        all-gathered over the EP group (a collective)."""
        value = value.full_tensor() if _by_hand(value) and hasattr(value, "full_tensor") else value
        value = value.detach().contiguous()
        parts = [torch.empty_like(value) for _ in range(self.ep)]
        dist.all_gather(parts, value, group=self.ep_group)
        return torch.cat(parts).cpu()

    def gather_state(self, module: nn.Module, weights: dict[str, torch.Tensor] | None,
                     state: dict[str, dict[str, torch.Tensor]] | None) -> None:
        """Put the one-process expert tensors of ``module`` into ``weights`` (a state dict) and ``state`` (optimizer
        state by name) in place, where a hand-written split left this rank's slice (DTensors were gathered by the
        model-state functions already). A collective over the EP group; None: that part skipped."""
        experts = {id(p) for p in self.params}
        for name, param in module.named_parameters():
            if id(param) not in experts or not _by_hand(param):
                continue
            if weights is not None:
                weights[name] = self._full(param)
            entry = (self.strategy.optimizer.state.get(param) or {}) if state is not None else {}
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state.setdefault(name, {})[key] = self._full(value)

    def cut_state(self, module: nn.Module, weights: dict[str, torch.Tensor],
                  state: dict[str, dict[str, torch.Tensor]] | None) -> None:
        """The reverse of :meth:`gather_state` before a load: this rank's slice of each hand-split expert tensor, in
        place (DTensors are cut by ``load_full_state`` from their placements). No communication."""
        experts = {id(p) for p in self.params}
        for name, param in module.named_parameters():
            if id(param) not in experts or not _by_hand(param) or name not in weights:
                continue
            weights[name] = weights[name].chunk(self.ep)[self.ep_rank]
            for key, value in (state or {}).get(name, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[name][key] = value.chunk(self.ep)[self.ep_rank]

    def checkpoint_layout(self) -> dict[str, Any]:
        """An EP checkpoint is the portable form (DCP, full tensors by name, ``format = "dcp"``): any ep resumes it,
        and ``single``, ``ddp`` or ``fsdp`` without experts split."""
        return {"format": "dcp", "strategy": self.strategy.name, "ep": self.ep, "ep_impl": self.impl}

    def full_state_dict(self, model: nn.Module | None = None) -> dict[str, torch.Tensor] | None:
        """The one-process state dict on rank 0 (None elsewhere); a collective over the EP group."""
        model = model if model is not None else self.strategy.unwrapped()
        weights = full_model_state(model, "scratch", {}, UNSPLIT_TP)
        self.gather_state(model, weights, None)
        return weights if self.ctx.is_main else None

    def save(self, ckpt_dir: Path) -> None:
        """Gather the full model and optimizer state (every rank calls it) and write the portable form on rank 0."""
        model, optimizer = self.strategy.unwrapped(), self.strategy.optimizer
        weights = full_model_state(model, "scratch", {}, UNSPLIT_TP)
        state = full_optimizer_state(model, optimizer, "scratch", {}, UNSPLIT_TP)
        self.gather_state(model, weights, state)
        if self.ctx.is_main:
            write_portable(Path(ckpt_dir), weights, state, self.strategy.scheduler.state_dict())

    def load_portable(self, portable: Path) -> None:
        """Every rank reads the full portable form and keeps its experts (no communication); then the LR schedule.

        Raises:
            CheckpointError: a name the model has and the checkpoint lacks, or the reverse."""
        weights, state, scheduler = read_portable(Path(portable))
        model = self.strategy.unwrapped()
        self.cut_state(model, weights, state)
        load_full_state(model, self.strategy.optimizer, weights, state, "scratch", {}, UNSPLIT_TP)
        load_schedule(self.strategy.optimizer, self.strategy.scheduler, scheduler)

