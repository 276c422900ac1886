"""What a training process does differently when ``parallel.pp > 1``: its stages of the split model, the schedule
that runs a step's micro-batches over them, the gradient norm over all stages, the measured bubble in the step
event, and checkpoints that join the stages by name.

:class:`PipelineParallel` is the step's :class:`~torch_handle.train.loop.MicroBatchLoop`: the trainer reads the
step's ``grad_accum`` micro-batches, and the pipeline re-splits their ``micro_batch_size · grad_accum`` samples
into ``m`` pipeline micro-batches and runs them through its schedule: hand-written (``pp_impl = "scratch"``:
:mod:`torch_handle.parallel.pipeline.scratch`) or torch's (``"native"``: ``torch.distributed.pipelining``).

The objective (:mod:`torch_handle.train.objectives`) cuts each micro-batch into the model's inputs and the loss's
target (``split``: a preference pair's chosen and rejected rows stay in one micro-batch), readies the targets
before the schedule (``prepare``: a reference's log-probabilities, from a forward-only pass) and computes the last
stage's loss (``output_loss``: a mean over ``units``, tokens or pairs). The loss of micro-batch i is that mean
times its units over the step's units N, so the gradients summed over the m micro-batches are those of the step's
mean (the one-process loss of the same samples; no rescaling afterwards, ``scale_grads=False`` for torch's
schedules). N is the replica's count, or the global batch's over the data-parallel degree where the data counts
labels per sample (:func:`~torch_handle.train.loss.global_mean_weight`: packed conversations), so that the
replicas' averaged gradients are those of the global batch's mean over its trained tokens.

With context parallelism (``cp``: :class:`~torch_handle.train.shares.context.ContextParallel`, composed inside the
pipeline, around TP) every stage runs on this rank's T/cp tokens of each micro-batch: the CP share hooks every
attention layer of the whole model before the split, and each stage's forward pre-hook shards its ``input_ids``
and ``position_ids`` by the micro-batch's head-tail order (computed from the whole sequence's positions, so every
stage's RoPE rotates by the true positions and its document mask is the whole sequence's: the rotary table is
sharded per stage, torchtitan PR #792). The last stage's loss is the CP share's: this rank's sum over its labels
over the micro-batch's count, times cp, since the strategy averages the gradients over dp × cp ranks; N is the
replica's count over cp (or the trainer's global weight, which counts the dp × cp ranks), so that the step's sums
over the ranks are the loss · tokens and the tokens of the replica.

With the chunked loss (``training.loss_impl = "chunked"``) the last stage returns its final normalised hidden states
(B, T, C) rather than the logits, and :meth:`PipelineParallel.loss` applies the output layer a chunk of tokens at a
time (:func:`~torch_handle.train.loss.chunked_loss_fn`, or the TP share's vocabulary-parallel one): no
(tokens × vocabulary) logits exist on the last stage, in training or evaluation.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from torch_handle.checkpoint.convert import load_schedule, read_portable, write_portable
from torch_handle.common.testhooks import HANG_ENV, parse_test_stall
from torch_handle.config.schema import ParallelConfig
from torch_handle.errors import CheckpointError
from torch_handle.model.pipeline import split_decoder, split_layers, tied_names
from torch_handle.observe.heartbeat import beat
from torch_handle.parallel.pipeline import data_parallel
from torch_handle.parallel.pipeline.p2p import StageLink
from torch_handle.parallel.pipeline.schedules import stage_ranks
from torch_handle.parallel.pipeline.scratch import ScratchPipeline
from torch_handle.parallel.pipeline.timeline import Timeline, summarize
from torch_handle.parallel.tensor.checkpoint import full_model_state, full_optimizer_state, load_full_state
from torch_handle.train.grad_norm import clip_, local, mesh_grad_norm
from torch_handle.train.loop import plain
from torch_handle.train.loss import AuxLossScale
from torch_handle.train.shares.contract import UNSPLIT_TP, PortableShare
from torch_handle.train.strategy import DistContext


class PipelineParallel(PortableShare):
    """One process's share of a pipeline (``parallel.pp > 1``): the stages it runs, its schedule, and what the
    trainer asks of it. With tensor parallelism (``tp``) each stage's layers are split over the stage's TP ranks
    and the last stage's loss is vocabulary-parallel; with data parallelism the strategy wraps each stage (DDP,
    FSDP2), which syncs once a step. The pipeline's group is this rank's ("pp") line of the mesh: the ranks at its
    (dp, tp) coordinate in every stage.

    Args:
        parallel: the ``[parallel]`` table.
        ctx: this rank's place, with its layout (``attach_layout``).
        n_microbatches: m (``parallel.pp_microbatches``, or ``grad_accum``).
        tp: the :class:`~torch_handle.train.shares.tensor.TensorParallel` share of this rank, or None.
        ep: the :class:`~torch_handle.train.shares.expert.ExpertParallel` share of this rank, or None.
        cp: the :class:`~torch_handle.train.shares.context.ContextParallel` share of this rank (around ``tp``), or
            None.

    The composed share of its layout (:data:`~torch_handle.train.shares.contract.COMPOSITION`): every call reaches this
    rank's stages, then their sequence split (``cp``), then their TP split (``tp``), then their experts (``ep``).
    """

    def __init__(self, parallel: ParallelConfig, ctx: DistContext, n_microbatches: int, cp: Any = None,
                 tp: Any = None, ep: Any = None):
        self.parallel, self.ctx, self.m, self.tp, self.cp = parallel, ctx, n_microbatches, tp, cp
        self.inner = cp if cp is not None else tp  # the loss, its traffic and step figures: CP's (around TP's)
        self.cp_degree = 1 if cp is None else cp.cp
        self.chunked = False  # training.loss_impl = "chunked": the last stage returns hidden states (set per step)
        self.impl, self.schedule_name = parallel.pp_impl, parallel.pp_schedule
        self.pp, self.v = parallel.pp, parallel.pp_stages_per_rank
        self.n_stages = self.pp * self.v
        self.stage_to_rank = stage_ranks(self.pp, self.v, self.schedule_name)  # pipeline ranks
        self.my_stages = [s for s, r in enumerate(self.stage_to_rank) if r == ctx.pp_rank]
        self.group = ctx.pp_group
        self.group_ranks = dist.get_process_group_ranks(self.group)  # global rank of each pipeline rank
        self.timeline = Timeline(ctx.device)
        self.strategy: Any = None
        self.ep = ep  # its experts split over "ep" (pp x ep): reduced and saved with the stages' parameters
        self.shard: nn.Module | None = None
        self.tied: dict[str, str] = {}
        self._tie_group = self._tie_groups()
        self._tokens = torch.ones((), dtype=torch.float64)  # N of the running step (the loss's denominator)
        self._trainer: Any = None  # the running step's (or evaluation's): its objective computes the loss
        self._targets: list[dict[str, torch.Tensor]] = []  # the running schedule's micro-batch targets
        self._train = True  # a training step's schedule (else an evaluation's)
        self.first_stage_saved_bytes: int | None = None
        self.peak_saved_bytes: int | None = None
        self.activation_saved_bytes: int | None = None  # the loop's figure: this rank's first stage, first micro-batch
        self.test_stall = parse_test_stall(os.environ.get(HANG_ENV, ""), ctx.rank)
        self._running, self._forwards = 0, 0  # the running step (1-based), its forwards so far on the first stage

    # -- build ---------------------------------------------------------------------------------------------------
    def _tie_groups(self) -> Any:
        """The process group of the ranks that run the first and the last stage (tied embeddings), when they
        differ; every rank creates every such group (``new_group`` is collective), keeps its own."""
        first, last = self.stage_to_rank[0], self.stage_to_rank[-1]
        if first == last:
            return None
        layout, mine = self.ctx.layout, None
        for dp_rank in range(layout.dp):
            for cp_rank in range(layout.cp):
                for tp_rank in range(layout.tp):
                    ranks = [layout.rank(stage, dp_rank, tp_rank, cp_rank) for stage in (first, last)]
                    group = dist.new_group(ranks)
                    if self.ctx.rank in ranks:
                        mine = group
        return mine

    def split(self, model: nn.Module) -> nn.Module:
        """Keep this rank's stages of ``model`` (same weights on every rank) and build its schedule; returns the
        :class:`~torch_handle.model.pipeline.PipelineShard` the strategy steps."""
        args = model.args
        per_layer = sum(p.numel() for p in model.layers[0].parameters())
        embed = model.embed.weight.numel()
        ranges = split_layers(args.n_layers, self.n_stages, self.parallel.pp_layers, by=self.parallel.pp_split,
                              layer_params=per_layer, embed_params=embed,
                              head_params=0 if args.tie_embeddings else model.lm_head.weight.numel())
        self.ranges = ranges
        self.tied = tied_names(model)
        self._names = [n for n, _ in model.named_parameters()]
        self.shard, stages = split_decoder(model, ranges, self.my_stages)
        self._stage_modules = stages  # unwrapped (a strategy may wrap the views): where the last stage's output is set
        if self.cp is not None:  # each stage's tokens: this rank's of the micro-batch, by its positions
            for stage in stages:
                stage.register_forward_pre_hook(self.cp.shard_stage_inputs, with_kwargs=True)
        if self.test_stall is not None:
            stages[0].register_forward_pre_hook(self._stall)
        self.stages = self.shard.stage_views  # the modules the schedule calls: a strategy may wrap them (DDP)
        return self.shard

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Split ``model`` over the TP ranks (with ``tp``), keep this rank's stages (:meth:`split`) and split their
        experts (with ``ep``); returns the shard the strategy steps. The schedule's losses bypass the trainer's
        probe: the stages' MoE layers get the gradient a micro-batch's loss gets in gradient accumulation over m
        micro-batches, 1/m (:class:`~torch_handle.train.loss.AuxLossScale`)."""
        if self.tp is not None:
            self.tp.parallelize(model)
        if self.cp is not None:
            self.cp.hook_attention(model)
        shard = self.split(model)
        AuxLossScale(shard, 1.0 / self.m)
        if self.ep is not None:
            self.ep.parallelize(shard)
        return shard

    def _stall(self, module: nn.Module, args: Any) -> None:
        """``HANDLE_TEST_HANG_RANK = RANK:STEP:SECONDS:MB``: sleep before the first stage's forward of micro-batch
        MB in step STEP (:func:`~torch_handle.common.testhooks.parse_test_stall`)."""
        step, seconds, microbatch = self.test_stall
        if self._running == step and self._forwards == microbatch:
            time.sleep(seconds)
        self._forwards += 1

    def bind(self, strategy: Any) -> PipelineParallel:
        """Work with the strategy that steps this rank's shard (it has wrapped the stage modules it syncs, DDP or
        FSDP2) and build the schedule over them: the strategy stops clipping (the norm spans every stage:
        :meth:`before_step`), and its state is saved and loaded here. Returns self."""
        super().bind(strategy)
        if self.inner is not None:  # the CP share binds its TP share
            self.inner.bind(strategy)
        if self.ep is not None:
            self.ep.bind(strategy)
        self.grad_sync = strategy.pipeline_grad_sync() or data_parallel.NoSync()
        if self.impl == "scratch":
            link = StageLink(self.group, self.group_ranks, self.my_stages[0], self.ctx.device, self.timeline)
            self.engine: Any = ScratchPipeline(self.stages[0], link, self.n_stages, self.schedule_name, self.timeline,
                                               self.grad_sync)
        else:
            from torch_handle.train.shares.pipeline_native import native_schedule

            self.engine = native_schedule(self)
        return self

    # -- the step ------------------------------------------------------------------------------------------------
    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.my_stages

    def _chunks(self, batch: dict[str, torch.Tensor], objective: Any
                ) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
        """The samples of ``batch`` as m micro-batches: each one's model inputs and loss target (the objective's
        ``split``)."""
        parts = [dict(zip(batch, values)) for values in zip(*(v.chunk(self.m) for v in batch.values()))]
        split = [objective.split(part) for part in parts]
        return [x for x, _ in split], [y for _, y in split]

    def begin_step(self) -> None:
        if self.inner is not None:
            self.inner.begin_step()

    def loss(self, logits: Any, labels: torch.Tensor, label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's (token-mean loss, labelled tokens) of its output: logits (B, T, V, or V/tp), or with the
        chunked loss its hidden states (B, T, C) (:meth:`chunked_loss` with its output layer's weight). The CP
        share's (labels sharded; see the module) or the TP share's where there is one."""
        if self.chunked:
            return self.chunked_loss(logits, self.shard.lm_head.weight, labels, label_smoothing)
        inner = self.inner if self.inner is not None else super()
        return inner.loss(logits, labels, label_smoothing)

    def chunked_loss(self, hidden: Any, weight: Any, labels: torch.Tensor, label_smoothing: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`loss` of the logits ``hidden @ weight.T`` without them: hidden (B, T, C) (T/cp under context
        parallelism, T/tp under sequence parallelism), weight (V or V/tp, C): the CP share's (labels sharded), the TP
        share's vocabulary-parallel chunked loss, else the whole one."""
        inner = self.inner if self.inner is not None else super()
        return inner.chunked_loss(hidden, weight, labels, label_smoothing)

    def token_losses(self, logits: Any, labels: torch.Tensor) -> torch.Tensor:
        inner = self.inner if self.inner is not None else super()
        return inner.token_losses(logits, labels)

    def native_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The ``loss_fn(output, target)`` of torch's schedules: ``target`` is the micro-batch's index (1,). The
        call of torch's shape inference (``TimedStage.inferring``: outputs of uninitialised inputs) leaves no
        metrics: the objective's sums since the last sync, its own alone, are dropped."""
        loss = self._loss(logits, int(target[0]))
        if any(stage.inferring for stage in self.engine.stages):
            self._trainer.objective.attach(loss.new_zeros(0, dtype=torch.float64))
        return loss

    def _loss(self, output: Any, i: int) -> torch.Tensor:
        """Micro-batch i's loss: the objective's mean loss of the last stage's ``output`` times its units over the
        step's N (see the module docstring)."""
        mean, n = self._trainer.objective.output_loss(self._trainer, output, self._targets[i], train=self._train)
        return mean * n / self._tokens

    def _begin(self, trainer: Any, batch: dict[str, torch.Tensor], *, train: bool
               ) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
        """Ready a schedule of ``batch``'s micro-batches: their inputs (returned), targets (prepared by the
        objective, under the step's autocast and TP context) and units N (returned)."""
        objective = trainer.objective
        inputs, self._targets = self._chunks(batch, objective)
        count = sum(objective.units(t) for t in self._targets)
        self.chunked = trainer.loss_impl == "chunked"
        for stage in self._stage_modules:
            stage.return_hidden = self.chunked and stage.last
        weight = trainer.loss_weight if train else None  # the global batch's mean over dp (× cp) ranks
        self._tokens = count.double() / self.cp_degree if weight is None else torch.tensor(
            trainer.training.grad_accum / weight, dtype=torch.float64, device=count.device)
        self._trainer, self._train = trainer, train
        with trainer.strategy.autocast(), self.micro_batch():
            objective.prepare(trainer, inputs, self._targets, self.forward_only, train=train)
        return inputs, count

    def run(self, trainer: Any, batches: Iterator[dict[str, torch.Tensor]], stats: torch.Tensor) -> None:
        """The step's micro-batches through the schedule (see :class:`~torch_handle.train.loop.MicroBatchLoop`)."""
        timer = trainer.timer
        beat("train_step", trainer.step)
        with timer.phase("data"):
            parts = [next(batches) for _ in range(trainer.training.grad_accum)]
            batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        inputs, count = self._begin(trainer, batch, train=True)
        self._running, self._forwards = trainer.step + 1, 0
        self.timeline.begin()
        counting = self.first_stage_saved_bytes is None
        self.engine.count_saved = counting
        with trainer.strategy.autocast(), self.micro_batch():
            losses = self._step(inputs)
        if counting:
            self.first_stage_saved_bytes = self.engine.saved_bytes[0] if 0 in self.my_stages else 0
            self.peak_saved_bytes = self.engine.peak_saved_bytes
            self.activation_saved_bytes = self.engine.saved_bytes[0]
        spans = self.timeline.spans()
        busy = {"forward": sum(b - a for k, *_, a, b in spans if k == "F"),
                "backward": sum(b - a for k, *_, a, b in spans if k in ("B", "W"))}
        timer.lap_shared(busy if any(busy.values()) else {"forward": 1.0})
        if self.has_last and self.ctx.tp_rank == 0:  # a stage's TP ranks hold the same loss: count it once
            stats[0] += plain(torch.stack([plain(x) for x in losses]).sum()).double() * self._tokens
            stats[1] += count / self.cp_degree  # every cp rank adds its share of the sum (and of the count)

    def _step(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        if self.impl == "scratch":
            return self.engine.step(inputs, self._loss)
        losses: list[torch.Tensor] = []
        kwargs = {k: torch.cat([x[k] for x in inputs]) for k in inputs[0]}
        target = torch.arange(len(inputs), device=self.ctx.device) if self.has_last else None  # native_loss's i
        self.engine.step(**kwargs, target=target, losses=losses)
        return [x.detach() for x in losses]

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor], trainer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ losses · units, units) of one evaluation batch, on the rank of the last stage (zeros elsewhere);
        the objective's evaluation loss (``train=False``), forwards only."""
        inputs, count = self._begin(trainer, dict(batch), train=False)
        with trainer.strategy.autocast(), self.micro_batch():
            losses = self.forward_only(inputs, self._loss)
        if not self.has_last or self.ctx.tp_rank > 0:  # counted once per replica (each cp rank its share)
            return torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        return (plain(torch.stack([plain(x) for x in losses]).sum()).double() * self._tokens,
                count.double() / self.cp_degree)

    @torch.no_grad()
    def forward_only(self, inputs: list[dict[str, torch.Tensor]], fn: Any) -> list[Any]:
        """``fn(output, i)`` of every micro-batch's last-stage output, on the last stage's ranks (empty
        elsewhere), forwards only, no graph kept (evaluation; a reference's log-probabilities). Collective over the
        pipeline group; the caller sets the autocast and TP context."""
        if self.impl == "scratch":
            return self.engine.evaluate(inputs, fn)
        return self._forward_only(inputs, fn)

    def _forward_only(self, inputs: list[dict[str, torch.Tensor]], fn: Any) -> list[Any]:
        """Every micro-batch through this rank's stages, stage after stage: the last stage's ``fn(output, i)``.
        The native path's: torch's ``schedule.eval`` needs exactly m micro-batches (an evaluation batch of
        ``micro_batch_size`` samples may have fewer) and fails for ZBV (torch 2.13: "can't steal_bwd_input")."""
        ranks = [self.group_ranks[r] for r in self.stage_to_rank]  # global rank of every stage
        off = Timeline(enabled=False)
        links = {s: StageLink(self.group, ranks, s, self.ctx.device, off) for s in self.my_stages}
        losses = []
        for i, kwargs in enumerate(inputs):
            h = None
            for s, module in zip(self.my_stages, self.stages):
                if s > 0 and ranks[s - 1] != self.ctx.rank:
                    h = links[s].recv_activation(i)
                h = module(h, **kwargs)
                if s == self.n_stages - 1:
                    losses.append(fn(h, i))
                elif ranks[s + 1] != self.ctx.rank:
                    links[s].send_activation(h, i)
        for link in links.values():
            link.flush()
        return losses

    def before_step(self, max_norm: float) -> float:
        """After the schedule, before the optimizer step: sum the tied embedding's gradients of the first and last
        stage, then clip every gradient by the norm over all stages, TP shards and FSDP shards (the tied matrix
        counted once: :func:`~torch_handle.train.grad_norm.mesh_grad_norm`). Returns that norm before clipping."""
        named = [(n, p) for n, p in self.shard.named_parameters() if p.grad is not None]
        if self._tie_group is not None:
            for name, p in named:
                if name in self.tied or name in self.tied.values():
                    dist.all_reduce(local(p.grad), group=self._tie_group)
        if self.tp is not None:
            self.tp.sync_partial_grads(named)
        experts = {}
        if self.ep is not None:
            self.ep.sync_grads()
            experts = self.ep.norm_args(self.shard)
        plan = self.tp.plan if self.tp is not None and self.tp.impl == "scratch" else None
        norm = mesh_grad_norm(named, self.ctx.mesh, plan, exclude=self.tied, pp_group=self.group, **experts)
        clip_((p for _, p in named), norm, max_norm)
        return norm

    def step_stats(self, timeline: bool = False) -> dict[str, Any]:
        """The layout and ``pipeline``: every pipeline rank's busy, wait and idle seconds and the measured and
        theoretical bubble (:func:`~torch_handle.parallel.pipeline.timeline.summarize`), with the spans themselves
        when ``timeline``. A collective over the pipeline group; the figures on rank 0."""
        gathered = self._gather((self.timeline.spans(), self.peak_saved_bytes))
        if not self.ctx.is_main:
            return {}
        tp = self.inner.step_stats() if self.inner is not None else {}  # its traffic (CP's and TP's)
        pipeline = summarize([s for s, _ in gathered], self.schedule_name, self.pp, self.m, self.v, timeline=timeline)
        pipeline["impl"] = self.impl
        pipeline["layers"] = [len(r) for r in self.ranges]
        if all(peak is not None for _, peak in gathered):
            for row, (_, peak) in zip(pipeline["ranks"], gathered):
                row["activation_peak_bytes"] = peak
        return {**tp, "layout": self.ctx.layout.describe(), "pipeline": pipeline}

    # -- checkpoints: the stages joined by name, in the portable form ------------------------------------------
    def checkpoint_layout(self) -> dict[str, Any]:
        """A pipeline checkpoint is the portable form (DCP, full tensors by name: ``format = "dcp"``), joined from
        every stage on rank 0, so that any strategy or world size resumes it (torchtitan #474: every stage's
        parameters, not the first stage's only)."""
        cp = {} if self.cp is None else {"cp": self.cp_degree, "cp_impl": self.cp.impl}
        return {"format": "dcp", "strategy": self.strategy.name, "pp": self.pp, "pp_impl": self.impl, **cp}

    def parameter_names(self) -> list[str]:
        """The one-process model's parameter names (every stage's), in its ``named_parameters()`` order: a
        ``torch`` checkpoint of another run numbers its optimizer state so."""
        return self._names

    def _gather(self, own: Any) -> list[Any] | None:
        """``own`` of every pipeline rank, on the group's first (None elsewhere); every pipeline line of the mesh
        gathers on its own, rank 0's holds the stages of (dp 0, tp 0)."""
        first = dist.get_rank(self.group) == 0
        out: list[Any] = [None] * self.pp if first else None
        dist.gather_object(own, out, group=self.group, group_dst=0)
        return out

    def _split(self) -> tuple[str, Any, Any]:
        """(impl, plan, TP target) for the TP checkpoint functions (:mod:`torch_handle.parallel.tensor.checkpoint`):
        this rank's TP split, or none (an empty plan: whole tensors, FSDP's DTensors gathered)."""
        if self.tp is None:
            return "scratch", {}, UNSPLIT_TP
        return self.tp.impl, self.tp.plan, self.tp._target()

    def full_state_dict(self, model: nn.Module | None = None) -> dict[str, torch.Tensor] | None:
        """The one-process state dict, joined from every stage (each gathered over its TP and FSDP shards) on rank
        0 (None elsewhere); a collective."""
        weights = full_model_state(self.shard, *self._split())
        if self.ep is not None:
            self.ep.gather_state(self.shard, weights, None)
        parts = self._gather(weights)  # every pipeline line's first rank gathers its line: keep rank 0's
        if not self.ctx.is_main:
            return None
        return {k: v for part in parts if part for k, v in part.items()}

    def save(self, ckpt_dir: Path) -> None:
        """Join every stage's weights and optimizer state (by parameter name; gathered over TP and FSDP shards) on
        rank 0 and write the portable form with the LR schedule; every rank calls it."""
        weights = self.full_state_dict()
        state = full_optimizer_state(self.shard, self.strategy.optimizer, *self._split())
        if self.ep is not None:
            self.ep.gather_state(self.shard, None, state)
        own = None if state is None else {k: v for k, v in state.items() if k not in self.tied}
        parts = self._gather(own)
        if self.ctx.is_main:
            state_by_name = {k: v for part in parts if part for k, v in part.items()}
            write_portable(Path(ckpt_dir), weights, state_by_name, self.strategy.scheduler.state_dict())

    def load_portable(self, portable: Path) -> None:
        """Every rank reads the portable form and keeps its stages' tensors, cut to its TP and FSDP shards (no
        communication); then the LR schedule.

        Raises:
            CheckpointError: a name this rank's stages have and the checkpoint lacks."""
        weights, state, scheduler = read_portable(Path(portable))
        own = self.shard.state_dict().keys()
        missing = sorted(own - weights.keys())
        if missing:
            raise CheckpointError(f"{portable}: model state has no {missing[0]} ({len(missing)} name(s) missing)")
        by_name = {}
        for name, p in self.shard.named_parameters():
            if not p.requires_grad:  # LoRA's frozen base: no optimizer state
                continue
            entry = state.get(self.tied.get(name, name))
            if entry is None:
                raise CheckpointError(f"{portable}: optimizer state has no {self.tied.get(name, name)}")
            by_name[name] = entry
        weights = {k: weights[k] for k in own}
        if self.ep is not None:
            self.ep.cut_state(self.shard, weights, by_name)
        load_full_state(self.shard, self.strategy.optimizer, weights, by_name, *self._split())
        load_schedule(self.strategy.optimizer, self.strategy.scheduler, scheduler)

    def micro_batch(self) -> contextlib.AbstractContextManager:
        """Context of the step's schedule (and of evaluation): ``loss_parallel()`` under native TP."""
        return contextlib.nullcontext() if self.tp is None else self.tp.micro_batch()
