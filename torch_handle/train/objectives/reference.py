"""The reference model of a DPO full fine-tune (``[finetune.preference] reference``): a frozen copy, or the
precomputed table shared between runs.

``copy`` (:func:`build_reference_copy`): a second model built as the run built its policy at step 0 (the seed's
weights, or ``model.init_from``'s), frozen (no gradients, evaluation mode), held as the strategy holds the policy's
parameters (:data:`~torch_handle.config.layout.COPY_SHARDED`: a plain copy under single, ddp, scratch-ddp and
DeepSpeed ZeRO-1/2, ``fully_shard`` under fsdp), and run under ``no_grad`` on every micro-batch before the policy
(torchtune's full-fine-tune DPO recipe keeps such a ``_ref_model``). It is the objective's, not the strategy's: never
in the optimizer or a checkpoint; a resumed run builds it again from the same base, not from the moved policy.

``precomputed`` (:func:`cached_reference`): the table of :func:`~torch_handle.train.objectives.pairs.
precompute_reference` is kept in the run directory (for a resume) and in ``<cache>/reference-logps/<KEY>.pt``
(``<cache>``: :func:`~torch_handle.data.cache.cache_root`), ``KEY`` the SHA-256 of what the log-probabilities depend
on (:func:`reference_key`): the data (its identity and options), the base (the SHA-256 of ``init_from``'s weight and
config files, or the seed for a model built from scratch), the model's options, the fine-tuning method, the
precision, the loss path and the device type. A second run on the same data and base reads the table instead of
computing it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from torch_handle.train.objectives.logps import sequence_logps

REFERENCE_CACHE = "reference-logps"
"""The cache's subdirectory of precomputed reference tables, one ``<KEY>.pt`` each."""
COUNTS = {"computed": 0, "cached": 0}
"""How often this process computed a precomputed reference and read one from the cache (for tests and logs)."""


class ReferenceCopy:
    """A frozen copy of the policy as built, with the strategy's face that
    :func:`~torch_handle.train.objectives.logps.sequence_logps` reads: ``model`` (what is called: the module,
    ``fully_shard``-ed in place under fsdp), :meth:`unwrapped` and :meth:`autocast` (the policy strategy's)."""

    def __init__(self, model: torch.nn.Module, autocast: Any) -> None:
        self.model = model
        self._autocast = autocast

    def unwrapped(self) -> torch.nn.Module:
        return self.model

    def autocast(self) -> AbstractContextManager:
        return self._autocast()

    def logps(self, ids: torch.Tensor, labels: torch.Tensor, loss_impl: str) -> torch.Tensor:
        """The copy's summed log-probabilities of rows ``ids``, ``labels`` (N, T) -> (N,) fp32, without gradients;
        a sharded copy's parameters are sharded again afterwards (FSDP2 keeps its root unit gathered after a forward
        when a backward is expected: none comes). Collective under fsdp."""
        with torch.no_grad():
            out = sequence_logps(self, ids, labels, loss_impl)
        reshard = getattr(self.model, "reshard", None)
        if reshard is not None:
            reshard()
        return out

    def nbytes(self) -> int:
        """The bytes of the copy's parameters this rank holds (a shard's local rows under fsdp)."""
        from torch_handle.train.strategy import tensor_bytes

        return tensor_bytes(q.to_local() if hasattr(q, "to_local") else q for q in self.model.parameters())


def build_reference_copy(trainer: Any) -> ReferenceCopy:
    """``reference = "copy"``: the trainer's model built again as at step 0 (``torch.manual_seed(run.seed)``, the
    model plugin's factory, ``init_from`` and ``[finetune]`` as :func:`~torch_handle.finetune.build.prepare_model`
    applies them to a new run), on the device, frozen, in evaluation mode, held like the policy. The global random
    state is left as it was. Collective-free.

    Raises:
        ValueError: a layout :func:`~torch_handle.config.layout.reference_copy_problem` refuses (``handle
            validate`` says so first)."""
    from torch_handle.checkpoint import hf_dir
    from torch_handle.config.layout import COPY_SHARDED, reference_copy_problem
    from torch_handle.finetune.build import prepare_model
    from torch_handle.observe.fields import Level

    p, data = trainer.preset, trainer.data
    problem = reference_copy_problem(p)
    if problem is not None:
        raise ValueError(f"finetune.preference.{problem[0]}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(p.run.seed)  # as Trainer.build seeds the policy's factory
        model = trainer.registry.get("model", p.model.name).factory(p.model.options, data.vocab_size, data.pad_id,
                                                                    data.max_len)
        prepare_model(model, p, new_run=True, load_base=hf_dir.load_into)
    model.requires_grad_(False)
    model.train(False)
    strategy = trainer.strategy
    if p.strategy.name == "fsdp":
        model = strategy.wrap(model.to(trainer.ctx.device))  # fully_shard, with the policy's mixed precision
    else:  # the dtype the policy's parameters have (DeepSpeed casts them to bf16/fp16 itself)
        dtype = next((q.dtype for q in strategy.unwrapped().parameters() if q.is_floating_point()), None)
        model = model.to(trainer.ctx.device, dtype=dtype)
    copy = ReferenceCopy(model, strategy.autocast)
    trainer.note(Level.INFO, f"finetune.preference.reference: a frozen copy of the model as built "
                             f"({COPY_SHARDED[p.strategy.name]}), {copy.nbytes():,} bytes on rank {trainer.ctx.rank}")
    return copy


def base_identity(preset: Any) -> dict[str, Any]:
    """What the model as built depends on: ``{"base": SHA-256 of init_from's *.safetensors and config.json}`` or
    ``{"seed": run.seed}`` for a model built from scratch, the model plugin and its options (``init_from`` left
    out: the bytes count, not the path), and the fine-tuning method (QLoRA's base is NF4)."""
    options = dataclasses.asdict(preset.model.options) if dataclasses.is_dataclass(preset.model.options) else \
        dict(vars(preset.model.options))
    init_from = options.pop("init_from", None)
    out: dict[str, Any] = {"model": preset.model.name, "options": options, "method": preset.finetune.method}
    if init_from:
        from torch_handle.data.shards import file_sha256

        root = Path(init_from)
        files = sorted(root.glob("*.safetensors")) + [root / "config.json"]
        out["base"] = hashlib.sha256("".join(f"{f.name}:{file_sha256(f)};" for f in files if f.is_file())
                                     .encode()).hexdigest()
    else:
        out["seed"] = preset.run.seed
    return out


def reference_key(trainer: Any) -> str:
    """The SHA-256 (hex) naming a precomputed reference table in the cache: the data's identity
    (:func:`torch_handle.launch.data_identity.record`), dataset plugin and options and split sizes, the base
    (:func:`base_identity`), the precision, the loss path and the device type."""
    from torch_handle.launch import data_identity

    p, data = trainer.preset, trainer.data
    data_options = p.data.options
    fields = {"data": data_identity.record(data.identity, data.tokenizer_path), "dataset": p.data.name,
              "data_options": dataclasses.asdict(data_options) if dataclasses.is_dataclass(data_options) else
              dict(vars(data_options)), "sizes": [len(data.train), len(data.valid)], **base_identity(p),
              "precision": p.training.precision, "loss_impl": trainer.loss_impl,
              "device": trainer.ctx.device.type}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def cached_reference(trainer: Any, compute: Any) -> dict[str, torch.Tensor]:
    """The precomputed reference of a run at step 0: read from the cache when every rank finds
    ``<cache>/reference-logps/<KEY>.pt`` (:func:`reference_key`), else ``compute(trainer)`` (collective) and
    written there by rank 0 (a temporary file renamed into place). Logs which. Collective (one all-reduce)."""
    from torch_handle.data.cache import cache_root
    from torch_handle.observe.fields import Level

    ctx = trainer.ctx
    path = cache_root(trainer.preset.run.output_dir) / REFERENCE_CACHE / f"{reference_key(trainer)}.pt"
    found = torch.tensor([float(path.is_file())], device=ctx.device)
    if ctx.distributed:  # read by all or computed by all: computing is collective
        import torch.distributed as dist

        dist.all_reduce(found, op=dist.ReduceOp.MIN)
    if found.item() > 0:
        table = {k: v.to(ctx.device) for k, v in torch.load(path, weights_only=True).items()}
        COUNTS["cached"] += 1
        trainer.note(Level.INFO, f"finetune.preference.reference: the precomputed reference read from {path} (the "
                                 f"same data and base)")
        return table
    table = compute(trainer)
    COUNTS["computed"] += 1
    if ctx.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        torch.save({k: v.cpu() for k, v in table.items()}, tmp)
        os.replace(tmp, path)
        trainer.note(Level.INFO, f"finetune.preference.reference: precomputed before step 1, cached at {path}")
    return table
