"""The run's parallel share, built from its layout: the pipeline, context-, tensor- and expert-parallel shares side by
side (each only when its degree is above 1, each module imported only then: an EP-only run imports no tensor
parallelism), and
the one share the trainer uses everywhere (build, step, checkpoint, export), composed in the order of
:data:`~torch_handle.train.shares.contract.COMPOSITION`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch_handle.config.layout import pipeline_microbatches
from torch_handle.config.loader import Preset
from torch_handle.parallel.mesh import attach_layout
from torch_handle.train.shares.contract import ParallelShare


@dataclass(frozen=True)
class Shares:
    """This rank's shares of a layout: ``tp`` (:class:`~torch_handle.train.shares.tensor.TensorParallel`), ``pp``
    (:class:`~torch_handle.train.shares.pipeline.PipelineParallel`, which holds the other two) and ``ep``
    (:class:`~torch_handle.train.shares.expert.ExpertParallel`), None where the degree is 1; ``ctx`` is the rank's
    ``DistContext`` with the layout's mesh and the EP share (``ctx.ep_share``, for the strategy)."""

    ctx: Any
    tp: Any = None
    pp: Any = None
    ep: Any = None
    cp: Any = None
    """:class:`~torch_handle.train.shares.context.ContextParallel` (cp > 1; around the TP share when tp > 1, held by
    the pipeline's share when pp > 1: each stage's inputs sharded, its loss over the whole sequence's labels)."""

    @property
    def run(self) -> ParallelShare | None:
        """The run's one share: the pipeline's (it delegates to the TP and EP shares of its stages), else the CP
        share (it delegates to the TP share), else the TP share, else the EP share; None for a data-parallel run
        (the strategy holds the whole model)."""
        return self.pp or self.cp or self.tp or self.ep


def build_shares(preset: Preset, ctx: Any) -> Shares:
    """The shares of ``preset.parallel``'s layout on this rank, before the model exists (a collective: the mesh).

    Raises:
        ValueError: the layout does not fit the world size (:class:`~torch_handle.common.parallel_dims.ParallelDims`)."""
    par = preset.parallel
    cp = getattr(par, "cp", 1)
    if max(par.tp, par.pp, par.ep, cp) == 1:
        return Shares(ctx)
    ctx = attach_layout(ctx, par)
    tp = ep = pp = cp_share = None
    if par.tp > 1:
        from torch_handle.train.shares.tensor import TensorParallel

        tp = TensorParallel(par, ctx)
    if cp > 1:  # around tp; inside a pipeline's stages (handle validate refuses cp with ep)
        from torch_handle.train.shares.context import ContextParallel

        document_mask = bool(getattr(preset.data.options, "document_mask", False))
        cp_share = ContextParallel(par, ctx, document_mask, inner=tp)
        if par.pp == 1:
            return Shares(ctx, tp=tp, cp=cp_share)
    if par.ep > 1:
        from torch_handle.train.shares.expert import ExpertParallel

        ep = ExpertParallel(ctx, par.ep_impl)
    if par.pp > 1:
        from torch_handle.train.shares.pipeline import PipelineParallel

        pp = PipelineParallel(par, ctx, pipeline_microbatches(preset), cp_share, tp, ep)
    return Shares(replace(ctx, ep_share=ep), tp, pp, ep, cp_share)
