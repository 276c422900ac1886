"""Downstream tasks during training (``[eval]``): lm-evaluation-harness tasks scored on the workers with the model
being trained, every ``eval.every`` steps and after the last one.

Every rank of the data-parallel group runs the harness on the same tasks with a
:class:`~torch_handle.infer.lm_eval_model.HandleLM` over the group (the harness's own distributed evaluation,
``lm_eval.evaluator.evaluate``): rank r of W builds the requests of documents r, r + W, ... of each task and scores
them with its replica of the model; the per-document metrics are gathered on rank 0, which aggregates them as the
harness does for one process (so the scores equal a one-process ``handle eval`` of the same weights). The model is
in eval mode meanwhile and put back as it was after; the random generators are restored too (the harness seeds
Python's, NumPy's and torch's), so the training's dropout masks and data order do not change.

Rank 0 then emits a ``tasks`` event (:data:`~torch_handle.observe.fields.Kind.TASKS`: ``step``, ``scores``
{task: {metric: value}}, ``seconds``, ``requests`` per rank) and writes the harness's JSON to
``RUN/evals/<time>-step<N>-<tasks>.json`` (``handle runs`` shows the newest). A task that cannot be loaded, or a
scoring that raises, is a warning event: training goes on. A run whose ranks do not each hold the whole model
(tensor, pipeline, expert or context parallelism; a sharding strategy) or that is not a decoder gets one warning
and no in-loop evaluation (``handle eval RUN --tasks`` scores its final weights or a checkpoint).

Sources: OLMo's in-loop downstream evaluation (task accuracy beside the loss while pretraining); the harness's
``evaluate`` for the split and the aggregation.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from typing import Any

import torch
import torch.distributed as dist

from torch_handle.config.schema import EvalConfig
from torch_handle.observe.fields import TASK_SCORES, Kind, Level
from torch_handle.observe.heartbeat import busy

log = logging.getLogger("torch_handle")


def scorable(trainer: Any, limit: int | None = None) -> str | None:
    """Why ``trainer``'s model cannot be scored in the loop (one phrase), or None when every rank holds the whole
    decoder (no parallel share: tp, pp, ep, cp; data parallelism over every rank; whole parameters) and ``limit``
    (documents per task) gives every rank at least one."""
    from torch_handle.model.transformer import DecoderLM

    ctx = trainer.ctx
    if trainer.share is not None or ctx.dp_size != ctx.world_size:
        return "each rank holds a part of the model (parallel layout)"
    model = _model(trainer)
    if not isinstance(model, DecoderLM):
        return f"the harness scores decoders, this model is a {type(model).__name__}"
    try:
        sharded = any(trainer.strategy.local_shard(p) is not p for p in model.parameters())
    except Exception:  # noqa: BLE001 - a strategy that cannot say (scratch-fsdp: a parameter outside its units)
        sharded = True
    if sharded:
        return f"strategy {trainer.preset.strategy.name} shards the parameters"
    if trainer.data.tokenizer_path is None:
        return "the data has no tokenizer.json"
    if limit is not None and limit < ctx.world_size:  # a rank without a task's documents skips its collectives
        return f"eval.limit {limit} leaves some of the {ctx.world_size} ranks no document (use >= {ctx.world_size})"
    return None


def _model(trainer: Any) -> torch.nn.Module:
    model = trainer.strategy.unwrapped()
    return getattr(model, "_orig_mod", model)  # torch.compile's wrapper


@contextlib.contextmanager
def kept_rng(device: torch.device):
    """Python's, NumPy's and torch's generators (CPU, and ``device`` when CUDA) as they were, after the block."""
    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


class InLoopTasks:
    """The ``[eval]`` table's tasks, scored by :meth:`maybe_run` at the steps it names (every rank calls it).

    Args:
        config: the preset's ``[eval]`` table (tasks, every, limit, include_paths, batch_size, num_fewshot).
    """

    def __init__(self, config: EvalConfig):
        self.config = config
        self.enabled = bool(config.tasks)
        self._resolved: tuple[list[Any], Any] | None = None
        self._tokenizer: Any = None

    def due(self, step: int, last: bool) -> bool:
        """Whether the tasks run after ``step``: every ``eval.every`` steps and after the last step."""
        every = self.config.every
        return self.enabled and (last or bool(every and step % every == 0))

    def maybe_run(self, trainer: Any, last: bool) -> None:
        """Score the tasks after ``trainer.step`` when :meth:`due` (collective over the trainer's ranks)."""
        if self.due(trainer.step, last):
            self.run(trainer)

    def _warn(self, trainer: Any, message: str) -> None:
        log.warning(message)
        trainer.events.emit(Kind.LOG, level=Level.WARNING, message=message)

    def run(self, trainer: Any) -> dict[str, Any] | None:
        """Score the tasks now; returns the harness's results on rank 0 (None elsewhere, or when nothing ran). The
        random generators are as they were after it (loading a task's data draws from them too)."""
        with kept_rng(trainer.ctx.device):
            return self._run(trainer)

    def _run(self, trainer: Any) -> dict[str, Any] | None:
        reason = scorable(trainer, self.config.limit)
        if reason is not None:
            self.enabled = False
            self._warn(trainer, f"eval.tasks: not scored during training: {reason} (score the final weights with "
                                f"handle eval RUN --tasks {','.join(self.config.tasks)})")
            return None
        step, started = trainer.step, time.perf_counter()
        try:
            tasks, manager = self._load(trainer)
        except ImportError as e:
            self.enabled = False
            self._warn(trainer, f"eval.tasks: the eval extra is missing ({e}): pip install 'torch-handle[eval]'")
            return None
        if not tasks:
            return None
        model = _model(trainer)
        was_training = model.training
        try:
            with busy("tasks"):
                trainer.strategy.train(False)
                return self._score(trainer, model, tasks, manager, step, started)
        except Exception as e:  # noqa: BLE001 - a task's failure is a warning; the training goes on
            self._warn(trainer, f"eval.tasks at step {step}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
            return None
        finally:
            trainer.strategy.train(was_training)

    def _load(self, trainer: Any) -> tuple[dict[str, Any], Any]:
        """The task objects every rank could build (each one's data read now); a task any rank could not build is
        a warning naming it, left out this time."""
        from torch_handle.infer import downstream

        logging.getLogger("lm_eval").setLevel(logging.ERROR)
        loaded, errors = [], []
        try:  # validated with the preset, but a data file may have gone since: then no task this time
            specs, manager = self._resolved or downstream.resolve_tasks(self.config.tasks, self.config.include_paths)
            self._resolved = specs, manager
        except downstream.DataError as e:
            specs, manager, errors = [], None, [str(e)] * len(self.config.tasks)
        for spec in specs:
            try:
                loaded.append(downstream.load_tasks([spec], manager))
                errors.append("")
            except Exception as e:  # noqa: BLE001 - a task the harness cannot build: a warning
                loaded.append({})
                errors.append(" ".join(str(e).split())[:300] or type(e).__name__)
        loaded += [{}] * (len(errors) - len(loaded))
        if self._tokenizer is None:  # read here, where the ranks agree on what failed, not alone in _score
            from tokenizers import Tokenizer

            try:
                self._tokenizer = Tokenizer.from_file(str(trainer.data.tokenizer_path))
            except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception type
                errors = [f"{trainer.data.tokenizer_path}: unreadable ({' '.join(str(e).split())[:200]})"] * len(errors)
        ok = torch.tensor([float(not err) for err in errors], device=trainer.ctx.device)
        if trainer.ctx.distributed:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # a task is scored only where every rank built it
        tasks: dict[str, Any] = {}
        for name, found, err, good in zip(self.config.tasks, loaded, errors, ok.tolist()):
            if good:
                tasks.update(found)
            else:
                self._warn(trainer, f"eval.tasks: {name} skipped at step {trainer.step}: "
                                    f"{err or 'it failed to load on another rank'}")
        return tasks, manager

    def _score(self, trainer: Any, model: torch.nn.Module, tasks: dict[str, Any], manager: Any, step: int,
               started: float) -> dict[str, Any] | None:
        from torch_handle.infer import downstream
        from torch_handle.infer.generate import LoadedRun
        from torch_handle.infer.lm_eval_model import HandleLM

        group = dist.group.WORLD if trainer.ctx.distributed else None
        lm = HandleLM(model, self._tokenizer, batch_size=self.config.batch_size, group=group)
        loaded = LoadedRun(trainer.run_dir, model, self._tokenizer, trainer.preset, trainer.run_dir / "checkpoints")
        results = downstream.evaluate_run(loaded, list(tasks), manager, limit=self.config.limit,
                                          num_fewshot=self.config.num_fewshot, batch_size=self.config.batch_size,
                                          step=step, tasks=tasks, lm=lm)
        if results is None:  # not rank 0: the scores are computed there, and nothing collective follows
            return None
        counts = [dict(c) for c in lm.counts_per_rank]
        seconds = round(time.perf_counter() - started, 3)
        results["handle"].update(in_loop=True, weights=f"the training model at step {step}", seconds=seconds,
                                 requests_per_rank=counts)
        found = downstream.scores(results)
        trainer.events.emit(Kind.TASKS, step=step, **{TASK_SCORES: found}, seconds=seconds, requests=counts)
        with contextlib.suppress(OSError):  # a full disk loses the file, not the run (the event has the scores)
            downstream.write_results(trainer.run_dir, results)
        log.info("step %d: eval tasks %s (%.1f s)", step, "; ".join(
            f"{task} " + " ".join(f"{m}={v:.4f}" for m, v in metrics.items()) for task, metrics in found.items()),
            seconds)
        return results
