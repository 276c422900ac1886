"""Preference pairs as training samples (``[finetune] objective = "dpo"``): one sample per pair, its chosen and
rejected rows side by side, each padded to ``seq_len`` positions, so a pair is never split across windows, ranks
or micro-batches and no two pairs share a row (no packing).

A side of ``L`` tokens gives ``L - 1`` positions, as a conversation does (:mod:`torch_handle.data.chat.packing`):
its ids but the last as inputs, its ids but the first as labels, a label kept only where its token is trained (the
completion's), ``IGNORE_INDEX`` elsewhere and on the padding. The padding's ids are the end-of-document id and come
after the side's tokens, so causal attention never lets a real token see them. A pair with a side longer than
``seq_len + 1`` tokens (prepared with a larger ``--max-len``) is left out, counted and logged.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.errors import DataError

log = logging.getLogger("torch_handle")


class PreferencePairs:
    """The pairs of a prepared split (documents 2i and 2i + 1: chosen and rejected, :mod:`torch_handle.data.chat
    .pairs`).

    Item: ``{"input_ids", "labels"}``, each (2, seq_len) int64: row 0 the chosen side, row 1 the rejected, and
    ``"pair"``, the item's index (a 0-d int64: where a precomputed reference keeps its log-probabilities). A batch
    of B items is (B, 2, seq_len); the DPO objective runs it as one (2B, seq_len) forward, the B chosen rows first.

    Raises:
        DataError: a split without masks or with an odd number of documents (not prepared with --preference), or
            with no pair that fits.
    """

    def __init__(self, split: Any, seq_len: int, *, fill_id: int = 0, name: str = "pairs"):
        if not split.has_masks or split.n_documents % 2:
            raise DataError(f"{name}: not preference pairs (objective dpo needs handle data prepare --preference)")
        self.split, self.seq_len, self.fill_id = split, seq_len, fill_id
        starts = split.doc_starts.astype(np.int64)
        self.starts, self.ends = starts, np.append(starts[1:], split.n_tokens)
        longest = np.maximum(*(self.ends - starts).reshape(-1, 2).T) if len(starts) else np.zeros(0, np.int64)
        fits = longest <= seq_len + 1
        self.dropped = int((~fits).sum())
        if self.dropped:
            log.warning("data %s: %d pair(s) with a side longer than seq_len + 1 = %d tokens left out (prepare with "
                        "--max-len %d)", name, self.dropped, seq_len + 1, seq_len)
        self.pairs = np.flatnonzero(fits)
        if not len(self.pairs):
            raise DataError(f"{name}: no pair fits seq_len = {seq_len}")

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def sample_positions(self) -> int:
        """Positions each sample computes (both rows, ``2 * seq_len``; :func:`torch_handle.train.step_report
        .window_tokens`)."""
        return 2 * self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self.pairs):
            raise IndexError(f"pair {i} outside [0, {len(self.pairs)})")
        ids = np.full((2, self.seq_len + 1), self.fill_id, dtype=np.int64)
        labels = np.full((2, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        for side in range(2):
            d = 2 * int(self.pairs[i]) + side
            start, stop = int(self.starts[d]), int(self.ends[d])
            tokens, trained = self.split.window(start, stop), self.split.mask(start, stop)
            n = stop - start - 1
            ids[side, :n + 1] = tokens
            labels[side, :n] = np.where(trained[1:], tokens[1:], IGNORE_INDEX)
        return {"input_ids": torch.from_numpy(ids[:, :-1]), "labels": torch.from_numpy(labels),
                "pair": torch.tensor(i, dtype=torch.int64)}
