"""The preset schema: one dataclass per table, each field documented by the string under it.

``[run]``, ``[training]`` and ``[launch]`` are the core's tables, described here. ``[model]``, ``[data]``,
``[strategy]`` and ``[profiler]`` each carry a ``name`` that picks a plugin; the rest of such a table is validated
against the dataclass that plugin registered (:class:`PluginSection` holds both). Defaults live in the dataclasses,
so a preset holds only what differs from them. The loader (TOML, ``extends``, ``--set``, the validation walk and
line finding) is :mod:`torch_handle.config.loader`; this module only describes, as torchtitan keeps ``job_config.py``
apart from its config manager.

Standard library only, so reading the schema (``handle presets show --docs``) is instant.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from torch_handle.common.precision import ConfigPrecision
from torch_handle.errors import InvalidValue

FROZEN_ON_RESUME = "frozen_on_resume"
"""The field metadata key that :func:`param`'s ``frozen_on_resume`` sets (read by :func:`resume_declaration`)."""


def param(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
          le: float | None = None, lt: float | None = None, default_factory: Any = dataclasses.MISSING,
          frozen_on_resume: bool | str | None = None) -> Any:
    """A dataclass field with a numeric range that validation enforces (``ge``: >=, ``gt``: >, ``le``: <=,
    ``lt``: <).

    ``frozen_on_resume`` (a plugin's option): whether ``handle run --resume --set`` may change it, when the
    table's rule (:mod:`torch_handle.checkpoint.resume`) is not the right one: a string freezes it with that
    reason (the end of the one-line refusal: ``cannot change strategy.x on --resume (1 -> 2): <reason>``), True
    freezes it with the table's reason, False lets it change.

    Raises:
        TypeError: ``frozen_on_resume`` is an empty string or not a bool or str.
    """
    if not (frozen_on_resume is None or isinstance(frozen_on_resume, bool)
            or (isinstance(frozen_on_resume, str) and frozen_on_resume)):
        raise TypeError(f"frozen_on_resume must be a bool or a non-empty reason, got {frozen_on_resume!r}")
    metadata = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt),
                                  (FROZEN_ON_RESUME, frozen_on_resume)) if v is not None}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def resume_declaration(cls: type, name: str) -> bool | str | None:
    """What the options dataclass ``cls`` declares for its option ``name`` on a resume (``param(...,
    frozen_on_resume=...)``): a reason or True (frozen), False (may change), None (not declared, or no such
    option)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get(FROZEN_ON_RESUME)
    return None


# --------------------------------------------------------------------------------------------------------------
# Core sections. The string under each field is its documentation (shown by `handle presets show --docs`).
# --------------------------------------------------------------------------------------------------------------


@dataclass
class RunConfig:
    """``[run]``: what the run is called and where it writes."""

    name: str = "handle"
    """Run name; the run directory is ``<output_dir>/<name>-<UTC timestamp>``."""
    output_dir: str = "runs"
    """Directory that holds run directories (relative to the working directory)."""
    seed: int = param(1234, ge=0)
    """Seed for torch, Python and NumPy on every rank (the data order depends on it too)."""

    def check(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.name):
            raise InvalidValue("name", f"{self.name!r} must use only letters, digits, '.', '_' and '-'")
        if self.name[0] in ".-":
            # a hidden run directory would be skipped by `handle tui`; a leading '-' reads as an option
            raise InvalidValue("name", f"{self.name!r} must not start with '.' or '-'")


@dataclass
class TrainingConfig:
    """``[training]``: the optimisation loop, shared by every strategy."""

    steps: int = param(200, ge=1)
    """Optimizer steps to run (each step consumes micro_batch_size * grad_accum * world_size samples)."""
    micro_batch_size: int = param(8, ge=1)
    """Samples per rank per forward/backward."""
    grad_accum: int = param(1, ge=1)
    """Micro-batches accumulated before each optimizer step."""
    lr: float = param(1e-3, gt=0.0)
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = param(0.1, ge=0.0, le=1.0)
    """Final learning rate as a fraction of lr (cosine and linear schedules)."""
    warmup_steps: int = param(20, ge=0)
    """Linear warm-up from 0 to lr over this many steps."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Learning-rate decay after warm-up."""
    weight_decay: float = param(0.01, ge=0.0)
    """Decoupled weight decay of AdamW (Loshchilov & Hutter 2019)."""
    beta1: float = param(0.9, ge=0.0, le=1.0)
    """AdamW beta1."""
    beta2: float = param(0.95, ge=0.0, le=1.0)
    """AdamW beta2."""
    grad_clip: float = param(1.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    label_smoothing: float = param(0.0, ge=0.0, lt=1.0)
    """Label smoothing eps of the training loss (Szegedy et al. 2016; Vaswani et al. 2017 use 0.1): the target
    puts 1 - eps on the label and eps spread over the vocabulary. Validation loss stays plain cross-entropy.
    0 = off. May change on --resume (the checkpoint does not depend on it)."""
    precision: ConfigPrecision = "auto"
    """Compute precision: bf16 and fp16 keep fp32 master weights; fp16 uses dynamic loss scaling. auto: chosen
    when the run starts: bf16 on CUDA compute capability >= 8.0, else fp16 where the strategy scales the loss,
    else fp32; on a CPU bf16 only where a measured bf16 matmul is >= 1.25x as fast as fp32 (docs/performance.md)."""
    eval_every: int = param(50, ge=0)
    """Evaluate on the validation split every N steps (and at the end); 0 = only at the end."""
    eval_steps: int = param(10, ge=1)
    """Validation micro-batches per rank for each evaluation."""
    log_every: int = param(10, ge=1)
    """Every N steps, gather per-rank memory into the step event."""
    checkpoint_every: int = param(100, ge=0)
    """Write a checkpoint every N steps (and at the end); 0 = only at the end."""
    keep_last: int = param(2, ge=1)
    """How many checkpoints to keep; older ones are deleted once a newer one is complete."""
    on_nan: Literal["stop", "skip"] = "stop"
    """On a non-finite loss: stop the run as failed, or skip that update."""
    compile: bool = False
    """``torch.compile`` each of the model's ``blocks()`` in place (as torchtitan does) before the strategy wraps
    it: single, ddp, fsdp, scratch-ddp; on one process (``single``, no activation checkpointing, no MoE, nothing
    frozen) the whole model instead. The loss's cross-entropy is compiled too and, on CPU, AdamW fused.
    docs/performance.md compares it with eager and with litgpt."""
    loss_impl: Literal["auto", "chunked", "full"] = "auto"
    """How the output layer and the loss are computed. full: the model returns the (B, T, V) logits and the loss
    reads them. chunked: the model returns its last hidden states and the loss projects them to the vocabulary a
    chunk of tokens at a time, the gradients computed chunk by chunk, so no (tokens x vocabulary) tensor exists
    (Liger Kernel's FusedLinearCrossEntropy): the same loss and gradients with far less memory at large
    vocabularies; the from-scratch decoder on an unsplit model whose strategy holds whole parameters. auto:
    chunked where it runs and a micro-batch's fp32 logits would reach 256 MiB, else full (docs/performance.md).
    May change on --resume."""


@dataclass
class LaunchConfig:
    """``[launch]``: how torchrun starts the workers."""

    nproc_per_node: int = param(1, ge=1)
    """Worker processes on this node (one per GPU on CUDA)."""
    nnodes: int = param(1, ge=1)
    """Number of nodes; every node runs `handle run` with its own node_rank."""
    node_rank: int = param(0, ge=0)
    """Rank of this node, 0 .. nnodes-1."""
    rdzv_endpoint: str = ""
    """host:port of the rendezvous for multi-node runs; empty on one node (a free port is chosen)."""
    max_restarts: int = param(0, ge=0)
    """How often torchrun restarts the worker group after a failure; each restart resumes from a checkpoint."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: auto = nccl with CUDA, gloo without."""
    timeout_s: int = param(600, ge=10)
    """Timeout of collective operations in seconds; a lost peer ends in an error instead of a hang."""
    hang_timeout_s: float = param(300.0, gt=0.0)
    """Watchdog: when no rank of this node has made progress for this many seconds, the launcher writes every
    rank's Python stacks to logs/stacks-<time>.txt and a `hang` event naming where each rank waits. At most
    half of timeout_s, so it fires well before the collective timeout ends the run."""
    on_hang: Literal["warn", "stop"] = "warn"
    """What the watchdog does after the stacks: warn (the run goes on; it may still recover) or stop (the run
    ends failed with the hang message, every worker terminated)."""

    def check(self) -> None:
        if self.hang_timeout_s > self.timeout_s / 2:
            raise InvalidValue("hang_timeout_s", f"{self.hang_timeout_s:g} must be at most half of launch.timeout_s "
                                                 f"({self.timeout_s} s, the collective timeout), so the watchdog "
                                                 f"fires well before the timeout ends the run: lower it or raise "
                                                 f"launch.timeout_s")
        if self.node_rank >= self.nnodes:
            raise InvalidValue("node_rank", f"{self.node_rank} must be below nnodes ({self.nnodes})")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise InvalidValue("rdzv_endpoint", "is required when nnodes > 1 (for example 'node0:29400')")
        if self.rdzv_endpoint:
            m = re.fullmatch(r"(?:[^\s:\[\]]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})", self.rdzv_endpoint)
            if not m or not 1 <= int(m.group(1)) <= 65535:
                raise InvalidValue("rdzv_endpoint", f"{self.rdzv_endpoint!r} must look like 'host:port' "
                                                    f"(port 1-65535)")
        if self.backend == "nccl":
            import torch  # only for an explicit nccl choice: validation stays torch-free otherwise

            devices = torch.cuda.device_count()
            if self.nproc_per_node > devices:
                raise InvalidValue("nproc_per_node", f"{self.nproc_per_node} processes but {devices} CUDA device(s) "
                                                     f"visible: nccl needs one device per process (or use gloo)")


PP_SCRATCH = ("gpipe", "1f1b")
"""The pipeline schedules written by hand (``pp_impl = "scratch"``)."""
PP_MULTI_STAGE = frozenset({"interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev"})
"""Schedules that run several model chunks (stages) per rank: ``parallel.pp_stages_per_rank`` v >= 2."""
PP_V_SHAPED = frozenset({"zbv", "dualpipev"})
"""Schedules that place stages in a V (rank r holds stages r and 2p - 1 - r) and need exactly v = 2."""


@dataclass
class ParallelConfig:
    """``[parallel]``: how each model replica is split across ranks. The data-parallel degree (the ``[strategy]``'s
    replicas) is then world_size / tp; ranks are laid out with TP varying fastest (docs/tensor-parallel.md)."""

    tp: int = param(1, ge=1)
    """Tensor-parallel degree: each Transformer block's linears split over this many ranks (Megatron-LM's layout).
    Must divide the world size, n_heads and d_ff."""
    tp_impl: Literal["auto", "native", "scratch"] = "auto"
    """native: DTensor parallelize_module, as torchtitan does; scratch: the hand-written column/row-parallel
    layers and f/g functions of torch_handle/parallel/tensor/; auto: native where it runs (strategy single or
    fsdp, pp = 1), else scratch, chosen when the preset loads and recorded in run.json (tp_impl_reason)."""
    sequence_parallel: bool = False
    """Run LayerNorm and dropout on 1/tp of the sequence between the TP regions (Korthikanti et al. 2022);
    needs seq_len divisible by tp."""

    ep: int = param(1, ge=1)
    """Expert-parallel degree: each MoE layer's n_experts split over this many ranks, drawn from the data-parallel
    ranks as torchtitan does (ep divides the data-parallel degree and model.n_experts); tokens travel to their
    experts' ranks and back by two all-to-alls (docs/expert-parallel.md)."""
    ep_impl: Literal["native", "scratch"] = "native"
    """native: torch's all_to_all_single with split sizes on the DeviceMesh's "ep" dimension, as torchtitan does;
    scratch: the hand-written dispatch and combine of torch_handle/parallel/expert/ (counts exchanged first, the
    permutation written out, bytes and waits counted)."""

    pp: int = param(1, ge=1)
    """Pipeline-parallel degree: the model's layers split into this many stages on as many ranks
    (docs/pipeline-parallel.md). tp x pp must divide the world size."""
    pp_impl: Literal["native", "scratch"] = "native"
    """native: torch.distributed.pipelining (PipelineStage and its schedule classes); scratch: the hand-written
    GPipe and 1F1B of torch_handle/parallel/pipeline/."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv",
                         "dualpipev"] = "1f1b"
    """The order of forwards and backwards: gpipe and 1f1b (both implementations); the rest run several stages
    per rank (pp_stages_per_rank >= 2) and are native only; zbv and dualpipev need exactly 2."""
    pp_microbatches: int = param(0, ge=0)
    """m: pipeline micro-batches per step; they split the step's micro_batch_size x grad_accum samples, which m
    must divide. 0: grad_accum (each of the step's micro-batches is one pipeline micro-batch)."""
    pp_stages_per_rank: int = param(1, ge=1)
    """v: model chunks (stages) per pipeline rank; the model splits into pp x v stages."""
    pp_layers: list[int] = field(default_factory=list)
    """Layers of each stage, first to last (pp x v counts adding up to n_layers); empty: balanced by pp_split."""
    pp_split: Literal["layers", "params"] = "layers"
    """How an empty pp_layers balances the stages: equal layers, or equal parameters (the embedding counts on the
    first stage, the head on the last)."""

    cp: int = param(1, ge=1)
    """Context-parallel degree: each sequence split over this many ranks, which read the same samples and each keep
    2 of its 2 x cp chunks (head-tail balanced, per packed document); attention meets the other ranks' keys by
    cp_impl (docs/context-parallel.md). data.seq_len must divide by 2 x cp; dp = world size / cp."""
    cp_impl: Literal["auto", "ring", "allgather", "ulysses", "native"] = "auto"
    """ring: K/V blocks passed around the ring (Liu et al. 2023); allgather: K/V gathered once per layer (Llama 3);
    ulysses: all-to-all from sequence to head shards (n_heads and n_kv_heads divisible by cp); native: torch's
    FlexAttention context parallel, the all-gather algorithm (CUDA only); auto: ring, or allgather with packed
    documents (data.document_mask)."""

    def check(self) -> Iterator[InvalidValue]:
        """Every problem of the table (a generator: the walk reports them all, one per key)."""
        if self.sequence_parallel and self.tp == 1:
            yield InvalidValue("sequence_parallel", "needs parallel.tp > 1 (it splits the sequence over the TP group)")
        if self.pp > 1:
            multi, v = self.pp_schedule in PP_MULTI_STAGE, self.pp_stages_per_rank
            if self.pp_impl == "scratch" and self.pp_schedule not in PP_SCRATCH:
                yield InvalidValue("pp_schedule", f"{self.pp_schedule!r} is native only; pp_impl = \"scratch\" runs "
                                                  f"{' or '.join(PP_SCRATCH)}")
            if multi and v < 2:
                yield InvalidValue("pp_stages_per_rank", f"{self.pp_schedule} runs several stages per rank: set "
                                                         f"pp_stages_per_rank >= 2 (it is {v})")
            elif self.pp_schedule in PP_V_SHAPED and v != 2:
                yield InvalidValue("pp_stages_per_rank", f"{self.pp_schedule} needs exactly 2 (it is {v})")
            if not multi and v > 1:
                yield InvalidValue("pp_stages_per_rank", f"{v} needs a schedule with several stages per rank "
                                                         f"(interleaved-1f1b, looped-bfs, interleaved-zb, zbv, "
                                                         f"dualpipev), not {self.pp_schedule}")
            if self.pp_layers and len(self.pp_layers) != self.pp * v:
                yield InvalidValue("pp_layers", f"lists {len(self.pp_layers)} stages; it needs pp x "
                                                f"pp_stages_per_rank = {self.pp * v} layer counts (or [] to balance)")
            elif self.pp_layers and min(self.pp_layers) < 1:
                yield InvalidValue("pp_layers", "every stage needs at least one layer")


FINETUNE_TARGETS = ("attention", "mlp", "all", "q_proj", "k_proj", "v_proj", "out_proj", "o_proj", "gate_proj",
                    "up_proj", "down_proj", "linear1", "linear2")
"""What ``finetune.target_modules`` accepts: groups, this model's linears, peft's ``o_proj``
(``torch_handle/finetune/lora.py`` resolves them)."""


PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE_LOSSES = ("simpo", "orpo")
"""The preference losses (``torch_handle/train/objectives/preference.py``) that keep no reference model."""


@dataclass
class PreferenceConfig:
    """``[finetune.preference]``: the loss of ``objective = "dpo"`` on preference pairs (``handle data prepare
    --preference``; docs/fine-tuning.md#preference-tuning)."""

    loss: Literal["sigmoid", "ipo", "hinge", "simpo", "orpo"] = "sigmoid"
    """sigmoid: DPO (Rafailov et al. 2023); ipo (Azar et al. 2023); hinge (SLiC, Zhao et al. 2023); simpo (Meng et
    al. 2024, reference-free); orpo (Hong et al. 2024, reference-free, an SFT term plus an odds-ratio term)."""
    beta: float = 0.1
    """β > 0: the strength of the pull towards the reference (sigmoid, hinge), IPO's τ, SimPO's reward scale (2.0
    in its paper), ORPO's λ."""
    label_smoothing: float = param(0.0, ge=0.0, lt=0.5)
    """ε: the chance a pair's labels are flipped (conservative DPO; sigmoid and simpo)."""
    gamma: float = 0.0
    """SimPO's target reward margin γ (0.5 to 1.5 in its paper)."""
    reference: Literal["auto", "adapters_off", "copy", "precomputed", "none"] = "auto"
    """The reference model's log-probabilities: adapters_off (LoRA/QLoRA: the same model with its adapters switched
    off, no second copy), copy (a full fine-tune: a frozen copy of the model as built, sharded like the policy,
    every step), precomputed (once, from the model as built, before step 1; kept in the run directory and cached
    under the data's and the base's hashes, no reference model), none (a reference-free loss), auto (adapters_off
    with LoRA/QLoRA, precomputed for a full fine-tune, none for a reference-free loss)."""

    def resolved(self, method: str) -> str:
        """The reference a run of ``finetune.method`` keeps: ``reference``, or what ``auto`` stands for."""
        if self.reference != "auto":
            return self.reference
        return "none" if self.loss in REFERENCE_FREE_LOSSES else "adapters_off" if method in ("lora", "qlora") \
            else "precomputed"

    def check(self) -> Iterator[InvalidValue]:
        if self.beta <= 0:
            yield InvalidValue("beta", f"{self.beta!r} must be > 0 (beta scales the log-ratios; at 0 the loss stays "
                                       f"at ln 2 and nothing is learned)")
        free = self.loss in REFERENCE_FREE_LOSSES
        if self.reference == "none" and not free:
            yield InvalidValue("reference", f"'none': loss {self.loss!r} compares with a reference model (valid: "
                                            f"adapters_off, auto; or a reference-free loss: "
                                            f"{', '.join(REFERENCE_FREE_LOSSES)})")
        if self.reference in ("adapters_off", "copy", "precomputed") and free:
            yield InvalidValue("reference", f"{self.reference!r}: loss {self.loss!r} is reference-free (valid: none, "
                                            f"auto)")


@dataclass
class FinetuneConfig:
    """``[finetune]``: train low-rank adapters on a frozen base instead of every weight (LoRA, Hu et al. 2021;
    docs/lora.md). The base is the model's ``init_from`` directory (a ``handle export --format hf`` of a run, or a
    Llama / Qwen 3 checkpoint), loaded again and checked by hash on every resume; without ``init_from`` the base
    is the seed's initial weights (for tests). Checkpoints and ``model.safetensors`` hold the adapters alone."""

    method: Literal["none", "lora", "qlora"] = "none"
    """none: train every weight; lora: adapters on the target linears, everything else frozen; qlora: LoRA on a
    base stored in 4-bit NormalFloat (Dettmers et al. 2023)."""
    rank: int = param(8, ge=1)
    """r: the adapters' inner width (A is r x in_features, B out_features x r)."""
    alpha: float = param(16.0, gt=0.0)
    """The update is scaled by alpha / rank (peft's lora_alpha)."""
    dropout: float = param(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input (peft's lora_dropout); the base path has none of it."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """The linears that get adapters: q_proj, k_proj, v_proj, out_proj (o_proj), gate_proj, up_proj, down_proj
    (linear1, linear2 for the paper's FFN), or the groups attention, mlp, all. Default: W_q and W_v, as Hu et al."""
    objective: Literal["lm", "sft", "dpo"] = "lm"
    """lm: every token is a label (text); sft: conversations prepared with ``handle data prepare --chat``, packed,
    the loss the mean over their trained tokens only (the answers; docs/fine-tuning.md); dpo: preference pairs
    prepared with ``--preference``, the loss ``[finetune.preference]`` names. Any method."""
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    """``[finetune.preference]``: the preference loss of ``objective = "dpo"``."""

    def check(self) -> Iterator[InvalidValue]:
        if self.objective == "dpo" and self.method == "none" and self.preference.reference == "adapters_off":
            yield InvalidValue("preference.reference", "'adapters_off' needs adapters (method = 'lora' or 'qlora'); "
                                                       "a full fine-tune takes 'copy' or 'precomputed' (or auto)")
        if self.objective == "dpo" and self.method != "none" and self.preference.reference == "copy":
            yield InvalidValue("preference.reference", f"'copy' is a full fine-tune's (method = 'none'); under "
                                                       f"method = {self.method!r} the reference is the same model "
                                                       f"with its adapters off (valid: adapters_off, precomputed, "
                                                       f"auto)")
        for target in self.target_modules:
            if target not in FINETUNE_TARGETS:
                yield InvalidValue("target_modules", f"{target!r} is not a linear of the Transformer (valid: "
                                                     f"{', '.join(FINETUNE_TARGETS)})")
        if self.method != "none" and not self.target_modules:
            yield InvalidValue("target_modules", "is empty: name at least one linear (or attention, mlp, all)")


@dataclass
class EvalConfig:
    """``[eval]``: downstream tasks of EleutherAI's lm-evaluation-harness scored during training, on the workers with
    the model being trained (docs/evaluation.md#during-training); each rank of the data-parallel group scores its
    share of the documents. Needs the ``eval`` extra. The task names, include directories and local data files are
    checked with the preset by the transformer model plugin's ``check_preset`` (the harness is not imported here)."""

    tasks: list[str] = field(default_factory=list)
    """Harness task names (``hellaswag``, ``arc_easy``) or those of ``include_paths`` directories; empty: none."""
    every: int = param(0, ge=0)
    """Score the tasks every this many optimizer steps, and after the last step; 0: after the last step only."""
    limit: int | None = param(None, ge=1)
    """Documents per task (the first ones; the harness's ``--limit``); unset: every document."""
    include_paths: list[str] = field(default_factory=list)
    """Directories of local task YAML files (the harness's ``--include_path``), relative to the working directory."""
    batch_size: int = param(16, ge=1)
    """Requests per forward."""
    num_fewshot: int | None = param(None, ge=0)
    """Examples from the task's few-shot split put before each question (the harness's ``--num_fewshot``); unset:
    the task's own setting."""


@dataclass
class PluginSection:
    """A ``[model]``/``[data]``/``[strategy]``/``[profiler]`` table: the plugin ``name`` and its options."""

    name: str
    options: Any
    """An instance of the dataclass that the plugin registered for its section."""


PLUGIN_TABLES: dict[str, str] = {"model": "model", "data": "dataset", "strategy": "strategy", "profiler": "profiler"}
"""Preset table -> plugin kind."""

DEFAULT_PLUGINS: dict[str, str] = {"model": "transformer", "data": "pydoc", "strategy": "single", "profiler": "none"}
CORE_TABLES: dict[str, type] = {"run": RunConfig, "training": TrainingConfig, "launch": LaunchConfig,
                                "parallel": ParallelConfig, "finetune": FinetuneConfig, "eval": EvalConfig}
TABLE_ORDER = ("run", "model", "data", "training", "finetune", "eval", "strategy", "parallel", "launch", "profiler")


def plugin_name(table: str, values: Any) -> Any:
    """The plugin a (merged) plugin table selects: its ``name``, else the default; None when it is not a table."""
    if values is None:
        return DEFAULT_PLUGINS[table]
    return values.get("name", DEFAULT_PLUGINS[table]) if isinstance(values, dict) else None


@dataclass
class Preset:
    """A fully resolved and validated preset."""

    run: RunConfig
    model: PluginSection
    data: PluginSection
    training: TrainingConfig
    strategy: PluginSection
    launch: LaunchConfig
    profiler: PluginSection
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    source: str = "<preset>"
    """Where the preset came from (for messages)."""
    resolved: dict[str, str] = field(default_factory=dict, compare=False)
    """The settings the loader chose for an ``"auto"``, by ``table.key``, each with its one-line reason
    (``{"parallel.tp_impl": "auto → scratch: ddp does not wrap DTensor parameters ..."}``); not written to TOML."""

    @property
    def world_size(self) -> int:
        return self.launch.nproc_per_node * self.launch.nnodes


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal under each field), by field name."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
