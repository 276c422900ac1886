"""One description of a run's layout, for every view: ``dp 2 × tp 2 × pp 2 (ddp; tp scratch + sp; pp 1F1B scratch)``.

:class:`RunLayout` holds the parallel degrees (dp × cp × tp × pp, with ep of dp; ranks numbered by
:class:`~torch_handle.common.parallel_dims.ParallelDims`, the training mesh's arithmetic), their implementations, the data-parallel strategy and the world
size. It is built from a preset (:meth:`RunLayout.from_preset`), from run.json's ``layout`` record
(:meth:`RunLayout.from_record`), or, for runs made before run.json carried it, from preset.toml's tables or from
run.json's ``strategy`` and ``world_size`` alone (:meth:`RunLayout.from_run`). :meth:`RunLayout.label` is the line
``handle run``'s summary, ``handle runs``, ``handle validate``, ``handle estimate``, ``handle bench scaling``, the
dashboard header and its run picker show.

How the line reads:

* one rank: ``1 rank (single)``;
* data parallelism only: ``dp 2 (ddp)``, ``dp 4 (deepspeed ZeRO-2)``;
* with tensor or pipeline parallelism, every degree above 1 after ``dp`` (always there):
  ``dp 1 × tp 2 (tp scratch)``, ``dp 2 × pp 2 (ddp; pp GPipe native)``; the strategy is named only when
  dp > 1 (it runs the data parallelism: one replica has none to run, whatever the preset names);
* with context parallelism, ``cp`` after ``dp`` (and ``ep``) and its implementation: ``dp 1 × cp 2 (ddp; cp ring)``;
* with expert parallelism, ``ep`` after ``dp``, whose figure is then the expert-data-parallel degree dp / ep, so
  the degrees still multiply to the world size: ``dp 2 × ep 2 (ddp; ep native)`` is 4 data-parallel ranks in 2 EP
  groups (:mod:`torch_handle.parallel.mesh`);
* degrees not known (an old run with neither record nor preset.toml): ``ddp, world size 2``.

Ranks are named the same way everywhere: their global rank, with its coordinate in each dimension of degree > 1
where there is model parallelism (:meth:`RunLayout.rank_name`: ``rank 4 (dp0 tp0 pp1)``; with expert parallelism the
dp coordinate is the expert-data-parallel one and ep the EP rank: ``rank 3 (dp1 ep1)``).

Standard library only (no torch, no click).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from torch_handle.common.fsio import read_toml
from torch_handle.common.parallel_dims import ParallelDims
from torch_handle.common.text import clean, strategy_label

SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B", "zbv": "ZBV",
                  "dualpipev": "DualPipeV", "interleaved-zb": "interleaved ZB", "looped-bfs": "looped BFS"}
"""How a ``parallel.pp_schedule`` reads in the line (anything else: itself, cleaned)."""

LAYOUT_KEY = "layout"
"""run.json's key holding :meth:`RunLayout.record`."""


def chosen_cp_impl(requested: str, document_mask: bool) -> str:
    """The context-parallel attention ``parallel.cp_impl = requested`` runs: itself, or for ``"auto"`` ``allgather``
    with packed documents (every key in hand makes the document mask one ordinary masked attention: Llama 3,
    §3.3.2) and ``ring`` without (K/V never held whole: the least memory). Here, below config, so that the layout
    line names what runs (:mod:`torch_handle.config.context_parallel` checks the choice)."""
    if requested != "auto":
        return requested
    return "allgather" if document_mask else "ring"


def _degree(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _text(value: Any, limit: int = 24) -> str | None:
    return clean(value, limit) if isinstance(value, (str, int)) and not isinstance(value, bool) and value != "" \
        else None


@dataclass(frozen=True)
class RunLayout:
    """A run's ranks as dp × tp × pp, how each dimension is implemented, and its strategy.

    ``dp``, ``tp``, ``pp`` None: not known (an old run), and the line names the strategy and world size only.
    """

    world_size: int | None = None
    strategy: str | None = None
    """The ``[strategy]`` plugin's name (``ddp``, ``deepspeed``, ``fsdp``, ``single``, ...)."""
    zero_stage: int | None = None
    """DeepSpeed's ZeRO stage (None for the other strategies)."""
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    tp_impl: str | None = None
    """``parallel.tp_impl`` (``scratch``, ``native``); None with tp = 1."""
    sequence_parallel: bool = False
    pp_impl: str | None = None
    """``parallel.pp_impl``; None with pp = 1."""
    pp_schedule: str | None = None
    """``parallel.pp_schedule``; None with pp = 1."""
    pp_stages_per_rank: int = 1
    ep: int = 1
    """Expert-parallel degree (it divides dp: EP ranks are drawn from the data-parallel ones)."""
    ep_impl: str | None = None
    """``parallel.ep_impl``; None with ep = 1."""
    cp: int = 1
    """Context-parallel degree (ranks sharing each sequence; dp = world size / (tp × pp × cp))."""
    cp_impl: str | None = None
    """``parallel.cp_impl`` as it runs (``auto`` resolved); None with cp = 1."""

    @classmethod
    def from_preset(cls, preset: Any) -> RunLayout:
        """The layout of a loaded :class:`~torch_handle.config.schema.Preset` (read by attribute only)."""
        par = preset.parallel
        cp_impl = chosen_cp_impl(getattr(par, "cp_impl", "auto"), bool(getattr(preset.data.options, "document_mask",
                                                                                  False)))
        return cls.from_parts(preset.world_size, preset.strategy.name,
                              getattr(preset.strategy.options, "zero_stage", None),
                              par.tp, par.pp, par.tp_impl, par.sequence_parallel, par.pp_impl, par.pp_schedule,
                              par.pp_stages_per_rank, getattr(par, "ep", 1), getattr(par, "ep_impl", None),
                              getattr(par, "cp", 1), cp_impl)

    @classmethod
    def from_parts(cls, world_size: Any, strategy: Any, zero_stage: Any, tp: Any = 1, pp: Any = 1,
                   tp_impl: Any = None, sequence_parallel: Any = False, pp_impl: Any = None, pp_schedule: Any = None,
                   pp_stages_per_rank: Any = 1, ep: Any = 1, ep_impl: Any = None, cp: Any = 1,
                   cp_impl: Any = None) -> RunLayout:
        """The layout of these values, as a preset or run.json holds them (bad or missing values: not known; the
        implementations are dropped for a degree of 1; dp = world_size / (tp × pp × cp) when that divides; an ep
        that does not divide dp: 1)."""
        world, tp, pp, cp, ep = _degree(world_size), _degree(tp), _degree(pp), _degree(cp) or 1, _degree(ep) or 1
        dims = None
        if world is not None and tp is not None and pp is not None:
            for experts in (ep, 1):  # an ep that does not divide dp: 1
                try:
                    dims = ParallelDims(world, tp=tp, pp=pp, cp=cp, ep=experts)
                    break
                except ValueError:
                    continue
        known = dims is not None
        has_tp, has_pp = known and tp > 1, known and pp > 1
        cp, ep = (dims.cp, dims.ep) if known else (1, 1)
        return cls(world_size=world, strategy=_text(strategy, 40), zero_stage=_degree_or_zero(zero_stage),
                   dp=dims.dp if known else None, tp=tp if known else None, pp=pp if known else None,
                   tp_impl=_text(tp_impl) if has_tp else None,
                   sequence_parallel=bool(has_tp and sequence_parallel is True),
                   pp_impl=_text(pp_impl) if has_pp else None, pp_schedule=_text(pp_schedule) if has_pp else None,
                   pp_stages_per_rank=(_degree(pp_stages_per_rank) or 1) if has_pp else 1,
                   ep=ep, ep_impl=_text(ep_impl) if ep > 1 else None, cp=cp,
                   cp_impl=_text(cp_impl) if cp > 1 else None)

    @classmethod
    def from_record(cls, record: Any) -> RunLayout | None:
        """The layout run.json's ``layout`` holds (:meth:`record`), or None when ``record`` is not a mapping."""
        if not isinstance(record, dict):
            return None
        return cls.from_parts(record.get("world_size"), record.get("strategy"), record.get("zero_stage"),
                              record.get("tp"), record.get("pp"), record.get("tp_impl"),
                              record.get("sequence_parallel"), record.get("pp_impl"), record.get("pp_schedule"),
                              record.get("pp_stages_per_rank", 1), record.get("ep", 1), record.get("ep_impl"),
                              record.get("cp", 1), record.get("cp_impl"))

    @classmethod
    def from_run(cls, run_dir: Path | None, info: dict[str, Any], degrees: Any = None) -> RunLayout:
        """A run's layout: run.json's ``layout`` record (``info``); for a run made before run.json had one, its
        preset.toml's ``[parallel]`` table (read as TOML, not loaded: no plugin needed), else ``info``'s
        ``strategy``, ``zero_stage`` and ``world_size`` with the degrees not known; either one
        :meth:`matching` ``degrees``, the newest step event's ``layout``, when given. Never raises."""
        recorded = cls.from_record(info.get(LAYOUT_KEY))
        if recorded is not None:
            return recorded
        strategy, zero, world = info.get("strategy"), info.get("zero_stage"), info.get("world_size")
        table = _preset_parallel(run_dir) if run_dir is not None else None
        if table is None:
            found = cls(world_size=_degree(world), strategy=_text(strategy, 40), zero_stage=_degree_or_zero(zero))
        else:
            found = cls.from_parts(world, strategy, zero, table.get("tp", 1), table.get("pp", 1),
                                   table.get("tp_impl"), table.get("sequence_parallel", False), table.get("pp_impl"),
                                   table.get("pp_schedule"), table.get("pp_stages_per_rank", 1), table.get("ep", 1),
                                   table.get("ep_impl"), table.get("cp", 1), table.get("cp_impl"))
        return found.matching(degrees)

    def matching(self, degrees: Any) -> RunLayout:
        """This layout, or where ``degrees`` (a step event's ``layout``: ``{"dp": 2, "tp": 2}``, tp and pp 1 when
        left out) name other ones, the layout of those degrees with this strategy and no implementation known (an
        old run's steps say what ran). Bad ``degrees`` (not a mapping, not positive integers): this layout."""
        if not isinstance(degrees, dict):
            return self
        dp, tp, pp = (_degree(degrees.get("dp")), _degree(degrees.get("tp", 1)), _degree(degrees.get("pp", 1)))
        ep, cp = _degree(degrees.get("ep", 1)), _degree(degrees.get("cp", 1))
        if None in (dp, tp, pp, ep, cp) or (self.dp, self.tp, self.pp, self.ep, self.cp) == (dp, tp, pp, ep, cp):
            return self
        return RunLayout.from_parts(dp * tp * pp * cp, self.strategy, self.zero_stage, tp, pp, ep=ep, cp=cp)

    def with_strategy(self, strategy: Any, zero_stage: Any) -> RunLayout:
        """This layout with the strategy the workers reported (their status event's, e.g. scratch-ddp's ZeRO-1
        where the preset names only the plugin); this layout when ``strategy`` is empty."""
        if not strategy:
            return self
        return replace(self, strategy=_text(strategy, 40), zero_stage=_degree_or_zero(zero_stage))

    def record(self) -> dict[str, Any]:
        """The JSON-ready mapping run.json's ``layout`` holds (and ``handle runs --json`` shows): every field,
        plus ``label``."""
        return {**asdict(self), "label": self.label()}

    @property
    def strategy_text(self) -> str:
        """``deepspeed ZeRO-2``, ``ddp``; ``-`` without a strategy."""
        return strategy_label(self.strategy, self.zero_stage)

    def degrees_text(self) -> str:
        """The degrees alone, ``dp 2 × tp 2 × pp 2`` (:meth:`label` without the implementations: a narrow
        screen's form); the strategy and world size where the degrees are not known."""
        return self.label().split(" (", 1)[0] if self.dp is not None else self.label()

    # -- ranks: one naming in every view ------------------------------------------------------------------------

    def dims(self) -> ParallelDims | None:
        """The degrees as :class:`~torch_handle.common.parallel_dims.ParallelDims`, the training mesh's arithmetic;
        None when they are not known."""
        if self.dp is None or self.tp is None or self.pp is None:
            return None
        return ParallelDims(self.dp * self.tp * self.pp * self.cp, self.tp, self.pp, self.ep, self.cp)

    def coordinates(self, rank: int) -> dict[str, int] | None:
        """Global ``rank``'s place in the mesh, ``{"dp": dp_rank, "tp": tp_rank, "pp": pp_rank}``, with ``"edp"``
        and ``"ep"`` when ep > 1 and ``"cp"`` when cp > 1 (:meth:`ParallelDims.coordinates`); None when the degrees
        are not known or ``rank`` is not in ``range(world_size)``."""
        dims = self.dims()
        return None if dims is None else dims.coordinates(rank)

    def global_rank(self, *, dp: int = 0, tp: int = 0, pp: int = 0, cp: int = 0) -> int | None:
        """The global rank at these coordinates (each in ``range`` of its degree), or None when the degrees are not
        known or a coordinate is out of range. Pipeline rank ``i`` of rank 0's pipeline (what a step event's
        ``pipeline`` describes) is ``global_rank(pp=i)``."""
        dims = self.dims()
        if dims is None or not dims.contains(dp=dp, tp=tp, pp=pp, cp=cp):
            return None
        return dims.rank(pp, dp, tp, cp)

    def pipeline_ranks(self) -> list[int] | None:
        """The global ranks of rank 0's pipeline (dp 0, tp 0), by pipeline rank: what a step event's ``pipeline``
        describes (``[0, 4]`` for dp 2 × tp 2 × pp 2); None when the degrees are not known."""
        if self.pp is None or self.dp is None:
            return None
        return [rank for i in range(self.pp) if (rank := self.global_rank(pp=i)) is not None]

    def coordinate_text(self, rank: int) -> str:
        """``dp0 tp0 pp1``: ``rank``'s coordinate in each dimension of degree > 1, or ``""`` when the run has
        model parallelism in no dimension (its rank is its dp rank) or the degrees are not known."""
        where = self.coordinates(rank)
        if where is None or (self.tp == 1 and self.pp == 1 and self.ep == 1 and self.cp == 1):
            return ""
        if self.ep > 1:  # the dp coordinate is the expert-data-parallel one (the line's dp figure is dp / ep)
            where = {**where, "dp": where["edp"]}
        degrees = {"dp": self.dp // self.ep, "ep": self.ep, "cp": self.cp, "tp": self.tp, "pp": self.pp}
        return " ".join(f"{dim}{where[dim]}" for dim in ("dp", "ep", "cp", "tp", "pp")
                        if degrees[dim] > 1 or (dim == "dp" and self.cp > 1))

    def rank_name(self, rank: int) -> str:
        """How every view names a rank: ``rank 4 (dp0 tp0 pp1)`` with tp or pp > 1, ``rank 3 (dp1 ep1)`` with ep > 1,
        else ``rank 4``."""
        where = self.coordinate_text(rank)
        return f"rank {rank} ({where})" if where else f"rank {rank}"

    def label(self) -> str:
        """The one line every view shows (the module's docstring has the forms)."""
        if self.dp is None or self.tp is None or self.pp is None:
            world = f", world size {self.world_size}" if self.world_size is not None else ""
            return f"{self.strategy_text}{world}"
        degrees = " × ".join([f"dp {self.dp // self.ep}", *([f"ep {self.ep}"] if self.ep > 1 else []),
                              *([f"cp {self.cp}"] if self.cp > 1 else []),
                              *([f"tp {self.tp}"] if self.tp > 1 else []), *([f"pp {self.pp}"] if self.pp > 1 else [])])
        if degrees == "dp 1" and self.world_size == 1:
            degrees = "1 rank"
        alone = self.tp == 1 and self.pp == 1  # no replica of several ranks: the strategy runs whatever there is
        parts = [self.strategy_text] if self.strategy and (self.dp > 1 or alone) else []
        if self.ep > 1 and self.ep_impl:
            parts.append(f"ep {self.ep_impl}")
        if self.cp > 1 and self.cp_impl:
            parts.append(f"cp {self.cp_impl}")
        if self.tp > 1 and (self.tp_impl or self.sequence_parallel):  # not known (an old run's events): left out
            parts.append(" ".join(["tp", *([self.tp_impl] if self.tp_impl else [])])
                         + (" + sp" if self.sequence_parallel else ""))
        if self.pp > 1 and (self.pp_schedule or self.pp_impl):
            schedule = SCHEDULE_NAMES.get(self.pp_schedule or "", self.pp_schedule)
            v = f" v{self.pp_stages_per_rank}" if self.pp_stages_per_rank > 1 else ""
            parts.append(" ".join(["pp", *([schedule + v] if schedule else []),
                                   *([self.pp_impl] if self.pp_impl else [])]))
        return f"{degrees} ({'; '.join(parts)})" if parts else degrees


def _degree_or_zero(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3 else None


def _preset_parallel(run_dir: Path) -> dict[str, Any] | None:
    """preset.toml's ``[parallel]`` table (``{}`` when it has none), or None when there is no readable
    preset.toml."""
    data = read_toml(Path(run_dir) / "preset.toml")
    if data is None:
        return None
    table = data.get("parallel", {})
    return table if isinstance(table, dict) else {}
