"""Dataset plugins: ``pydoc`` (embedded default), ``text`` (local files), ``parallel`` (translation pairs)."""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from torch_handle.api import (DataError, InvalidValue, hookimpl, param, pydoc_corpus, read_parallel,
                              split_documents, text_files)


@dataclass
class PydocConfig:
    """``[data]`` options of ``pydoc``: language modelling on the CPython documentation topics that ship with
    every Python install (``pydoc_data.topics``), so the default run needs no download."""

    task: ClassVar[str] = "lm"
    seq_len: int = param(128, ge=2)
    """Tokens per language-modelling sample."""
    vocab_size: int = param(4096, ge=260)
    """BPE vocabulary size (including the 4 special tokens and the 256 byte symbols)."""
    valid_fraction: float = param(0.05, gt=0.0, le=0.5)
    """Share held out for validation: whole documents (picked by a hash of their source and number), or the tail
    of the last document when there are too few (docs/data.md)."""
    num_workers: int = param(0, ge=0, frozen_on_resume=False)
    """DataLoader worker processes per rank (0: load in the training process; reads are memory maps)."""
    tokenizer: str = ""
    """A tokenizer.json, or a directory holding one (a ``handle export --format hf`` directory, a run directory),
    to encode the text with instead of training one on it: what fine-tuning a base on a new corpus needs (the
    base's token ids; empty with ``model.init_from`` holding one: that one). vocab_size must be at least its size."""
    document_mask: bool = False
    """Attend within documents only: each sample also carries ``position_ids`` restarting at every document."""


@dataclass
class TextConfig(PydocConfig):
    """``[data]`` options of ``text``: language modelling on local UTF-8 text files."""

    path: str = ""
    """A file, a directory, or a glob of text files (for example 'data/*.txt')."""
    valid_path: str = ""
    """Optional separate validation file/glob; when empty, valid_fraction of path is held out."""
    def check(self) -> None:
        if not self.path:
            raise InvalidValue("path", "is required: a text file, a directory or a glob")


@dataclass
class ParallelConfig:
    """``[data]`` options of ``parallel``: translation on aligned ``<split>.<lang>`` files (Multi30k style)."""

    task: ClassVar[str] = "translation"
    path: str = ""
    """Directory holding train.<src>/train.<tgt> and valid.<src>/valid.<tgt>."""
    src_lang: str = "en"
    """Source-language file suffix."""
    tgt_lang: str = "de"
    """Target-language file suffix."""
    seq_len: int = param(64, ge=4)
    """Maximum tokens per source or target sentence (longer ones are truncated)."""
    vocab_size: int = param(8000, ge=260)
    """Joint BPE vocabulary for both languages."""
    max_pairs: int = param(0, ge=0)
    """Use only the first N training pairs (0 = all)."""
    num_workers: int = param(0, ge=0, frozen_on_resume=False)
    """DataLoader worker processes per rank."""

    def check(self) -> None:
        if not self.path:
            raise InvalidValue("path", "is required: a directory with train.<src>, train.<tgt>, valid.* files")
        for key in ("src_lang", "tgt_lang"):
            lang = getattr(self, key)
            if not lang or "/" in lang or lang.startswith("."):
                raise InvalidValue(key, f"{lang!r} must be a file suffix such as 'en'")
        if self.src_lang == self.tgt_lang:
            raise InvalidValue("tgt_lang", f"{self.tgt_lang!r} must differ from src_lang")


# --------------------------------------------------------------------------------------------------------------
# Pre-flight checks: run by `handle run` before anything starts (no torch import). They find missing paths,
# misaligned files and bytes that are not UTF-8 in what they read, with the same one-line messages as the
# loaders (torch_handle.data.datasets). Files are read in full up to PREFLIGHT_BYTES in all; beyond that only the first
# bytes of each file are checked and the loaders report what is left when the run starts.
# --------------------------------------------------------------------------------------------------------------

PREFLIGHT_BYTES = 64 << 20
_HEAD_BYTES = 1 << 20


class _Budget:
    def __init__(self, total: int | None = None):
        self.left = PREFLIGHT_BYTES if total is None else total


def _preflight_read(path: Path, budget: _Budget) -> str | None:
    """Check that ``path`` is readable UTF-8; its text when it was read in full (within the budget), else None."""
    try:
        size = path.stat().st_size
        whole = size <= budget.left
        with open(path, "rb") as f:
            raw = f.read(size if whole else _HEAD_BYTES)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    if whole:
        budget.left -= len(raw)
    try:
        text, _ = codecs.utf_8_decode(raw, "strict", whole)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (undecodable byte at offset {e.start})") from None
    return text if whole else None


def preflight_text(options: TextConfig) -> None:
    """``text``: every file that path (and valid_path) selects exists, is UTF-8, and the corpus is not empty."""
    from torch_handle.api import not_text_problem, tokenizer_path

    if options.tokenizer:
        try:
            tokenizer_path(options.tokenizer)
        except DataError as e:
            raise DataError(f"data.tokenizer: {e}") from None
    files = text_files(options.path) + (text_files(options.valid_path) if options.valid_path else [])
    if problem := next(filter(None, map(not_text_problem, files)), None):
        raise DataError(problem)
    budget = _Budget()
    texts = [_preflight_read(f, budget) for f in text_files(options.path)]
    if all(t is not None for t in texts) and not "".join(texts).strip():
        raise DataError(f"{options.path}: empty corpus")
    valid = [_preflight_read(f, budget) for f in text_files(options.valid_path)] if options.valid_path else None
    if any(t is None for t in [*texts, *(valid or [])]):
        return  # too large to read here in full: the loaders check the rest
    if valid is None:
        texts, valid = split_documents(texts, options.valid_fraction)
    # Byte-level BPE gives at most one token per byte, so fewer bytes than seq_len + 1 can never fill a sample.
    for split, parts in (("train", texts), ("validation", valid)):
        n_bytes = sum(len(t.encode("utf-8")) for t in parts)
        if n_bytes < options.seq_len + 1:
            raise DataError(f"{options.path} ({split} split): {n_bytes} bytes is too small for one sample of "
                            f"seq_len={options.seq_len} (lower seq_len or add text)")


def preflight_parallel(options: ParallelConfig) -> None:
    """``parallel``: the directory and its train/valid files exist, are UTF-8, and each pair has equal line counts."""
    root = Path(options.path)
    if not root.is_dir():
        raise DataError(f"{root}: no such directory (data.path must hold train.{options.src_lang} etc.)")
    budget = _Budget()
    for split in ("train", "valid"):
        src_path, tgt_path = root / f"{split}.{options.src_lang}", root / f"{split}.{options.tgt_lang}"
        for p in (src_path, tgt_path):
            if not p.is_file():
                raise DataError(f"{p}: no such file (data.path must hold {split}.{options.src_lang} and "
                                f"{split}.{options.tgt_lang})")
        src, tgt = _preflight_read(src_path, budget), _preflight_read(tgt_path, budget)
        if src is None or tgt is None:
            continue
        n_src, n_tgt = len(src.splitlines()), len(tgt.splitlines())
        if n_src != n_tgt:
            raise DataError(f"{src_path} has {n_src} lines but {tgt_path} has {n_tgt}: parallel files must align")
        if not n_src:
            raise DataError(f"{src_path}: empty corpus")


_LARGE = 16 << 20
"""Corpora from this many bytes are encoded by a pool of processes (below, in the rank that prepares)."""


def _cache_key(sources, valid, options) -> str:
    """What the prepared shards depend on: each source's content hash, the tokenizer (a given file's hash, or
    the vocabulary to train) and the validation share."""
    import hashlib

    from torch_handle.api import tokenizer_path
    from torch_handle.data.shards import VERSION, file_sha256

    tok = getattr(options, "tokenizer", "")
    parts = [f"v{VERSION}", *(s.sha256() for s in sources), "valid", *(s.sha256() for s in valid),
             f"tokenizer={file_sha256(tokenizer_path(tok)) if tok else options.vocab_size}",
             f"valid_fraction={options.valid_fraction if not valid else 0}"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _progress_logger(name: str):
    import logging
    import time

    log, last = logging.getLogger("torch_handle"), [0.0]

    def show(p) -> None:
        if time.monotonic() - last[0] >= 2.0 or p.bytes >= p.total_bytes:
            last[0] = time.monotonic()
            log.info("data %s: preparing, %.1f of %.1f MB read, %s tokens, %.2f MB/s", name, p.bytes / 1e6,
                     p.total_bytes / 1e6, f"{p.tokens:,}", p.mb_per_s)

    return show


def _lm_bundle(sources, valid, options, ctx, name):
    """Prepare ``sources`` once into ``ctx.cache_dir/tokens-KEY`` (one rank builds while the others wait at the
    barrier) and read it by memory map: a later start of the same data encodes nothing."""
    import logging

    from torch_handle.api import DataBundle, TokenWindows, open_prepared, prepare

    out = Path(ctx.cache_dir) / f"tokens-{_cache_key(sources, valid, options)}"
    if ctx.is_main and not (out / "meta.json").is_file():
        logging.getLogger("torch_handle").info("data %s: preparing into %s", name, out)
        size = sum(s.bytes for s in [*sources, *valid])
        prepare(sources, out, valid=valid, tokenizer=getattr(options, "tokenizer", "") or None,
                vocab_size=options.vocab_size, valid_fraction=options.valid_fraction, force=True,
                workers=None if size >= _LARGE else 0, progress=_progress_logger(name))
    ctx.barrier()
    data = open_prepared(out)
    if getattr(options, "tokenizer", "") and data.vocab_size > options.vocab_size:
        raise DataError(f"{options.tokenizer}: {data.vocab_size} tokens, more than data.vocab_size = "
                        f"{options.vocab_size}")
    mask = options.document_mask
    train = TokenWindows(data.train, options.seq_len, document_mask=mask, name=f"{name} (train split)")
    valid_set = TokenWindows(data.valid, options.seq_len, document_mask=mask, name=f"{name} (validation split)")
    return DataBundle(train=train, valid=valid_set, vocab_size=data.vocab_size, max_len=options.seq_len,
                      tokenizer_path=data.tokenizer_path, description=name)


def build_pydoc(options: PydocConfig, ctx):
    from torch_handle.api import memory_source

    return _lm_bundle([memory_source("pydoc_data.topics", pydoc_corpus())], [], options, ctx, "pydoc_data.topics")


def build_text(options: TextConfig, ctx):
    from torch_handle.api import resolve_sources

    valid = resolve_sources([options.valid_path], fmt="text") if options.valid_path else []
    return _lm_bundle(resolve_sources([options.path], fmt="text"), valid, options, ctx, options.path)


def build_parallel(options: ParallelConfig, ctx):
    from torch_handle.api import DataBundle, TranslationDataset, load_or_train_tokenizer, pad_collate

    root = Path(options.path)
    if not root.is_dir():
        raise DataError(f"{root}: no such directory (data.path must hold train.{options.src_lang} etc.)")
    src, tgt = read_parallel(root, "train", options.src_lang, options.tgt_lang)
    if options.max_pairs:
        src, tgt = src[: options.max_pairs], tgt[: options.max_pairs]
    vsrc, vtgt = read_parallel(root, "valid", options.src_lang, options.tgt_lang)
    tok, tok_path = load_or_train_tokenizer(src + tgt, options.vocab_size, ctx.cache_dir, is_main=ctx.is_main,
                                            barrier=ctx.barrier)

    def ids(lines):
        return [e.ids for e in tok.encode_batch(lines)]

    train = TranslationDataset(ids(src), ids(tgt), options.seq_len)
    valid = TranslationDataset(ids(vsrc), ids(vtgt), options.seq_len)
    return DataBundle(train=train, valid=valid, vocab_size=tok.get_vocab_size(), max_len=options.seq_len + 1,
                      tokenizer_path=tok_path, collate_fn=pad_collate, description=str(root))


@hookimpl
def handle_register_datasets(register):
    register("pydoc", PydocConfig, build_pydoc, "CPython documentation topics (embedded; no download)")
    register("text", TextConfig, build_text, "language modelling on local UTF-8 text files",
             preflight=preflight_text)
    register("parallel", ParallelConfig, build_parallel, "translation on aligned <split>.<lang> files",
             preflight=preflight_parallel)
