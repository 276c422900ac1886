"""The training loop that runs on every rank (started by ``torch_handle.train.worker`` under torchrun).

``Trainer`` builds data, model and strategy from the preset, resumes from the newest valid checkpoint, and runs
``train_step`` until ``training.steps``; rank 0 alone writes telemetry, run.json and the manifest. Each
component gets only its own preset section.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from torch_handle.checkpoint import hf_dir, shared_dirs, store as ckpt
from torch_handle.common.fsio import replacing
from torch_handle.common.testhooks import DELAY_ENV, HANG_ENV, parse_test_delay, parse_test_hang
from torch_handle.config.loader import Preset
from torch_handle.finetune.build import prepare_model
from torch_handle.data.datasets import DataBundle, DataContext, GlobalBatchSampler, ResumableDistributedSampler
from torch_handle.model.parallelize import checkpointed_blocks, model_blocks
from torch_handle.parallel.tensor.random import get_rng_tracker
from torch_handle.registry import PluginRegistry
from torch_handle.rundir import HEARTBEAT_S, STOP_FILE, touch_heartbeat, update_run_info
from torch_handle.train.strategy import DistContext, Strategy
from torch_handle.observe.fields import (ACTIVATION_SAVED_BYTES, BACKWARD_S, COMM_S, CUDA_ALLOCATED_BYTES,
                                         CUDA_MAX_ALLOCATED_BYTES, CUDA_RESERVED_BYTES, DATA_S, GRAD_BYTES,
                                         OPTIMIZER_BYTES, RSS_BYTES, STEP_PHASES, WAIT_S, Kind, Level,
                                         Status)
from torch_handle.observe.comm import comm_fields
from torch_handle.observe.heartbeat import beat, busy
from torch_handle.observe.state import SLOW_RANK_LOGS, SLOW_RANK_RATIO, slowest_rank
from torch_handle.observe.telemetry import EVENTS_FILE, EventWriter, NullEventWriter
from torch_handle.train.loop import GradientAccumulation, MicroBatchLoop, plain
from torch_handle.train.loss import loss_fn
from torch_handle.train.phases import PhaseTimer
from torch_handle.train.routing import RoutingTelemetry

log = logging.getLogger("torch_handle")


class NonFiniteLoss(Exception):
    """The loss was NaN/inf and ``on_nan = "stop"``."""


class Trainer:
    """Owns one rank's run: build, resume, loop, evaluate, checkpoint, export, close."""

    def __init__(self, preset: Preset, run_dir: Path, ctx: DistContext, registry: PluginRegistry):
        self.preset, self.run_dir, self.ctx, self.registry = preset, Path(run_dir), ctx, registry
        self.training = preset.training
        self.events = EventWriter(self.run_dir / EVENTS_FILE) if ctx.is_main else NullEventWriter()
        self.step = 0
        self.tp: Any = None  # the TensorParallel share of this process when parallel.tp > 1 (see build)
        self.pp: Any = None  # the PipelineParallel share when parallel.pp > 1: also the step's micro-batch loop
        self.loop: MicroBatchLoop = GradientAccumulation()
        self.epoch = 0
        self.samples_in_epoch = 0
        """The data position: samples of this epoch's global order consumed by all ranks (GlobalBatchSampler)."""
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.activation_saved_bytes: int | None = None
        """Bytes autograd saved for this rank's first micro-batch (measured once per process)."""
        self.timer = PhaseTimer(ctx.device)
        """Step breakdown (``timer.enabled = False`` turns it off; benchmarks/breakdown_overhead.py compares)."""
        self.test_delay_s = parse_test_delay(os.environ.get(DELAY_ENV, ""), ctx.rank)
        self.test_hang = parse_test_hang(os.environ.get(HANG_ENV, ""), ctx.rank)
        self.peak_flops: float | None = None
        """This rank's device peak FLOP/s for the run's precision (measured, cached; rank 0 only), for ``mfu``."""
        self._slow_streak: tuple[int | None, int] = (None, 0)
        self._pending_logs: list[dict[str, Any]] = []
        self.gather = shared_dirs.gatherer(ctx)
        self.dir_leaders: list[int] = [0] * ctx.world_size
        """For every rank, the lowest rank that sees its run directory (all 0 on one node or a shared filesystem;
        found by :func:`torch_handle.launch.shared_dirs.directory_leaders` in ``build``)."""

    @property
    def is_dir_main(self) -> bool:
        """This rank writes what one rank per run directory writes: checkpoint directories, run.json, tokenizer.json,
        and reads the STOP file (rank 0, plus the first rank of every node with a run directory of its own)."""
        return self.dir_leaders[self.ctx.rank] == self.ctx.rank

    # -- build ---------------------------------------------------------------------------------------------------
    def build(self) -> None:
        p = self.preset
        if max(p.parallel.tp, p.parallel.pp, p.parallel.ep) > 1:
            from torch_handle.train.tensor_parallel import TensorParallel, attach_layout

            self.ctx = attach_layout(self.ctx, p.parallel)
        if p.parallel.tp > 1:
            self.tp = TensorParallel(p.parallel, self.ctx)
        if p.parallel.pp > 1:
            from torch_handle.config.layout import pipeline_microbatches
            from torch_handle.train.pipeline_parallel import PipelineParallel

            self.pp = PipelineParallel(p.parallel, self.ctx, pipeline_microbatches(p), self.training.label_smoothing,
                                       self.tp)
        ctx = self.ctx
        ckpt.seed_everything(p.run.seed)
        data_plugin = self.registry.get("dataset", p.data.name)
        cache_dir = Path(p.run.output_dir) / ".cache"
        # one filesystem for all nodes, or one each? (for the run directory and the tokenizer cache separately)
        self.dir_leaders, cache_leaders = shared_dirs.directory_leaders([self.run_dir, cache_dir], ctx.rank,
                                                                      ctx.local_rank, self.gather)
        beat("data", busy=ctx.local_rank == 0)  # the tokenizer may be built here while the other ranks wait
        self.data: DataBundle = data_plugin.factory(
            p.data.options, DataContext(cache_dir=cache_dir, is_main=cache_leaders[ctx.rank] == ctx.rank,
                                             barrier=ctx.barrier))
        beat("build")
        if self.is_dir_main and self.data.tokenizer_path is not None:
            shutil.copyfile(self.data.tokenizer_path, self.run_dir / "tokenizer.json")
        log.info("data %s: %d train / %d validation samples, vocabulary %d, max_len %d",
                 self.data.description or p.data.name, len(self.data.train), len(self.data.valid),
                 self.data.vocab_size, self.data.max_len)

        # Same seed on every rank: identical initial weights (DDP would broadcast them anyway; ZeRO-3 must not
        # rely on that).
        torch.manual_seed(p.run.seed)
        model_plugin = self.registry.get("model", p.model.name)
        model = model_plugin.factory(p.model.options, self.data.vocab_size, self.data.pad_id, self.data.max_len)
        prepare_model(model, p, new_run=not ckpt.list_checkpoints(self.run_dir / "checkpoints"),  # init_from, LoRA
                      load_base=hf_dir.load_into, note=lambda line: self._note(Level.INFO, line))
        flops = getattr(model, "flops_per_token", None)  # optional part of the model contract
        self.model_info = {"params": sum(t.numel() for t in model.parameters()),
                           "flops_per_token": float(flops(self.data.max_len)) if flops is not None else None}
        self.routing = RoutingTelemetry(model, ctx.tp_rank, ctx.dp_size)  # every MoE layer, before a pipeline split
        model.to(ctx.device)
        if self.tp is not None:
            self.tp.parallelize(model)
        if self.pp is not None:
            model = self.pp.split(model)
        if self.training.compile:
            # Per block and in place (nn.Module.compile), as torchtitan does: the blocks stay the modules that
            # blocks() returns, so fsdp's fully_shard per block and activation checkpointing see them unchanged.
            for block in model_blocks(model, default=[model]):
                block.compile()
        # From here on each replica and pipeline stage draws its own dropout masks; a replica's TP ranks the same
        # ones, but in the TP regions each its own (torch_handle.parallel.tensor.random)
        ckpt.seed_everything(p.run.seed + 1000 * ctx.dp_rank + 100_003 * ctx.pp_rank, ctx.tp_rank)

        strategy_plugin = self.registry.get("strategy", p.strategy.name)
        self.strategy: Strategy = strategy_plugin.factory(p.strategy.options, self.training, ctx, model)
        share = self.pp or self.tp or self.strategy.expert_parallel  # a split model saves its state itself
        self.state_io = self.strategy if share is None else share.bind(self.strategy)
        self.loop = self.pp or self.strategy.micro_batch_loop() or GradientAccumulation()

        t = self.training
        # the samples of each step depend on the seed and the step, not on the world size (see GlobalBatchSampler)
        global_batch = t.micro_batch_size * t.grad_accum * ctx.dp_size
        if len(self.data.train) < global_batch:
            raise ValueError(f"training split has {len(self.data.train)} samples: too few for one batch of "
                             f"micro_batch_size={t.micro_batch_size} on each of {ctx.dp_size} ranks "
                             f"(x grad_accum {t.grad_accum}: {global_batch} samples per step)")
        self.train_sampler = GlobalBatchSampler(len(self.data.train), micro_batch_size=t.micro_batch_size,
                                                grad_accum=t.grad_accum, world_size=ctx.dp_size, rank=ctx.dp_rank,
                                                seed=p.run.seed, shuffle=True)
        self.valid_sampler = ResumableDistributedSampler(self.data.valid, num_replicas=ctx.dp_size,
                                                         rank=ctx.dp_rank, shuffle=False, drop_last=True)
        self.train_loader = self._loader(self.data.train, batch_sampler=self.train_sampler)
        self.valid_loader = self._loader(self.data.valid, self.valid_sampler)
        self.profiler = self.registry.get("profiler", p.profiler.name).factory(
            p.profiler.options, self.run_dir / "traces", ctx.rank)

        # telemetry sinks (TensorBoard, ...) on rank 0; one that fails is disabled with a warning, never fatal
        self.events.open_sinks({n: r.factory for n, r in self.registry.sinks.items()}, self.run_dir, p)
        if ctx.is_main and self.model_info["flops_per_token"]:
            self.peak_flops = self._peak()
        ctx.barrier()  # the other ranks wait (idle) while rank 0 measures the peak, which needs the cores

    def _peak(self) -> float | None:
        """The matmul peak behind MFU (:func:`torch_handle.observe.peak.peak_for_mfu`), reported as a log event."""
        from torch_handle.observe.peak import peak_for_mfu

        with busy("peak"):  # seconds of matmuls on this rank alone when not cached: progress, not a hang
            value, message = peak_for_mfu(self.ctx.device, self.training.precision, torch.get_num_threads())
        if value is not None:
            self.events.emit(Kind.LOG, level=Level.INFO, message=message)
        return value

    def _loader(self, dataset: Any, sampler: ResumableDistributedSampler | None = None, *,
                batch_sampler: GlobalBatchSampler | None = None) -> DataLoader:
        # A private generator: creating a DataLoader iterator must not draw from the global torch RNG, or a
        # resumed run would see different dropout masks than an uninterrupted one.
        nw = getattr(self.preset.data.options, "num_workers", 0)
        batching = ({"batch_sampler": batch_sampler} if batch_sampler is not None else
                    {"batch_size": self.training.micro_batch_size, "sampler": sampler, "drop_last": True})
        return DataLoader(dataset, **batching, num_workers=nw, collate_fn=self.data.collate_fn,
                          pin_memory=self.ctx.device.type == "cuda",
                          generator=torch.Generator().manual_seed(self.preset.run.seed),
                          persistent_workers=nw > 0)

    # -- resume --------------------------------------------------------------------------------------------------
    def maybe_resume(self) -> None:
        root = self.run_dir / "checkpoints"
        # the newest checkpoint that verifies in every run directory (one directory: rank 0's newest valid one)
        path, skipped = shared_dirs.agree_on_checkpoint(root, self.ctx.rank, self.dir_leaders, self.gather)
        for message in skipped:
            log.warning(message)
            self.events.emit(Kind.LOG, level=Level.WARNING, message=message)
        if path is None:
            return
        path = Path(path)
        layout = ckpt.read_layout(path)
        how = self._load_checkpoint(path, layout)
        self.strategy.apply_schedule()  # a resume may change training.lr: the checkpoint holds the old peak
        self._load_position(path, layout)
        message = f"resumed from {path.relative_to(self.run_dir)} at step {self.step}{how}"
        log.info(message)
        self.events.emit(Kind.LOG, level=Level.INFO, message=message)

    def checkpoint_layout(self) -> dict[str, Any]:
        """This run's ``layout.json`` (see :data:`torch_handle.checkpoint.store.LAYOUT`)."""
        t = self.training
        return {**self.state_io.checkpoint_layout(), "world_size": self.ctx.world_size,
                "micro_batch_size": t.micro_batch_size, "grad_accum": t.grad_accum,
                "global_batch": self.train_sampler.global_batch, "precision": t.precision}

    def _load_checkpoint(self, path: Path, layout: dict[str, Any]) -> str:
        """Model, optimizer and schedule: the strategy's own loader when it reads this layout, else rank 0 (the
        first rank of each run directory) converts the checkpoint to the portable form (torch_handle.checkpoint.convert) and
        every rank loads that. Returns what the resume message adds (empty for a native load).

        Raises:
            CheckpointError: the conversion failed (one line), or it would need the shards of several nodes'
                run directories.
        """
        if "world_size" not in layout or ("strategy" not in layout and layout.get("format") != "dcp"):
            layout = {**self.strategy.checkpoint_layout(), "world_size": self.ctx.world_size, **layout}  # older
        if self.state_io.loads_natively(layout):
            self.strategy.load(path)
            return ""
        from torch_handle.checkpoint import convert
        from torch_handle.common.units import fmt_bytes

        if len(set(self.dir_leaders)) > 1 and layout.get("format") != "torch":
            # each node's directory holds only its own ranks' shards: no rank sees the whole checkpoint
            raise ckpt.CheckpointError(f"{path}: resuming a checkpoint written by {convert.describe(layout)} under "
                                       f"another strategy or world size needs one run directory shared by all "
                                       f"nodes (its shards are spread over the nodes' directories)")
        outcome: Any = None
        if self.is_dir_main:  # one conversion per run directory, while that directory's other ranks wait
            names = getattr(self.state_io, "parameter_names", self.strategy.parameter_names)()
            try:
                with busy("convert"):
                    outcome = convert.ensure_portable(path, layout, names)
            except Exception as e:  # noqa: BLE001 - every rank must learn of it, not wait at the next collective
                outcome = f"{type(e).__name__}: {e}".splitlines()[0]
        outcomes = self.gather(outcome)
        failed = next((o for o in outcomes if isinstance(o, str)), None)
        if failed is not None:
            raise ckpt.CheckpointError(f"cannot convert {path} (written by {convert.describe(layout)}): {failed}")
        start = time.perf_counter()
        self.state_io.load_portable(convert.portable_dir(path, layout))
        loaded_s = time.perf_counter() - start
        done = outcomes[self.dir_leaders[self.ctx.rank]]
        if done is None:
            converted = ""
        elif done["cached"]:
            converted = "converted to the portable form by an earlier resume, "
        else:
            converted = (f"converted to the portable form in {done['seconds']:.2f} s "
                         f"({fmt_bytes(done['bytes'])}), ")
        how = f" (written by {convert.describe(layout)}; {converted}loaded in {loaded_s:.2f} s)"
        if self.training.precision == "fp16":
            self._note(Level.WARNING, "the fp16 loss scale starts again from its initial value (a converted "
                                      "checkpoint carries no loss scaler)")
        return how

    def _load_position(self, path: Path, layout: dict[str, Any]) -> None:
        """Step, epoch and data position (the same for every rank), and this rank's RNG states when the
        checkpoint has them (else a fresh seed, logged)."""
        own = ckpt.own_rng_state(path, self.ctx.rank, layout, self.preset.parallel.tp)
        state = ckpt.load_trainer_state(path, self.ctx.rank if own else 0, restore_rng=own)
        if not own:
            ckpt.seed_everything(self.preset.run.seed + 1000 * self.ctx.dp_rank + state.step, self.ctx.tp_rank)
        if self.ctx.is_main and (not own or (layout.get("world_size") or self.ctx.world_size) < self.ctx.world_size):
            self._note(Level.INFO, f"ranks with no RNG state of their own in the checkpoint (written on "
                                   f"{layout.get('world_size')} ranks, tp = {layout.get('tp', 1)}) are seeded from "
                                   f"run.seed + 1000 x dp rank + step")
        self.step, self.epoch = state.step, state.epoch
        t, global_batch = self.training, self.train_sampler.global_batch
        if state.samples_in_epoch is not None:
            self.samples_in_epoch = state.samples_in_epoch
        else:  # written before the global order: per-rank micro-batches of the run's (then frozen) settings
            self.samples_in_epoch = state.batch_in_epoch * t.micro_batch_size * self.ctx.world_size
            self._note(Level.WARNING, f"the checkpoint predates the world-size-independent data order: the rest "
                                      f"of epoch {self.epoch} is drawn in the new order from sample "
                                      f"{self.samples_in_epoch}")
        saved = layout.get("global_batch")
        if saved and saved != global_batch:
            self._note(Level.WARNING, f"global batch changed from {saved} to {global_batch} samples per step "
                                      f"(micro_batch_size x grad_accum x world size): the data continues at sample "
                                      f"{self.samples_in_epoch} of epoch {self.epoch}, but the trajectory will "
                                      f"differ from an uninterrupted run's")

    def _note(self, level: str, message: str) -> None:
        """A rank-0 log event (and a line in this rank's log)."""
        (log.warning if level == Level.WARNING else log.info)(message)
        self.events.emit(Kind.LOG, level=level, message=message)

    # -- loop ----------------------------------------------------------------------------------------------------
    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches forever, epoch after epoch, starting at the saved position."""
        accum, global_batch = self.training.grad_accum, self.train_sampler.global_batch
        while True:
            self.train_sampler.set_epoch(self.epoch)
            self.train_sampler.skip(self.samples_in_epoch)
            for i, batch in enumerate(self.train_loader):
                if i % accum == accum - 1:  # the step's last micro-batch: its global batch is consumed
                    self.samples_in_epoch += global_batch
                yield {k: v.to(self.ctx.device, non_blocking=True) for k, v in batch.items()}
            self.epoch += 1
            self.samples_in_epoch = 0

    def forward_loss(self, batch: dict[str, torch.Tensor], *, train: bool = True) -> tuple[torch.Tensor, int]:
        """(loss, tokens) of one micro-batch; training steps use ``training.label_smoothing``, evaluation
        (``train=False``) plain cross-entropy, so validation losses stay comparable across settings."""
        labels = batch.pop("labels")
        with self.strategy.autocast():
            logits = self.strategy.model(**batch)
        eps = self.training.label_smoothing if train else 0.0
        return loss_fn(logits, labels, eps) if self.tp is None else self.tp.loss(logits, labels, eps)

    def micro_batch(self):
        """Context of one micro-batch's forward, loss and backward (``loss_parallel()`` for native TP)."""
        return contextlib.nullcontext() if self.tp is None else self.tp.micro_batch()

    def train_step(self, batches: Iterator[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """One optimizer step over ``grad_accum`` micro-batches; returns its ``step`` event (plus ``stop``).

        The phases are timed as laps (:class:`~torch_handle.train.phases.PhaseTimer`: ``perf_counter`` on CPU, CUDA
        events read once after the step's synchronize on GPU) and each is a ``handle/<phase>`` profiler range.
        """
        t0 = time.perf_counter()
        t, timer = self.training, self.timer
        timer.begin()
        if self.tp is not None:
            self.tp.begin_step()
        # [loss * tokens, tokens, stop] stays on the device until the one sync below (nccl needs it there too)
        stats = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        self.loop.run(self, batches, stats)
        log_memory = (self.step + 1) % t.log_every == 0 or self.step == 0
        with timer.phase("sync"):
            # One small all-reduce carries the global loss, token count, the stop request (rank 0 reads the STOP
            # file) and an MoE model's routing counts, so every rank agrees on them without another collective.
            stats[2] = float(self.is_dir_main and (self.run_dir / STOP_FILE).exists())  # any node's launcher
            stats = self.routing.attach(stats, self.strategy.unwrapped())
            if self.ctx.distributed:
                if self.test_hang and self.test_hang[0] == self.step + 1:
                    time.sleep(self.test_hang[1])  # HANDLE_TEST_HANG_RANK: this rank hangs, its peers wait below
                dist.all_reduce(stats)
            stats = stats.cpu()
            grad_bytes = self.strategy.grad_bytes() if log_memory else 0
        loss_value = float(stats[0] / stats[1])
        record: dict[str, Any] = {"step": self.step + 1, "loss": loss_value, "tokens": int(stats[1])}
        with timer.phase("optimizer"):
            if not math.isfinite(loss_value):
                if t.on_nan == "stop":
                    raise NonFiniteLoss(f"non-finite loss ({loss_value}) at step {self.step + 1}")
                self.strategy.skip_step()
                record["skipped"] = True
                grad_norm = float("nan")
            elif share := self.pp or self.tp or self.strategy.expert_parallel:  # the norm over every part, clipped
                grad_norm = share.before_step(t.grad_clip or float("inf"))
                self.strategy.step()
            else:
                grad_norm = self.strategy.step()
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize()  # honest step time: wait for the kernels we launched (and the phase events)
        self.step += 1
        dt = time.perf_counter() - t0
        record.update(lr=self.strategy.lr, grad_norm=grad_norm, step_time_s=dt, tokens_per_s=record["tokens"] / dt)
        stats_of_strategy = self.strategy.step_stats()  # e.g. comm_s, allreduce_calls, allreduce_bytes (scratch-ddp)
        record.update(stats_of_strategy)
        if self.tp is not None:
            record.update(self.tp.step_stats())  # the layout; the scratch path's TP traffic
        if self.pp is not None:
            record.update(self.pp.step_stats(timeline=log_memory))  # the layout; busy, idle, the bubble
        record.update(comm_fields(record), **self.routing.fields(stats))  # observe.comm; an MoE's train.routing
        parts = timer.read()
        if parts:
            # the strategy's gradient-communication wait happened inside its backward: count it once, as comm_s
            comm = float(stats_of_strategy.get(COMM_S) or 0.0)
            record.update({STEP_PHASES[phase]: seconds for phase, seconds in parts.items()})
            record[BACKWARD_S] = max(0.0, parts["backward"] - comm)
        flops = self.model_info["flops_per_token"]
        if flops:
            record["tflops"] = flops * record["tokens_per_s"] / 1e12
            if self.peak_flops:
                record["mfu"] = flops * record["tokens_per_s"] / (self.peak_flops * self.ctx.world_size)
        if log_memory:
            own = {"rank": self.ctx.rank, "step_time_s": dt}
            if parts:
                own.update({DATA_S: parts["data"], WAIT_S: parts["sync"] + float(stats_of_strategy.get(COMM_S) or 0)})
            memory, ranks = self.gather_memory(grad_bytes, own)
            record["memory"] = memory
            if ranks is not None and len(ranks) > 1:
                record["ranks"] = ranks
                self._check_slow_ranks(ranks)
        record["stop"] = bool(stats[2] > 0)
        return record

    def activation_counter(self):
        """Counts the distinct storages autograd saves during one micro-batch's forward (parameters and buffers
        left out; with activation checkpointing the blocks' inputs instead): ``activation_saved_bytes`` in the
        memory telemetry, as ``handle estimate`` names its prediction."""
        from torch_handle.observe.activations import SavedTensorCounter

        model = self.strategy.unwrapped()
        return SavedTensorCounter([*model.parameters(), *model.buffers()], checkpointed_blocks(model))

    def gather_memory(self, grad_bytes: int, timing: dict[str, Any] | None = None
                      ) -> tuple[list[dict[str, int]] | None, list[dict[str, Any]] | None]:
        """Every rank's memory figures and its own step timing (``rank``, ``step_time_s``, ``data_s``,
        ``wait_s``, seconds), in one ``all_gather_object``; ``(memory, ranks)`` on rank 0, ``(None, None)``
        elsewhere."""
        mem = {"rank": self.ctx.rank, **self.strategy.param_bytes_split(), GRAD_BYTES: grad_bytes,
               OPTIMIZER_BYTES: self.strategy.optimizer_bytes(), RSS_BYTES: psutil.Process().memory_info().rss}
        if self.ctx.device.type == "cuda":
            mem.update({CUDA_ALLOCATED_BYTES: torch.cuda.memory_allocated(),
                        CUDA_MAX_ALLOCATED_BYTES: torch.cuda.max_memory_allocated(),
                        CUDA_RESERVED_BYTES: torch.cuda.memory_reserved()})
        if self.activation_saved_bytes is not None:
            mem[ACTIVATION_SAVED_BYTES] = self.activation_saved_bytes
        timing = timing if timing is not None else {"rank": self.ctx.rank}
        if not self.ctx.distributed:
            return [mem], [timing]
        gathered: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, (mem, timing))
        if not self.ctx.is_main:
            return None, None
        return [m for m, _ in gathered], [r for _, r in gathered]

    def _check_slow_ranks(self, ranks: list[dict[str, Any]]) -> None:
        """Rank 0: a ``log`` warning when the same rank lags the other ranks' median by more than
        :data:`~torch_handle.observe.state.SLOW_RANK_RATIO` of the median step time for
        :data:`~torch_handle.observe.state.SLOW_RANK_LOGS` consecutive gathers (once per such streak)."""
        slow = slowest_rank(ranks)
        if slow is None or slow["ratio"] <= SLOW_RANK_RATIO:
            self._slow_streak = (None, 0)
            return
        rank, count = self._slow_streak
        count = count + 1 if rank == slow["rank"] else 1
        self._slow_streak = (slow["rank"], count)
        if count == SLOW_RANK_LOGS:
            message = (f"rank {slow['rank']} is slow: {slow['lag_s'] * 1000:.0f} ms per step "
                       f"({slow['ratio']:.0%} of the median step time) behind the other ranks for {count} "
                       f"consecutive logs (its data wait {slow['data_s'] * 1000:.0f} ms, the others' median "
                       f"{slow['median_data_s'] * 1000:.0f} ms)")
            log.warning(message)
            # emitted after this step's event (by _emit_step), so the warning follows the 5th log it is about
            self._pending_logs.append({"level": Level.WARNING, "message": message, "rank": slow["rank"],
                                       "lag_s": slow["lag_s"]})

    @torch.no_grad()
    def evaluate(self) -> float:
        self.strategy.train(False)
        total = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        for i, batch in enumerate(self.valid_loader):
            beat("eval", self.step)
            if i >= self.training.eval_steps:
                break
            batch = {k: v.to(self.ctx.device, non_blocking=True) for k, v in batch.items()}
            if self.pp is not None:
                loss_sum, n = self.pp.evaluate(batch)  # on the last stage; zeros elsewhere
                total += torch.stack([loss_sum, n]).to(total)
                continue
            with self.micro_batch():
                loss, n = self.forward_loss(batch, train=False)
            once = float(self.ctx.tp_rank == 0)
            total[0] += plain(loss).double() * n * once
            total[1] += n * once
        if self.ctx.distributed:
            dist.all_reduce(total)
        total = total.cpu()
        self.strategy.train(True)
        return float(total[0] / total[1]) if total[1] > 0 else float("nan")

    def save_checkpoint(self) -> None:
        """Write ``checkpoints/step-<step>`` (every rank takes part). A write that fails (disk full, unwritable)
        removes the partial directory, keeps the previous checkpoint, and raises CheckpointError naming the
        directory and the bytes needed (see :func:`torch_handle.checkpoint.store.write_failure`): the run fails."""
        root = self.run_dir / "checkpoints"
        tmp = ckpt.tmp_dir_for(root, self.step)
        beat("checkpoint", self.step)
        try:
            if self.is_dir_main:  # one temporary directory per run directory
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            self.ctx.barrier()
            self.state_io.save(tmp)
            if self.ctx.is_main:
                ckpt.save_layout(tmp, self.checkpoint_layout())
            steps_done = self.samples_in_epoch // self.train_sampler.global_batch
            ckpt.save_trainer_state(tmp, self.ctx.rank, ckpt.TrainerState(
                self.step, self.epoch, steps_done * self.training.grad_accum, self.samples_in_epoch))
            ckpt.inject_fault(self.step, tmp)  # test hook: HANDLE_TEST_CHECKPOINT_ENOSPC
            self.ctx.barrier()
            # separate run directories: each gets the files that rank 0 alone wrote (a no-op on a shared one)
            shared_dirs.copy_missing_files(tmp, self.ctx.rank, self.dir_leaders, self.gather, self.ctx.device)
            if self.is_dir_main:
                final = ckpt.finalize(root, self.step, keep_last=None)
                self.events.emit(Kind.CHECKPOINT, step=self.step, path=str(final.relative_to(self.run_dir)))
        except Exception as e:
            if not ckpt.is_write_failure(e):
                raise
            raise ckpt.write_failure(root, self.step, e, clean_up=self.is_dir_main) from None
        self.ctx.barrier()
        if self.is_dir_main:  # only now: every directory has the new checkpoint, so a common step always remains
            ckpt.prune(root, self.training.keep_last)

    def export(self) -> None:
        """Final weights as ``model.safetensors`` (rank 0; every rank takes part in gathering them)."""
        beat("export", self.step)
        model = self.strategy.unwrapped()
        share = self.tp or self.pp or self.strategy.expert_parallel
        state = self.strategy.full_state_dict() if share is None else share.full_state_dict(model)
        if state is None:
            return
        from safetensors.torch import save_file

        # tied weights share storage, which safetensors refuses: store each tensor on its own
        tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
        with replacing(self.run_dir / "model.safetensors") as tmp:
            save_file(tensors, str(tmp), metadata={"step": str(self.step), "preset": "preset.toml"})

    def _emit_step(self, record: dict[str, Any]) -> None:
        record.pop("stop", None)
        self.events.emit(Kind.STEP, **record)
        if self.ctx.is_main and time.monotonic() - getattr(self, "_last_beat", 0.0) >= HEARTBEAT_S:
            touch_heartbeat(self.run_dir)  # rank 0's sign of life, next to the launcher's
            self._last_beat = time.monotonic()
        for fields in self._pending_logs:
            self.events.emit(Kind.LOG, **fields)
        self._pending_logs.clear()

    def train(self) -> str:
        """Run to ``training.steps``; returns the final status (``finished`` or ``stopped``)."""
        t = self.training
        # zero_stage None first: a run resumed under a strategy without stages must not keep the old one's;
        # vocab_size and max_len as the data built them (a tokenizer may stop short of data.vocab_size)
        info = {"status": Status.RUNNING, "world_size": self.ctx.world_size, "zero_stage": None,
                **self.strategy.describe(), "model_params": self.model_info["params"], "steps": t.steps,
                "restart": self.restart, "flops_per_token": self.model_info["flops_per_token"],
                "vocab_size": self.data.vocab_size, "max_len": self.data.max_len}
        if self.peak_flops:
            info.update(peak_flops=self.peak_flops, precision=t.precision)
        if self.is_dir_main:  # train_start_time: the launcher's sign that a Ctrl-C is now answered at a step
            fields = dict(info, train_start_time=time.time(), **({"restarts": self.restart} if self.restart else {}))
            update_run_info(self.run_dir, **fields)
        if self.ctx.is_main:
            self.events.emit(Kind.STATUS, **info)
            log.info("strategy %s", json.dumps(self.strategy.describe()))
        batches = self.batches()
        status = Status.FINISHED
        self.strategy.train(True)
        if self.step == 0:
            # the untrained baseline, so the first eval shows where learning started
            self.events.emit(Kind.EVAL, step=0, val_loss=self.evaluate())
        with self.profiler:
            while self.step < t.steps:
                record = self.train_step(batches)
                stop = record["stop"]
                self._emit_step(record)
                self.profiler.step()
                last = self.step == t.steps
                if last or (t.eval_every and self.step % t.eval_every == 0):
                    val = self.evaluate()
                    self.events.emit(Kind.EVAL, step=self.step, val_loss=val)
                if last or stop or (t.checkpoint_every and self.step % t.checkpoint_every == 0):
                    self.save_checkpoint()
                if stop and not last:
                    status = Status.STOPPED
                    break
        if status == Status.FINISHED:
            self.export()
        return status

    def close(self, status: str, message: str = "") -> None:
        strategy = getattr(self, "strategy", None)  # None when build() failed before the strategy existed
        try:
            if strategy is not None:
                strategy.close()  # removes gradient hooks; after a failed collective it may fail too
        except Exception as e:  # noqa: BLE001 - the run's status below matters more
            log.warning("strategy.close() failed: %s: %s", type(e).__name__, e)
        self.events.emit(Kind.STATUS, status=status, step=self.step, **({"message": message} if message else {}))
        if self.is_dir_main:  # rank 0, and a node's first rank when its run directory is not rank 0's
            update_run_info(self.run_dir, status=status, end_time=time.time(), step=self.step, message=message)
        self.events.close()  # closes the sinks too
        get_rng_tracker().reset()  # the process's generators are torch's alone again (a run in this process: tests)
