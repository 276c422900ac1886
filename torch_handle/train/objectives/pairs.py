"""The objective ``dpo``: preference pairs (:class:`~torch_handle.data.chat.pair_samples.PreferencePairs`) and a
preference loss (:mod:`torch_handle.train.objectives.preference`, ``[finetune.preference]``).

A micro-batch of B pairs, ``input_ids`` and ``labels`` (B, 2, T), runs as ONE forward of 2B rows, the B chosen rows
first, then the B rejected (torchtune's and TRL's ``concatenated_forward``); each row's summed log-probability of
its trained tokens (the completion's) is the policy's ``s``. The reference model's, for a reference-based loss, is
the same model with its LoRA adapters switched off (:func:`~torch_handle.finetune.lora.adapters_disabled`, no second
copy; peft's ``disable_adapter`` as TRL and torchtune use it), in evaluation mode (no dropout), under ``no_grad``;
or ``precomputed`` (:func:`precompute_reference`): computed once for every pair, from the model as built, before
step 1 (TRL's ``precompute_ref_log_probs``; no reference model kept, so a full fine-tune has one too), kept in
the run directory (:data:`REFERENCE_FILE`) for a resume and cached for other runs on the same data and base; or, for
a full fine-tune, ``copy``: a frozen copy of the model as built, held like the policy
(:mod:`~torch_handle.train.objectives.reference`). The loss is the mean over pairs; a step's and an
evaluation's metrics are the means over the pairs of every data-parallel rank (their sums ride on the trainer's one
all-reduce: :meth:`DirectPreference.attach`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.finetune.lora import adapters_disabled
from torch_handle.train.objectives.logps import row_logps, sequence_logps
from torch_handle.train.objectives.preference import METRICS, PairLogps, PreferenceLoss, preference_loss

STUCK_STEPS = 3
"""Steps past the warm-up after which a loss still at ln 2 with zero margins is reported (trl #1311, #1627)."""
REFERENCE_FILE = "reference_logps.pt"
"""In the run directory: the precomputed reference's ``{"train": (N, 2), "valid": (M, 2)}`` float64 sums (chosen,
rejected per pair, in the splits' order)."""
TRAINED_TOKENS = "tokens"
"""The step record's key for the labels a step counted (the trainer's ``tokens``; the step report adds the
positions computed beside them)."""


@contextlib.contextmanager
def reference_model(model: torch.nn.Module) -> Iterator[None]:
    """``model`` as its reference inside the block: adapters off, evaluation mode (no dropout: TRL's
    ``disable_dropout``), no gradients; the training mode restored after."""
    training = model.training
    model.train(False)
    try:
        with torch.no_grad(), adapters_disabled(model):
            yield
    finally:
        model.train(training)


def reference_rows(trainer: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """Summed log-probabilities (N,) of rows ``ids``, ``labels`` (N, T) from the trainer's model as it is (the
    caller sets the reference up: :func:`reference_model`), through whatever split it has: the TP share's
    vocabulary-split logits, or a pipeline's forward-only pass (``forward_only``). On one rank of each TP and CP group
    and on the last pipeline stage; None on the others. Collective under tp, pp or cp."""
    if trainer.pipeline is None:
        logps = sequence_logps(trainer.strategy, ids, labels, trainer.loss_impl, trainer.share)
    else:
        out = trainer.pipeline.forward_only([{"input_ids": ids}], lambda o, i: row_logps(o, labels, trainer.share))
        logps = out[0] if out else None
    return logps if trainer.ctx.tp_rank == 0 and trainer.ctx.cp_rank == 0 else None


def precompute_reference(trainer: Any) -> dict[str, torch.Tensor]:
    """The reference's summed log-probabilities of every pair of the training and validation splits, ``{"train":
    (N, 2), "valid": (M, 2)}`` float64 (chosen, rejected), from the model as it is now (:func:`reference_model`:
    adapters off, evaluation mode, no gradients), micro-batch by micro-batch. Each data-parallel rank computes every
    ``dp_size``-th pair and one all-reduce joins them; every rank runs as many forwards (the last ones repeated), as
    a sharded model's collectives need. Collective."""
    from torch_handle.observe.heartbeat import beat

    strategy, ctx, B = trainer.strategy, trainer.ctx, trainer.training.micro_batch_size
    out = {}
    for split, dataset in (("train", trainer.data.train), ("valid", trainer.data.valid)):
        table = torch.zeros(len(dataset), 2, dtype=torch.float64, device=ctx.device)
        share = -(-len(dataset) // ctx.dp_size)  # pairs per rank, rounded up
        mine = [min(ctx.dp_rank + ctx.dp_size * k, len(dataset) - 1) for k in range(share)]
        for start in range(0, share, B):
            beat("reference", trainer.step)
            index = mine[start:start + B]
            items = [dataset[i] for i in index]
            ids, labels = (torch.stack([it[k] for it in items]).to(ctx.device) for k in ("input_ids", "labels"))
            with reference_model(strategy.unwrapped()):
                logps = reference_rows(trainer, ids.transpose(0, 1).reshape(2 * len(index), -1),
                                       labels.transpose(0, 1).reshape(2 * len(index), -1))
            if logps is None:  # a TP rank but the first, a pipeline stage but the last: the others write
                continue
            owned = [k for k, i in enumerate(index) if ctx.dp_rank + ctx.dp_size * (start + k) < len(dataset)]
            rows = logps.view(2, len(index)).T.double()  # (pairs, 2)
            table[[index[k] for k in owned]] = rows[owned]
        if ctx.distributed:
            import torch.distributed as dist

            dist.all_reduce(table)
        out[split] = table
    return out


class DirectPreference:
    """``dpo``: the preference loss of ``options`` (a :class:`~torch_handle.config.schema.PreferenceConfig`) on
    pairs, for a model fine-tuned by ``method``. ``reference``: ``adapters_off``, ``copy``
    (:mod:`~torch_handle.train.objectives.reference`), ``precomputed`` or ``none`` (``auto``: none for a
    reference-free loss, adapters_off under lora and qlora, else precomputed)."""

    name = "dpo"

    def __init__(self, options: Any, method: str = "lora") -> None:
        self.loss: PreferenceLoss = preference_loss(options.loss, options.beta, options.label_smoothing,
                                                    options.gamma)
        self.reference = options.resolved(method)
        self.copy: Any = None
        """``copy``'s frozen model (:class:`~torch_handle.train.objectives.reference.ReferenceCopy`), once built."""
        self.table: dict[str, torch.Tensor] | None = None
        """The precomputed reference (:func:`precompute_reference`), once read or computed."""
        self.sums: torch.Tensor | None = None
        """Σ over pairs of each of :data:`METRICS`, then the trained tokens, since the last :meth:`attach`."""
        self.training = False
        """Whether the sums are a training step's (else an evaluation's)."""
        self.margins: list[float] | None = []
        """The training steps' ``rewards/margins`` until the check of :meth:`check_stuck` (None after it)."""

    def forward_loss(self, trainer: Any, batch: dict[str, torch.Tensor], *, train: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the mean of the micro-batch's per-pair losses, its pairs B) of ``batch`` (``input_ids``, ``labels``:
        (B, 2, T))."""
        if train:
            self.check_stuck(trainer)
        self.training = train
        inputs, target = self.split(batch)
        ids, labels, index = inputs["input_ids"], target["labels"], target.get("pair")  # (2B, T): chosen, rejected
        B = ids.shape[0] // 2
        strategy = trainer.strategy
        # the reference first: its forward's buffers (its (2B, T, V) logits among them) are freed before the policy
        # saves anything, so the step's peak is the policy's alone (benchmarks/preference.py: 1.008x SFT's on the
        # same rows with the policy first, 1.00003x so)
        ref: tuple[torch.Tensor, ...] = ()
        if self.reference == "adapters_off":
            with reference_model(strategy.unwrapped()):
                logps = sequence_logps(strategy, ids, labels, trainer.loss_impl, trainer.share)
            ref = (logps[:B], logps[B:])
        elif self.reference == "precomputed":
            rows = self.reference_table(trainer)["train" if train else "valid"][index].float()  # (B, 2)
            ref = (rows[:, 0], rows[:, 1])
        elif self.reference == "copy":
            if self.copy is None:  # built at the first micro-batch: step 0's evaluation, or a resume's first step
                from torch_handle.train.objectives.reference import build_reference_copy

                self.copy = build_reference_copy(trainer)
            logps = self.copy.logps(ids, labels, trainer.loss_impl)
            ref = (logps[:B], logps[B:])
        policy = sequence_logps(strategy, ids, labels, trainer.loss_impl, trainer.share)  # (2B,) fp32
        loss, pairs = self.pair_loss(trainer, policy, labels, ref)
        return trainer.aux_loss_scale.probe(loss), pairs

    def pair_loss(self, trainer: Any, policy: torch.Tensor, labels: torch.Tensor, ref: tuple[torch.Tensor, ...]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the mean of the per-pair losses, pairs B) from the policy's summed log-probabilities ``policy`` (2B,),
        the chosen rows first, their ``labels`` (2B, T) and the reference's (chosen (B,), rejected (B,)) or ``()``;
        adds the metric sums (once per TP and CP group); the pairs B (B / cp on each cp rank)."""
        B = policy.shape[0] // 2
        counts = (labels != IGNORE_INDEX).sum(1)
        lengths = counts.to(policy.dtype)
        losses, metrics = self.loss(PairLogps(policy[:B], policy[B:], lengths[:B], lengths[B:],
                                              *(r.to(policy.dtype) for r in ref)))
        ctx = trainer.ctx
        once = float(ctx.tp_rank == 0 and ctx.cp_rank == 0)  # a replica's TP and CP ranks hold the same pairs
        sums = torch.stack([*(metrics[k].sum() for k in METRICS), counts.sum().float()]).double() * once
        self.sums = sums if self.sums is None else self.sums + sums
        cp = ctx.cp_size  # the loop sums the pairs over a replica's cp ranks: B / cp each
        return losses.mean(), torch.tensor(B if cp == 1 else B / cp, device=losses.device)

    # -- a pipeline's micro-batches (parallel.pp > 1): the schedule calls these pieces -------------------------
    def split(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the model's inputs: ``input_ids`` (2B, T), the B chosen rows first; the loss's target: ``labels``
        (2B, T), and ``pair`` (B,) when the batch has it) of a micro-batch of B pairs (B, 2, T)."""
        ids, labels = batch.pop("input_ids"), batch.pop("labels")
        B = ids.shape[0]
        target = {"labels": labels.transpose(0, 1).reshape(2 * B, -1)}
        if "pair" in batch:
            target["pair"] = batch.pop("pair")
        return {"input_ids": ids.transpose(0, 1).reshape(2 * B, -1), **batch}, target

    def units(self, target: dict[str, torch.Tensor]) -> torch.Tensor:
        """The pairs of a micro-batch's target (what its loss is the mean over)."""
        return torch.tensor(target["labels"].shape[0] // 2, device=target["labels"].device)

    def prepare(self, trainer: Any, inputs: list[dict[str, torch.Tensor]], targets: list[dict[str, torch.Tensor]],
                forward: Any, *, train: bool = True) -> None:
        """Before a pipeline runs a step's (or an evaluation's) micro-batches: each target gets its rows'
        reference log-probabilities (``reference``: (2B,)), on the ranks of the last stage. ``adapters_off``: one
        forward-only pass of the micro-batches with the adapters off (``forward(inputs, fn)``: ``fn(output, i)``
        of micro-batch i's last-stage output, for each i; empty elsewhere); ``precomputed``: the table's rows by
        pair index."""
        if train:
            self.check_stuck(trainer)
        self.training = train
        if self.reference == "adapters_off":
            with reference_model(trainer.strategy.unwrapped()):
                rows = forward(inputs, lambda out, i: row_logps(out, targets[i]["labels"], trainer.share))
        elif self.reference == "precomputed":
            table = self.reference_table(trainer)["train" if train else "valid"]
            rows = [table[t["pair"]].T.reshape(-1) for t in targets]  # (B, 2) -> (2B,)
        else:
            return
        for target, row in zip(targets, rows):
            target["reference"] = row

    def output_loss(self, trainer: Any, output: Any, target: dict[str, torch.Tensor], *, train: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss, pairs) of the last stage's ``output`` (logits (2B, T, V), or V/tp under tensor
        parallelism) for a micro-batch's ``target`` (:meth:`split`, :meth:`prepare`)."""
        policy = row_logps(output, target["labels"], trainer.share)
        ref = target.get("reference")
        B = policy.shape[0] // 2
        return self.pair_loss(trainer, policy, target["labels"], () if ref is None else (ref[:B], ref[B:]))

    def check_stuck(self, trainer: Any) -> None:
        """Once, :data:`STUCK_STEPS` steps past the warm-up: a warning when every step's reward margin was zero (the
        loss at ln 2): the policy still equals its reference."""
        margins = self.margins
        if margins is None or len(margins) < trainer.training.warmup_steps + STUCK_STEPS:
            return
        self.margins = None
        if max(abs(m) for m in margins) < 1e-6:
            from torch_handle.observe.fields import Level

            trainer.note(Level.WARNING, f"finetune.objective = 'dpo': the reward margins were 0 and the loss ln 2 for "
                                        f"all of the first {len(margins)} steps: the policy still equals its "
                                        f"reference (does anything train? finetune.target_modules; training.lr = "
                                        f"{trainer.training.lr:g}; finetune.preference.beta = {self.loss.beta:g})")

    def reference_table(self, trainer: Any) -> dict[str, torch.Tensor]:
        """The precomputed reference: read from the run directory (a resume), else read from the cache of the same
        data and base or computed now (before step 1: the first call is the step-0 evaluation's;
        :func:`~torch_handle.train.objectives.reference.cached_reference`) and written there. Collective the first
        time.

        Raises:
            RuntimeError: a run past step 0 without the file, or a file for other data (other pair counts)."""
        if self.table is None:
            path = trainer.run_dir / REFERENCE_FILE
            sizes = {"train": len(trainer.data.train), "valid": len(trainer.data.valid)}
            if path.exists():
                self.table = {k: v.to(trainer.ctx.device) for k, v in torch.load(path, weights_only=True).items()}
                if {k: len(v) for k, v in self.table.items()} != sizes:
                    raise RuntimeError(f"{path}: the precomputed reference of other data ({sizes} pairs now)")
            elif trainer.step > 0:
                raise RuntimeError(f"{path}: missing, and the model is past step 0 (no longer the reference)")
            else:
                from torch_handle.train.objectives.reference import cached_reference

                self.table = cached_reference(trainer, precompute_reference)  # or read from the shared cache
                if trainer.is_dir_main:
                    torch.save({k: v.cpu() for k, v in self.table.items()}, path)
        return self.table

    def attach(self, vector: torch.Tensor) -> torch.Tensor:
        sums = self.sums if self.sums is not None else vector.new_zeros(len(METRICS) + 1)
        self.sums = None
        return torch.cat([vector, sums.to(vector)])

    def fields(self, reduced: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        """The pair means of :data:`METRICS` (``reduced[1]``: the pairs counted) and the trained tokens as
        ``tokens``."""
        k = len(METRICS) + 1
        tail, pairs = reduced[-k:].tolist(), max(float(reduced[1]), 1.0)
        out: dict[str, Any] = {name: tail[i] / pairs for i, name in enumerate(METRICS)}
        out[TRAINED_TOKENS] = int(tail[-1])
        if self.training and self.margins is not None:
            self.margins.append(out["rewards/margins"])
        return out, reduced[:-k]
