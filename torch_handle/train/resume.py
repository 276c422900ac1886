"""A run that starts again: the newest checkpoint every run directory holds, its model, optimizer and schedule (the
strategy's own load when it reads that layout, else through the portable form), and the data position and RNG
states it was written at. :func:`resume` is the trainer's ``maybe_resume``; it reads the trainer's parts and returns
where the run continues, which the trainer sets.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_handle.checkpoint import shared_dirs, store as ckpt
from torch_handle.launch import data_identity
from torch_handle.observe.fields import Kind, Level
from torch_handle.observe.heartbeat import busy

log = logging.getLogger("torch_handle")


@dataclass(frozen=True)
class Position:
    """Where a resumed run continues: the optimizer ``step`` done, the ``epoch``, and ``samples_in_epoch`` of that
    epoch's global order consumed by all ranks."""

    step: int
    epoch: int
    samples_in_epoch: int


def resume(trainer: Any) -> Position | None:
    """Load the newest checkpoint that verifies in every run directory into ``trainer`` (model, optimizer, schedule,
    this rank's RNG states) and log where it resumed; None (nothing loaded) when there is none. Every rank calls it.

    Raises:
        CheckpointError: the checkpoint needed a conversion that failed (see :func:`load_state`).
    """
    root = trainer.run_dir / "checkpoints"
    # the newest checkpoint that verifies in every run directory (one directory: rank 0's newest valid one)
    path, skipped = shared_dirs.agree_on_checkpoint(root, trainer.ctx.rank, trainer.dir_leaders, trainer.gather)
    for message in skipped:
        log.warning(message)
        trainer.events.emit(Kind.LOG, level=Level.WARNING, message=message)
    if path is None:
        return None
    path = Path(path)
    layout = ckpt.read_layout(path)
    # the data and tokenizer it was trained on (handle run --resume checks the same before anything starts)
    now = data_identity.record(trainer.data.identity, trainer.data.tokenizer_path)
    data_identity.check_layout(layout, now, path)
    how = load_state(trainer, path, layout)
    trainer.strategy.apply_schedule()  # a resume may change training.lr: the checkpoint holds the old peak
    position = load_position(trainer, path, layout)
    message = f"resumed from {path.relative_to(trainer.run_dir)} at step {position.step}{how}"
    log.info(message)
    trainer.events.emit(Kind.LOG, level=Level.INFO, message=message)
    return position


def load_state(trainer: Any, path: Path, layout: dict[str, Any]) -> str:
    """Model, optimizer and schedule: the strategy's own loader when it reads this layout, else rank 0 (the
    first rank of each run directory) converts the checkpoint to the portable form (torch_handle.checkpoint.convert)
    and every rank loads that. Returns what the resume message adds (empty for a native load).

    Raises:
        CheckpointError: the conversion failed (one line), or it would need the shards of several nodes'
            run directories.
    """
    strategy, checkpointer, ctx = trainer.strategy, trainer.checkpointer, trainer.ctx
    if "world_size" not in layout or ("strategy" not in layout and layout.get("format") != "dcp"):
        layout = {**strategy.checkpoint_layout(), "world_size": ctx.world_size, **layout}  # older
    if checkpointer.loads_natively(layout):
        checkpointer.load(path)
        return ""
    from torch_handle.checkpoint import convert
    from torch_handle.common.units import fmt_bytes

    if len(set(trainer.dir_leaders)) > 1 and layout.get("format") != "torch":
        # each node's directory holds only its own ranks' shards: no rank sees the whole checkpoint
        raise ckpt.CheckpointError(f"{path}: resuming a checkpoint written by {convert.describe(layout)} under "
                                   f"another strategy or world size needs one run directory shared by all "
                                   f"nodes (its shards are spread over the nodes' directories)")
    outcome: Any = None
    if trainer.is_dir_main:  # one conversion per run directory, while that directory's other ranks wait
        names = checkpointer.parameter_names()
        try:
            with busy("convert"):
                outcome = convert.ensure_portable(path, layout, names)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, not wait at the next collective
            outcome = f"{type(e).__name__}: {e}".splitlines()[0]
    outcomes = trainer.gather(outcome)
    failed = next((o for o in outcomes if isinstance(o, str)), None)
    if failed is not None:
        raise ckpt.CheckpointError(f"cannot convert {path} (written by {convert.describe(layout)}): {failed}")
    start = time.perf_counter()
    checkpointer.load_portable(convert.portable_dir(path, layout))
    loaded_s = time.perf_counter() - start
    done = outcomes[trainer.dir_leaders[ctx.rank]]
    if done is None:
        converted = ""
    elif done["cached"]:
        converted = "converted to the portable form by an earlier resume, "
    else:
        converted = (f"converted to the portable form in {done['seconds']:.2f} s "
                     f"({fmt_bytes(done['bytes'])}), ")
    how = f" (written by {convert.describe(layout)}; {converted}loaded in {loaded_s:.2f} s)"
    if trainer.training.precision == "fp16":
        trainer.note(Level.WARNING, "the fp16 loss scale starts again from its initial value (a converted "
                                    "checkpoint carries no loss scaler)")
    return how


def load_position(trainer: Any, path: Path, layout: dict[str, Any]) -> Position:
    """Step, epoch and data position (the same for every rank), and this rank's RNG states when the
    checkpoint has them (else a fresh seed, logged)."""
    ctx, preset = trainer.ctx, trainer.preset
    own = ckpt.own_rng_state(path, ctx.rank, layout, preset.parallel.tp)
    state = ckpt.load_trainer_state(path, ctx.rank if own else 0, restore_rng=own)
    if not own:
        ckpt.seed_everything(preset.run.seed + 1000 * ctx.dp_rank + state.step, ctx.tp_rank, preset.parallel.tp)
    if ctx.is_main and (not own or (layout.get("world_size") or ctx.world_size) < ctx.world_size):
        trainer.note(Level.INFO, f"ranks with no RNG state of their own in the checkpoint (written on "
                                 f"{layout.get('world_size')} ranks, tp = {layout.get('tp', 1)}) are seeded from "
                                 f"run.seed + 1000 x dp rank + step")
    t, global_batch = trainer.training, trainer.train_sampler.global_batch
    if state.samples_in_epoch is not None:
        samples_in_epoch = state.samples_in_epoch
    else:  # written before the global order: per-rank micro-batches of the run's (then frozen) settings
        samples_in_epoch = state.batch_in_epoch * t.micro_batch_size * ctx.world_size
        trainer.note(Level.WARNING, f"the checkpoint predates the world-size-independent data order: the rest "
                                    f"of epoch {state.epoch} is drawn in the new order from sample "
                                    f"{samples_in_epoch}")
    saved = layout.get("global_batch")
    if saved and saved != global_batch:
        trainer.note(Level.WARNING, f"global batch changed from {saved} to {global_batch} samples per step "
                                    f"(micro_batch_size x grad_accum x world size): the data continues at sample "
                                    f"{samples_in_epoch} of epoch {state.epoch}, but the trajectory will "
                                    f"differ from an uninterrupted run's")
    return Position(state.step, state.epoch, samples_in_epoch)
