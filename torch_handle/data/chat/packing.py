"""Conversations packed into fixed-length samples for supervised fine-tuning (``[finetune] objective = "sft"``).

Each conversation of ``L`` tokens gives ``L - 1`` positions: its ids but the last as inputs, its ids but the first
as labels, a label kept only where its token is trained (``IGNORE_INDEX`` elsewhere). The conversations of a split
are packed best-fit-decreasing into samples of ``seq_len`` positions (longest first, each into the fullest sample
it still fits; TRL's ``_pack_bfd``, torchtune's ``PackedDataset``), never split; the rest of a sample is padding
(labels ``IGNORE_INDEX``). ``position_ids`` restart at every conversation and at the padding, so the model's
document mask (docs/modern-decoder.md) keeps each conversation from attending to another. A conversation longer
than ``seq_len + 1`` tokens (prepared with a larger ``--max-len``) is left out, counted and logged.

The plan is computed once per split from the document offsets and masks (1 byte a token, read once) and is the
same on every rank; items are read from the shards by memory map at each access.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import numpy as np
import torch

from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.errors import DataError

log = logging.getLogger("torch_handle")


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of item indices: items by falling length (ties by index), each into the bin with the least room left
    that still holds it, else a new bin. Every length must be at most ``capacity``."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin), sorted
    for i in order:
        n = int(lengths[i])
        k = bisect.bisect_left(room, (n, -1))
        if k < len(room):
            left, b = room.pop(k)
        else:
            left, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if left - n > 0:
            bisect.insort(room, (left - n, b))
    return bins


class PackedConversations:
    """The conversations of a prepared split (:class:`~torch_handle.data.shards.TokenSplit` with masks) as packed
    samples of ``seq_len`` positions.

    Item: ``{"input_ids", "labels", "position_ids"}``, each (seq_len,) int64; the padding's ids are ``fill_id``
    (the end-of-document id: no padding token is needed, the padding is a segment of its own).

    Raises:
        DataError: a split without masks (not prepared with ``--chat``), or with no conversation that fits.
    """

    def __init__(self, split: Any, seq_len: int, *, fill_id: int = 0, name: str = "conversations"):
        if not split.has_masks:
            raise DataError(f"{name}: no trained-token masks (objective sft needs conversations: handle data prepare "
                            f"--chat)")
        self.split, self.seq_len, self.fill_id = split, seq_len, fill_id
        starts = split.doc_starts.astype(np.int64)
        ends = np.append(starts[1:], split.n_tokens)
        positions = ends - starts - 1  # (D,) label positions of each conversation
        mask = split.mask(0, split.n_tokens)
        mask[starts] = False  # a conversation's first token is never a label
        trained = np.add.reduceat(mask.astype(np.int64), starts) if len(starts) else np.zeros(0, np.int64)
        fits = (positions <= seq_len) & (positions > 0)
        self.dropped = int((~fits).sum())
        if self.dropped:
            log.warning("data %s: %d conversation(s) longer than seq_len + 1 = %d tokens left out (prepare with "
                        "--max-len %d)", name, self.dropped, seq_len + 1, seq_len)
        kept = np.flatnonzero(fits)
        if not len(kept):
            raise DataError(f"{name}: no conversation fits seq_len = {seq_len}")
        self.starts, self.positions = starts, positions
        self.samples = [[int(kept[j]) for j in b] for b in best_fit_decreasing(positions[kept], seq_len)]
        self._labels = np.array([int(trained[s].sum()) for s in self.samples], dtype=np.int64)
        self.efficiency = float(positions[kept].sum()) / (len(self.samples) * seq_len)
        """Conversation positions over sample positions (1.0: no padding)."""

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def sample_positions(self) -> int:
        """Positions each sample computes, trained or not (``seq_len``): a step's ``window_tokens`` per sample
        (:func:`torch_handle.train.step_report.window_tokens`)."""
        return self.seq_len

    def label_counts(self, indices: Any) -> int:
        """Trained labels of the samples ``indices`` together (what a global batch's loss is the mean over)."""
        return int(self._labels[np.asarray(indices, dtype=np.int64)].sum())

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self.samples):
            raise IndexError(f"sample {i} outside [0, {len(self.samples)})")
        ids = np.full(self.seq_len + 1, self.fill_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros(self.seq_len, dtype=np.int64)
        at = 0
        for d in self.samples[i]:
            start, n = int(self.starts[d]), int(self.positions[d])
            tokens = self.split.window(start, start + n + 1)
            trained = self.split.mask(start, start + n + 1)[1:]
            ids[at: at + n] = tokens[:-1]
            labels[at: at + n] = np.where(trained, tokens[1:], IGNORE_INDEX)
            positions[at: at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(self.seq_len - at)  # the padding: a segment of its own
        return {"input_ids": torch.from_numpy(ids[:-1]), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(positions)}
