"""Data: corpora, the BPE tokenizer, token datasets and a resumable distributed sampler.

- Corpora: the embedded default (the CPython documentation topics in ``pydoc_data.topics``, which every Python
  install ships), local text files (a glob), and aligned parallel files for translation.
- Tokenizer: byte-level BPE trained with HF ``tokenizers`` on the training split only, with the special tokens
  ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3 and ChatML's ``<|im_start|>`` 4, ``<|im_end|>`` 5 (reserved
  so that every model pretrained here can be chat-tuned with ``--template chatml``: docs/fine-tuning.md); cached by
  content hash and reused. One rank per cache directory
  builds it (rank 0; on several nodes without a shared filesystem, each node's first rank) while the others wait
  at a barrier.
- Datasets return dicts of LongTensors whose keys match the model's forward arguments, plus ``labels``
  (``IGNORE_INDEX`` where no loss is taken).
- Samplers: :class:`GlobalBatchSampler` (training: the samples of each optimizer step depend on the seed and the
  step only, not on the world size) and :class:`ResumableDistributedSampler` (validation).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

from torch_handle.common.fsio import replacing
from torch_handle.data.tokenizer_file import (BOS_ID, EOS_ID, IM_END_ID, IM_START_ID, PAD_ID,  # noqa: F401
                                             RESERVED_TOKENS, SPECIAL_TOKENS, TOKENIZER_VERSION, UNK_ID,
                                             train_tokenizer)
from torch_handle.errors import DataError

IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------


def corpus_fingerprint(texts: Sequence[str], vocab_size: int) -> str:
    h = hashlib.sha256(f"{TOKENIZER_VERSION}:{vocab_size}".encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode("utf-8", "surrogatepass")).digest())
    return h.hexdigest()[:16]


def load_or_train_tokenizer(texts: Sequence[str], vocab_size: int, cache_dir: Path, *, is_main: bool,
                            barrier: Callable[[], None]):
    """The tokenizer for ``texts`` and its file: from ``cache_dir`` when one with the same fingerprint exists, else
    trained by the rank with ``is_main`` and written atomically, while the other ranks wait at ``barrier``.

    ``is_main`` must be true on exactly one rank of the ranks that see this ``cache_dir``: rank 0 on one node or a
    shared filesystem, each node's first rank when every node has its own disk (the worker finds out with
    :func:`torch_handle.launch.shared_dirs.directory_leaders`). The temporary file's name carries the host and pid, so two
    builders on one shared directory would never write the same temporary file.
    """
    from tokenizers import Tokenizer

    path = Path(cache_dir) / f"tokenizer-{corpus_fingerprint(texts, vocab_size)}.json"
    if is_main and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tok = train_tokenizer(texts, vocab_size)
        with replacing(path) as tmp:
            tok.save(str(tmp))
    barrier()
    return Tokenizer.from_file(str(path)), path


def encode_stream(tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """Concatenate documents into one stream of token ids, each document (a whole text: paragraph breaks stay
    text) ended by ``<eos>``. Shape (N,) int64. In memory: for corpora of any size see
    :func:`torch_handle.data.prepare.prepare`."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch([t for t in texts if t]):  # tokenizers parallelises a batch in Rust
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------------


class LMDataset(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens from one token stream.

    Item: ``{"input_ids": (seq_len,), "labels": (seq_len,)}``, labels shifted by one.

    Raises:
        DataError: when the stream is too short for a single window.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, name: str = "corpus"):
        if tokens.numel() < seq_len + 1:
            raise DataError(f"{name}: {tokens.numel()} tokens is too small for one sample of seq_len={seq_len}")
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (tokens.numel() - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        chunk = self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


class TokenWindows(Dataset):
    """Packed samples from a prepared split (:class:`torch_handle.data.shards.TokenSplit`): window ``i`` is tokens
    ``[i * seq_len, (i + 1) * seq_len + 1)`` of the split's stream, across document and shard boundaries, read
    from disk at each access (nothing of the corpus is held in memory).

    Item: ``{"input_ids": (seq_len,), "labels": (seq_len,)}``, labels shifted by one; with ``document_mask`` also
    ``"position_ids": (seq_len,)``, each token's position in its document, restarting at 0 at every document
    start and at the window's first token (the model then attends within documents only).

    Raises:
        DataError: when the split is too short for a single window.
    """

    def __init__(self, split: Any, seq_len: int, *, document_mask: bool = False, name: str = "corpus"):
        if split.n_tokens < seq_len + 1:
            raise DataError(f"{name}: {split.n_tokens} tokens is too small for one sample of seq_len={seq_len}")
        self.split, self.seq_len, self.document_mask = split, seq_len, document_mask
        self.n = (split.n_tokens - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} outside [0, {self.n})")
        start = i * self.seq_len
        chunk = torch.from_numpy(self.split.window(start, start + self.seq_len + 1))
        item = {"input_ids": chunk[:-1], "labels": chunk[1:]}
        if self.document_mask:
            item["position_ids"] = torch.from_numpy(self.split.positions(start, start + self.seq_len))
        return item


class TranslationDataset(Dataset):
    """Sentence pairs for an encoder-decoder: source ``tokens + <eos>``; target input ``<bos> + tokens``,
    labels ``tokens + <eos>``; each truncated to ``max_len``.

    Item: ``{"src_ids": (S,), "tgt_ids": (T,), "labels": (T,)}`` of varying lengths (see :func:`pad_collate`).
    """

    def __init__(self, src_ids: list[list[int]], tgt_ids: list[list[int]], max_len: int):
        self.pairs = [(s[: max_len - 1] + [EOS_ID], t[: max_len - 1]) for s, t in zip(src_ids, tgt_ids)]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        src, tgt = self.pairs[i]
        return {"src_ids": torch.tensor(src), "tgt_ids": torch.tensor([BOS_ID, *tgt]),
                "labels": torch.tensor([*tgt, EOS_ID])}


def pad_collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad every key to the longest item: ids with ``<pad>`` (``PAD_ID`` of the tokenizers trained here),
    labels with ``IGNORE_INDEX``. (B, L_max)."""
    out = {}
    for key in items[0]:
        fill = IGNORE_INDEX if key == "labels" else PAD_ID
        out[key] = torch.nn.utils.rnn.pad_sequence([it[key] for it in items], batch_first=True, padding_value=fill)
    return out


@dataclass
class DataBundle:
    """What a dataset plugin returns."""

    train: Dataset
    valid: Dataset
    vocab_size: int
    """Size of the tokenizer's vocabulary (the model's embedding rows)."""
    max_len: int
    """Longest sequence the model will see (positional-encoding length)."""
    tokenizer_path: Path | None = None
    """A ``tokenizers`` JSON file, copied into the run directory as ``tokenizer.json``."""
    collate_fn: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]] | None = None
    """Batches the samples (None: default stacking; ``pad_collate`` for variable lengths)."""
    pad_id: int | None = None
    """Token id of padding, which the model hides from attention (``pad_collate`` pads with it); None: no id is
    padding (a bundle of prepared data: the ``pad_id`` its meta.json records)."""
    description: str = ""
    """Where the data came from, for the rank logs (``data <description>: N train / M validation samples``)."""
    identity: Any = None
    """The data's :class:`~torch_handle.data.shards.DataIdentity` when the plugin knows it (prepared data:
    :func:`torch_handle.data.bundle.prepared_bundle`): checkpoints record it, and a resume on other data is refused
    (:mod:`torch_handle.launch.data_identity`). None: the tokenizer file's hash alone is recorded."""


@dataclass
class DataContext:
    """What the worker hands a dataset plugin."""

    cache_dir: Path
    """Where tokenizers (and other derived files) are cached across runs."""
    is_main: bool
    """This rank builds what is missing in ``cache_dir``: one rank per cache directory (rank 0 on one node or a
    shared filesystem; each node's first rank when the nodes do not share ``cache_dir``)."""
    barrier: Callable[[], None]
    """Every rank calls it once the builders are done (a collective over all ranks)."""
    objective: str = "lm"
    """``[finetune] objective``: ``lm`` (every token a label) or ``sft`` (conversations, the trained tokens only)."""


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` that can start part-way into an epoch, for exact resume.

    ``set_epoch(e)`` must be called every epoch (as with the parent: it seeds the shuffle). ``skip(n)`` drops
    the first ``n`` indices of this rank for the current epoch only.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._skip = 0

    def skip(self, n: int) -> None:
        self._skip = n

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self._skip = self._skip, 0
        return iter(indices[skip:])


class GlobalBatchSampler(Sampler[list[int]]):
    """Batch sampler for one rank whose global batches do not depend on the world size, and the keeper of the data
    position.

    Every epoch ``e`` has one order of the whole dataset, ``torch.randperm(num_samples)`` drawn from a generator
    seeded with ``seed + e`` (the same permutation ``DistributedSampler`` draws; ``shuffle=False``: 0, 1, 2, ...).
    Global batch ``k`` of the epoch is the next ``G = micro_batch_size * grad_accum * world_size`` samples of that
    order; within it, micro-batch ``i`` of rank ``r`` is the slice at offset ``(r * grad_accum + i) *
    micro_batch_size``. So the samples of optimizer step ``s`` are a function of the seed and ``s`` only, however
    they are spread over ranks and micro-batches: 2 ranks x micro-batch 8 and 1 rank x micro-batch 8 x grad_accum 2
    see the same 16 samples at every step. The remainder of an epoch shorter than ``G`` is dropped.

    The position is ``(epoch, samples_in_epoch)``: the samples of the epoch's order that all ranks together have
    consumed. Iterating yields lists of ``micro_batch_size`` dataset indices, ``grad_accum`` per global batch, from
    the position to the epoch's end (a ``DataLoader``'s ``batch_sampler``); the consumer calls :meth:`advance` once a
    global batch is consumed (a ``DataLoader`` with workers draws ahead of what the step used, so drawing is not
    consuming). :meth:`state_dict` and :meth:`load_state_dict` carry the position through a checkpoint, for any
    world size and micro-batching.

    Raises:
        ValueError: arguments that are not positive, ``rank`` outside ``[0, world_size)``, or fewer samples than
            one global batch.
    """

    def __init__(self, num_samples: int, *, micro_batch_size: int, grad_accum: int = 1, world_size: int = 1,
                 rank: int = 0, seed: int = 0, shuffle: bool = True):
        for name, value in (("micro_batch_size", micro_batch_size), ("grad_accum", grad_accum),
                            ("world_size", world_size)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.num_samples, self.micro_batch_size, self.grad_accum = int(num_samples), micro_batch_size, grad_accum
        self.world_size, self.rank, self.seed, self.shuffle = world_size, rank, seed, shuffle
        self.global_batch = micro_batch_size * grad_accum * world_size
        """Samples per optimizer step over all ranks."""
        if self.num_samples < self.global_batch:
            raise ValueError(f"{self.num_samples} samples are too few for one global batch of {self.global_batch} "
                             f"(micro_batch_size={micro_batch_size} x grad_accum={grad_accum} x world size "
                             f"{world_size})")
        self.epoch = 0
        self.samples_in_epoch = 0
        self._order: tuple[int, np.ndarray] | None = None

    # -- the position ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "samples_in_epoch"}``: where the next global batch starts."""
        return {"epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at ``state`` (of :meth:`state_dict`, any multiple of any global batch); a position with no whole
        global batch left in its epoch is the next epoch's start."""
        self.epoch, self.samples_in_epoch = int(state["epoch"]), max(0, int(state["samples_in_epoch"]))
        self._roll_over()

    def advance(self) -> np.ndarray:
        """One global batch consumed: the position moves past it. Returns its indices, int64 (global_batch,), in
        the epoch's order (all ranks' micro-batches, rank 0's first): what the step trained on."""
        start = self.samples_in_epoch
        indices = self.order_array(self.epoch)[start: start + self.global_batch]
        self.samples_in_epoch += self.global_batch
        self._roll_over()
        return indices

    def peek(self) -> np.ndarray:
        """The indices :meth:`advance` will return next (the global batch at the position), int64 (global_batch,)."""
        return self.order_array(self.epoch)[self.samples_in_epoch: self.samples_in_epoch + self.global_batch]

    def _roll_over(self) -> None:
        if self.steps_in_epoch(self.samples_in_epoch) == 0:
            self.epoch, self.samples_in_epoch = self.epoch + 1, 0

    # -- the order ---------------------------------------------------------------------------------------------
    def order(self, epoch: int) -> list[int]:
        """The order of the dataset in ``epoch``, the same on every rank and for every world size."""
        return self.order_array(epoch).tolist()

    def order_array(self, epoch: int) -> np.ndarray:
        """:meth:`order` as int64 (num_samples,): 8 bytes a sample where a list of Python ints takes about 36 (a
        1 GB corpus has millions of samples). Drawn once an epoch."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        if not self.shuffle:
            order = np.arange(self.num_samples, dtype=np.int64)
        else:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=g).numpy()
        self._order = (epoch, order)
        return order

    def steps_in_epoch(self, start: int = 0) -> int:
        """Global batches left in an epoch after its first ``start`` samples."""
        return max(0, self.num_samples - start) // self.global_batch

    def __len__(self) -> int:
        """Micro-batches of this rank in a whole epoch."""
        return self.steps_in_epoch() * self.grad_accum

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's micro-batches from the position to the end of its epoch."""
        epoch, start = self.epoch, self.samples_in_epoch
        order = self.order_array(epoch)
        mb, ga = self.micro_batch_size, self.grad_accum
        for k in range(self.steps_in_epoch(start)):
            base = start + k * self.global_batch
            for i in range(ga):
                offset = base + (self.rank * ga + i) * mb
                yield order[offset: offset + mb].tolist()
