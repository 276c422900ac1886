"""Weighted mixtures of prepared token sources, blended deterministically over the global sample index.

Weights are **per sample**: source j gives a share ``w_j / sum(w)`` of the mixture's samples, and since every
sample is a window of ``seq_len + 1`` tokens, the same share of its tokens. The order is Megatron-Core's
"largest sampling error first" (``megatron/core/datasets/helpers.cpp``, ``build_blending_indices``): sample ``i``
goes to the source ``j`` that maximises ``w_j * (i + 1) - count_j`` (its shortfall once sample ``i`` is drawn;
ties to the first source), so after any ``n`` samples every source has within one sample of its share.

The weights are first made exact integers: ``p_j`` parts of ``q`` (the shares rounded to 1/:data:`RESOLUTION`,
by largest remainder so that they add up to ``q``, then divided by their greatest common divisor; 0.5/0.3/0.2 is
5/3/2 of 10). In integers the greedy's shortfall after ``q`` samples is exactly zero for every source, so its
choices repeat with period ``q``: one period (at most :data:`RESOLUTION` samples, a tight loop done once) gives
the source of any sample and the count of that source's earlier samples in O(1), vectorised with numpy, for any
mixture length -- nothing grows with the corpus.

The mixture has as many samples as its sources together (``sum_j len_j``). Source j is drawn ``n_j`` times in
that length; when ``n_j <= len_j`` (downsampled) its k-th draw takes its window ``k * len_j // n_j`` (evenly
strided over the whole source), else (upsampled, a source shorter than its share) ``k % len_j``: it wraps around.

No torch at import in :func:`blend_period` and :func:`integer_weights` (the pre-flight checks use them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

RESOLUTION = 10_000
"""Shares are rounded to 1/RESOLUTION of the total weight (0.0001)."""


def integer_weights(weights: Sequence[float]) -> tuple[list[int], int]:
    """``(p, q)``: the normalised weights as integer parts ``p_j`` of ``q`` (see the module docstring).

    Raises:
        ValueError: a weight that is not positive and finite, or whose share rounds to 0 (below 1/RESOLUTION).
    """
    w = [float(x) for x in weights]
    if not w or any(not math.isfinite(x) or x <= 0 for x in w):
        raise ValueError(f"weights must be positive numbers, got {weights!r}")
    total = sum(w)
    exact = [x / total * RESOLUTION for x in w]
    parts = [int(math.floor(e)) for e in exact]
    by_remainder = sorted(range(len(w)), key=lambda j: (-(exact[j] - parts[j]), j))
    for j in by_remainder[: RESOLUTION - sum(parts)]:
        parts[j] += 1
    if any(p == 0 for p in parts):
        j = parts.index(0)
        raise ValueError(f"weight {w[j]} is below 1/{RESOLUTION} of the total {total}")
    g = math.gcd(*parts)
    return [p // g for p in parts], RESOLUTION // g


def blend_period(parts: Sequence[int], q: int) -> tuple[np.ndarray, np.ndarray]:
    """One period of the "largest sampling error first" order for integer weights ``parts`` of ``q``.

    Returns ``(source, rank)``, each (q,): ``source[r]`` the source of sample ``r`` (int16), ``rank[r]`` how many
    samples of that source come before it in the period (int64). Exact integer arithmetic: the shortfall of source
    j after sample i is ``(p_j * (i + 1) - q * count_j) / q``.
    """
    k = len(parts)
    source = np.empty(q, dtype=np.int16)
    rank = np.empty(q, dtype=np.int64)
    counts = [0] * k
    for i in range(q):
        best, best_err = 0, parts[0] * (i + 1) - q * counts[0]
        for j in range(1, k):
            err = parts[j] * (i + 1) - q * counts[j]
            if err > best_err:
                best, best_err = j, err
        source[i], rank[i] = best, counts[best]
        counts[best] += 1
    assert counts == list(parts), (counts, parts)  # the shortfall is zero after q samples: the order repeats
    return source, rank


@dataclass(frozen=True)
class Blend:
    """The blend of sources of lengths ``lengths`` (samples) with integer weights ``parts`` of ``q``, over a
    mixture of ``sum(lengths)`` samples. Every method takes int64 arrays of sample indices (N,)."""

    parts: tuple[int, ...]
    q: int
    lengths: tuple[int, ...]
    source_period: np.ndarray
    rank_period: np.ndarray

    @classmethod
    def build(cls, weights: Sequence[float], lengths: Sequence[int]) -> "Blend":
        parts, q = integer_weights(weights)
        source, rank = blend_period(parts, q)
        return cls(tuple(parts), q, tuple(int(n) for n in lengths), source, rank)

    @property
    def size(self) -> int:
        """Samples in the mixture: those of every source together."""
        return int(sum(self.lengths))

    def draws(self) -> np.ndarray:
        """How many of the mixture's samples each source gives, int64 (K,)."""
        full, rest = divmod(self.size, self.q)
        counts = np.bincount(self.source_period[:rest], minlength=len(self.parts))
        return full * np.asarray(self.parts, dtype=np.int64) + counts

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        """The source of each sample, int64 (N,)."""
        return self.source_period[np.asarray(indices, dtype=np.int64) % self.q].astype(np.int64)

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, window)`` of each sample: which source and which of its windows, int64 (N,) each."""
        indices = np.asarray(indices, dtype=np.int64)
        cycle, r = np.divmod(indices, self.q)
        source = self.source_period[r].astype(np.int64)
        k = cycle * np.asarray(self.parts, dtype=np.int64)[source] + self.rank_period[r]  # earlier draws of it
        n = self.draws()[source]
        length = np.asarray(self.lengths, dtype=np.int64)[source]
        window = np.where(n <= length, k * length // np.maximum(n, 1), k % length)
        return source, window

    def upsampled(self) -> list[int]:
        """The sources drawn more often than they have windows (they wrap around)."""
        return [j for j, (n, length) in enumerate(zip(self.draws(), self.lengths)) if n > length]


class MixedWindows:
    """A weighted mixture of :class:`~torch_handle.data.datasets.TokenWindows` (one per source), blended by
    :class:`Blend`. Items are those of the sources (``input_ids``, ``labels``, and ``position_ids`` with document
    masking): nothing is added, so a batch reaches the model unchanged; which source gave a sample is a side
    table, :meth:`source_of`.

    ``names``: one per source (the telemetry's keys).
    """

    def __init__(self, sources: Sequence[Any], weights: Sequence[float], names: Sequence[str]):
        self.sources, self.names = list(sources), list(names)
        self.seq_len = int(self.sources[0].seq_len)
        self.blend = Blend.build(weights, [len(s) for s in self.sources])

    def __len__(self) -> int:
        return self.blend.size

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} outside [0, {len(self)})")
        source, window = self.blend.locate(np.array([i]))
        return self.sources[int(source[0])][int(window[0])]

    def source_of(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The source index of each sample (int64, (N,)), an index into :attr:`names`."""
        return self.blend.source_of(np.asarray(indices, dtype=np.int64))

    def tokens_per_source(self, indices: Sequence[int] | np.ndarray) -> dict[str, int]:
        """Tokens (``seq_len`` labels a sample) each source gave to the samples ``indices``, by name."""
        counts = np.bincount(self.source_of(indices), minlength=len(self.names)) * self.seq_len
        return {name: int(c) for name, c in zip(self.names, counts)}
