"""What each pipeline rank holds (``[parallel] pp > 1``): the schedules' micro-batches in flight
(:func:`in_flight_peak`, which :mod:`torch_handle.plan.estimate_layout` uses for every layout), and
:func:`pipeline_ranks`, the same estimate for tp = 1 from each stage split off and run on its own: the reference
``estimate_layout``'s per-part figures are tested against (``tests/test_estimate_layout.py``).

A rank of a pipeline keeps the parameters, gradients and optimizer state of its stages' layers only (the embedding
on the first stage, the final norm and output projection on the last; tied embeddings: a copy on both), split as a
run splits them (:func:`torch_handle.model.pipeline.split_decoder` on the meta device), so the strategy's formula
applies to that shard.

Its activations are those of the micro-batches in flight: forwarded, not yet backwarded. One pipeline micro-batch
(``micro_batch_size · grad_accum / m`` samples) of one stage saves what the stage's forward (and, on the last
stage, the loss) saves for backward, measured on fake tensors as for the whole model
(:mod:`torch_handle.plan.estimate_activations`); how many are alive at once is the schedule's:

* GPipe: all m (every forward runs before the first backward; Huang et al. 2019).
* 1F1B: stage s holds at most min(m, p - s): the first stage p, the last one (Narayanan et al. 2021, §2.2).
  torch's ``Schedule1F1B`` runs p - s warm-up forwards, the hand-written one p - s - 1 and then one more forward
  before its first backward: the same peak.
* Several stages per rank (interleaved 1F1B, looped BFS, the zero-bubble schedules, DualPipeV): the order torch's
  schedule class computes for each rank (its ``_calculate_single_rank_operations``), walked action by action; the
  peak of the bytes alive over the rank's stages is reported. A micro-batch counts as alive from its forward to
  its full backward, or to its weight-gradient backward (W) where the schedule splits the backward: an upper bound
  for the zero-bubble schedules, whose input-gradient backward already frees part of it.

The loss path's transient fp32 logits buffers count once, on the rank of the last stage; with checkpointing the
recomputed block once on every rank.

torch is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from torch_handle.plan.estimate_activations import ActivationBytes, fake_activations
from torch_handle.plan.estimate_model import (ModelBuild, ModelShape, build_model, lm_inputs, model_build,
                                              rows_per_sample)

if TYPE_CHECKING:
    from torch_handle.config.schema import Preset
    from torch_handle.registry import PluginRegistry

__all__ = ["PipelineRank", "in_flight_peak", "pipeline_ranks", "stage_saved_bytes"]


@dataclass(frozen=True)
class PipelineRank:
    """What one pipeline rank holds: its stages' parameters and activations."""

    pp_rank: int
    stages: tuple[int, ...]
    """The stages this rank runs (one, or v with interleaved schedules)."""
    shape: ModelShape
    """Its stages' parameters (a tied head: its own copy)."""
    microbatch_saved: tuple[int, ...]
    """Bytes one micro-batch saves for backward in each of ``stages``."""
    in_flight: tuple[int, ...]
    """The most micro-batches alive at once in each of ``stages``."""
    activation: ActivationBytes
    """Its peak: ``saved`` = the most bytes alive at once over its stages, + logits (last stage) and recompute."""


def _torch_order(schedule: str, pp: int, v: int, m: int) -> list[list[Any]]:
    """Each rank's actions in the order torch's multi-stage ``schedule`` class computes them (None: an idle slot),
    without building stages or process groups."""
    from torch.distributed.pipelining import schedules as S

    from torch_handle.parallel.pipeline.schedules import NATIVE_SCHEDULES

    cls = getattr(S, NATIVE_SCHEDULES[schedule])
    rounds = max(1, m // pp)
    state = SimpleNamespace(pp_group_size=pp, n_local_stages=v, _n_microbatches=m, number_of_rounds=rounds,
                            microbatches_per_round=m // rounds, num_stages=pp * v, _stages=[None] * v)
    return [cls._calculate_single_rank_operations(state, rank) for rank in range(pp)]


def _walk(actions: list[Any], stage_bytes: dict[int, int]) -> tuple[int, dict[int, int]]:
    """(Peak bytes alive, peak micro-batches alive per stage) over one rank's torch actions."""
    alive: dict[int, set[int]] = {s: set() for s in stage_bytes}
    peak, most = 0, {s: 0 for s in stage_bytes}
    flat = [sub for a in actions if a is not None for sub in (a.sub_actions or (a,))]
    for a in flat:
        kind = a.computation_type.value
        if kind == "F":
            alive[a.stage_index].add(a.microbatch_index)
            most[a.stage_index] = max(most[a.stage_index], len(alive[a.stage_index]))
            peak = max(peak, sum(stage_bytes[s] * len(mbs) for s, mbs in alive.items()))
        elif kind in ("B", "W"):  # a full backward, or the weight half of a split one
            alive[a.stage_index].discard(a.microbatch_index)
    return peak, most


def in_flight_peak(schedule: str, pp: int, v: int, m: int, stage_bytes: list[int]) -> list[tuple[int, list[int]]]:
    """Per pipeline rank: (the most activation bytes alive at once, the most micro-batches alive in each of its
    stages), for ``schedule`` with p = ``pp`` ranks, v stages per rank, m micro-batches, ``stage_bytes[s]`` one
    micro-batch's saved bytes of stage s. See the module docstring for the rules."""
    from torch_handle.parallel.pipeline.schedules import stage_ranks

    owner = stage_ranks(pp, v, schedule)
    if v == 1 and schedule in ("gpipe", "1f1b"):
        counts = [m if schedule == "gpipe" else min(m, pp - s) for s in range(pp)]
        return [(counts[s] * stage_bytes[s], [counts[s]]) for s in range(pp)]
    out = []
    for rank, actions in enumerate(_torch_order(schedule, pp, v, m)):
        mine = {s: stage_bytes[s] for s, r in enumerate(owner) if r == rank}
        peak, most = _walk(actions, mine)
        out.append((peak, [most[s] for s in sorted(mine)]))
    return out


def _ranges(build: ModelBuild, model: Any, n_stages: int, preset: Preset) -> list[range]:
    """The stages' layers as a run splits them (``PipelineParallel.split``)."""
    from torch_handle.model.pipeline import split_layers

    args, par = model.args, preset.parallel
    return split_layers(args.n_layers, n_stages, par.pp_layers, by=par.pp_split,
                        layer_params=sum(p.numel() for p in model.layers[0].parameters()),
                        embed_params=model.embed.weight.numel(),
                        head_params=0 if args.tie_embeddings else model.lm_head.weight.numel())


def stage_saved_bytes(build: ModelBuild, ranges: list[range], batch: int, seq_len: int, mode: str,
                      precision: str) -> list[int]:
    """Bytes one micro-batch of ``batch`` x ``seq_len`` tokens saves for backward in each stage (the stage's
    forward; on the last stage its loss too), run one stage at a time on fake tensors the way a pipeline runs it:
    the first stage from token ids, the others from a received (B, T, C) activation."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch_handle.common.precision import torch_dtype
    from torch_handle.model.pipeline import split_decoder
    from torch_handle.observe.activations import SavedTensorCounter

    out = []
    with FakeTensorMode(allow_non_fake_inputs=False):
        model = build_model(build)
        model.train()
        autocast = torch.autocast("cpu", dtype=torch_dtype(precision)) if mode == "autocast" else None
        for s in range(len(ranges)):
            _, (stage,) = split_decoder(model, ranges, [s])
            ids = torch.randint(4, build.vocab_size, (batch, seq_len))
            h = None if s == 0 else torch.randn(batch, seq_len, model.args.d_model, requires_grad=True)
            blocks = list(stage.layers.values()) if model.args.activation_checkpointing else []
            with SavedTensorCounter([*model.parameters(), *model.buffers()], blocks) as counter:
                with autocast or contextlib.nullcontext():
                    y = stage(h, **lm_inputs(build, ids))
                if stage.last:
                    labels = torch.randint(4, build.vocab_size, (batch, seq_len))
                    y = F.cross_entropy(y.float().flatten(0, 1), labels.flatten())
                    y.backward()
                else:
                    y.backward(torch.randn_like(y))
            out.append(counter.bytes)
    return out


def pipeline_ranks(preset: Preset, registry: PluginRegistry, mode: str) -> list[PipelineRank]:
    """Every pipeline rank of ``preset`` (``[parallel] pp > 1``), computing in ``mode``
    (:func:`~torch_handle.plan.estimate_activations.compute_mode`).

    Raises:
        PresetError: a dataset without ``vocab_size``/``seq_len`` options.
        ValueError: a model without a pipeline split (one line).
    """
    import torch

    from torch_handle.config.layout import pipeline_microbatches
    from torch_handle.model.pipeline import split_decoder
    from torch_handle.parallel.pipeline.schedules import stage_ranks

    par, t = preset.parallel, preset.training
    pp, v, m = par.pp, par.pp_stages_per_rank, pipeline_microbatches(preset)
    build = dataclasses.replace(model_build(preset, registry), tp=1)
    with torch.device("meta"):
        model = build_model(build)
    ranges = _ranges(build, model, pp * v, preset)
    owner = stage_ranks(pp, v, par.pp_schedule)
    seq, batch = preset.data.options.seq_len, t.micro_batch_size * t.grad_accum // m * rows_per_sample(preset)
    checkpointing = bool(getattr(preset.model.options, "activation_checkpointing", False))
    whole = fake_activations(build, batch, seq, t.precision, mode, checkpointing)  # logits and recompute
    saved = stage_saved_bytes(build, ranges, batch, seq, mode, t.precision)
    peaks = in_flight_peak(par.pp_schedule, pp, v, m, saved)
    out = []
    for rank in range(pp):
        stages = tuple(s for s, r in enumerate(owner) if r == rank)
        with torch.device("meta"):
            shard, _ = split_decoder(model, ranges, stages)
        last = pp * v - 1 in stages
        act = ActivationBytes(peaks[rank][0], whole.logits if last else 0, whole.recompute)
        out.append(PipelineRank(rank, stages, ModelShape.of(shard), tuple(saved[s] for s in stages),
                                tuple(peaks[rank][1]), act))
    return out
