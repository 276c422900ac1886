"""Sink plugin ``wandb``: the run's scalars, resolved preset and status in Weights & Biases.

Asked for with the environment variable ``HANDLE_WANDB`` (no preset table selects a sink; ``handle run`` passes
the environment on to the workers), and then opened on rank 0 like every sink:

======================================  =============================================================
``HANDLE_WANDB``                        mode
======================================  =============================================================
unset, empty, ``0``, ``false``, ``off``  no W&B run (the sink does nothing)
``1``, ``true``, ``on``, ``auto``        ``WANDB_MODE`` when set; else ``online`` when ``WANDB_API_KEY``
                                        is set; else ``offline``
``offline`` / ``online``                that mode
======================================  =============================================================

Offline runs are written to ``<run_dir>/wandb/offline-run-*`` and uploaded later with ``wandb sync DIR``; the
W&B run id is derived from the run directory, so a resumed run continues the same W&B run. Logged: the
TensorBoard sink's scalars (``train/*`` and ``time/*`` for every step, ``valid/loss`` and a DPO run's
``valid/rewards/*``, ``valid/logps/*`` for every evaluation after step 0), the resolved preset as the run's
config, and the status: ``summary.status`` (running, finished, failed, stopped), ``summary.step``, and the exit
code ``handle run`` gives (0 finished, 1 failed, 130 stopped) as ``finish(exit_code)``. The project is ``WANDB_PROJECT`` or ``torch-handle``.

``wandb`` is the optional extra ``torch-handle[wandb]``; it is imported by the factory only. Asked for without
it, the sink is disabled with one warning naming the extra, and the run goes on; so it does when W&B fails at
any point (:class:`torch_handle.observe.telemetry.EventWriter` disables a sink that raises).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from handle_plugins.sinks import TIME_SCALARS, TRAIN_SCALARS, VALID_SCALARS, task_scalars

from torch_handle.api import Kind, Sink, Status, hookimpl

EXTRA = "wandb"
ENV = "HANDLE_WANDB"
OFF = ("", "0", "false", "no", "off")
AUTO = ("1", "true", "yes", "on", "auto")
MODES = ("offline", "online")
EXIT_CODES = {Status.FINISHED: 0, Status.FAILED: 1, Status.STOPPED: 130}
"""Final status -> the exit code ``handle run`` returns for it (what ``finish(exit_code)`` records)."""
DEFAULT_PROJECT = "torch-handle"


def missing_extra_message() -> str:
    return f"{ENV} asks for the wandb sink, which needs the {EXTRA} extra: pip install 'torch-handle[{EXTRA}]'"


def wandb_available() -> bool:
    """Whether ``wandb`` can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):
        return False


def resolve_mode(env: Mapping[str, str]) -> str | None:
    """The W&B mode ``env`` asks for: None (no W&B run), or a mode for ``wandb.init(mode=...)``.

    Raises:
        ValueError: ``HANDLE_WANDB`` (or, in auto mode, ``WANDB_MODE``) has a value it does not know.
    """
    raw = env.get(ENV, "").strip().lower()
    if raw in OFF:
        return None
    if raw in MODES:
        return raw
    if raw not in AUTO:
        raise ValueError(f"{ENV}={env.get(ENV)!r}: expected one of {', '.join((*AUTO, *MODES, *OFF[1:]))}")
    wandb_mode = env.get("WANDB_MODE", "").strip().lower()
    if wandb_mode:
        if wandb_mode == "disabled":
            return None
        if wandb_mode in ("online", "offline", "shared"):
            return wandb_mode
        raise ValueError(f"WANDB_MODE={env.get('WANDB_MODE')!r}: expected online, offline, shared or disabled")
    return "online" if env.get("WANDB_API_KEY") else "offline"


def run_id(run_dir: Path) -> str:
    """A W&B run id for ``run_dir``: its name (letters, digits, ``-``, ``_``, ``.``) and a hash of its absolute
    path, at most 64 characters; the same for every resume of the run."""
    import hashlib  # here: its OpenSSL import costs ~25 ms, and plugin modules load on every `handle` command

    path = Path(run_dir).resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", path.name)[:55]
    return f"{name}-{digest}"


def _finite(value: Any) -> Any:
    return math.nan if value is None else value


class WandbSink(Sink):
    """Sends rank 0's events to a W&B run (``run.log`` with the event's ``step``); ``close()`` finishes it.

    Args:
        run: the object ``wandb.init`` returned (anything with ``log``, ``summary`` and ``finish``).
        teardown: called after ``finish`` (``wandb.teardown``: waits for W&B's service process).
    """

    def __init__(self, run: Any, teardown: Callable[[], Any] | None = None):
        self.run = run
        self.teardown = teardown
        self.status: str | None = None

    def emit(self, event: dict[str, Any]) -> None:
        kind, step = event.get("kind"), event.get("step")
        if kind == Kind.STEP:
            data = {f"train/{k}": _finite(event[k]) for k in TRAIN_SCALARS if k in event}
            data.update({f"time/{k}": _finite(event[k]) for k in TIME_SCALARS if k in event})
            self.run.log(data, step=step)
        elif kind == Kind.EVAL and step:
            data = {"valid/loss": _finite(event.get("val_loss"))}
            data.update({f"valid/{k}": _finite(event[k]) for k in VALID_SCALARS if k in event})
            self.run.log(data, step=step)
        elif kind == Kind.TASKS:
            self.run.log(task_scalars(event), step=step)
        elif kind == Kind.STATUS:
            self.status = event.get("status")
            fields = {k: event[k] for k in ("status", "step", "message", "world_size", "strategy", "zero_stage",
                                            "model_params", "peak_flops", "precision", "restart") if k in event}
            self.run.summary.update(fields)
        elif kind == Kind.CHECKPOINT:
            self.run.summary.update({"checkpoint": event.get("path"), "checkpoint_step": step})

    def close(self) -> None:
        self.run.finish(exit_code=EXIT_CODES.get(self.status, 1))
        if self.teardown is not None:
            # finish() returns before W&B's service process has written (or uploaded) everything, and the worker
            # ends with os._exit, which skips the atexit hook that would wait for it: wait here.
            self.teardown()


def build_wandb(run_dir: Path, preset: Any, env: Mapping[str, str] | None = None) -> WandbSink | None:
    """The sink factory: None unless ``HANDLE_WANDB`` asks for W&B.

    Raises:
        RuntimeError: asked for, but ``wandb`` is not installed (the message names the extra).
        ValueError: ``HANDLE_WANDB`` / ``WANDB_MODE`` has an unknown value.
    """
    env = os.environ if env is None else env
    mode = resolve_mode(env)
    if mode is None:
        return None
    if not wandb_available():
        raise RuntimeError(missing_extra_message())
    import wandb

    from torch_handle.config.loader import preset_to_dict

    run_dir = Path(run_dir)
    config = {**preset_to_dict(preset), "handle": {"run_dir": str(run_dir.resolve())}}
    tags = [f"model:{preset.model.name}", f"strategy:{preset.strategy.name}"]
    run = wandb.init(project=env.get("WANDB_PROJECT") or DEFAULT_PROJECT, name=run_dir.name, id=run_id(run_dir),
                     resume="allow", dir=str(run_dir), mode=mode, config=config, tags=tags, job_type="train",
                     settings=wandb.Settings(console="off", x_disable_stats=True))
    return WandbSink(run, wandb.teardown)


@hookimpl
def handle_register_sinks(register):
    register("wandb", build_wandb, f"Weights & Biases (train/*, time/*, valid/loss, preset, status); on with "
                                   f"{ENV}=1 (offline unless W&B is configured); extra: pip install "
                                   f"'torch-handle[{EXTRA}]'")
