"""``parallel.tp_impl``: which tensor-parallel implementation a layout can run, and what ``"auto"`` picks.

Two implementations split a block's linears (docs/tensor-parallel.md): ``native``, DTensor's
``parallelize_module`` as torchtitan does, and ``scratch``, the hand-written layers of
``torch_handle/parallel/tensor/``. The hand-written one runs wherever tensor parallelism runs, because its model is
plain ``nn.Module`` s and tensors; DTensor runs only where

* the data-parallel strategy wraps DTensor parameters: its options class declares
  ``native_tensor_parallel = True`` (``single``, ``fsdp``; DDP's buckets take plain tensors), and
* there is no pipeline (``pp = 1``): DTensor's collectives inside torch's pipeline schedules do not match across
  a stage's TP ranks in torch 2.13.

``"auto"`` (the default) takes ``native`` where it runs and ``scratch`` elsewhere. The loader resolves it once,
before the checks that span tables (:func:`resolve_tp_impl`), so every check, ``handle estimate``, ``handle plan``
and the run's ``preset.toml`` see the concrete one, and :attr:`~torch_handle.config.schema.Preset.resolved` keeps
the reason (``handle run`` records it in run.json as ``tp_impl_reason``). With ``tp = 1`` it stays ``"auto"``:
there is nothing to split, and a resume that turns tensor parallelism on chooses then. An explicit ``native``
where it cannot run is refused (:func:`torch_handle.config.layout.check_parallel`), naming ``scratch`` and
``auto``.

Standard library only.
"""

from __future__ import annotations

from typing import Any

AUTO = "auto"
KEY = "parallel.tp_impl"
"""The key of :attr:`~torch_handle.config.schema.Preset.resolved` that holds the reason of an ``auto`` choice."""
REASON_FIELD = "tp_impl_reason"
"""run.json's field with that reason (a run whose tp_impl was chosen by ``auto``)."""


def native_tp_problem(preset: Any) -> str | None:
    """Why DTensor tensor parallelism (``tp_impl = "native"``) cannot run ``preset``'s layout, or None when it
    can (whatever ``tp`` is): :func:`native_problem` of its strategy and ``pp``."""
    return native_problem(preset.strategy.name, type(preset.strategy.options), preset.parallel.pp)


def native_problem(strategy: str, options_cls: type, pp: int) -> str | None:
    """Why DTensor tensor parallelism cannot run under ``strategy`` (its options class ``options_cls`` declares
    ``native_tensor_parallel = True`` when it wraps DTensor parameters) with ``pp`` pipeline stages, or None."""
    if pp > 1:
        return ("tensor parallelism inside pipeline stages is hand-written only (DTensor's collectives inside "
                "torch's schedules do not match across the stage's TP ranks in torch 2.13)")
    if not getattr(options_cls, "native_tensor_parallel", False):
        return f"{strategy} does not wrap DTensor parameters (fsdp and single do)"
    return None


def chosen_impl(requested: str, strategy: str, options_cls: type, pp: int) -> str:
    """The implementation a ``requested`` ``tp_impl`` runs with under ``strategy`` and ``pp``: itself, or for
    ``auto`` native where :func:`native_problem` finds nothing, else scratch (``handle estimate --compare`` names
    each strategy's)."""
    if requested != AUTO:
        return requested
    return "native" if native_problem(strategy, options_cls, pp) is None else "scratch"


def resolve_tp_impl(preset: Any) -> str | None:
    """Replace ``parallel.tp_impl = "auto"`` of ``preset`` (tp > 1) by the implementation that runs its layout,
    in place, and record why in ``preset.resolved[KEY]``; returns that reason line (``auto → scratch: ddp does not
    wrap DTensor parameters (fsdp and single do)``), or None when there was nothing to choose (an explicit
    implementation, or tp = 1)."""
    par = preset.parallel
    if par.tp_impl != AUTO or par.tp == 1:
        return None
    problem = native_tp_problem(preset)
    par.tp_impl = chosen_impl(AUTO, preset.strategy.name, type(preset.strategy.options), par.pp)
    why = problem or f"DTensor runs {preset.strategy.name} with pp = 1"
    preset.resolved[KEY] = f"auto → {par.tp_impl}: {why}"
    return preset.resolved[KEY]


def requested_tp_impl(preset: Any) -> str:
    """What ``preset`` asked for: ``"auto"`` when the loader chose its implementation, else its own value (a
    layout planner varies strategy and pp, so it must re-choose where the preset left the choice to auto)."""
    return AUTO if KEY in preset.resolved else preset.parallel.tp_impl
