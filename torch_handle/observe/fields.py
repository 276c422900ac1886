"""The vocabulary of ``events.jsonl``: event kinds, run statuses, log levels, and the field names that more than
one module writes or reads. What each field means: docs/run-directory.md. Standard library only.
"""

from __future__ import annotations


class Kind:
    """The ``kind`` of an event."""

    STATUS = "status"
    STEP = "step"
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    LOG = "log"
    HANG = "hang"
    TASKS = "tasks"
    """Downstream task scores of an in-loop evaluation (``[eval]``, :mod:`torch_handle.train.eval_tasks`):
    ``step``, :data:`TASK_SCORES`, ``seconds``, ``requests``, ``ranks``."""


class Status:
    """Run statuses, in ``status`` events and in ``run.json``."""

    STARTING = "starting"
    """run.json only: the run directory exists, torchrun has not started yet."""
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"
    RESTARTING = "restarting"
    """A worker failed and torchrun restarts the group (``launch.max_restarts``)."""
    RESTARTED = "restarted"
    """Read as :attr:`RESTARTING` (older files)."""
    UNREADABLE = "unreadable"
    """Never written: what the run picker shows for a run.json it cannot read."""
    LOST = "lost"
    """Never written: run.json says active, but the launcher is gone and the heartbeat is stale
    (:func:`torch_handle.rundir.is_lost`); ``handle run --resume`` continues it like a stopped run. Not in
    :attr:`FINAL` (no worker or launcher ever records it), though nothing more happens to a lost run either."""
    HUNG = "hung"
    """Never written: the newest event is a ``hang`` (no step since) of a run that is still active; the run may
    still recover (``launch.on_hang = "warn"``). Not in :attr:`FINAL`."""
    FINAL = (FINISHED, FAILED, STOPPED)
    """Statuses after which nothing more happens to the run (until ``--resume``)."""
    RESTART = (RESTARTING, RESTARTED)


class Level:
    """The ``level`` of a ``log`` event."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


# step events: rank 0's step breakdown, seconds summed over micro-batches; with COMM_S the parts tile step_time_s
DATA_S = "data_s"  # waiting for the next batch
FORWARD_S = "forward_s"
BACKWARD_S = "backward_s"  # without COMM_S
SYNC_S = "sync_s"  # the trainer's loss/stop all-reduce
OPTIMIZER_S = "optimizer_s"  # clip, step, schedule
COMM_S = "comm_s"  # gradient communication not hidden behind backward (a strategy's step_stats, scratch-ddp)
TP_COMM_S = "tp_comm_s"  # rank 0's seconds in the step's tensor-parallel collectives (tp_impl = "scratch")
CP_COMM_S = "cp_comm_s"  # rank 0's seconds blocked in the step's context-parallel communication (parallel.cp > 1)
COMM = "comm"  # {"dp": s, "tp": s, "pp": s}: communication per dimension of the layout (observe.comm)

# step events of a run whose labels are a part of the positions it computes (SFT's packed conversations):
# ``tokens`` counts the positions, these the labels (train.step_report)
TRAINED_TOKENS = "trained_tokens"  # labels of the step's global batch: the tokens the loss is the mean over
TRAINED_SHARE = "trained_share"  # trained_tokens / tokens, 0..1
TRAINED_TOKENS_PER_S = "trained_tokens_per_s"  # trained_tokens / step_time_s
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                      "logps/rejected")
"""A preference (DPO) run's step and eval fields, TRL's names: pair means of the implicit rewards (nats, β·log-ratio),
the share of pairs whose chosen reward is higher (0..1), their margin (nats), and the completions' log-probabilities
(nats). Defined here, standard library only, so the sinks and the dashboard read them without torch;
:data:`torch_handle.train.objectives.preference.METRICS` is this tuple."""

STEP_PHASES = {"data": DATA_S, "forward": FORWARD_S, "backward": BACKWARD_S, "sync": SYNC_S,
               "optimizer": OPTIMIZER_S}
"""The trainer's step phases in the order a step runs them (torch_handle.train.phases) -> the field of their
seconds."""
BREAKDOWN = (*STEP_PHASES.values(), COMM_S)
"""Every part of a step in ``step`` events (a strategy without ``comm_s`` leaves it out)."""

# step events: ``memory``, one object per rank, bytes
PARAM_BYTES = "param_bytes"  # trainable + frozen
TRAINABLE_PARAM_BYTES = "trainable_param_bytes"  # parameters an optimizer updates
FROZEN_PARAM_BYTES = "frozen_param_bytes"  # a LoRA run's frozen base, at its storage bytes (NF4 under QLoRA)
GRAD_BYTES = "grad_bytes"
OPTIMIZER_BYTES = "optimizer_bytes"
RSS_BYTES = "rss_bytes"
CUDA_ALLOCATED_BYTES = "cuda_allocated_bytes"
CUDA_MAX_ALLOCATED_BYTES = "cuda_max_allocated_bytes"
CUDA_RESERVED_BYTES = "cuda_reserved_bytes"

# activations of one micro-batch, the same names in the memory telemetry and in ``handle estimate --json``
ACTIVATION_SAVED_BYTES = "activation_saved_bytes"  # distinct storages autograd saves for backward (both)
ACTIVATION_LOGITS_BYTES = "activation_logits_bytes"  # the fp32 (B, T, V) logits buffer (estimate)
ACTIVATION_RECOMPUTE_BYTES = "activation_recompute_bytes"  # the largest block rebuilt in backward (estimate)
ACTIVATION_BYTES = "activation_bytes"  # the sum of the three (estimate; in older events: the saved part)
ACTIVATION_PARTS = (ACTIVATION_SAVED_BYTES, ACTIVATION_LOGITS_BYTES, ACTIVATION_RECOMPUTE_BYTES)

MEMORY = (PARAM_BYTES, TRAINABLE_PARAM_BYTES, FROZEN_PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES, RSS_BYTES,
          ACTIVATION_SAVED_BYTES, CUDA_ALLOCATED_BYTES, CUDA_MAX_ALLOCATED_BYTES, CUDA_RESERVED_BYTES)
"""Every figure a ``memory`` entry carries besides ``rank``."""

# step events: ``ranks``, one object per rank every log_every steps (with more than one rank)
WAIT_S = "wait_s"  # seconds the rank waited in collectives it can observe: SYNC_S + COMM_S

# step events of a mixture-of-experts model: ``moe``, one object, each list one entry per MoE layer (train.routing)
MOE = "moe"
MOE_LAYERS = "layers"  # the layers' module paths without ".ff": "layers.1", "decoder.layers.3"
MOE_TOP_K = "top_k"
MOE_TOKENS_PER_EXPERT = "tokens_per_expert"  # [layer][expert] assignments computed (after capacity), all dp ranks
MOE_DROPPED_TOKENS = "dropped_tokens"  # [layer] assignments cut by the capacity, all dp ranks
MOE_AUX_LOSS = "aux_loss"  # [layer] load-balancing loss value (no coefficient), mean over micro-batches and ranks
MOE_Z_LOSS = "z_loss"  # [layer] router z-loss value, likewise
MOE_MAX_LOAD_RATIO = "max_load_ratio"  # [layer] the busiest expert's tokens / the mean per expert (1 = uniform)
MOE_A2A_BYTES = "a2a_bytes"  # [layer] bytes sent in the expert all-to-alls, all ranks (expert parallelism)
MOE_A2A_WAIT_MS = "a2a_wait_ms"  # [layer] ms waited in them, mean over the dp ranks (expert parallelism)

# tasks events (in-loop downstream evaluation, train.eval_tasks)
TASK_SCORES = "scores"  # {task: {metric: value}}: lm-eval's metrics (acc, acc_norm 0..1; exact_match,strip; ...)
