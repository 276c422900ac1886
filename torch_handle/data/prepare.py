"""``handle data prepare``: a corpus, once, into memory-mapped token shards (:mod:`torch_handle.data.shards`).

The documents of the sources (:mod:`torch_handle.data.sources`: plain text, JSON Lines, Parquet, a
``datasets.save_to_disk`` directory) are read in order, in pieces, by this process; worker processes encode
batches of pieces (HF ``tokenizers`` ``encode_batch``, special tokens off); this process writes the ids in corpus
order (:class:`~torch_handle.data.shards.ShardWriter`, ``<eos>`` after each document), so the shards are
byte-identical for any number of workers. At most ``2 * workers + 2`` batches (about 1 MiB of text each) are in
flight: memory does not grow with the corpus. As Megatron-LM's ``tools/preprocess_data.py`` (a pool of encoders,
one writer), with the order kept.

The tokenizer is given (a tokenizer.json, or a directory holding one: a ``handle export``, a Hugging Face model
directory), or the byte-level BPE of :func:`torch_handle.data.datasets.train_tokenizer` is trained on the first
``tokenizer_sample_bytes`` of the training documents.

Validation split (meta.json ``valid.method``):

* ``documents``: whole documents, document ``k`` of source ``s`` held out when the first 8 bytes of
  ``sha256("s\\0k")`` as a fraction of 2**64 are below ``valid_fraction``: independent of workers and parts;
* ``tail``: corpora of too few documents for that (plain text or in-memory documents only, fewer than
  ``MIN_VALID_DOCUMENTS / valid_fraction`` of them, such as one text file): the last ``valid_fraction`` of the
  corpus's bytes, cut at the line boundary before that point (the document there is ended in train and its tail
  is a validation document);
* ``source``: the ``valid`` sources, whole; ``none``: ``valid_fraction`` 0.

Parts (``part=(i, n)``, ``--part I/N``): part ``i`` encodes the documents whose number in the corpus (counting
every document of every source, train then valid sources) is ``i`` modulo ``n``, into ``out/part-IIIII-of-NNNNN``;
every part reads the whole corpus but encodes only its share. :func:`~torch_handle.data.shards.open_prepared`
reads the parts one after the other: the same documents as one prepare, part by part in that order. Every part
needs the same given tokenizer.

Everything is written into a temporary directory beside the output and renamed at the end
(:func:`torch_handle.common.fsio.replacing_dir`): a killed prepare leaves nothing a run would read (its temporary
directory is removed by the next prepare of the same output). No torch import.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from torch_handle.common.fsio import replace_problem, replacing_dir
from torch_handle.common.names import TOKENIZER_FILE
from torch_handle.data.shards import META_FILE, ShardWriter, file_sha256, part_dir_name, token_dtype, write_meta
from torch_handle.data.sources import Source, read_source, resolve_sources
from torch_handle.data.tokenizer_file import eos_id, load_tokenizer, pad_id_of, tokenizer_path, vocab_size_of
from torch_handle.errors import DataError

MIN_VALID_DOCUMENTS = 20
"""Fewer expected validation documents than this and the ``tail`` method holds out a byte tail instead."""
TOKENIZER_SAMPLE_BYTES = 64 << 20
BATCH_CHARS = 1 << 20


@dataclass
class Progress:
    """What a prepare has done so far (handed to the ``progress`` callback after every written batch)."""

    bytes: int
    """Source bytes read."""
    total_bytes: int
    documents: int
    tokens: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)

    @property
    def eta_s(self) -> float | None:
        return (self.total_bytes - self.bytes) / (self.bytes / self.seconds) if self.bytes and self.seconds else None


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------


def _train(train_pieces: Iterator[str], vocab_size: int, sample_bytes: int):
    from torch_handle.data.tokenizer_file import train_tokenizer

    sample, size = [], 0
    for piece in train_pieces:
        sample.append(piece)
        size += len(piece.encode("utf-8", "surrogatepass"))
        if size >= sample_bytes:
            break
    return train_tokenizer(sample, vocab_size)


# ---------------------------------------------------------------------------------------------------------------
# Encoding workers
# ---------------------------------------------------------------------------------------------------------------

_TOKENIZER = None


def _init_worker(tokenizer_json: str) -> None:
    """Runs first in each encoding process (spawned with ``TOKENIZERS_PARALLELISM=false``: one core per process,
    the processes are the parallelism)."""
    global _TOKENIZER
    import signal

    from tokenizers import Tokenizer

    from torch_handle.common.procs import die_with_parent

    die_with_parent(signal.SIGKILL)  # a killed prepare leaves no encoder behind

    _TOKENIZER = Tokenizer.from_str(tokenizer_json)


def _encode(pieces: list[str], tok: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Ids of ``pieces`` concatenated (uint32) and each piece's count (int64), by ``tok`` (default: this encoding
    process's)."""
    encs = (tok or _TOKENIZER).encode_batch(pieces, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
    ids = np.fromiter((i for e in encs for i in e.ids), dtype=np.uint32, count=int(lengths.sum()))
    return ids, lengths


class _InProcess:
    """The pool's ``submit`` for ``workers=0``: each batch encoded at once in this process (HF ``tokenizers``
    parallelises a batch over its own threads), without the seconds that spawning encoders costs."""

    def __init__(self, tok: Any):
        self.tok = tok

    def submit(self, fn: Callable[..., Any], batch: list[str]) -> Future:
        done: Future = Future()
        done.set_result(fn(batch, self.tok))
        return done

    def __enter__(self) -> _InProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


# ---------------------------------------------------------------------------------------------------------------
# Documents in corpus order, with their split
# ---------------------------------------------------------------------------------------------------------------


def held_out(key: str, number: int, fraction: float) -> bool:
    """Whether document ``number`` of the source ``key`` is held out for validation (``documents`` method)."""
    digest = hashlib.sha256(f"{key}\0{number}".encode()).digest()
    return int.from_bytes(digest[:8], "little") < fraction * 2 ** 64


@dataclass
class _Holdout:
    """How the validation split is taken: from ``valid`` sources (``method`` "source"), none, the ``tail`` of the
    training sources, or whole ``documents`` held out (``fraction`` of them)."""

    train: list[Source]
    valid: list[Source]
    method: str
    fraction: float
    cut: int = 0
    """``tail``: the byte of the training sources where validation begins."""


def _stream(holdout: _Holdout, part: tuple[int, int] | None, counts: dict[int, dict[str, int]] | None = None
            ) -> Iterator[tuple[str, str, bool, int]]:
    """``(split, piece, end, bytes_read)`` of this part's documents in corpus order; ``counts[source][split]``
    gets each source's documents."""
    number, done_before, pos = 0, 0, 0
    in_tail = False
    for s, src in enumerate([*holdout.train, *holdout.valid]):
        is_valid_source = s >= len(holdout.train)
        split, doc_no, started = None, 0, False
        done = 0
        for piece, end, done in read_source(src):
            mine = part is None or number % part[1] == part[0]
            if split is None:
                split = ("valid" if is_valid_source or in_tail or
                         (holdout.method == "documents" and held_out(src.key, doc_no, holdout.fraction)) else "train")
            if holdout.method == "tail" and not in_tail and not is_valid_source:
                size = len(piece.encode("utf-8", "surrogatepass"))
                if pos + size >= holdout.cut:
                    k = len(piece.encode("utf-8", "surrogatepass")[:holdout.cut - pos].decode("utf-8", "ignore"))
                    k = piece.rfind("\n", 0, k) + 1
                    if mine and (started or piece[:k]):
                        yield "train", piece[:k], True, done_before + done
                        _count(counts, s, "train")
                    piece, split, in_tail, started = piece[k:], "valid", True, False
                pos += size
            if mine and (piece or (end and started)):
                yield split, piece, end, done_before + done
                started = True
            if end:
                if mine and started:
                    _count(counts, s, split)
                number, doc_no, split, started = number + 1, doc_no + 1, None, False
        done_before += done


def _count(counts: dict[int, dict[str, int]] | None, source: int, split: str) -> None:
    if counts is not None:
        counts.setdefault(source, {}).setdefault(split, 0)
        counts[source][split] += 1


def holdout_of(train: list[Source], valid: list[Source], fraction: float) -> _Holdout:
    """How the validation split of ``train`` (and ``valid`` sources) is taken (the module docstring's methods):
    what a prepare does, and what the pre-flight of the ``text`` dataset checks.

    Raises:
        DataError: a fraction outside [0, 1).
    """
    if valid:
        return _Holdout(train, valid, "source", 0.0)
    if fraction <= 0:
        return _Holdout(train, [], "none", 0.0)
    if not 0 < fraction < 1:
        raise DataError(f"valid_fraction {fraction}: valid are 0 <= f < 1")
    countable = all(s.format in ("text", "memory") for s in train)
    n_docs = sum(1 if s.format == "text" else len(s.texts or ()) for s in train)
    if countable and n_docs * fraction < MIN_VALID_DOCUMENTS:
        return _Holdout(train, [], "tail", fraction, cut=int(sum(s.bytes for s in train) * (1 - fraction)))
    return _Holdout(train, [], "documents", fraction)


def split_bytes(holdout: _Holdout) -> dict[str, int]:
    """Source bytes of each split before a prepare (``{"train", "valid"}``), for a pre-flight: exact for the
    ``source`` and ``none`` methods and for plain-text files held out whole (``documents``: one document a file);
    ``tail`` is cut at a line boundary when prepared, so its figures are the byte cut's; sources of several
    documents a file count as train."""
    train = sum(s.bytes for s in holdout.train)
    if holdout.method == "source":
        return {"train": train, "valid": sum(s.bytes for s in holdout.valid)}
    if holdout.method == "tail":
        return {"train": holdout.cut, "valid": train - holdout.cut}
    if holdout.method == "documents":
        valid = sum(s.bytes for s in holdout.train if s.format == "text" and held_out(s.key, 0, holdout.fraction))
        return {"train": train - valid, "valid": valid}
    return {"train": train, "valid": 0}


# ---------------------------------------------------------------------------------------------------------------
# Prepare
# ---------------------------------------------------------------------------------------------------------------


def _sources(specs: Sequence[str | Source], **kw: str) -> list[Source]:
    out: list[Source] = []
    for spec in specs:
        out.extend([spec] if isinstance(spec, Source) else resolve_sources([spec], **kw))
    return out


def _remove_stale(target: Path) -> None:
    """Temporary directories of killed prepares of ``target`` on this host (``.NAME.<pid>.tmp``, pid gone)."""
    from torch_handle.common.procs import pid_alive

    for tmp in target.parent.glob(f".{target.name}.*.tmp") if target.parent.is_dir() else []:
        pid = tmp.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def prepare(sources: Sequence[str | Source], out: str | Path, *, valid: Sequence[str | Source] = (),
            tokenizer: str | Path | None = None, vocab_size: int = 4096,
            tokenizer_sample_bytes: int = TOKENIZER_SAMPLE_BYTES, valid_fraction: float = 0.05,
            workers: int | None = None, part: tuple[int, int] | None = None, force: bool = False,
            dtype: str = "auto", fmt: str = "auto", field: str = "text", column: str = "text",
            progress: Callable[[Progress], None] | None = None) -> dict[str, Any]:
    """Prepare ``sources`` (files, directories, globs, or :class:`Source` objects) into token shards in ``out``.

    Returns the summary: ``{"directory", "splits": {split: {"tokens", "documents"}}, "bytes", "seconds",
    "mb_per_s", "workers", "tokenizer", "vocab_size", "dtype", "valid_method", "part"}``.

    ``workers``: encoding processes (None: one per usable core); 0 encodes in this process, which suits corpora of
    a few MB (spawning each encoder costs about a second).

    Raises:
        DataError: bad input (see :mod:`torch_handle.data.sources`), a missing tokenizer, a vocabulary that does not
            fit ``dtype``, ``out`` not empty without ``force``, a part without a given tokenizer; one line each,
            and nothing written.
    """
    from torch_handle.common.procs import usable_cores

    t0 = time.perf_counter()
    out = Path(out)
    workers = usable_cores() if workers is None else workers
    if workers < 0:
        raise DataError(f"workers {workers}: valid are 0 (encode in this process) or more")
    if part is not None:
        i, n = part
        if not 0 <= i < n:
            raise DataError(f"part {i}/{n}: valid are 0/N .. N-1/N")
        if tokenizer is None:
            raise DataError("a part needs a given tokenizer (--tokenizer): every part must encode with the same one")
    target = out / part_dir_name(*part) if part else out
    if problem := replace_problem(target, force, marker=META_FILE, kind="a prepared", what="the token shards"):
        raise DataError(problem)
    if dtype not in ("auto", "uint16", "uint32"):
        raise DataError(f"dtype {dtype!r}: valid are auto, uint16, uint32")
    kw = {"fmt": fmt, "field": field, "column": column}
    holdout = holdout_of(_sources(sources, **kw), _sources(valid, **kw), valid_fraction)
    if tokenizer is not None:
        tok_path = tokenizer_path(tokenizer)
        tok = load_tokenizer(tok_path)
        eos = eos_id(tok, tok_path)
        _check_dtype(vocab_size_of(tok), dtype, tok_path)
    hashes = [s.sha256() for s in [*holdout.train, *holdout.valid]]
    total = sum(s.bytes for s in [*holdout.train, *holdout.valid])
    _remove_stale(target)
    counts: dict[int, dict[str, int]] = {}
    with replacing_dir(target) as tmp:
        if tokenizer is None:
            tok_path, eos = tmp / TOKENIZER_FILE, 2  # <eos> of SPECIAL_TOKENS
            train_pieces = (p for split, p, _, _ in _stream(holdout, None) if split == "train" and p)
            tok = _train(train_pieces, vocab_size, tokenizer_sample_bytes)
            tok.save(str(tok_path))
            _check_dtype(vocab_size_of(tok), dtype, tok_path)
        else:
            shutil.copyfile(tok_path, tmp / TOKENIZER_FILE)
        vocab, pad_id = vocab_size_of(tok), pad_id_of(tok, tok_path, eos)
        np_dtype = token_dtype(vocab) if dtype == "auto" else np.dtype(dtype).newbyteorder("<")
        writers = {split: ShardWriter(tmp, split, np_dtype, eos) for split in ("train", "valid")}
        state = Progress(0, total, 0, 0, 0.0)
        if workers:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # inherited by the spawned encoders
        pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker,
                                   initargs=(tok.to_str(),)) if workers else _InProcess(tok)
        with pool:
            inflight: deque = deque()

            def drain_one() -> None:
                fut, marks, done = inflight.popleft()
                ids, lengths = fut.result()
                offsets = np.concatenate([[0], np.cumsum(lengths)])
                for (split, end), lo, hi in zip(marks, offsets[:-1], offsets[1:]):
                    writers[split].add(ids[lo:hi], end=end)
                    state.documents += end
                state.tokens += int(lengths.sum()) + sum(end for _, end in marks)
                state.bytes, state.seconds = done, time.perf_counter() - t0
                if progress is not None:
                    progress(state)

            batch, marks, chars = [], [], 0
            for split, piece, end, done in _stream(holdout, part, counts):
                batch.append(piece)
                marks.append((split, end))
                chars += len(piece)
                if chars >= BATCH_CHARS or len(batch) >= 4096:
                    inflight.append((pool.submit(_encode, batch), marks, done))
                    batch, marks, chars = [], [], 0
                    if len(inflight) > 2 * max(workers, 1) + 1:
                        drain_one()
            if batch:
                inflight.append((pool.submit(_encode, batch), marks, total))
            while inflight:
                drain_one()
        splits = {split: w.close() for split, w in writers.items()}
        if part is None and not splits["train"]["documents"]:
            raise DataError(f"{_names(holdout.train)}: no training documents (lower the validation share)")
        if part is None and holdout.method == "documents" and not splits["valid"]["documents"]:
            raise DataError(f"{_names(holdout.train)}: no document held out for validation among "
                            f"{splits['train']['documents']:,} (give --valid SRC or a larger --valid-fraction)")
        write_meta(tmp, _meta(holdout, part, hashes, counts, tok_path if tokenizer else None, tmp, vocab, (eos, pad_id),
                              np_dtype, splits, vocab_size, tokenizer_sample_bytes))
    seconds = time.perf_counter() - t0
    return {"directory": str(target), "splits": {k: {"tokens": v["tokens"], "documents": v["documents"]}
                                                 for k, v in splits.items()},
            "bytes": total, "seconds": round(seconds, 3), "mb_per_s": round(total / 1e6 / seconds, 3),
            "workers": workers, "tokenizer": str(tokenizer) if tokenizer else "trained", "vocab_size": vocab,
            "dtype": np_dtype.name, "valid_method": holdout.method, "part": list(part) if part else None}


def _names(sources: list[Source]) -> str:
    return ", ".join(str(s.path) for s in sources[:3]) + (", ..." if len(sources) > 3 else "")


def _check_dtype(vocab: int, dtype: str, path: Path) -> None:
    if dtype != "auto" and vocab > np.iinfo(np.dtype(dtype)).max + 1:
        raise DataError(f"{path}: a vocabulary of {vocab:,} tokens does not fit {dtype} (ids up to "
                        f"{np.iinfo(np.dtype(dtype)).max:,}); give dtype uint32 or auto")


def _meta(holdout: _Holdout, part, hashes, counts, given: Path | None, tmp: Path, vocab: int,
          specials: tuple[int, int | None], np_dtype,
          splits, vocab_size: int, sample_bytes: int) -> dict[str, Any]:
    sources = []
    for s, (src, sha) in enumerate(zip([*holdout.train, *holdout.valid], hashes)):
        c = counts.get(s, {})
        split = "valid" if s >= len(holdout.train) else ("both" if len(c) == 2 else next(iter(c), "train"))
        sources.append({"path": str(src.path), "format": src.format, "sha256": sha, "bytes": src.bytes,
                        "documents": sum(c.values()), "split": split})
    eos, pad_id = specials
    tokenizer = {"file": TOKENIZER_FILE, "sha256": file_sha256(tmp / TOKENIZER_FILE), "vocab_size": vocab,
                 "eos_id": eos, "pad_id": pad_id}
    tokenizer.update({"given": str(given)} if given else {"trained": {"vocab_size": vocab_size,
                                                                       "sample_bytes": sample_bytes}})
    return {"dtype": np_dtype.name, "tokenizer": tokenizer, "splits": splits, "sources": sources,
            "valid": {"method": holdout.method, "fraction": holdout.fraction},
            "part": {"index": part[0], "count": part[1]} if part else None}
