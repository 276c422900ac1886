"""What a rank reports of one optimizer step: the ``step`` event's record (loss, tokens, lr, the norm, the phase
breakdown, the strategy's and the parallel share's figures, TFLOP/s and MFU), every rank's memory and timing
gathered on the steps that log memory, the slow-rank warning, and the event itself (rank 0 writes it).

The trainer computes the step (micro-batches, one all-reduce, the optimizer step) and hands its outcome to
:meth:`StepReport.record`; everything collective in here (the share's ``step_stats``, the memory gather) runs on
every rank in the same order.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from torch_handle.observe.comm import comm_fields
from torch_handle.observe.fields import (ACTIVATION_SAVED_BYTES, BACKWARD_S, COMM_S, CUDA_ALLOCATED_BYTES,
                                         CUDA_MAX_ALLOCATED_BYTES, CUDA_RESERVED_BYTES, DATA_S, GRAD_BYTES,
                                         OPTIMIZER_BYTES, RSS_BYTES, STEP_PHASES, TRAINED_SHARE,
                                         TRAINED_TOKENS, TRAINED_TOKENS_PER_S, WAIT_S, Kind, Level)
from torch_handle.observe.state import SLOW_RANK_LOGS, SLOW_RANK_RATIO, slowest_rank
from torch_handle.rundir import HEARTBEAT_S, touch_heartbeat

log = logging.getLogger("torch_handle")


def window_tokens(dataset: Any, global_batch: int) -> int | None:
    """Positions (tokens) a step of ``global_batch`` samples of ``dataset`` computes, for a dataset whose labels
    are a part of its positions and that says how many positions a sample has (``sample_positions``: packed
    conversations, :class:`~torch_handle.data.chat.packing.PackedConversations`); None for any other (every
    position a label, so ``tokens`` already counts them)."""
    positions = getattr(dataset, "sample_positions", None)
    return None if positions is None else global_batch * int(positions)


class StepReport:
    """One rank's reporting of its steps.

    Args:
        ctx: this rank's ``DistContext``.
        strategy: the run's strategy (its ``step_stats``, ``lr`` and memory figures).
        shares: the run's parallel shares (TP, then the pipeline's), whose ``step_stats`` join the record.
        events: the run's event writer (rank 0's; a null writer elsewhere).
        run_dir: the run directory (rank 0 touches its heartbeat).
        flops_per_token: the model's FLOPs per token (None: no ``tflops``/``mfu``).
        peak_flops: this rank's device peak FLOP/s behind ``mfu`` (rank 0; None: no ``mfu``).
        window_tokens: the positions a step computes when only some of them are labels (:func:`window_tokens`:
            packed conversations), else None (every position a label).
    """

    def __init__(self, ctx: Any, strategy: Any, shares: list[Any], events: Any, run_dir: Path,
                 flops_per_token: float | None, peak_flops: float | None, window_tokens: int | None = None) -> None:
        self.ctx, self.strategy, self.shares, self.events, self.run_dir = ctx, strategy, shares, events, Path(run_dir)
        self.flops_per_token, self.peak_flops, self.window_tokens = flops_per_token, peak_flops, window_tokens
        self._slow_streak: tuple[int | None, int] = (None, 0)
        self._pending_logs: list[dict[str, Any]] = []
        self._last_beat = 0.0

    def record(self, record: dict[str, Any], *, grad_norm: float, seconds: float, log_memory: bool, grad_bytes: int,
               timer: Any, activation_saved_bytes: int | None, routing: dict[str, Any]) -> dict[str, Any]:
        """Complete the step's ``record`` (``step``, ``loss``, ``tokens`` and maybe ``skipped`` already set) after
        the optimizer step: lr, ``grad_norm``, ``step_time_s`` (``seconds``), tokens/s (with ``window_tokens``:
        ``tokens`` becomes the positions computed, and ``trained_tokens`` (the labels counted),
        ``trained_share`` (0..1 of ``tokens``) and ``trained_tokens_per_s`` join), the strategy's and the
        share's figures, ``routing`` (an MoE's), the phase breakdown from ``timer``, TFLOP/s and MFU, and on
        ``log_memory`` steps every rank's memory (``grad_bytes``: gradient bytes before the step;
        ``activation_saved_bytes``: the loop's measurement) and timing. Collective: every rank calls it."""
        dt = seconds
        if self.window_tokens:  # SFT: the trainer counted the labels, the trained part of the windows computed
            trained = record["tokens"]
            record.update({"tokens": self.window_tokens, TRAINED_TOKENS: trained, TRAINED_TOKENS_PER_S: trained / dt,
                           TRAINED_SHARE: trained / self.window_tokens})
        record.update(lr=self.strategy.lr, grad_norm=grad_norm, step_time_s=dt, tokens_per_s=record["tokens"] / dt)
        stats_of_strategy = self.strategy.step_stats()  # e.g. comm_s, allreduce_calls, allreduce_bytes (scratch-ddp)
        record.update(stats_of_strategy)
        for share in self.shares:
            record.update(share.step_stats(timeline=log_memory))  # the layout; TP traffic; the pipeline bubble
        record.update(comm_fields(record), **routing)  # observe.comm; an MoE's train.routing
        parts = timer.read()
        if parts:
            # the strategy's gradient-communication wait happened inside its backward: count it once, as comm_s
            comm = float(stats_of_strategy.get(COMM_S) or 0.0)
            record.update({STEP_PHASES[phase]: seconds for phase, seconds in parts.items()})
            record[BACKWARD_S] = max(0.0, parts["backward"] - comm)
        flops = self.flops_per_token
        if flops:
            record["tflops"] = flops * record["tokens_per_s"] / 1e12
            if self.peak_flops:
                record["mfu"] = flops * record["tokens_per_s"] / (self.peak_flops * self.ctx.world_size)
        if log_memory:
            own = {"rank": self.ctx.rank, "step_time_s": dt}
            if parts:
                own.update({DATA_S: parts["data"], WAIT_S: parts["sync"] + float(stats_of_strategy.get(COMM_S) or 0)})
            memory, ranks = self.gather_memory(grad_bytes, activation_saved_bytes, own)
            record["memory"] = memory
            if ranks is not None and len(ranks) > 1:
                record["ranks"] = ranks
                self.check_slow_ranks(ranks)
        return record

    def gather_memory(self, grad_bytes: int, activation_saved_bytes: int | None = None,
                      timing: dict[str, Any] | None = None
                      ) -> tuple[list[dict[str, int]] | None, list[dict[str, Any]] | None]:
        """Every rank's memory figures (bytes) and its own step timing (``rank``, ``step_time_s``, ``data_s``,
        ``wait_s``, seconds), in one ``all_gather_object``; ``(memory, ranks)`` on rank 0, ``(None, None)``
        elsewhere."""
        strategy = self.strategy
        mem = {"rank": self.ctx.rank, **strategy.param_bytes_split(), GRAD_BYTES: grad_bytes,
               OPTIMIZER_BYTES: strategy.optimizer_bytes(), RSS_BYTES: psutil.Process().memory_info().rss}
        if self.ctx.device.type == "cuda":
            mem.update({CUDA_ALLOCATED_BYTES: torch.cuda.memory_allocated(),
                        CUDA_MAX_ALLOCATED_BYTES: torch.cuda.max_memory_allocated(),
                        CUDA_RESERVED_BYTES: torch.cuda.memory_reserved()})
        if activation_saved_bytes is not None:
            mem[ACTIVATION_SAVED_BYTES] = activation_saved_bytes
        timing = timing if timing is not None else {"rank": self.ctx.rank}
        if not self.ctx.distributed:
            return [mem], [timing]
        gathered: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, (mem, timing))
        if not self.ctx.is_main:
            return None, None
        return [m for m, _ in gathered], [r for _, r in gathered]

    def check_slow_ranks(self, ranks: list[dict[str, Any]]) -> None:
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
            # emitted after this step's event (by emit), so the warning follows the 5th log it is about
            self._pending_logs.append({"level": Level.WARNING, "message": message, "rank": slow["rank"],
                                       "lag_s": slow["lag_s"]})

    def emit(self, record: dict[str, Any]) -> None:
        """Write the step event (without its ``stop``), touch rank 0's heartbeat at most every
        :data:`~torch_handle.rundir.HEARTBEAT_S` seconds, then any slow-rank warning of this step."""
        record.pop("stop", None)
        self.events.emit(Kind.STEP, **record)
        if self.ctx.is_main and time.monotonic() - self._last_beat >= HEARTBEAT_S:
            touch_heartbeat(self.run_dir)  # rank 0's sign of life, next to the launcher's
            self._last_beat = time.monotonic()
        for fields in self._pending_logs:
            self.events.emit(Kind.LOG, **fields)
        self._pending_logs.clear()
