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

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from torch_handle.checkpoint import hf_dir, shared_dirs, store as ckpt
from torch_handle.common.fsio import replacing
from torch_handle.common.testhooks import DELAY_ENV, HANG_ENV, parse_test_delay, parse_test_hang
from torch_handle.config.loader import Preset
from torch_handle.finetune.build import nf4_digest, prepare_model
from torch_handle.finetune.nf4 import nf4_storage
from torch_handle.launch import data_identity
from torch_handle.data.cache import cache_root
from torch_handle.data.chat.template import copy_chat_files
from torch_handle.data.datasets import DataBundle, DataContext, GlobalBatchSampler, ResumableDistributedSampler
from torch_handle.parallel.tensor.random import get_rng_tracker
from torch_handle.registry import PluginRegistry
from torch_handle.rundir import STOP_FILE, update_run_info
from torch_handle.train.strategy import DistContext, Strategy
from torch_handle.observe.fields import Kind, Level, Status
from torch_handle.observe.data_mix import step_source_tokens
from torch_handle.observe.heartbeat import beat, busy
from torch_handle.observe.telemetry import EVENTS_FILE, EventWriter, NullEventWriter
from torch_handle.train.loop import GradientAccumulation, MicroBatchLoop, plain
from torch_handle.config.loss_impl import chunked_loss_problem
from torch_handle.train.loss import AuxLossScale, global_mean_weight, pick_loss_impl
from torch_handle.train.objectives import objective_for
from torch_handle.train.phases import PhaseTimer
from torch_handle.train.compiled import compile_for_training
from torch_handle.train.shares.compose import build_shares
from torch_handle.train.eval_tasks import InLoopTasks
from torch_handle.train.resume import resume
from torch_handle.train.shares.contract import Checkpointer, ParallelShare
from torch_handle.train.routing import RoutingTelemetry
from torch_handle.train.step_report import StepReport, window_tokens

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
        self.share: ParallelShare | None = None
        """The run's parallel share (tp, pp or ep > 1; :func:`~torch_handle.train.shares.compose.build_shares`):
        build, step, checkpoints and export go through it; None: the strategy holds the whole model."""
        self.pipeline: Any = None  # the PipelineParallel share when parallel.pp > 1: also the loop and the evaluation
        self.loop: MicroBatchLoop = GradientAccumulation()
        self.step_indices: Any = None
        """The dataset indices of the latest step's global batch (all ranks'), as the sampler handed them out."""
        self.loss_weight: float | None = None
        """This step's :func:`~torch_handle.train.loss.global_mean_weight` (the loop's backward applies it)."""
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.timer = PhaseTimer(ctx.device)
        """Step breakdown (``timer.enabled = False`` turns it off; benchmarks/breakdown_overhead.py compares)."""
        self.test_delay_s = parse_test_delay(os.environ.get(DELAY_ENV, ""), ctx.rank)
        self.test_hang = parse_test_hang(os.environ.get(HANG_ENV, ""), ctx.rank)
        self.peak_flops: float | None = None
        """This rank's device peak FLOP/s for the run's precision (measured, cached; rank 0 only), for ``mfu``."""
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
        shares = build_shares(p, self.ctx)  # the layout's mesh, and its TP, pipeline and EP shares side by side
        self.ctx, self.share, self.pipeline = shares.ctx, shares.run, shares.pp
        ctx = self.ctx
        ckpt.seed_everything(p.run.seed)
        data_plugin = self.registry.get("dataset", p.data.name)
        cache_dir = cache_root(p.run.output_dir)  # the launcher prepared text and pydoc here (data.cache)
        # one filesystem for all nodes, or one each? (for the run directory and the tokenizer cache separately)
        self.dir_leaders, cache_leaders = shared_dirs.directory_leaders([self.run_dir, cache_dir], ctx.rank,
                                                                      ctx.local_rank, self.gather)
        beat("data", busy=ctx.local_rank == 0)  # parallel's tokenizer may be trained here while the others wait
        t0 = time.perf_counter()
        self.data: DataBundle = data_plugin.factory(
            p.data.options, DataContext(cache_dir=cache_dir, is_main=cache_leaders[ctx.rank] == ctx.rank,
                                             barrier=ctx.barrier, objective=p.finetune.objective))
        beat("build")
        if self.is_dir_main and self.data.tokenizer_path is not None:
            shutil.copyfile(self.data.tokenizer_path, self.run_dir / "tokenizer.json")
            copy_chat_files(self.data.tokenizer_path.parent, self.run_dir)  # conversations: for handle chat
        log.info("data %s: %d train / %d validation samples, vocabulary %d, max_len %d (data set-up %.2f s)",
                 self.data.description or p.data.name, len(self.data.train), len(self.data.valid),
                 self.data.vocab_size, self.data.max_len, time.perf_counter() - t0)

        # Same seed on every rank: identical initial weights (DDP would broadcast them anyway; ZeRO-3 must not
        # rely on that).
        torch.manual_seed(p.run.seed)
        model_plugin = self.registry.get("model", p.model.name)
        model = model_plugin.factory(p.model.options, self.data.vocab_size, self.data.pad_id, self.data.max_len)
        prepare_model(model, p, new_run=not ckpt.list_checkpoints(self.run_dir / "checkpoints"),  # init_from, LoRA
                      load_base=hf_dir.load_into, note=lambda line: self.note(Level.INFO, line))
        flops = getattr(model, "flops_per_token", None)  # optional part of the model contract
        stored = sum(t.numel() for t in nf4_storage(model))  # QLoRA's NF4 bytes: weights, but not parameters
        self.model_info = {"params": sum(t.numel() for t in model.parameters()) - stored,
                           "flops_per_token": float(flops(self.data.max_len)) if flops is not None else None}
        self.routing = RoutingTelemetry(model, ctx.tp_rank, ctx.dp_size)  # every MoE layer, before a pipeline split
        self.loss_impl = pick_loss_impl(self.training.loss_impl, self.training.micro_batch_size * self.data.max_len,
                                        self.data.vocab_size, chunked_loss_problem(p))
        log.info("training.loss_impl: %s (%s)", self.loss_impl, self.training.loss_impl)
        model.to(ctx.device)
        self.aux_loss_scale = AuxLossScale(model)  # what the MoE layers' attached losses get in backward
        self.objective, self.eval_fields, self.tasks = objective_for(p), {}, InLoopTasks(p.eval)  # lm/sft/dpo; [eval]
        if self.share is not None:
            model = self.share.parallelize(model)  # TP split, the pipeline's stages, the experts split over "ep"
        if self.training.compile:
            log.info("training.compile: %s", compile_for_training(model, p, self.share))
        # From here on each replica and pipeline stage draws its own dropout masks; a replica's TP ranks the same
        # ones, but in the TP regions each its own (torch_handle.parallel.tensor.random)
        ckpt.seed_everything(p.run.seed + 1000 * ctx.dp_rank + 100_003 * ctx.pp_rank, ctx.tp_rank, p.parallel.tp)

        strategy_plugin = self.registry.get("strategy", p.strategy.name)
        self.strategy: Strategy = strategy_plugin.factory(p.strategy.options, self.training, ctx, model)
        self.checkpointer: Checkpointer = self.strategy if self.share is None else self.share.bind(self.strategy)
        self.loop = self.pipeline or self.strategy.micro_batch_loop() or GradientAccumulation()
        self.nf4_start = nf4_digest(self.strategy.unwrapped(), self.strategy.local_shard)  # QLoRA's base as built

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
        self.report = StepReport(ctx, self.strategy, [self.share] if self.share else [], self.events, self.run_dir,
                                 self.model_info["flops_per_token"], self.peak_flops,
                                 window_tokens(self.data.train, global_batch))

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
        """Continue from the newest checkpoint every run directory holds, if any (:func:`~.resume.resume`)."""
        position = resume(self)
        if position is not None:
            self.step = position.step
            self.train_sampler.load_state_dict({"epoch": position.epoch, "samples_in_epoch": position.samples_in_epoch})

    def checkpoint_layout(self) -> dict[str, Any]:
        """This run's ``layout.json`` (see :data:`torch_handle.checkpoint.store.LAYOUT`)."""
        t = self.training
        return {**self.checkpointer.checkpoint_layout(), "world_size": self.ctx.world_size,
                "micro_batch_size": t.micro_batch_size, "grad_accum": t.grad_accum,
                "global_batch": self.train_sampler.global_batch, "precision": t.precision,
                **data_identity.record(self.data.identity, self.data.tokenizer_path)}  # a resume on other data

    def note(self, level: str, message: str) -> None:
        """A rank-0 log event (and a line in this rank's log)."""
        (log.warning if level == Level.WARNING else log.info)(message)
        self.events.emit(Kind.LOG, level=level, message=message)

    # -- loop ----------------------------------------------------------------------------------------------------
    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches forever, epoch after epoch, from the sampler's position (which it keeps)."""
        accum = self.training.grad_accum
        while True:
            for i, batch in enumerate(self.train_loader):  # to the end of the sampler's epoch
                if i % accum == accum - 1:  # the step's last micro-batch: its global batch is consumed
                    self.step_indices = self.train_sampler.advance()
                yield {k: v.to(self.ctx.device, non_blocking=True) for k, v in batch.items()}

    def forward_loss(self, batch: dict[str, torch.Tensor], *, train: bool = True) -> tuple[torch.Tensor, Any]:
        """(mean loss, tokens or pairs it is the mean over) of one micro-batch: the objective's (objectives/)."""
        return self.objective.forward_loss(self, batch, train=train)

    def micro_batch(self):
        """Context of one micro-batch's forward, loss and backward (``loss_parallel()`` for native TP)."""
        return contextlib.nullcontext() if self.share is None else self.share.micro_batch()

    def train_step(self, batches: Iterator[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """One optimizer step over ``grad_accum`` micro-batches; returns its ``step`` event (plus ``stop``).

        The phases are timed as laps (:class:`~torch_handle.train.phases.PhaseTimer`: ``perf_counter`` on CPU, CUDA
        events read once after the step's synchronize on GPU) and each is a ``handle/<phase>`` profiler range.
        """
        t0 = time.perf_counter()
        t, timer = self.training, self.timer
        timer.begin()
        if self.share is not None:
            self.share.begin_step()
        self.loss_weight = global_mean_weight(self.data.train, self.train_sampler.peek(), t.grad_accum,
                                              self.ctx.dp_cp_size)
        # [loss * tokens, tokens, stop] stays on the device until the one sync below (nccl needs it there too)
        stats = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        self.loop.run(self, batches, stats)  # the micro-batches
        log_memory = (self.step + 1) % t.log_every == 0 or self.step == 0
        with timer.phase("sync"):
            # One small all-reduce carries the global loss, token count, the stop request (rank 0 reads the STOP
            # file) and an MoE model's routing counts, so every rank agrees on them without another collective.
            stats[2] = float(self.is_dir_main and (self.run_dir / STOP_FILE).exists())  # any node's launcher
            stats = self.objective.attach(self.routing.attach(stats, self.strategy.unwrapped()))
            if self.ctx.distributed:
                if self.test_hang and self.test_hang[0] == self.step + 1:
                    time.sleep(self.test_hang[1])  # HANDLE_TEST_HANG_RANK: this rank hangs, its peers wait below
                dist.all_reduce(stats)
            stats = stats.cpu()
            grad_bytes = self.strategy.grad_bytes() if log_memory else 0
        fields, stats = self.objective.fields(stats)  # a preference loss's rewards and log-probs
        record: dict[str, Any] = {"step": self.step + 1, "loss": float(stats[0] / stats[1]), "tokens": int(stats[1]),
                                  **fields}
        if self.ctx.is_main:  # a mixture's tokens by source, from the step's samples (observe.data_mix)
            record.update(step_source_tokens(self.data.train, self.step_indices))
        with timer.phase("optimizer"):
            grad_norm = self._optimizer_step(record)
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize()  # honest step time: wait for the kernels we launched (and the phase events)
        self.step += 1
        self.report.record(record, grad_norm=grad_norm, seconds=time.perf_counter() - t0, log_memory=log_memory,
                           grad_bytes=grad_bytes, timer=timer, activation_saved_bytes=self.loop.activation_saved_bytes,
                           routing=self.routing.fields(stats))
        record["stop"] = bool(stats[2] > 0)
        return record

    def _optimizer_step(self, record: dict[str, Any]) -> float:
        """The optimizer step after the sync, or a skipped one (``record["skipped"]``) for a non-finite loss under
        ``on_nan = "skip"``. Returns the gradient norm before clipping (NaN when skipped).

        Raises:
            NonFiniteLoss: a non-finite loss under ``on_nan = "stop"``."""
        t, loss = self.training, record["loss"]
        if not math.isfinite(loss):
            if t.on_nan == "stop":
                raise NonFiniteLoss(f"non-finite loss ({loss}) at step {self.step + 1}")
            self.strategy.skip_step()
            record["skipped"] = True
            return float("nan")
        if self.share is not None:  # the norm over every part, clipped
            grad_norm = self.share.before_step(t.grad_clip or float("inf"))
            self.strategy.step()
            return grad_norm
        return self.strategy.step()

    @torch.no_grad()
    def evaluate(self) -> float:
        self.strategy.train(False)
        total = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        for i, batch in enumerate(self.valid_loader):
            beat("eval", self.step)
            if i >= self.training.eval_steps:
                break
            batch = {k: v.to(self.ctx.device, non_blocking=True) for k, v in batch.items()}
            if self.pipeline is not None:
                loss_sum, n = self.pipeline.evaluate(batch, self)  # on the last stage; zeros elsewhere
                total += torch.stack([loss_sum, n]).to(total)
                continue
            with self.micro_batch():
                loss, n = self.forward_loss(batch, train=False)
            once = float(self.ctx.tp_rank == 0)
            total[0] += plain(loss).double() * n * once
            total[1] += n * once
        total = self.objective.attach(total)
        if self.ctx.distributed:
            dist.all_reduce(total)
        self.eval_fields, total = self.objective.fields(total.cpu())
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
            self.checkpointer.save(tmp)
            if self.ctx.is_main:
                ckpt.save_layout(tmp, self.checkpoint_layout())
            position = self.train_sampler.state_dict()
            steps_done = position["samples_in_epoch"] // self.train_sampler.global_batch
            ckpt.save_trainer_state(tmp, self.ctx.rank, ckpt.TrainerState(
                self.step, position["epoch"], steps_done * self.training.grad_accum, position["samples_in_epoch"]))
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
        state = self.strategy.full_state_dict() if self.share is None else self.share.full_state_dict(model)
        if state is None:
            return
        if not self.ctx.is_main:  # two writers race for one file (an empty dict once won: issue 38)
            raise RuntimeError(f"rank {self.ctx.rank}: the run's share returned final weights off rank 0")
        from safetensors.torch import save_file

        # tied weights share storage, which safetensors refuses: store each tensor on its own
        tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
        with replacing(self.run_dir / "model.safetensors") as tmp:
            save_file(tensors, str(tmp), metadata={"step": str(self.step), "preset": "preset.toml"})

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
            self.events.emit(Kind.EVAL, step=0, val_loss=self.evaluate(), **self.eval_fields)
        with self.profiler:
            while self.step < t.steps:
                record = self.train_step(batches)
                stop = record["stop"]
                self.report.emit(record)
                self.profiler.step()
                last = self.step == t.steps
                if last or (t.eval_every and self.step % t.eval_every == 0):
                    val = self.evaluate()
                    self.events.emit(Kind.EVAL, step=self.step, val_loss=val, **self.eval_fields)
                self.tasks.maybe_run(self, last)  # [eval]'s downstream tasks (train.eval_tasks)
                if last or stop or (t.checkpoint_every and self.step % t.checkpoint_every == 0):
                    self.save_checkpoint()
                if stop and not last:
                    status = Status.STOPPED
                    break
        self.check_nf4()
        if status == Status.FINISHED:
            self.export()
        return status

    def check_nf4(self) -> None:
        """QLoRA: every rank's NF4 bytes hashed again and gathered, run.json's ``nf4_sha256`` = {"start": [per
        rank], "end": [per rank]} and ``nf4_bytes`` = [per rank: the NF4 bytes it stores]; a rank whose base changed
        is logged as an error (a frozen base must not move). Collective (every rank calls it); nothing without NF4
        linears."""
        if self.nf4_start is None:
            return
        end = nf4_digest(self.strategy.unwrapped(), self.strategy.local_shard)
        pairs = self.gather((self.nf4_start, end))
        if self.is_dir_main:
            update_run_info(self.run_dir, nf4_bytes=[b[1] for _, b in pairs],
                            nf4_sha256={"start": [a[0] for a, _ in pairs], "end": [b[0] for _, b in pairs]})
        if end != self.nf4_start:
            log.error("the NF4 base changed in training on rank %d (sha256 %s at the start, %s now)",
                      self.ctx.rank, self.nf4_start[0][:12], end[0][:12])

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
