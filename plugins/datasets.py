"""Dataset plugins: ``pydoc`` (embedded default), ``text`` (local files), ``parallel`` (translation pairs)."""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from torch_handle.api import DataError, InvalidValue, hookimpl, param, pydoc_corpus, read_parallel


@dataclass
class PydocConfig:
    """``[data]`` options of ``pydoc``: language modelling on the CPython documentation topics that ship with
    every Python install (``pydoc_data.topics``), so the default run needs no download."""

    task: ClassVar[str] = "lm"
    seq_len: int = param(128, ge=2)
    """Tokens per language-modelling sample."""
    vocab_size: int = param(4096, ge=262)
    """BPE vocabulary size (including the 6 special tokens, ChatML's two among them, and the 256 byte symbols)."""
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
    vocab_size: int = param(8000, ge=262)
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
# Pre-flight checks: run by `handle run` and `handle validate` before anything starts (no torch import). They read
# the files a run reads, selected by the same function (torch_handle.data.sources.resolve_sources: directories
# recursively) and split as a prepare splits them (torch_handle.data.prepare.holdout_of), and find missing paths,
# misaligned files and bytes that are not UTF-8, with the same one-line messages as the readers. Files are read in
# full up to PREFLIGHT_BYTES in all; beyond that only the first bytes of each file are checked, and the prepare
# that `handle run` does next (still before any worker starts) reports what is left.
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


def text_sources(options: TextConfig) -> tuple[list, list]:
    """``(train, valid)`` sources of ``text``: the files ``path`` (and ``valid_path``) select, read as plain text.

    Raises:
        DataError: nothing matches, an empty file, a JSON Lines or Parquet file (``handle data prepare`` reads it).
    """
    from torch_handle.api import resolve_sources

    return (resolve_sources([options.path], fmt="text"),
            resolve_sources([options.valid_path], fmt="text") if options.valid_path else [])


def preflight_text(options: TextConfig) -> None:
    """``text``: every file that path (and valid_path) selects exists, is UTF-8, and each split can fill a sample."""
    from torch_handle.api import tokenizer_path
    from torch_handle.data.prepare import holdout_of, split_bytes

    if options.tokenizer:
        try:
            tokenizer_path(options.tokenizer)
        except DataError as e:
            raise DataError(f"data.tokenizer: {e}") from None
    train, valid = text_sources(options)
    budget = _Budget()
    texts = [_preflight_read(s.path, budget) for s in [*train, *valid]]
    if all(t is not None for t in texts[:len(train)]) and not "".join(texts[:len(train)]).strip():
        raise DataError(f"{options.path}: empty corpus")
    # Byte-level BPE gives at most one token per byte, so fewer bytes than seq_len + 1 can never fill a sample.
    for split, n_bytes in split_bytes(holdout_of(train, valid, options.valid_fraction)).items():
        if n_bytes < options.seq_len + 1:
            raise DataError(f"{options.path} ({'validation' if split == 'valid' else split} split): {n_bytes} bytes "
                            f"is too small for one sample of seq_len={options.seq_len} (lower seq_len or add text)")


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


# --------------------------------------------------------------------------------------------------------------
# text and pydoc: prepared by the launcher (torch_handle.data.cache), opened by the ranks
# --------------------------------------------------------------------------------------------------------------


def _corpus(options: PydocConfig):
    """What a ``text`` or ``pydoc`` run reads (torch_handle.data.cache.Corpus)."""
    from torch_handle.api import Corpus, memory_source, tokenizer_path

    if isinstance(options, TextConfig):
        train, valid = text_sources(options)
    else:
        train, valid = [memory_source("pydoc_data.topics", pydoc_corpus())], []
    return Corpus(train, valid, tokenizer_path(options.tokenizer) if options.tokenizer else None,
                  options.vocab_size, options.valid_fraction)


def _name(options: PydocConfig) -> str:
    return options.path if isinstance(options, TextConfig) else "pydoc_data.topics"


def prepare_lm(options: PydocConfig, cache: Path, progress=None):
    """In the launcher: the corpus prepared into the cache unless it is there, each split checked to fill one
    sample, the vocabulary to fit ``vocab_size``. Returns the data's identity.

    Raises:
        DataError: bad input found while preparing, a split too short, a given tokenizer too big."""
    from torch_handle.api import ensure_prepared, open_prepared

    data = open_prepared(ensure_prepared(_corpus(options), cache, progress))
    for split in ("train", "valid"):
        if getattr(data, split).n_tokens < options.seq_len + 1:
            raise DataError(f"{_name(options)} ({'validation' if split == 'valid' else split} split): "
                            f"{getattr(data, split).n_tokens} tokens is too small for one sample of "
                            f"seq_len={options.seq_len} (lower seq_len or add text)")
    if options.tokenizer and data.vocab_size > options.vocab_size:
        raise DataError(f"{options.tokenizer}: {data.vocab_size} tokens, more than data.vocab_size = "
                        f"{options.vocab_size}")
    return data.identity()


def build_lm(options: PydocConfig, ctx):
    """In each rank: the directory the launcher prepared, opened (nothing is prepared or hashed here)."""
    from torch_handle.api import find_prepared, open_prepared, prepared_bundle

    name = _name(options)
    data = open_prepared(find_prepared(_corpus(options), ctx.cache_dir, name))
    return prepared_bundle([(name, data, 1.0)], options.seq_len, document_mask=options.document_mask,
                           description=name)


def build_parallel(options: ParallelConfig, ctx):
    from torch_handle.api import SPECIAL_TOKENS, DataBundle, TranslationDataset, load_or_train_tokenizer, pad_collate

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
                      tokenizer_path=tok_path, collate_fn=pad_collate,
                      pad_id=SPECIAL_TOKENS.index("<pad>"), description=str(root))


@hookimpl
def handle_register_datasets(register):
    register("pydoc", PydocConfig, build_lm, "CPython documentation topics (embedded; no download)",
             prepare=prepare_lm)
    register("text", TextConfig, build_lm, "language modelling on local UTF-8 text files",
             preflight=preflight_text, prepare=prepare_lm)
    register("parallel", ParallelConfig, build_parallel, "translation on aligned <split>.<lang> files",
             preflight=preflight_parallel)
