"""Prepared token shards: the on-disk format that ``handle data prepare`` writes and the ``tokens`` dataset reads.

A prepared directory holds, for each split (``train``, ``valid``), one or more shards, and one ``meta.json``::

    DIR/meta.json             what is here (below); written last, so a directory without it is not prepared
    DIR/tokenizer.json        the tokenizer that made the ids (HF ``tokenizers`` JSON)
    DIR/train-00000.bin       token ids, little-endian ``dtype`` (uint16 when the vocabulary fits, else uint32),
                              documents one after the other, each ended by ``<eos>``
    DIR/train-00000.idx       int64 little-endian document boundaries within the shard: ``[0, end_0, end_1, ...]``
                              (documents + 1 entries; document d is ``bin[idx[d]:idx[d + 1]]``)

As Megatron-Core's indexed dataset (``megatron/core/datasets/indexed_dataset.py``: a ``.bin`` of tokens and an
``.idx`` of offsets) and nanoGPT's ``train.bin``: the tokens never enter Python lists; a reader maps only the
window it needs (:meth:`TokenSplit.window`) and drops the mapping at once (nanoGPT #287: a long-lived memmap's
pages count in the process's RSS), so resident memory does not grow with the corpus.

A corpus prepared in parts (``handle data prepare --part I/N``, one Slurm array task each) is a directory of
``part-IIIII-of-NNNNN/`` subdirectories, each a prepared directory of its own, all with one tokenizer:
:func:`open_prepared` reads them as one dataset, in part order, without copying.

``meta.json``::

    {"format": "handle-tokens", "version": 1, "dtype": "uint16",
     "tokenizer": {"file": "tokenizer.json", "sha256": HEX, "vocab_size": 4096, "eos_id": 2, "pad_id": 0},
     "splits": {"train": {"tokens": N, "documents": D, "shards": [{"bin": ..., "idx": ..., "tokens": n,
                                                                   "documents": d}, ...]},
                "valid": {...}},
     "sources": [{"path": ..., "format": "text" | "jsonl" | "parquet" | "hf", "sha256": HEX, "bytes": B,
                  "documents": d, "split": "train" | "valid" | "both"}, ...],
     "valid": {"method": "documents" | "source" | "tail", "fraction": f},
     "part": null | {"index": i, "count": n}}

``pad_id`` is the tokenizer's padding token, or null when it has none (then no id is padding: id 0 is ``!`` in
GPT-2's, Llama 3's and Qwen's vocabularies); directories prepared before it was recorded get it from the tokenizer
file (:func:`pad_id_of`). What a run and a resume compare of a prepared directory is its :class:`DataIdentity`.

No torch import: the CLI's checks read it too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from torch_handle.common.names import TOKENIZER_FILE
from torch_handle.errors import DataError

FORMAT, VERSION = "handle-tokens", 1
META_FILE = "meta.json"
SPLITS = ("train", "valid")
SHARD_TOKENS = 1 << 28
"""A shard is closed at the first document end past this many tokens (512 MiB of uint16): few files, each well
under any filesystem's limit. Shard boundaries depend on the documents only, never on the number of workers."""
IDX_DTYPE = np.dtype("<i8")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest little-endian unsigned dtype that holds every id below ``vocab_size``: uint16 up to 65,536
    ids (ids 0..65,535), else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def part_dir_name(index: int, count: int) -> str:
    """``part-IIIII-of-NNNNN``: the subdirectory ``--part I/N`` writes (``index`` counts from 0)."""
    return f"part-{index:05d}-of-{count:05d}"


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------


class ShardWriter:
    """Appends documents of one split to ``DIR/<split>-NNNNN.bin/.idx`` shards.

    Call :meth:`add` with each document's ids in corpus order (the ``<eos>`` is appended here), then :meth:`close`,
    which returns the split's entry for ``meta.json``. The bytes depend on the documents and ``shard_tokens`` only.

    Raises:
        DataError: an id that does not fit ``dtype`` (a tokenizer bigger than the vocabulary it was sized for).
    """

    def __init__(self, directory: Path, split: str, dtype: np.dtype, eos_id: int | None, *,
                 shard_tokens: int = SHARD_TOKENS, masks: bool = False):
        self.directory, self.split, self.dtype, self.eos_id = Path(directory), split, np.dtype(dtype), eos_id
        self.shard_tokens, self.masks = shard_tokens, masks
        self.shards: list[dict[str, Any]] = []
        self._bin = self._ends = self._mask = None
        self._tokens = 0

    def _open(self) -> None:
        k = len(self.shards)
        name = f"{self.split}-{k:05d}"
        self.shards.append({"bin": f"{name}.bin", "idx": f"{name}.idx", "tokens": 0, "documents": 0,
                            **({"mask": f"{name}.mask"} if self.masks else {})})
        self._bin = open(self.directory / f"{name}.bin", "wb")
        self._mask = open(self.directory / f"{name}.mask", "wb") if self.masks else None
        self._ends: list[int] = [0]
        self._tokens = 0

    def _finish(self) -> None:
        if self._bin is None:
            return
        self._bin.close()
        if self._mask is not None:
            self._mask.close()
        np.asarray(self._ends, dtype=IDX_DTYPE).tofile(self.directory / self.shards[-1]["idx"])
        self.shards[-1].update(tokens=self._tokens, documents=len(self._ends) - 1)
        self._bin = None

    def add(self, ids: Iterable[int] | np.ndarray, *, end: bool = True, mask: Iterable[bool] | None = None) -> None:
        """Append one document (its ids without ``<eos>``), or with ``end=False`` the first pieces of one (no
        ``<eos>`` yet; the document ends with the next ``add`` whose ``end`` is true). A shard is closed only at a
        document's end. A writer without ``eos_id`` (conversations, which end with their end-of-turn) appends
        none; one with ``masks`` takes each token's ``mask`` (trained or not; the ``<eos>`` is not trained)."""
        arr = np.asarray(ids)
        if arr.size and (int(arr.max()) > np.iinfo(self.dtype).max or int(arr.min()) < 0):
            raise DataError(f"token id {int(arr.max())} does not fit {self.dtype.name} (vocabulary too big)")
        if self._bin is None:
            self._open()
        eos = end and self.eos_id is not None
        doc = np.empty(arr.size + eos, dtype=self.dtype)
        doc[:arr.size] = arr
        if eos:
            doc[-1] = self.eos_id
        if self._mask is not None:
            trained = np.zeros(doc.size, dtype=np.uint8)
            trained[:arr.size] = np.asarray(list(mask) if mask is not None else [], dtype=bool)
            self._mask.write(trained.tobytes())
        self._bin.write(doc.tobytes())
        self._tokens += doc.size
        if end:
            self._ends.append(self._tokens)
            if self._tokens >= self.shard_tokens:
                self._finish()

    def close(self) -> dict[str, Any]:
        """Close the last shard; the split's ``meta.json`` entry ``{"tokens", "documents", "shards"}``."""
        self._finish()
        return {"tokens": sum(s["tokens"] for s in self.shards),
                "documents": sum(s["documents"] for s in self.shards), "shards": self.shards}


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    """Write ``meta.json`` (``format`` and ``version`` filled in); keys sorted, so equal content is equal bytes."""
    full = {"format": FORMAT, "version": VERSION, **meta}
    (Path(directory) / META_FILE).write_text(json.dumps(full, indent=1, sort_keys=True) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shard:
    bin: Path
    start: int
    """Global token offset of the shard's first token within its split."""
    tokens: int


class TokenSplit:
    """One split of one or more prepared directories, read as one stream of tokens.

    ``doc_starts`` (int64, (D,)) are the global token offsets where documents begin: small (8 bytes a document),
    read into memory. The tokens stay on disk.

    Raises:
        DataError: a shard missing or of the wrong size for ``meta.json`` (truncated), an index that does not
            match its shard.
    """

    def __init__(self, metas: list[tuple[Path, dict[str, Any]]], split: str):
        self.split = split
        self.dtype = np.dtype(metas[0][1]["dtype"]).newbyteorder("<")
        self.shards: list[_Shard] = []
        starts: list[np.ndarray] = []
        total = 0
        self.has_masks = all("mask" in e for _, meta in metas for e in meta["splits"][split]["shards"])
        """Each token carries whether it is trained (conversations: ``handle data prepare --chat``)."""
        for directory, meta in metas:
            for entry in meta["splits"][split]["shards"]:
                bin_path, idx_path = directory / entry["bin"], directory / entry["idx"]
                n, d = int(entry["tokens"]), int(entry["documents"])
                files = [(bin_path, n * self.dtype.itemsize), (idx_path, (d + 1) * IDX_DTYPE.itemsize)]
                if self.has_masks:
                    files.append((directory / entry["mask"], n))
                for path, want in files:
                    if not path.is_file():
                        raise DataError(f"{path}: missing (listed in {directory / META_FILE}; prepare again)")
                    if path.stat().st_size != want:
                        raise DataError(f"{path}: {path.stat().st_size} bytes, {directory / META_FILE} says {want} "
                                        f"(truncated or changed; prepare again)")
                ends = np.fromfile(idx_path, dtype=IDX_DTYPE)
                if ends[0] != 0 or ends[-1] != n or (d and np.any(np.diff(ends) <= 0)):
                    raise DataError(f"{idx_path}: document offsets do not match {bin_path.name} (prepare again)")
                self.shards.append(_Shard(bin_path, total, n))
                starts.append(ends[:-1] + total)
                total += n
        self.n_tokens = total
        self.doc_starts = np.concatenate(starts) if starts else np.zeros(0, dtype=IDX_DTYPE)
        self._shard_starts = np.array([s.start for s in self.shards], dtype=np.int64)

    @property
    def n_documents(self) -> int:
        return int(self.doc_starts.size)

    def window(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the split as int64 (stop - start,), read through short-lived memory maps of
        only the pages needed (across shard boundaries).

        Raises:
            IndexError: a range outside ``[0, n_tokens]``.
        """
        return self._read(start, stop, lambda shard: shard.bin, self.dtype)

    def _read(self, start: int, stop: int, path_of: Any, dtype: np.dtype) -> np.ndarray:
        if not 0 <= start <= stop <= self.n_tokens:
            raise IndexError(f"tokens [{start}, {stop}) outside [0, {self.n_tokens}) of the {self.split} split")
        out = np.empty(stop - start, dtype=np.int64)
        k = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            shard = self.shards[k]
            lo, hi = pos - shard.start, min(stop, shard.start + shard.tokens) - shard.start
            if hi > lo:
                mm = np.memmap(path_of(shard), dtype=dtype, mode="r", offset=lo * dtype.itemsize, shape=(hi - lo,))
                out[pos - start: pos - start + hi - lo] = mm
                del mm
                pos += hi - lo
            k += 1
        return out

    def mask(self, start: int, stop: int) -> np.ndarray:
        """Whether each token of ``[start, stop)`` is trained, bool (stop - start,), read as :meth:`window` reads.

        Raises:
            IndexError: a range outside ``[0, n_tokens]``.
            DataError: the split has no masks (not conversations).
        """
        if not self.has_masks:
            raise DataError(f"the {self.split} split has no trained-token masks (prepare conversations with --chat)")
        return self._read(start, stop, lambda shard: shard.bin.with_suffix(".mask"), np.dtype(np.uint8)).astype(bool)

    def positions(self, start: int, stop: int) -> np.ndarray:
        """Each token's position in its document for the window ``[start, stop)``, int64 (stop - start,): 0 at the
        window's first token and at every document start within it, counting up in between (the ``position_ids``
        of a packed sample with document masking)."""
        first = int(np.searchsorted(self.doc_starts, start, side="right"))
        last = int(np.searchsorted(self.doc_starts, stop, side="left"))
        seg_starts = np.concatenate([[0], self.doc_starts[first:last] - start])  # (S,) within the window
        idx = np.arange(stop - start, dtype=np.int64)
        return idx - seg_starts[np.searchsorted(seg_starts, idx, side="right") - 1]


def read_meta(directory: Path) -> dict[str, Any]:
    """``DIR/meta.json``, checked for format and version.

    Raises:
        DataError: no meta.json (not a prepared directory, or a prepare that did not finish), unreadable JSON,
            another format or a newer version.
    """
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise DataError(f"{directory}: not a prepared token directory (no {META_FILE}; run `handle data prepare`)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable ({' '.join(str(e).split())})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{path}: not a {FORMAT} meta.json")
    if meta.get("version") != VERSION:
        raise DataError(f"{path}: version {meta.get('version')}, this handle reads version {VERSION}")
    for key in ("dtype", "tokenizer", "splits"):
        if key not in meta:
            raise DataError(f"{path}: no {key!r} entry (prepare again)")
    return meta


def prepared_parts(directory: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The prepared directories that ``directory`` stands for, with their ``meta.json``: itself, or its
    ``part-*-of-N`` subdirectories (all N of them, one tokenizer and dtype).

    Raises:
        DataError: see :func:`read_meta`; parts missing, of different counts, tokenizers or dtypes.
    """
    directory = Path(directory)
    if (directory / META_FILE).is_file():
        return [(directory, read_meta(directory))]
    parts = sorted(p for p in directory.glob("part-*-of-*") if p.is_dir()) if directory.is_dir() else []
    if not parts:
        if not directory.exists():
            raise DataError(f"{directory}: no such directory (give a directory written by `handle data prepare`)")
        return [(directory, read_meta(directory))]  # raises: not prepared
    counts = {p.name.rsplit("-of-", 1)[1] for p in parts}
    if len(counts) != 1:
        raise DataError(f"{directory}: parts of different counts ({', '.join(sorted(counts))})")
    count = int(counts.pop())
    have = {p.name for p in parts}
    missing = [part_dir_name(i, count) for i in range(count) if part_dir_name(i, count) not in have]
    missing += [part_dir_name(i, count) for i in range(count)
                if part_dir_name(i, count) in have and not (directory / part_dir_name(i, count) / META_FILE).is_file()]
    if missing:
        raise DataError(f"{directory}: {len(missing)} of {count} parts not prepared ({', '.join(missing[:3])}"
                        f"{', ...' if len(missing) > 3 else ''})")
    metas = [(directory / part_dir_name(i, count), read_meta(directory / part_dir_name(i, count)))
             for i in range(count)]
    first = metas[0][1]
    for path, meta in metas[1:]:
        if problem := tokenizer_problem(f"{path} was prepared with", meta["tokenizer"].get("sha256"),
                                        first["tokenizer"].get("sha256"), metas[0][0].name,
                                        "prepare every part with one --tokenizer"):
            raise DataError(problem)
        if meta["dtype"] != first["dtype"]:
            raise DataError(f"{path}: dtype {meta['dtype']}, {metas[0][0].name} has {first['dtype']}")
    return metas


@dataclass(frozen=True)
class DataIdentity:
    """What a run's ids mean and where they came from: what a checkpoint records, a resume compares, and a mixture,
    a ``model.init_from`` base and ``handle eval --data`` check (:func:`tokenizer_problem`)."""

    tokenizer_sha256: str
    """SHA-256 of the tokenizer file's bytes."""
    vocab_size: int
    eos_id: int
    pad_id: int | None
    """None: no id is padding."""
    data_fingerprint: str | None = None
    """Hash of the prepared data (every part's meta.json); None for data that is not prepared."""

    def record(self) -> dict[str, str]:
        """The keys a checkpoint's ``layout.json`` keeps (:mod:`torch_handle.launch.data_identity`)."""
        return {k: v for k, v in (("tokenizer_sha256", self.tokenizer_sha256),
                                  ("data_fingerprint", self.data_fingerprint)) if v}


def tokenizer_problem(what: str, sha256: str | None, want_sha256: str | None, want: str, fix: str) -> str | None:
    """The one tokenizer identity check: ``what`` (a prepared directory, a tokenizer file) was made with the
    tokenizer whose file hashes to ``sha256``; its ids must mean what ``want``'s (hash ``want_sha256``) mean. The
    problem as one line, ``"<what> another tokenizer than <want>: <fix>"`` (``what``: "DIR was prepared with",
    "data.tokenizer: FILE is"), or None when they are the same file (or either is unknown)."""
    if not sha256 or not want_sha256 or sha256 == want_sha256:
        return None
    return f"{what} another tokenizer than {want}: {fix}"


@dataclass
class Prepared:
    """A prepared dataset: its splits, tokenizer file and metadata (of the first part when in parts)."""

    directory: Path
    metas: list[tuple[Path, dict[str, Any]]]
    train: TokenSplit
    valid: TokenSplit

    @property
    def meta(self) -> dict[str, Any]:
        return self.metas[0][1]

    @property
    def tokenizer_path(self) -> Path:
        directory, meta = self.metas[0]
        return directory / meta["tokenizer"].get("file", TOKENIZER_FILE)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["tokenizer"]["eos_id"])

    @property
    def pad_id(self) -> int | None:
        """meta.json's ``pad_id``; for a directory prepared before it was recorded, the tokenizer file's
        (:func:`torch_handle.data.tokenizer_file.pad_id_of`)."""
        tok = self.meta["tokenizer"]
        if "pad_id" in tok:
            return None if tok["pad_id"] is None else int(tok["pad_id"])
        from tokenizers import Tokenizer

        from torch_handle.data.tokenizer_file import pad_id_of

        return pad_id_of(Tokenizer.from_file(str(self.tokenizer_path)), self.tokenizer_path, self.eos_id)

    @property
    def fingerprint(self) -> str:
        """Hash of every part's meta.json: changes when any shard, source or the tokenizer changes."""
        h = hashlib.sha256()
        for directory, _ in self.metas:
            h.update((directory / META_FILE).read_bytes())
        return h.hexdigest()[:16]

    def identity(self) -> DataIdentity:
        """From meta.json alone (the tokenizer's hash was taken when it was prepared)."""
        return DataIdentity(self.meta["tokenizer"]["sha256"], self.vocab_size, self.eos_id, self.pad_id,
                            self.fingerprint)


def mixture_identity(prepared: list[Prepared]) -> DataIdentity:
    """The identity of one prepared directory, or of a mixture of several (one fingerprint of theirs; the first's
    tokenizer, which every source shares: :func:`mixture_problems`)."""
    first = prepared[0].identity()
    if len(prepared) == 1:
        return first
    fingerprint = hashlib.sha256(",".join(p.fingerprint for p in prepared).encode()).hexdigest()[:16]
    return DataIdentity(first.tokenizer_sha256, first.vocab_size, first.eos_id, first.pad_id, fingerprint)


def mixture_problems(prepared: list[Prepared], key: str = "data.sources") -> list[str]:
    """One line per source prepared with another tokenizer than the first."""
    first = prepared[0]
    return [problem for p in prepared[1:] if (problem := tokenizer_problem(
        f"{key}: {p.directory} was prepared with", p.identity().tokenizer_sha256, first.identity().tokenizer_sha256,
        str(first.directory), f"every source of a mixture needs the same one: prepare it again with --tokenizer "
                              f"{first.tokenizer_path}"))]


_OPENED: dict[tuple, Prepared] = {}
"""What :func:`open_prepared` opened in this process, by directory and the state of its meta.json files."""


def _opened_key(directory: Path) -> tuple:
    metas = [directory / META_FILE] if (directory / META_FILE).is_file() else \
        sorted(directory.glob(f"part-*-of-*/{META_FILE}")) if directory.is_dir() else []
    stats = [(str(m), st.st_ino, st.st_size, st.st_mtime_ns) for m in metas for st in [m.stat()]]
    return (str(directory.resolve()), *stats)


def open_prepared(directory: Path) -> Prepared:
    """Open a prepared directory (or a directory of parts) for reading: once per process while its meta.json files
    stay the same (the launcher's checks, its pre-flight and a resume's identity share one opening; each rank
    opens it once).

    Raises:
        DataError: see :func:`prepared_parts` and :class:`TokenSplit`; a split with no tokens.
    """
    directory = Path(directory)
    key = _opened_key(directory)
    if len(key) > 1 and key in _OPENED:
        return _OPENED[key]
    prepared = _open_prepared(directory)
    if len(_OPENED) >= 8:
        _OPENED.pop(next(iter(_OPENED)))
    _OPENED[key] = prepared
    return prepared


def _open_prepared(directory: Path) -> Prepared:
    metas = prepared_parts(Path(directory))
    splits = {}
    for split in SPLITS:
        if any(split not in m["splits"] for _, m in metas):
            raise DataError(f"{directory}: no {split} split in {META_FILE}")
        splits[split] = TokenSplit(metas, split)
    tok = metas[0][0] / metas[0][1]["tokenizer"].get("file", TOKENIZER_FILE)
    if not tok.is_file():
        raise DataError(f"{tok}: missing (the tokenizer of {directory}; prepare again)")
    return Prepared(Path(directory), metas, splits["train"], splits["valid"])
