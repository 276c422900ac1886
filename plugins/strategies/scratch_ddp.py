"""Data parallelism written from scratch (``scratch-ddp``): what DistributedDataParallel does, in four ways of
increasing sophistication, and ZeRO stage 1 on top. Meant to be read top to bottom.

Every rank holds the whole model and runs its own micro-batches. After backward every gradient must be the
*mean* over the ranks, so that every rank takes the same optimizer step and the replicas stay identical. The
four ways to get there (``[strategy] sync``):

- ``naive``: after backward, one blocking ``all_reduce`` per parameter gradient, then divide by the world size.
  Many small messages (latency-bound), and none of it overlaps with backward.
- ``flat``: every gradient copied into one flat buffer (``_flatten_dense_tensors``), one all-reduce, copied back
  (``_unflatten_dense_tensors``). One large message, still after backward.
- ``overlap``: one asynchronous all-reduce per parameter, started by ``register_post_accumulate_grad_hook`` the
  moment autograd has finished that parameter's gradient, so communication runs while backward computes the
  earlier layers; after backward only the handles are waited for.
- ``bucketed``: gradients grouped into buckets of about ``bucket_mb`` MB in reverse registration order (the order
  in which backward produces them); a bucket's asynchronous all-reduce (on a flat copy) starts when its last
  gradient is ready, and buckets start strictly in order, so every rank issues the same collectives in the same
  order. Overlap *and* few messages: what PyTorch DDP does (Li et al. 2020, "PyTorch Distributed: Experiences
  on Accelerating Data Parallel Training", VLDB; https://pytorch.org/docs/stable/notes/ddp.html).

``shard_optimizer = true`` adds ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC20): :class:`ShardedOptimizer` gives each rank a balanced share of the
parameters, keeps optimizer state (Adam's two moments) only for that share, steps only it and broadcasts the
updated parameters from their owners. Optimizer state per rank shrinks by the world size.

With gradient accumulation, communication happens only on the last micro-batch of a step (``accumulating(sync)``):
the earlier ones accumulate into ``.grad`` locally, and no hook launches anything. fp16 uses dynamic loss
scaling (``torch.amp.GradScaler``) as the ``single`` and ``ddp`` strategies do; bf16/fp16 autocast is the base
``Strategy.autocast``. Per step, :meth:`ScratchDDPStrategy.step_stats` reports ``comm_s`` (seconds this rank
waited for gradient communication that did not hide behind backward), ``allreduce_calls`` and ``allreduce_bytes``.

Modelled on Stanford CS336 (Spring 2025), assignment 2 "Systems": naive DDP, flattened, overlapping individual
parameters, bucketed, and optimizer state sharding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from torch_handle.api import CheckpointError, Strategy, safe_load

MB = 1024 * 1024
"""``bucket_mb`` is in MiB, as DDP's ``bucket_cap_mb``."""


# ---------------------------------------------------------------------------------------------------------------
# ZeRO stage 1: the optimizer state, partitioned
# ---------------------------------------------------------------------------------------------------------------


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 around any ``torch.optim.Optimizer`` class (Rajbhandari et al. 2020, section 5.1).

    Every rank sees all parameters and all (already averaged) gradients, but owns a partition of the parameters:
    greedy by element count (largest first, each to the rank that owns the fewest elements so far), so the
    ranks' optimizer state is balanced. An inner ``optimizer_cls`` instance is built over the owned parameters
    only, so only they get optimizer state; :meth:`step` steps them, then every owner broadcasts its updated
    parameters (one flat message per owner) and the replicas are identical again.

    The outer ``param_groups`` hold *all* parameters with their hyperparameters: an LR scheduler writes the
    learning rate there, ``zero_grad`` clears every gradient, GradScaler unscales every gradient; :meth:`step`
    copies the hyperparameters into the inner groups first. ``state`` is the inner optimizer's state (only owned
    parameters have any).

    Args:
        params: parameters or parameter groups (dicts with ``"params"``), as for any optimizer; same order on
            every rank.
        optimizer_cls: the optimizer to shard, e.g. ``torch.optim.AdamW``.
        **defaults: its keyword arguments (``lr``, ``betas``, ...).

    All parameters must share one dtype and device (the broadcast flattens each owner's share into one buffer).
    Uses the default process group; without one it is the wrapped optimizer on one rank.
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer], **defaults: Any):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.owner: dict[torch.nn.Parameter, int] = {}
        """parameter -> the rank that owns (steps) it."""
        self.owned_numel = [0] * self.world_size
        """Elements owned by each rank."""
        self.inner: torch.optim.Optimizer | None = None
        super().__init__(params, defaults)  # calls add_param_group for each group, which partitions it
        self.inner = optimizer_cls([self._local_group(g) for g in self.param_groups], **defaults)
        self.state = self.inner.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group and assign its parameters to ranks: largest first, each to the least-loaded rank (ties:
        registration order, lowest rank), the same answer on every rank."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in sorted(group["params"], key=lambda p: -p.numel()):  # stable sort: deterministic everywhere
            rank = min(range(self.world_size), key=lambda r: self.owned_numel[r])
            self.owner[p] = rank
            self.owned_numel[rank] += p.numel()
        if self.inner is not None:
            self.inner.add_param_group(self._local_group(group))

    def _local_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``group`` with only the parameters this rank owns (possibly none)."""
        return {**{k: v for k, v in group.items() if k != "params"},
                "params": [p for p in group["params"] if self.owner[p] == self.rank]}

    def owned_by(self, rank: int) -> list[torch.nn.Parameter]:
        """Parameters owned by ``rank``, in registration order."""
        return [p for g in self.param_groups for p in g["params"] if self.owner[p] == rank]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the owned gradients so that the *global* L2 norm of all gradients is at most ``max_norm``.

        The norm is that of the whole model, not of a shard (what ZeRO does): each rank writes the L2 norms of
        the gradients it owns into a vector with one slot per parameter (zeros elsewhere) and one all-reduce
        sums the vectors. Adding zeros is exact, so every rank ends up with the very per-parameter norms that
        ``torch.nn.utils.clip_grad_norm_`` computes from all gradients, and the same total to the last bit.
        (An all-reduce of each rank's sum of squared norms gives the same norm up to rounding; measured, that
        1-ulp difference grows through Adam's normalisation of near-zero gradient elements to 1e-3 in the
        parameters after 10 steps, so it could not match DDP.) Coefficient as in torch: ``max_norm / (norm +
        1e-6)``, capped at 1.

        Returns:
            The global norm before clipping, a float32 scalar tensor (inf or nan when a gradient is).
        """
        params = [p for g in self.param_groups for p in g["params"]]
        norms = torch.zeros(len(params), dtype=torch.float32, device=params[0].device)  # (n_params,)
        owned = []
        for i, p in enumerate(params):
            if self.owner[p] == self.rank and p.grad is not None:
                norms[i] = torch.linalg.vector_norm(p.grad)
                owned.append(p.grad)
        if self.world_size > 1:
            dist.all_reduce(norms)
        total = torch.linalg.vector_norm(norms)
        coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in owned:
            g.mul_(coefficient.to(g.dtype))
        return total

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Step the owned parameters with the current hyperparameters, then broadcast every share from its owner.

        Returns:
            What ``closure`` returned (None without one).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        assert self.inner is not None
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})  # lr from the scheduler, ...
        self.inner.step()
        self.broadcast_parameters()
        return loss

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Every rank receives the parameters it does not own: one asynchronous broadcast per owner of that
        owner's share, flattened (each rank sends its updated share and receives the others')."""
        if self.world_size == 1:
            return
        in_flight = []
        for rank in range(self.world_size):
            params = self.owned_by(rank)
            if not params:
                continue
            flat = _flatten_dense_tensors([p.detach() for p in params])
            in_flight.append((rank, params, flat, dist.broadcast(flat, src=rank, async_op=True)))
        for rank, params, flat, work in in_flight:
            work.wait()
            if rank != self.rank:
                for p, new in zip(params, _unflatten_dense_tensors(flat, params)):
                    p.copy_(new)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the inner optimizer's state dict, the outer hyperparameters (the scheduler's lr)
        and the partition it belongs to."""
        assert self.inner is not None
        return {"rank": self.rank, "world_size": self.world_size, "owned_numel": list(self.owned_numel),
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's shard, written by :meth:`state_dict` on the same rank of the same partition.

        Raises:
            CheckpointError: when the shard belongs to another rank, world size or partition.
        """
        assert self.inner is not None
        mine = (self.rank, self.world_size, list(self.owned_numel))
        theirs = (state_dict.get("rank"), state_dict.get("world_size"), state_dict.get("owned_numel"))
        if theirs != mine:
            raise CheckpointError(f"optimizer shard of rank {theirs[0]} of {theirs[1]} (elements per rank "
                                  f"{theirs[2]}) cannot be loaded on rank {mine[0]} of {mine[1]} (elements per "
                                  f"rank {mine[2]}): resume with the same world size and model")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        self.inner.load_state_dict(state_dict["inner"])
        self.state = self.inner.state  # load_state_dict replaced the inner optimizer's state dict


# ---------------------------------------------------------------------------------------------------------------
# the strategy
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Bucket:
    """Gradients all-reduced together (``sync = "bucketed"``)."""

    params: list[torch.nn.Parameter]
    """In the order backward produces their gradients (reverse registration order)."""
    ready: int = 0
    """Gradients of this bucket finished in the current backward."""
    flat: torch.Tensor | None = None
    """The flat copy being all-reduced, shape (sum of numels,), while in flight."""
    work: Any = None
    """Its ``dist.Work`` handle, while in flight."""


def _new_stats() -> dict[str, Any]:
    return {"comm_s": 0.0, "allreduce_calls": 0, "allreduce_bytes": 0}


@dataclass
class _InFlight:
    """Overlap mode: the per-parameter all-reduces launched by the hooks during this backward."""

    works: list[tuple[torch.nn.Parameter, Any]] = field(default_factory=list)
    launched: set[int] = field(default_factory=set)


class ScratchDDPStrategy(Strategy):
    """Hand-written data parallelism; see the module docstring. Options: ``ScratchDDPConfig`` (``sync``,
    ``bucket_mb``, ``shard_optimizer``).

    Built with its model like every strategy: :meth:`wrap` broadcasts rank 0's parameters and buffers and
    registers the gradient hooks (``overlap``, ``bucketed``), :meth:`build_optimizer` builds AdamW, sharded or
    not. :meth:`close` removes the hooks.
    """

    name = "scratch-ddp"

    def __init__(self, options: Any, training: Any, ctx: Any, model: torch.nn.Module) -> None:
        self.params: list[torch.nn.Parameter] = []
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[torch.nn.Parameter, int] = {}
        self._next_bucket = 0
        self._overlap = _InFlight()
        self._hooks: list[Any] = []
        self._stats = _new_stats()
        super().__init__(options, training, ctx, model)
        # fp16 needs loss scaling to keep small gradients representable (Micikevicius et al. 2018). Every rank
        # holds the same averaged gradients, so every rank makes the same skip-or-step decision.
        self.scaler = torch.amp.GradScaler(ctx.device.type) if training.precision == "fp16" else None

    @property
    def sharded(self) -> bool:
        return bool(self.options.shard_optimizer)

    # -- set-up --------------------------------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Broadcast rank 0's parameters and buffers (identical replicas whatever the seeds), then register the
        hooks of ``overlap``/``bucketed``. The model itself is not wrapped."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        if self.ctx.distributed:
            with torch.no_grad():
                for t in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(t, src=0)
        if self.options.sync == "overlap":
            self._hooks = [p.register_post_accumulate_grad_hook(self._overlap_hook) for p in self.params]
        elif self.options.sync == "bucketed":
            self.buckets = self.make_buckets(self.params, self.options.bucket_mb * MB)
            self._bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b.params}
            self._hooks = [p.register_post_accumulate_grad_hook(self._bucket_hook) for p in self.params]
        return model

    @staticmethod
    def make_buckets(params: list[torch.nn.Parameter], cap_bytes: float) -> list[Bucket]:
        """Parameters in reverse registration order, cut into buckets that close once they reach ``cap_bytes``
        (so a bucket may exceed it by its last parameter, as in DDP) or when the dtype changes."""
        buckets: list[Bucket] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(params):
            if current and p.dtype != current[-1].dtype:
                buckets.append(Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap_bytes:
                buckets.append(Bucket(current))
                current, size = [], 0
        if current:
            buckets.append(Bucket(current))
        return buckets

    def build_optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """AdamW from ``[training]`` (as the base strategy), wrapped in :class:`ShardedOptimizer` when
        ``shard_optimizer`` is set."""
        if not self.sharded:
            return super().build_optimizer(params)
        t = self.training
        return ShardedOptimizer(params, torch.optim.AdamW, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8,
                                weight_decay=t.weight_decay, fused=(self.ctx.device.type == "cuda") or None)

    def describe(self) -> dict[str, Any]:
        o = self.options
        facts = {**super().describe(), "sync": o.sync, "shard_optimizer": o.shard_optimizer}
        if o.sync == "bucketed":
            facts.update(bucket_mb=o.bucket_mb, buckets=len(self.buckets))
        if self.sharded:
            facts.update(zero_stage=1, optimizer=f"ShardedOptimizer[{type(self.optimizer.inner).__name__}]")
        return facts

    # -- communication helpers (counted and timed for step_stats) ------------------------------------------------
    def _all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Any:
        """Sum ``tensor`` over the ranks in place; blocking calls count as waiting time (``comm_s``)."""
        self._stats["allreduce_calls"] += 1
        self._stats["allreduce_bytes"] += tensor.numel() * tensor.element_size()
        if async_op:
            return dist.all_reduce(tensor, async_op=True)
        start = time.perf_counter()
        dist.all_reduce(tensor)
        self._stats["comm_s"] += time.perf_counter() - start
        return None

    def _wait(self, work: Any) -> None:
        start = time.perf_counter()
        work.wait()
        self._stats["comm_s"] += time.perf_counter() - start

    @staticmethod
    def _grad(p: torch.nn.Parameter) -> torch.Tensor:
        """``p.grad``; zeros for a parameter that got no gradient, so that every rank reduces the same tensors."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    # -- hooks (called by autograd during backward) ---------------------------------------------------------------
    def _overlap_hook(self, p: torch.nn.Parameter) -> None:
        """``p.grad`` is final for this backward: start its all-reduce now (last micro-batch only)."""
        if not self._sync or not self.ctx.distributed:
            return
        self._overlap.works.append((p, self._all_reduce(p.grad, async_op=True)))
        self._overlap.launched.add(id(p))

    def _bucket_hook(self, p: torch.nn.Parameter) -> None:
        """Count ``p`` as ready in its bucket; launch every complete bucket from the next one on, in order."""
        if not self._sync or not self.ctx.distributed:
            return
        self.buckets[self._bucket_of[p]].ready += 1
        while self._next_bucket < len(self.buckets):
            bucket = self.buckets[self._next_bucket]
            if bucket.ready < len(bucket.params):
                break
            self._launch(bucket)
            self._next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.flat = _flatten_dense_tensors([self._grad(p) for p in bucket.params])
        bucket.work = self._all_reduce(bucket.flat, async_op=True)

    # -- the step ------------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss / grad_accum`` (times the loss scale in fp16); on the last micro-batch, then finish
        the gradient synchronisation: afterwards every ``.grad`` is the mean over the ranks."""
        loss = loss / self.training.grad_accum
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        if self._sync:
            self.sync_gradients()

    def sync_gradients(self) -> None:
        """Average the gradients over the ranks, the way ``options.sync`` says (a no-op without a process group).

        ``naive`` and ``flat`` communicate here, blocking; ``overlap`` and ``bucketed`` already launched (almost)
        everything from their hooks and only wait here. A parameter whose hook did not fire (no gradient this
        step) is reduced here, as zeros, so every rank issues the same collectives.
        """
        if not self.ctx.distributed:
            return
        world = self.ctx.world_size
        sync = self.options.sync
        if sync == "naive":
            for p in self.params:
                self._all_reduce(self._grad(p))
                p.grad.div_(world)
        elif sync == "flat":
            grads = [self._grad(p) for p in self.params]
            flat = _flatten_dense_tensors(grads)
            self._all_reduce(flat)
            flat.div_(world)
            for g, mean in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(mean)
        elif sync == "overlap":
            for p in self.params:
                if id(p) not in self._overlap.launched:
                    self._overlap.works.append((p, self._all_reduce(self._grad(p), async_op=True)))
            for p, work in self._overlap.works:
                self._wait(work)
                p.grad.div_(world)
            self._overlap = _InFlight()
        elif sync == "bucketed":
            for bucket in self.buckets[self._next_bucket:]:
                self._launch(bucket)
            for bucket in self.buckets:
                self._wait(bucket.work)
                bucket.flat.div_(world)
                for p, mean in zip(bucket.params, _unflatten_dense_tensors(bucket.flat, bucket.params)):
                    p.grad.copy_(mean)
                bucket.ready, bucket.flat, bucket.work = 0, None, None
            self._next_bucket = 0

    def step(self) -> float:
        """Clip by the global gradient norm (the sharded optimizer computes it with one all-reduce of squared
        norms), step (through the GradScaler in fp16), step the LR schedule, zero the gradients.

        Returns:
            The global gradient norm before clipping.
        """
        max_norm = self.training.grad_clip if self.training.grad_clip > 0 else float("inf")
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.sharded:
            grad_norm = self.optimizer.clip_grad_norm_(max_norm)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped on every rank alike when a gradient is inf/nan
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def step_stats(self) -> dict[str, float | int]:
        """Gradient communication since the previous call (one optimizer step): ``comm_s`` (seconds waited:
        for naive/flat every all-reduce, for overlap/bucketed the handle waits after backward),
        ``allreduce_calls``, ``allreduce_bytes`` (this rank's, payload only)."""
        stats, self._stats = self._stats, _new_stats()
        return stats

    def close(self) -> None:
        """Remove the gradient hooks and forget anything in flight (idempotent). Nothing is waited for: after a
        failure a peer may never answer, and the process group's teardown ends the collectives anyway."""
        for bucket in self.buckets:
            bucket.ready, bucket.flat, bucket.work = 0, None, None
        self._overlap, self._next_bucket = _InFlight(), 0
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def checkpoint_layout(self) -> dict[str, Any]:
        """Unsharded: the base ``torch`` format; sharded: ``torch-sharded`` (one optimizer file per rank)."""
        if not self.sharded:
            return super().checkpoint_layout()
        return {"format": "torch-sharded", "strategy": self.name}

    def loads_natively(self, layout: dict[str, Any]) -> bool:
        """Sharded: only its own shards on the same world size; unsharded: any ``torch`` checkpoint."""
        if not self.sharded:
            return super().loads_natively(layout)
        return layout.get("format") == "torch-sharded" and layout.get("world_size") == self.ctx.world_size

    def load_portable(self, portable: Path) -> None:
        """Sharded: the full weights, and the optimizer state of the parameters this rank owns (read in full on
        every rank: :func:`torch_handle.checkpoint.convert.read_portable`); unsharded: the base strategy's loader."""
        if not self.sharded:
            super().load_portable(portable)
            return
        from torch_handle.checkpoint import convert
        model_sd, state, schedule = convert.read_portable(Path(portable))
        model = self.unwrapped()
        try:
            model.load_state_dict(model_sd)
        except RuntimeError as e:
            raise CheckpointError(f"{portable}: does not fit the model ({str(e).splitlines()[0]})") from None
        names = {p: n for n, p in model.named_parameters()}
        inner = self.optimizer.inner
        saved = inner.state_dict()  # its param groups (numbered), the state replaced below
        owned = [p for g in inner.param_groups for p in g["params"]]
        missing = [names[p] for p in owned if names[p] not in state]
        if missing:
            raise CheckpointError(f"{portable}: no optimizer state for {missing[0]}")
        saved["state"] = {i: dict(state[names[p]]) for i, p in enumerate(owned)}
        inner.load_state_dict(saved)
        self.optimizer.state = inner.state
        convert.load_schedule(self.optimizer, self.scheduler, schedule)

    def save(self, ckpt_dir: Path) -> None:
        """Rank 0 writes ``model.pt``. Unsharded: rank 0 also writes ``optim.pt`` (base strategy); sharded: every
        rank writes its own shard with the schedule, ``optim-rank<R>.pt`` (as DeepSpeed writes one optimizer
        file per rank), with ``owned``: the indices (in parameter order) of the parameters it owns, what
        :mod:`torch_handle.checkpoint.convert` maps its state by. fp16 adds the loss scaler's state."""
        ckpt_dir = Path(ckpt_dir)
        if not self.sharded:
            super().save(ckpt_dir)
            if self.scaler is not None and self.ctx.is_main:
                torch.save(self.scaler.state_dict(), ckpt_dir / "scaler.pt")
            return
        if self.ctx.is_main:
            torch.save(self.unwrapped().state_dict(), ckpt_dir / "model.pt")
        every = [p for g in self.optimizer.param_groups for p in g["params"]]
        owned = [i for i, p in enumerate(every) if self.optimizer.owner[p] == self.ctx.rank]
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "owned": owned}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        torch.save(state, ckpt_dir / f"optim-rank{self.ctx.rank}.pt")

    def load(self, ckpt_dir: Path) -> None:
        """Every rank loads ``model.pt`` and its optimizer state (its own shard when sharded).

        Raises:
            CheckpointError: a file is missing or unsafe, or the shard belongs to another partition.
        """
        ckpt_dir = Path(ckpt_dir)
        if not self.sharded:
            super().load(ckpt_dir)
            if self.scaler is not None:
                self.scaler.load_state_dict(safe_load(ckpt_dir / "scaler.pt"))
            return
        shard = ckpt_dir / f"optim-rank{self.ctx.rank}.pt"
        if not shard.is_file():
            raise CheckpointError(f"{shard} is missing: was the checkpoint written with shard_optimizer = true "
                                  f"and the same world size?")
        self.unwrapped().load_state_dict(safe_load(ckpt_dir / "model.pt", self.ctx.device))
        state = safe_load(shard, self.ctx.device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
