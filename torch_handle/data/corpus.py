"""Corpora as text: the embedded default, local files, aligned parallel files. No torch import, so the CLI's
pre-flight checks and the worker's loaders share one implementation of what a path selects."""

from __future__ import annotations

import glob as globlib
from pathlib import Path
from typing import Sequence

from torch_handle.errors import DataError

# ---------------------------------------------------------------------------------------------------------------
# Corpora
# ---------------------------------------------------------------------------------------------------------------


def pydoc_corpus() -> list[str]:
    """The CPython documentation topics shipped in the standard library (about 0.47 MB of English prose and
    code), one document per topic in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def read_text(path: Path) -> str:
    """Read a UTF-8 file.

    Raises:
        DataError: naming the file and the byte offset of undecodable bytes.
    """
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (undecodable byte at offset {e.start})") from None


def text_files(pattern: str) -> list[Path]:
    """Files matching a glob (or one file / every file in a directory).

    Raises:
        DataError: when nothing matches.
    """
    p = Path(pattern).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
    elif p.is_file():
        files = [p]
    else:
        files = sorted(Path(f) for f in globlib.glob(str(p), recursive=True) if Path(f).is_file())
    if not files:
        raise DataError(f"{pattern}: no files match")
    return files


def split_documents(docs: Sequence[str], valid_fraction: float) -> tuple[list[str], list[str]]:
    """Split by characters: the last ``valid_fraction`` of the concatenated text is the validation split (a
    contiguous tail, so no sentence is in both)."""
    text = "\n\n".join(docs)
    cut = int(len(text) * (1 - valid_fraction))
    # move the cut to a line boundary
    nl = text.rfind("\n", 0, cut)
    cut = nl + 1 if nl > 0 else cut
    return [text[:cut]], [text[cut:]]


def read_parallel(directory: Path, split: str, src_lang: str, tgt_lang: str) -> tuple[list[str], list[str]]:
    """Aligned ``<split>.<src>`` / ``<split>.<tgt>`` files, one sentence per line.

    Raises:
        DataError: for a missing file, or files whose line counts differ (naming both files and counts).
    """
    return read_pairs(Path(directory) / f"{split}.{src_lang}", Path(directory) / f"{split}.{tgt_lang}")


def read_pairs(src_path: Path, tgt_path: Path) -> tuple[list[str], list[str]]:
    """Aligned lines of two files, one sentence per line.

    Raises:
        DataError: for a missing or empty file, or files whose line counts differ (naming both files and counts).
    """
    src, tgt = read_text(src_path).splitlines(), read_text(tgt_path).splitlines()
    if len(src) != len(tgt):
        raise DataError(f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: parallel files must align")
    if not src:
        raise DataError(f"{src_path}: empty corpus")
    return src, tgt
