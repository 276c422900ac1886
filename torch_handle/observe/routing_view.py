"""What a mixture-of-experts run's routing looked like, from the ``moe`` object of its step events (written by
:mod:`torch_handle.train.routing`; fields: :mod:`torch_handle.observe.fields`, docs/run-directory.md): the load of
each layer's experts over a window of steps, the dead and the hot ones, and a summary of the whole run. The
dashboard's routing panel and ``handle profile --routing`` read it. Standard library only.

The load of an expert is read against the uniform one: ``ratio`` = its assignments × E / the layer's assignments
(1 = its fair share, 0 = dead, E/k = every token of the layer; GShard and the Switch Transformer's "expert load"
over "mean load"). An expert is **dead** over a window when it got no token in it, **hot** when its ratio is at
least :data:`HOT_RATIO`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from torch_handle.observe.fields import (MOE, MOE_AUX_LOSS, MOE_DROPPED_TOKENS, MOE_LAYERS, MOE_MAX_LOAD_RATIO,
                                         MOE_TOKENS_PER_EXPERT, MOE_TOP_K, MOE_Z_LOSS)
from torch_handle.observe.tail import integer, number

WINDOW = 10
"""Steps the dashboard's heatmap adds up, and the summary's first and last figures average."""
HOT_RATIO = 1.5
"""An expert is hot at 1.5 times its fair share or more (its load over the mean load of its layer's experts)."""


def read_moe(event: dict[str, Any]) -> dict[str, Any] | None:
    """A step event's ``moe`` object when it is well formed -- ``layers`` names and ``tokens_per_expert``
    rows of one length E >= 1, one row per layer, counts >= 0 -- else None (never raises)."""
    moe = event.get(MOE)
    if not isinstance(moe, dict):
        return None
    layers, rows = moe.get(MOE_LAYERS), moe.get(MOE_TOKENS_PER_EXPERT)
    if not (isinstance(layers, list) and isinstance(rows, list) and layers and len(layers) == len(rows)):
        return None
    if not all(isinstance(r, list) and r and len(r) == len(rows[0]) for r in rows):
        return None
    if not all((c := integer(x)) is not None and c >= 0 for r in rows for x in r):
        return None
    return moe


def routing_steps(events: Iterable[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """``(step, moe)`` of every step event with a well-formed ``moe`` object, in file order."""
    out = []
    for e in events:
        if e.get("kind") == "step" and (step := integer(e.get("step"))) is not None and (moe := read_moe(e)):
            out.append((step, moe))
    return out


def layer_label(name: Any) -> str:
    """``L3`` for ``layers.3``, ``E1`` / ``D2`` for an encoder's or a decoder's ``encoder.layers.1`` /
    ``decoder.layers.2``; any other name as it is."""
    m = re.fullmatch(r"(?:(encoder|decoder)\.)?layers\.(\d+)", str(name))
    if not m:
        return str(name)
    return {"encoder": "E", "decoder": "D", None: "L"}[m.group(1)] + m.group(2)


def _per_layer(moe: dict[str, Any], key: str) -> list[float | None]:
    values = moe.get(key)
    n = len(moe[MOE_LAYERS])
    if not isinstance(values, list) or len(values) != n:
        return [None] * n
    return [number(v) for v in values]


def _mean(xs: Iterable[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return sum(got) / len(got) if got else None


@dataclass(frozen=True)
class LayerLoad:
    """One MoE layer's routing added up over some steps."""

    name: str
    counts: tuple[int, ...]
    """Assignments per expert (after capacity)."""
    dropped: int
    """Assignments cut by the capacity."""

    @property
    def label(self) -> str:
        return layer_label(self.name)

    @property
    def assigned(self) -> int:
        return sum(self.counts)

    @property
    def ratios(self) -> list[float]:
        """Each expert's load over the mean load (1 = uniform); all 0 for a layer without assignments."""
        total = self.assigned
        return [c * len(self.counts) / total if total else 0.0 for c in self.counts]

    @property
    def dead(self) -> list[int]:
        """Experts with no assignment (none when the layer had no tokens at all)."""
        return [e for e, c in enumerate(self.counts) if c == 0] if self.assigned else []

    @property
    def hot(self) -> list[int]:
        """Experts at :data:`HOT_RATIO` times their fair share or more, busiest first."""
        ratios = self.ratios
        return sorted((e for e, r in enumerate(ratios) if r >= HOT_RATIO), key=lambda e: -ratios[e])

    @property
    def drop_rate(self) -> float:
        """Dropped over routed assignments (0..1)."""
        routed = self.assigned + self.dropped
        return self.dropped / routed if routed else 0.0


def layer_loads(moes: Sequence[dict[str, Any]]) -> list[LayerLoad]:
    """The layers of the newest of ``moes`` (``moe`` objects of consecutive steps, oldest first), their counts
    added over those of the steps with the same layers and experts."""
    if not moes:
        return []
    newest = moes[-1]
    names, rows = newest[MOE_LAYERS], newest[MOE_TOKENS_PER_EXPERT]
    shape = (len(rows), len(rows[0]))
    counts = [[0] * shape[1] for _ in range(shape[0])]
    dropped = [0] * shape[0]
    for moe in moes:
        r = moe[MOE_TOKENS_PER_EXPERT]
        if moe[MOE_LAYERS] != names or (len(r), len(r[0])) != shape:
            continue  # another model (a resume that changed it): only the newest one's steps count
        for i, row in enumerate(r):
            for e, c in enumerate(row):
                counts[i][e] += integer(c) or 0
        for i, d in enumerate(_per_layer(moe, MOE_DROPPED_TOKENS)):
            dropped[i] += int(d or 0)
    return [LayerLoad(str(n), tuple(c), d) for n, c, d in zip(names, counts, dropped)]


def layer_means(moes: Sequence[dict[str, Any]], key: str) -> list[float | None]:
    """Per layer of the newest of ``moes``, the mean of its per-layer figure ``key`` (``aux_loss``, ...) over the
    steps with the same layers (None where no step has it)."""
    if not moes:
        return []
    names = moes[-1][MOE_LAYERS]
    same = [_per_layer(m, key) for m in moes if m[MOE_LAYERS] == names]
    return [_mean(values[i] for values in same) for i in range(len(names))]


def window_figures(moes: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Means over ``moes`` and their layers: ``aux_loss``, ``z_loss``, ``max_load_ratio`` (each step's own);
    ``drop_rate``: dropped over routed assignments of all of them."""
    loads = layer_loads(moes)
    routed = sum(x.assigned + x.dropped for x in loads)
    out: dict[str, float | None] = {key: _mean(v for m in moes for v in _per_layer(m, key))
                                    for key in (MOE_AUX_LOSS, MOE_Z_LOSS, MOE_MAX_LOAD_RATIO)}
    out["drop_rate"] = sum(x.dropped for x in loads) / routed if routed else None
    return out


def ratio_text(ratio: float) -> str:
    """A load ratio in 3 characters: ``0.4``, ``2.6``, `` 12``, ``99+``."""
    if ratio < 9.95:
        return f"{ratio:.1f}"
    return f"{ratio:3.0f}" if ratio < 99.5 else "99+"


def marks(loads: Sequence[LayerLoad], limit: int = 4) -> tuple[list[str], int, list[str], int]:
    """``(hot, hot_more, dead, dead_more)``: the hot experts, busiest first, as ``L0 e6 3.0`` (layer, expert,
    load), and the dead ones as ``L2 e6``, at most ``limit`` of each, with how many more there are."""
    hot = sorted(((x.ratios[e], x.label, e) for x in loads for e in x.hot), reverse=True)
    dead = [f"{x.label} e{e}" for x in loads for e in x.dead]
    return ([f"{label} e{e} {ratio_text(r).strip()}" for r, label, e in hot[:limit]], max(0, len(hot) - limit),
            dead[:limit], max(0, len(dead) - limit))


def marks_text(loads: Sequence[LayerLoad], limit: int = 4) -> str:
    """``hot L0 e6 3.0 · L2 e1 3.1 · dead L2 e6`` (:func:`marks`; ``+3``: three more); ``no dead or hot expert``
    when there is none."""
    hot, hot_more, dead, dead_more = marks(loads, limit)
    parts = [f"{word} " + " · ".join(names) + (f" +{more}" if more else "")
             for word, names, more in (("hot", hot, hot_more), ("dead", dead, dead_more)) if names]
    return " · ".join(parts) if parts else "no dead or hot expert"


def summarize(steps: Sequence[tuple[int, dict[str, Any]]], window: int = WINDOW) -> dict[str, Any]:
    """The routing of a whole run, per layer (JSON-able): ``experts`` E; ``share_min`` / ``share_max`` (an
    expert's share of the layer's assignments over the run, 0..1; uniform 1/E) with ``expert_min`` /
    ``expert_max``; ``dead`` (experts without an assignment in the whole run), ``dead_last`` (none in the last
    ``window`` steps), ``hot_last`` (hot there); ``drop_rate`` over the run; and ``aux_loss``, ``z_loss``,
    ``max_load_ratio`` as ``[first, last]``, each the mean of the first and the last ``window`` steps.

    Args:
        steps: ``(step, moe)`` in file order (:func:`routing_steps`); a step run twice (a restart) counts once,
            its later copy.
    """
    latest: dict[int, dict[str, Any]] = {}
    for step, moe in steps:
        latest[step] = moe
    ordered = [latest[s] for s in sorted(latest)]
    whole, last = layer_loads(ordered), layer_loads(ordered[-window:])
    first_w, last_w = ordered[:window], ordered[-window:]
    layers = []
    for i, (run, recent) in enumerate(zip(whole, last)):
        total = run.assigned
        shares = [c / total if total else 0.0 for c in run.counts]
        lo, hi = min(range(len(shares)), key=shares.__getitem__), max(range(len(shares)), key=shares.__getitem__)
        entry: dict[str, Any] = {"layer": run.name, "experts": len(run.counts), "share_min": shares[lo],
                                 "expert_min": lo, "share_max": shares[hi], "expert_max": hi, "dead": run.dead,
                                 "dead_last": recent.dead, "hot_last": recent.hot, "drop_rate": run.drop_rate}
        for key in (MOE_AUX_LOSS, MOE_Z_LOSS, MOE_MAX_LOAD_RATIO):
            entry[key] = [_mean(_per_layer(m, key)[i] for m in part) for part in (first_w, last_w)]
        layers.append(entry)
    top_k = integer(ordered[-1].get(MOE_TOP_K)) if ordered else None
    return {"steps": [min(latest), max(latest)] if latest else None, "logged_steps": len(ordered), "window": window,
            "top_k": top_k, "hot_ratio": HOT_RATIO, "layers": layers}


def _pair(values: Sequence[float | None], digits: int) -> str:
    a, b = (f"{v:.{digits}f}" if v is not None else "-" for v in values)
    return f"{a} → {b}"


def _experts(experts: Sequence[int], limit: int = 3) -> str:
    """``e1,e5 +3``: the first ``limit`` experts, the rest counted; ``-`` for none."""
    more = f" +{len(experts) - limit}" if len(experts) > limit else ""
    return ",".join(f"e{e}" for e in experts[:limit]) + more or "-"


def format_summary(summary: dict[str, Any]) -> str:
    """:func:`summarize`'s dict as a table for people (80 columns for up to 99 experts)."""
    layers = summary["layers"]
    if not layers:
        return "no routing figures"
    first, last = summary["steps"]
    e = layers[0]["experts"]
    lines = [(f"{len(layers)} MoE layers × {e} experts, top-{summary['top_k']}, steps {first}–{last} "
              f"({summary['logged_steps']} step events)"),
             f"share: of the layer's assignments (uniform {1 / e:.1%}); hot: ≥ {summary['hot_ratio']:g}× the "
             + "mean load;",
             f"first → last: means of the first and the last {summary['window']} steps", "",
             "layer min share  max share  dead    drop aux loss      max/mean    z loss"]
    for x in layers:  # 79 columns: up to 99 experts, the dead as "e1 +4"
        lines.append(f"{layer_label(x['layer']):<5}{x['share_min']:>6.1%} e{x['expert_min']:<3}"
                     f"{x['share_max']:>6.1%} e{x['expert_max']:<3}{_experts(x['dead'], 1):<7}{x['drop_rate']:>6.1%} "
                     f"{_pair(x['aux_loss'], 3):<14}{_pair(x['max_load_ratio'], 2):<12}{_pair(x['z_loss'], 2)}")
    recent = [f"{layer_label(x['layer'])} " + ", ".join(f"{word} {_experts(x[key])}" for word, key in
                                                       (("dead", "dead_last"), ("hot", "hot_last")) if x[key])
              for x in layers if x["dead_last"] or x["hot_last"]]
    lines += ["", f"last {summary['window']} steps: " + ("; ".join(recent) if recent else "no dead or hot expert")]
    return "\n".join(lines)
