"""The prepared-token cache of the ``text`` and ``pydoc`` datasets: ``<cache>/tokens-<KEY>/``, a directory of
:mod:`torch_handle.data.shards` prepared once, by the launcher, before any worker starts; the workers only open it.

``KEY`` is a hash of what the shards depend on: each source's content (SHA-256), the tokenizer (a given file's
SHA-256, or the vocabulary to train), the validation share and the format's version. Hashing a corpus reads all
of it, so a second, cheap key points to the first: the sources' paths, sizes and modification times (and the same
of a given tokenizer file), whose file ``<cache>/stat-index/<STAT>`` holds ``KEY``. A start whose files have not
changed reads that one small file; a file that was touched but not changed costs one hash and finds the prepared
directory it had. The workers look the directory up by the cheap key alone (:func:`find_prepared`) and never hash
or prepare.

Two launchers preparing the same corpus at once (two runs, or the nodes of a run on one shared filesystem) each
write a staging directory; the first to finish renames its own into place, the other keeps it.

``<cache>`` is ``<run.output_dir>/.cache``, or :data:`CACHE_ENV` when the environment sets it. No torch import.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from torch_handle.common.fsio import write_text_atomic
from torch_handle.data.shards import META_FILE, VERSION, file_sha256
from torch_handle.data.sources import Source
from torch_handle.data.tokenizer_file import TOKENIZER_VERSION
from torch_handle.errors import DataError

CACHE_ENV = "HANDLE_DATA_CACHE"
"""A cache directory for every run's derived data instead of ``<run.output_dir>/.cache`` (the test suite shares
one across its runs)."""
INDEX_DIR = "stat-index"
LARGE_BYTES = 16 << 20
"""Corpora from this many bytes are encoded by a pool of processes (one per usable core); smaller ones in the
launcher's own process, which spares the encoders' start-up (about a second each)."""


def cache_root(output_dir: str | Path) -> Path:
    """Where the runs under ``output_dir`` keep derived data (prepared tokens, trained tokenizers)."""
    return Path(os.environ.get(CACHE_ENV) or Path(output_dir) / ".cache")


@dataclass
class Corpus:
    """What a ``text`` or ``pydoc`` run reads: its sources and how they become tokens."""

    train: Sequence[Source]
    valid: Sequence[Source]
    """Validation sources of their own; empty: ``valid_fraction`` of ``train`` is held out."""
    tokenizer: Path | None
    """A given tokenizer file, or None to train one of ``vocab_size``."""
    vocab_size: int
    valid_fraction: float

    def _common(self) -> list[str]:
        return [f"v{VERSION}", f"valid_fraction={self.valid_fraction if not self.valid else 0}",
                f"vocab_size={f'{self.vocab_size}/{TOKENIZER_VERSION}' if self.tokenizer is None else 'given'}"]

    def stat_key(self) -> str:
        """The cheap key: paths, sizes and modification times (in-memory sources: their content, which is small)."""
        def stat(path: Path) -> str:
            st = path.stat()
            return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"

        def of(src: Source) -> str:
            if src.format == "memory":
                return f"memory:{src.sha256()}"
            files = sorted(f for f in src.path.rglob("*") if f.is_file()) if src.path.is_dir() else [src.path]
            return f"{src.format}:{src.field}:" + ",".join(map(stat, files))

        parts = [*self._common(), *map(of, self.train), "valid", *map(of, self.valid),
                 f"tokenizer={stat(self.tokenizer) if self.tokenizer else ''}"]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

    def content_key(self) -> str:
        """The key of the prepared directory: the sources' and the given tokenizer's content (each hashed once per
        :class:`Source` object; :func:`~torch_handle.data.prepare.prepare` reuses the hashes)."""
        parts = [*self._common(), *(s.sha256() for s in self.train), "valid", *(s.sha256() for s in self.valid),
                 f"tokenizer={file_sha256(self.tokenizer) if self.tokenizer else ''}"]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in [*self.train, *self.valid])


def find_prepared(corpus: Corpus, cache: Path, name: str) -> Path:
    """The prepared directory of ``corpus`` (by its :meth:`Corpus.stat_key`): what a worker opens.

    Raises:
        DataError: not prepared, or its sources changed since (``name``: the data, for the message).
    """
    pointer = Path(cache) / INDEX_DIR / corpus.stat_key()
    try:
        out = Path(cache) / f"tokens-{pointer.read_text(encoding='utf-8').strip()}"
    except OSError:
        out = None
    if out is None or not (out / META_FILE).is_file():
        raise DataError(f"{name}: not prepared in {cache} for the files as they are now (`handle run` prepares "
                        f"it before the workers start; were the files changed since?)")
    return out


def ensure_prepared(corpus: Corpus, cache: Path, progress: Callable[[Any], None] | None = None) -> Path:
    """The prepared directory of ``corpus``, prepared now if the cache has none (``progress``: see
    :func:`torch_handle.data.prepare.prepare`), and the cheap key pointed at it.

    Raises:
        DataError: what :func:`~torch_handle.data.prepare.prepare` raises for bad input (nothing is kept then).
    """
    from torch_handle.data.prepare import prepare

    cache = Path(cache)
    try:
        return find_prepared(corpus, cache, "")
    except DataError:
        pass
    key = corpus.content_key()
    out = cache / f"tokens-{key}"
    if not (out / META_FILE).is_file():
        _remove_stale(cache, key)
        staging = cache / f".tokens-{key}.{os.getpid()}.staging"
        shutil.rmtree(staging, ignore_errors=True)
        prepare(list(corpus.train), staging, valid=list(corpus.valid), tokenizer=corpus.tokenizer,
                vocab_size=corpus.vocab_size, valid_fraction=corpus.valid_fraction,
                workers=None if corpus.bytes >= LARGE_BYTES else 0, progress=progress)
        try:
            os.rename(staging, out)
        except OSError:  # another launcher's is in place: the same documents, the same tokenizer
            shutil.rmtree(staging, ignore_errors=True)
            if not (out / META_FILE).is_file():
                raise
    (cache / INDEX_DIR).mkdir(parents=True, exist_ok=True)
    write_text_atomic(cache / INDEX_DIR / corpus.stat_key(), key + "\n")
    return out


def _remove_stale(cache: Path, key: str) -> None:
    """Staging directories of killed launchers on this host (``.tokens-KEY.<pid>.staging``, pid gone)."""
    from torch_handle.common.procs import pid_alive

    for staging in cache.glob(f".tokens-{key}.*.staging") if cache.is_dir() else []:
        pid = staging.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)
