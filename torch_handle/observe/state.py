"""The one fold of a run's events (plus ``run.json``) into what the run amounts to: :class:`RunState`, used by
``handle run`` (progress line, summary), the dashboard and the run picker; and :func:`slowest_rank`, which the
trainer's slow-rank warning shares. Never raises on a malformed event. Standard library only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from torch_handle.common.run_layout import LAYOUT_KEY, RunLayout
from torch_handle.common.fsio import read_toml
from torch_handle.common.text import clean, finetune_label, strategy_label
from torch_handle.observe.comm import read_comm
from torch_handle.observe.data_mix import SOURCE_TOKENS, add_source_tokens
from torch_handle.observe.fields import (ACTIVATION_BYTES, ACTIVATION_SAVED_BYTES, BREAKDOWN, COMM, DATA_S, MEMORY,
                                         PREFERENCE_METRICS, TASK_SCORES, TRAINED_SHARE, TRAINED_TOKENS_PER_S,
                                         WAIT_S, Kind, Level, Status)
from torch_handle.observe.tail import BadLine, integer, number

FINETUNE_KEY = "finetune"
"""run.json's ``{"method", "rank"}`` of a fine-tuning run (``[finetune]``; absent when it trains every weight)."""

SLOW_RANK_RATIO = 0.2
"""A rank is slow when it lags the other ranks' median by more than this share of the median step time ..."""
SLOW_RANK_LOGS = 5
"""... in this many consecutive ``ranks`` gathers (every ``log_every`` steps): then rank 0 logs a warning."""


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def slowest_rank(ranks: Iterable[Any]) -> dict[str, Any] | None:
    """The rank furthest behind the others, from a step event's ``ranks`` list, or None (fewer than two usable
    entries).

    In synchronous training every rank's ``step_time_s`` is about the same -- the fast ranks wait for the slow
    one in a collective -- so the lag is read from what differs: a rank's own time, ``step_time_s - wait_s``
    (the waits it can observe), and its ``data_s`` (waiting for input involves no peer). A rank's ``lag_s`` is
    the larger of its two excesses over the median of the *other* ranks (with two ranks: over the other rank);
    ``ratio`` = ``lag_s`` / the median ``step_time_s``. Also returns ``rank``, ``data_s``, ``median_data_s``
    (of the other ranks), ``median_step_time_s`` and ``spread_s`` (the largest difference between two ranks in
    either figure, seconds).
    """
    rows = []
    for r in ranks:
        if not isinstance(r, dict):
            continue
        rank, st = integer(r.get("rank")), number(r.get("step_time_s"))
        if rank is None or st is None:
            continue
        data, wait = number(r.get(DATA_S)) or 0.0, number(r.get(WAIT_S)) or 0.0
        rows.append((rank, st, data, max(0.0, st - wait)))
    if len(rows) < 2:
        return None
    best = None
    for i, (rank, _, data, own) in enumerate(rows):
        others = rows[:i] + rows[i + 1:]
        med_data = _median([d for _, _, d, _ in others])
        lag = max(own - _median([o for _, _, _, o in others]), data - med_data, 0.0)
        if best is None or lag > best[0]:
            best = (lag, rank, data, med_data)
    assert best is not None
    lag, rank, data, med_data = best
    med_st = _median([st for _, st, _, _ in rows])
    owns, datas = [o for _, _, _, o in rows], [d for _, _, d, _ in rows]
    return {"rank": rank, "lag_s": lag, "ratio": lag / med_st if med_st > 0 else 0.0, "data_s": data,
            "median_data_s": med_data, "median_step_time_s": med_st,
            "spread_s": max(max(owns) - min(owns), max(datas) - min(datas))}


@dataclass
class Notice:
    """A line for a log panel that comes from the events, not from a log file."""

    level: str  # info | warning | error
    text: str


@dataclass
class RunState:
    """What a run amounts to, built by applying its events in order (``info``: the contents of run.json).

    Series are indexed like ``steps``: a restart that resumes from an earlier checkpoint truncates them (the new
    attempt wins). Values that are missing, of the wrong type or not finite are kept as None in the series and
    never raise. Used by ``handle run`` (progress line, summary) and by the dashboard.
    """

    run_dir: Path
    info: dict[str, Any] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    lr: list[float | None] = field(default_factory=list)
    tokens_per_s: list[float | None] = field(default_factory=list)
    step_time_s: list[float | None] = field(default_factory=list)
    comm_s: list[float | None] = field(default_factory=list)
    """Seconds waited for gradient communication per step (None where the strategy does not report it)."""
    data_s: list[float | None] = field(default_factory=list)
    forward_s: list[float | None] = field(default_factory=list)
    backward_s: list[float | None] = field(default_factory=list)
    optimizer_s: list[float | None] = field(default_factory=list)
    sync_s: list[float | None] = field(default_factory=list)
    """The step breakdown per step, one series per field of ``BREAKDOWN`` (seconds; None in events without
    it)."""
    mfu: float | None = None
    """The newest model FLOPs utilisation (0..1)."""
    trained_share: float | None = None
    """An SFT run's newest trained share of the positions computed (0..1, ``trained_share`` of step events); None
    for a run whose every position is a label."""
    trained_tokens_per_s: list[float | None] = field(default_factory=list)
    """An SFT run's trained tokens/s per step (``trained_tokens_per_s`` of step events; None where absent)."""
    preference_steps: list[int] = field(default_factory=list)
    """The steps whose events carry a preference (DPO) run's metrics (:data:`PREFERENCE_METRICS`)."""
    preference: dict[str, list[float | None]] = field(default_factory=dict)
    """metric -> its value at each of :attr:`preference_steps` (rewards and log-probs in nats, accuracies 0..1);
    empty for a run without them (the dashboard's preference panel shows only when it is not)."""
    val_preference: list[dict[str, float | None] | None] = field(default_factory=list)
    """Each evaluation's preference metrics (one per :attr:`val_steps`; None for an eval without them)."""
    task_steps: list[int] = field(default_factory=list)
    """The steps of the in-loop downstream evaluations (``tasks`` events: ``[eval]``)."""
    task_scores: dict[str, list[float | None]] = field(default_factory=dict)
    """``"<task> <metric>"`` -> its score at each of :attr:`task_steps` (None where an evaluation lacked it), in
    the order first seen; empty for a run without ``[eval]`` tasks (the dashboard's tasks panel shows only when it
    is not)."""
    layout_degrees: dict[str, Any] | None = None
    """The newest step event's ``layout`` as it carries it (``{"dp": 2, "tp": 2}``), or None; :attr:`run_layout`
    is how it reads."""
    preset_layout: RunLayout | None = None
    """For a run whose run.json has no ``layout`` record (an old one): :meth:`RunLayout.from_run`'s, read once."""
    preset_finetune: dict[str, Any] | None = None
    """For a run whose run.json has no ``finetune`` record: preset.toml's ``[finetune]`` (``{}``: none), read once."""
    comm: dict[str, float] | None = None
    """The newest step event's communication seconds per dimension of the layout (``{"dp": .., "tp": ..}``,
    :func:`~torch_handle.observe.comm.read_comm`); None when it has none."""
    peak_flops: float | None = None
    """FLOP/s per rank behind ``mfu`` (status event)."""
    breakdown_seen: bool = False
    """True once a step event carried the step breakdown (the dashboard shows its time panel then)."""
    slowest: dict[str, Any] | None = None
    """:func:`slowest_rank` of the newest ``ranks`` list (``rank``, ``lag_s``, ``ratio``, ``spread_s``, ...)."""
    source_tokens: list[dict[str, Any] | None] = field(default_factory=list)
    """A data mixture's tokens by source, per step (``source_tokens`` of step events; None where absent)."""
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float | None] = field(default_factory=list)
    grad_norm: float | None = None
    memory: dict[int, dict[str, int]] = field(default_factory=dict)
    """rank -> the latest memory figures (bytes; the fields of ``MEMORY`` the event has)."""
    peak_memory: dict[int, dict[str, int]] = field(default_factory=dict)
    """rank -> the largest value seen of each memory figure (bytes), across restarts."""
    event_status: str | None = None
    event_message: str = ""
    event_steps_total: int | None = None
    event_world_size: int | None = None
    event_strategy: str | None = None
    event_zero_stage: Any = None
    restarts_seen: int = 0
    first_time: float | None = None
    last_time: float | None = None
    """Unix times of the first and the newest event."""
    n_events: int = 0
    last_seq: int | None = None
    seq_gaps: int = 0
    """Times ``seq`` jumped forward (events missing from the file); 0 for a complete history."""
    bad_lines: list[BadLine] = field(default_factory=list)
    last_checkpoint: str | None = None
    tokens_per_s_head: list[float] = field(default_factory=list)
    """The first 2 tokens/s figures applied (warm-up), for :attr:`mean_tokens_per_s`."""
    tokens_per_s_sum: float = 0.0
    tokens_per_s_count: int = 0
    """Sum and count of the tokens/s figures applied after the first 2 (restarts do not remove any)."""
    hang: dict[str, Any] | None = None
    """The newest ``hang`` event (``message``, ``ranks``, ``stacks``, ...), kept after the run moved on."""
    hang_current: bool = False
    """True while no step or status event followed the newest ``hang`` event (the status is then ``hung``)."""
    lost_checked: tuple[float, bool] = (0.0, False)
    """(monotonic time, result) of the newest :func:`~torch_handle.rundir.is_lost` check (once a second)."""

    # -- applying --------------------------------------------------------------------------------------------

    def apply(self, events: Iterable[dict[str, Any]]) -> list[Notice]:
        """Apply events in order; returns the notices they produce (log events, restarts, failures)."""
        notices: list[Notice] = []
        for event in events:
            try:
                self._apply_one(event, notices)
            except Exception as e:  # noqa: BLE001 - a malformed event is reported, never fatal
                notices.append(Notice(Level.WARNING, f"event seq {clean(event.get('seq'), 20)} skipped: "
                                                     f"{type(e).__name__}: {clean(e, 200)}"))
        return notices

    def _apply_one(self, event: dict[str, Any], notices: list[Notice]) -> None:
        self.n_events += 1
        seq = integer(event.get("seq"))
        if seq is not None:
            if self.last_seq is not None and seq > self.last_seq + 1:
                self.seq_gaps += 1
                notices.append(Notice(Level.WARNING,
                                      f"events {self.last_seq + 1}..{seq - 1} are missing from the file"))
            self.last_seq = seq
        kind = event.get("kind")
        t = number(event.get("time"))
        if t is not None:
            self.first_time = t if self.first_time is None else self.first_time
            self.last_time = t
        if kind == Kind.STEP:
            if self.hang_current and (step := integer(event.get("step"))) is not None:
                self.hang_current = False
                notices.append(Notice(Level.INFO, f"step {step}: the run moves again after the hang"))
            self._apply_step(event)
        elif kind == Kind.EVAL:
            step = integer(event.get("step"))
            if step is None:
                return
            while self.val_steps and self.val_steps[-1] >= step:
                self.val_steps.pop()
                self.val_loss.pop()
                self.val_preference.pop()
            self.val_steps.append(step)
            self.val_loss.append(number(event.get("val_loss")))
            self.val_preference.append({k: number(event.get(k)) for k in PREFERENCE_METRICS}
                                       if any(k in event for k in PREFERENCE_METRICS) else None)
        elif kind == Kind.TASKS:
            self._apply_tasks(event)
        elif kind == Kind.STATUS:
            self._apply_status(event, notices)
        elif kind == Kind.LOG:
            level = clean(event.get("level") or Level.INFO, 10).lower()
            notices.append(Notice(level if level in (Level.WARNING, Level.ERROR) else Level.INFO,
                                  clean(event.get("message") or "", 1000)))
        elif kind == Kind.CHECKPOINT:
            self.last_checkpoint = clean(event.get("path") or "", 200)
        elif kind == Kind.HANG:
            message = clean(event.get("message") or "hang: no rank advanced", 1000)
            self.hang = {**event, "message": message}
            self.hang_current = True
            notices.append(Notice(Level.ERROR, message))

    def _apply_tasks(self, event: dict[str, Any]) -> None:
        step, scores = integer(event.get("step")), event.get(TASK_SCORES)
        if step is None or not isinstance(scores, dict):
            return
        self._drop_tasks(step)  # a restart scored these steps again: the new attempt wins
        self.task_steps.append(step)
        for task, metrics in scores.items():
            for metric, value in (metrics.items() if isinstance(metrics, dict) else ()):
                name = f"{clean(str(task), 80)} {clean(str(metric), 40)}"
                self.task_scores.setdefault(name, [None] * (len(self.task_steps) - 1)).append(number(value))
        for series in self.task_scores.values():
            series.extend([None] * (len(self.task_steps) - len(series)))

    def _drop_tasks(self, step: int) -> None:
        while self.task_steps and self.task_steps[-1] >= step:
            self.task_steps.pop()
            for series in self.task_scores.values():
                series.pop()

    def _apply_step(self, event: dict[str, Any]) -> None:
        step = integer(event.get("step"))
        if step is None:
            return
        if self.steps and step <= self.steps[-1]:
            self._truncate(step)  # a restart resumed from an earlier checkpoint: the new attempt wins
        self.steps.append(step)
        self.loss.append(number(event.get("loss")))
        self.lr.append(number(event.get("lr")))
        tokens_per_s = number(event.get("tokens_per_s"))
        self.tokens_per_s.append(tokens_per_s)
        if tokens_per_s is not None:
            if len(self.tokens_per_s_head) < 2:
                self.tokens_per_s_head.append(tokens_per_s)
            else:
                self.tokens_per_s_sum += tokens_per_s
                self.tokens_per_s_count += 1
        self.step_time_s.append(number(event.get("step_time_s")))
        self.trained_tokens_per_s.append(number(event.get(TRAINED_TOKENS_PER_S)))
        mix = event.get(SOURCE_TOKENS)
        self.source_tokens.append(mix if isinstance(mix, dict) else None)
        for key in BREAKDOWN:
            getattr(self, key).append(number(event.get(key)))
        self.breakdown_seen = self.breakdown_seen or self.forward_s[-1] is not None
        if (mfu := number(event.get("mfu"))) is not None:
            self.mfu = mfu
        if (share := number(event.get(TRAINED_SHARE))) is not None:
            self.trained_share = share
        if any(k in event for k in PREFERENCE_METRICS):
            self.preference_steps.append(step)
            for k in PREFERENCE_METRICS:
                self.preference.setdefault(k, []).append(number(event.get(k)))
        self.layout_degrees = event.get("layout") if isinstance(event.get("layout"), dict) else None
        self.comm = read_comm(event.get(COMM))
        ranks = event.get("ranks")
        if isinstance(ranks, list):
            self.slowest = slowest_rank(ranks)
        self.grad_norm = number(event.get("grad_norm"))
        memory = event.get("memory")
        if isinstance(memory, list):
            for mem in memory:
                if not isinstance(mem, dict):
                    continue
                rank = integer(mem.get("rank"))
                if rank is None:
                    continue
                latest = {k: int(v) for k in MEMORY if (v := number(mem.get(k))) is not None}
                if ACTIVATION_SAVED_BYTES not in latest and (v := number(mem.get(ACTIVATION_BYTES))) is not None:
                    latest[ACTIVATION_SAVED_BYTES] = int(v)  # older events: the saved part under the total's name
                self.memory[rank] = latest
                peak = self.peak_memory.setdefault(rank, {})
                for k, v in latest.items():
                    peak[k] = max(peak.get(k, 0), v)

    def _apply_status(self, event: dict[str, Any], notices: list[Notice]) -> None:
        status = clean(event.get("status") or "", 40)
        message = clean(event.get("message") or "", 500)
        self.hang_current = False
        if status in Status.RESTART:
            self.restarts_seen += 1
            notices.append(Notice(Level.WARNING, f"restarting: {message or 'a worker failed'}"))
        elif status == Status.RUNNING and self.event_status in Status.RESTART:
            notices.append(Notice(Level.INFO, f"restart {self.restarts_seen}: workers running again"))
        elif status == Status.FAILED:
            notices.append(Notice(Level.ERROR, f"run failed: {message}" if message else "run failed"))
        elif status == Status.STOPPED:
            notices.append(Notice(Level.WARNING, f"run stopped{': ' + message if message else ''}"))
        elif status == Status.FINISHED:
            notices.append(Notice(Level.INFO, "run finished"))
        restart = integer(event.get("restart"))
        if restart is not None:
            self.restarts_seen = max(self.restarts_seen, restart)
        self.event_status = status or self.event_status
        self.event_message = message
        if (steps := integer(event.get("steps"))) is not None:
            self.event_steps_total = steps
        if (ws := integer(event.get("world_size"))) is not None:
            self.event_world_size = ws
        if (peak := number(event.get("peak_flops"))) is not None and peak > 0:
            self.peak_flops = peak
        if event.get("strategy"):
            self.event_strategy = clean(event["strategy"], 40)
            self.event_zero_stage = event.get("zero_stage")

    def _truncate(self, step: int) -> None:
        keep = 0
        while keep < len(self.steps) and self.steps[keep] < step:
            keep += 1
        for series in (self.steps, self.loss, self.lr, self.tokens_per_s, self.step_time_s, self.source_tokens,
                       self.trained_tokens_per_s, *(getattr(self, key) for key in BREAKDOWN)):
            del series[keep:]
        while self.preference_steps and self.preference_steps[-1] >= step:
            self.preference_steps.pop()
            for series in self.preference.values():
                series.pop()
        while self.val_steps and self.val_steps[-1] >= step:
            self.val_steps.pop()
            self.val_loss.pop()
            self.val_preference.pop()
        self._drop_tasks(step)

    # -- derived ---------------------------------------------------------------------------------------------

    @property
    def source_totals(self) -> dict[str, int]:
        """A data mixture's tokens by source over the run's steps (empty for a run without a mixture)."""
        totals: dict[str, int] = {}
        for mix in self.source_tokens:
            add_source_tokens(totals, mix)
        return totals

    @property
    def status(self) -> str:
        """running | finished | failed | stopped | restarting | starting | lost | hung.

        run.json has the last word once it is final (the launcher records failures no worker could report);
        otherwise the newest status event. (A final event status while run.json says running is a resumed run
        whose workers have not reported yet: it shows as that final status until they do.)
        """
        info_status = self.info.get("status")
        if info_status in Status.FINAL:
            return info_status
        if info_status == Status.LOST or self.lost:
            return Status.LOST
        if self.hang_current:
            return Status.HUNG
        if self.event_status:
            return Status.RESTARTING if self.event_status in Status.RESTART else self.event_status
        return info_status if isinstance(info_status, str) and info_status else Status.STARTING

    @property
    def lost(self) -> bool:
        """run.json says the run is active, but its launcher is gone and its heartbeat stale (checked at most
        once a second; always False for an ``info`` without a recorded launcher)."""
        from torch_handle.rundir import is_lost

        now = time.monotonic()
        if now - self.lost_checked[0] >= 1.0:
            self.lost_checked = (now, is_lost(self.run_dir, self.info))
        return self.lost_checked[1]

    @property
    def message(self) -> str:
        if self.info.get("status") in Status.FINAL and self.info.get("message"):
            return clean(self.info["message"], 500)
        if self.status == Status.LOST:
            return f"the launcher is gone (killed?); continue with: handle run --resume {clean(str(self.run_dir))}"
        if self.status == Status.HUNG and self.hang:
            return self.hang["message"]
        return self.event_message

    @property
    def step(self) -> int:
        return self.steps[-1] if self.steps else integer(self.info.get("step")) or 0

    @property
    def steps_total(self) -> int | None:
        return self.event_steps_total or integer(self.info.get("steps"))

    @property
    def world_size(self) -> int | None:
        return self.event_world_size or integer(self.info.get("world_size"))

    @property
    def strategy(self) -> str:
        if self.event_strategy:
            return strategy_label(self.event_strategy, self.event_zero_stage)
        return strategy_label(self.info.get("strategy"), self.info.get("zero_stage"))

    @property
    def run_layout(self) -> RunLayout:
        """The run's layout, :class:`~torch_handle.common.run_layout.RunLayout`: run.json's ``layout`` record;
        for an older run preset.toml's ``[parallel]`` (read once, :meth:`RunLayout.from_run`), or the degrees of the
        newest step event where it has none or they differ; with the workers' strategy (their ZeRO stage) once an
        event named it."""
        layout = RunLayout.from_record(self.info.get(LAYOUT_KEY))
        if layout is None:
            if self.preset_layout is None:
                self.preset_layout = RunLayout.from_run(self.run_dir, self.info)
            layout = self.preset_layout.matching(self.layout_degrees)
        return layout.with_strategy(self.event_strategy, self.event_zero_stage)

    @property
    def finetune(self) -> str | None:
        """What the run fine-tunes with, as every view names it (``QLoRA r8 (NF4 base)``,
        :func:`~torch_handle.common.text.finetune_label`): run.json's ``finetune`` record, or for a run from
        before it preset.toml's ``[finetune]`` (read once); None for a run that trains every weight."""
        if FINETUNE_KEY in self.info:
            return finetune_label(self.info[FINETUNE_KEY])
        if self.preset_finetune is None:
            data = read_toml(self.run_dir / "preset.toml")
            self.preset_finetune = (data or {}).get("finetune") or {}
        return finetune_label(self.preset_finetune)

    @property
    def precision(self) -> str | None:
        """run.json's ``precision`` (the launcher's resolution of ``training.precision``), or None."""
        value = self.info.get("precision")
        return clean(value, 10) if value else None

    @property
    def restarts(self) -> int:
        return max(self.restarts_seen, integer(self.info.get("restarts")) or 0)

    @property
    def name(self) -> str:
        return clean(self.info.get("name") or self.run_dir.name, 80)

    @property
    def preset(self) -> str:
        preset = self.info.get("preset")
        return clean(Path(str(preset)).stem if preset else self.name, 80)

    @property
    def last_loss(self) -> float | None:
        return self.last(self.loss)

    @property
    def last_val_loss(self) -> float | None:
        return self.last(self.val_loss)

    @property
    def first_val_loss(self) -> float | None:
        """The earliest validation loss kept (the untrained baseline at step 0 when there is one)."""
        return next((x for x in self.val_loss if x is not None), None)

    @property
    def mean_tokens_per_s(self) -> float | None:
        """Mean global tokens/s of every step applied (the steps a restart did again included: they ran),
        leaving out the first 2 (warm-up: allocation, DeepSpeed's first bucket setup) when there are more; None
        without any figure."""
        if self.tokens_per_s_count:
            return self.tokens_per_s_sum / self.tokens_per_s_count
        head = self.tokens_per_s_head
        return sum(head) / len(head) if head else None

    def last(self, series: list[float | None]) -> float | None:
        """The newest value of ``series`` that is not None."""
        return next((x for x in reversed(series) if x is not None), None)

    def breakdown(self, i: int) -> dict[str, float | None]:
        """Each field of :data:`~torch_handle.observe.fields.BREAKDOWN` -> its seconds in step ``steps[i]``."""
        return {key: getattr(self, key)[i] for key in BREAKDOWN}

    def elapsed_s(self, info: dict[str, Any] | None = None) -> float | None:
        """Seconds from the run's launch (run.json's ``start_time``: start-up included, as a resumed run's earlier
        attempts and the pause between them are) to its end (``end_time`` once the status is final), or to the
        newest event while it runs; event times, not the clock. ``info``: run.json's contents where they are newer
        than :attr:`info` (``handle run``'s summary). The one elapsed time: the dashboard's header and the summary
        both show it. Without a ``start_time``, from the first event."""
        info = self.info if info is None else info
        start = number(info.get("start_time"))
        if start is None:
            start = self.first_time
        if start is None:
            return None
        end = number(info.get("end_time")) if info.get("status") in Status.FINAL or self.status in Status.FINAL \
            else None
        if end is None:
            end = self.last_time
        return None if end is None else max(0.0, end - start)

    def time_left_s(self) -> float | None:
        """Seconds to ``steps_total`` at the mean of the last 20 step times, whatever the status (``handle run``'s
        progress line, which knows the total from the preset); None without a total or a step time."""
        if not self.steps_total:
            return None
        recent = [x for x in self.step_time_s[-20:] if x is not None]
        if not recent:
            return None
        return max(0, self.steps_total - self.step) * sum(recent) / len(recent)

    def eta_s(self) -> float | None:
        """:meth:`time_left_s` while the run is running or restarting, else None (the dashboard's ETA)."""
        if self.status not in (Status.RUNNING, Status.RESTARTING):
            return None
        return self.time_left_s()
