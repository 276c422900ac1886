"""Corpus readers for ``handle data prepare``: what a source path selects, and its documents, streamed.

One document is one plain-text file, one JSON Lines line (its ``field``), one Parquet row (its ``column``, read in
record batches by ``pyarrow``) or one row of a ``datasets.save_to_disk`` directory (the ``hf`` extra). A reader
yields a document as pieces of at most about :data:`PIECE_CHARS` characters, so a 1 GB text file never sits in
memory whole: a long document is cut only after a newline that sits between two non-space characters
(``x\\nY``), where the byte-level BPE pre-tokenizer (GPT-2's regex, :func:`torch_handle.data.datasets.train_tokenizer`)
splits anyway, so the pieces encode to the ids of the whole. (A tokenizer that adds a prefix to every encoded text,
such as a sentencepiece ``Metaspace``, may differ by one token at each such cut of a document over 1 MiB.)

Every error is a :class:`DataError` of one line naming the file (and line, offset or column) and what is valid.
No torch import.
"""

from __future__ import annotations

import codecs
import glob as globlib
import gzip
import hashlib
import json
from dataclasses import dataclass, field
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, Iterator, Sequence

from torch_handle.data.shards import file_sha256
from torch_handle.errors import DataError

FORMATS = ("text", "jsonl", "parquet", "hf")
PIECE_CHARS = 1 << 20
"""Characters of a long document handed to the encoder at once (see the module docstring)."""
_BLOCK = 1 << 20
_NOT_TEXT = {".jsonl": ("JSON Lines", "jsonl", "--field NAME"), ".jsonl.gz": ("JSON Lines", "jsonl", "--field NAME"),
             ".parquet": ("Parquet", "parquet", "--column NAME")}
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass
class Source:
    """One input of a prepare: a file (or ``hf`` directory) and how to read it, or in-memory ``texts``."""

    path: Path
    format: str
    """``text``, ``jsonl``, ``parquet``, ``hf`` or ``memory`` (``texts`` given, e.g. the pydoc topics)."""
    key: str
    """Its name within its source argument (a file's path relative to the directory given): with the document
    number, what the validation hash reads, so moving the corpus keeps the split."""
    bytes: int = 0
    texts: Sequence[str] | None = field(default=None, repr=False)
    field: str = "text"
    """JSON Lines: the key holding the document; Parquet and hf: the column."""

    _sha256: str | None = dataclass_field(default=None, init=False, repr=False, compare=False)

    def sha256(self) -> str:
        """Hex SHA-256 of the content (a directory: of its files' names and hashes), computed once per object."""
        if self._sha256 is None:
            self._sha256 = self._hash()
        return self._sha256

    def _hash(self) -> str:
        if self.format == "memory":
            h = hashlib.sha256()
            for t in self.texts or ():
                h.update(hashlib.sha256(t.encode("utf-8", "surrogatepass")).digest())
            return h.hexdigest()
        return path_sha256(self.path)


def path_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, or of a directory's files' relative names and hashes (a ``datasets``
    directory)."""
    if not path.is_dir():
        return file_sha256(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path)}:{file_sha256(f)}".encode())
    return h.hexdigest()


def path_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def not_text_problem(path: Path) -> str | None:
    """Why ``path`` must not be read as plain text (a JSON Lines or Parquet file, by its suffix), or None."""
    name = path.name.lower()
    for suffix, (what, fmt, option) in _NOT_TEXT.items():
        if name.endswith(suffix):
            return (f"{path}: a {what} file, not plain text: `handle data prepare` reads it (format {fmt}, "
                    f"{option}); train on the result with data.name = \"tokens\"")
    return None


def detect_format(path: Path) -> str:
    """The format a path's suffix (or an hf directory's marker files) says."""
    if path.is_dir():
        return "hf"
    name = path.name.lower()
    return "jsonl" if name.endswith((".jsonl", ".jsonl.gz")) else "parquet" if name.endswith(".parquet") else "text"


def is_hf_dir(path: Path) -> bool:
    """Whether ``path`` is a ``datasets.save_to_disk`` directory (by its marker files)."""
    return path.is_dir() and any((path / m).is_file() for m in _HF_MARKERS)


def expand(spec: str) -> list[tuple[Path, str]]:
    """Files (and hf directories) that one argument selects, with their keys, in a fixed order."""
    p = Path(spec).expanduser()
    if is_hf_dir(p):
        return [(p, p.name)]
    if p.is_dir():
        return [(f, str(f.relative_to(p))) for f in sorted(p.rglob("*"))
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)]
    if p.is_file():
        return [(p, p.name)]
    return [(Path(f), Path(f).name) for f in sorted(globlib.glob(str(p), recursive=True))
            if Path(f).is_file() or is_hf_dir(Path(f))]


def resolve_sources(specs: Sequence[str], *, fmt: str = "auto", field: str = "text",
                    column: str = "text") -> list[Source]:
    """The sources that files, directories and globs select, each with its format (``fmt``, or by suffix when
    ``auto``), checked before anything is read: present, not empty, readable as that format (a Parquet file has
    ``column``; a ``.jsonl``/``.parquet`` is not read as plain text).

    Raises:
        DataError: one line naming the file and what is valid.
    """
    if fmt != "auto" and fmt not in FORMATS:
        raise DataError(f"format {fmt!r}: valid are auto, {', '.join(FORMATS)}")
    out: list[Source] = []
    for spec in specs:
        found = expand(str(spec))
        if not found:
            raise DataError(f"{spec}: no such file, or no files match")
        for path, key in found:
            kind = detect_format(path) if fmt == "auto" else fmt
            if kind == "text" and (problem := not_text_problem(path)):
                raise DataError(problem)
            size = path_bytes(path)
            if size == 0:
                raise DataError(f"{path}: empty source (0 bytes; give files with text)")
            src = Source(path, kind, key, size, field=column if kind in ("parquet", "hf") else field)
            if kind == "parquet":
                _parquet_column_check(src)
            elif kind == "hf" and not path.is_dir():
                raise DataError(f"{path}: not a directory (format hf reads a datasets.save_to_disk directory)")
            out.append(src)
    return out


def memory_source(name: str, texts: Sequence[str]) -> Source:
    """A source of documents already in memory (``name`` stands for it in meta.json and the validation hash)."""
    return Source(Path(name), "memory", name, sum(len(t.encode("utf-8", "surrogatepass")) for t in texts),
                  texts=texts)


# ---------------------------------------------------------------------------------------------------------------
# Reading: each reader yields (piece, end, bytes_done): a document's text in pieces, end=True on its last piece,
# and how many bytes of the source are read so far (for progress). Empty documents are skipped.
# ---------------------------------------------------------------------------------------------------------------


def _cut(buf: str) -> int:
    """Where a long buffer may be cut (see the module docstring): after the last ``\\n`` between two non-space
    characters, or 0 when there is none."""
    pos = len(buf) - 1
    while (pos := buf.rfind("\n", 1, pos)) > 0:
        if not buf[pos - 1].isspace() and not buf[pos + 1].isspace():
            return pos + 1
    return 0


def _pieces(text: str) -> Iterator[str]:
    while len(text) > PIECE_CHARS:
        cut = _cut(text[:PIECE_CHARS + 1]) or _cut(text)
        if not cut:
            break
        yield text[:cut]
        text = text[cut:]
    yield text


def _document(text: str, done: int) -> Iterator[tuple[str, bool, int]]:
    pieces = list(_pieces(text))
    for i, piece in enumerate(pieces):
        yield piece, i == len(pieces) - 1, done


def read_text_file(path: Path) -> Iterator[tuple[str, bool, int]]:
    """One document, the whole file, decoded as UTF-8 in blocks."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    buf, done, any_text = "", 0, False
    with open(path, "rb") as f:
        while True:
            block = f.read(_BLOCK)
            pending = len(decoder.getstate()[0])
            try:
                buf += decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 text (undecodable byte at offset {done - pending + e.start})"
                                ) from None
            done += len(block)
            if not block:
                break
            if len(buf) > PIECE_CHARS and (cut := _cut(buf)):
                any_text = any_text or bool(buf[:cut].strip())
                yield buf[:cut], False, done
                buf = buf[cut:]
    if any_text or buf.strip():
        yield buf, True, done
    else:
        raise DataError(f"{path}: empty source (no text)")


def _text_of(value: Any, where: str, name: str, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise DataError(f"{where}: {what} {name!r} is {type(value).__name__}, not text")


def jsonl_rows(path: Path) -> Iterator[tuple[int, Any, int]]:
    """``(line number, value, bytes read)`` of each non-blank line of a JSON Lines file (``.gz``: gzip), in order:
    what ``read_jsonl`` and the conversations' reader (:mod:`torch_handle.data.chat.rows`) read.

    Raises:
        DataError: a line that is not UTF-8 or not JSON, an unreadable or truncated file; one line naming it.
    """
    raw = open(path, "rb")
    try:
        stream = gzip.open(raw) if path.name.lower().endswith(".gz") else raw
        offset = 0
        for lineno, line in enumerate(stream, 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 (undecodable byte at offset {offset + e.start})") from None
            offset += len(line)
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: not JSON ({e.args[0] if e.args else e}); each line must be one "
                                f"JSON object") from None
            yield lineno, value, raw.tell()
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: unreadable ({e})") from None
    finally:
        raw.close()


def read_jsonl(path: Path, key: str) -> Iterator[tuple[str, bool, int]]:
    """One document per line: the line's ``key`` field (blank lines are skipped)."""
    for lineno, obj, done in jsonl_rows(path):
        if not isinstance(obj, dict) or key not in obj:
            keys = ", ".join(map(str, list(obj)[:8])) if isinstance(obj, dict) else type(obj).__name__
            raise DataError(f"{path}:{lineno}: no {key!r} field (it has: {keys}; give --field NAME)")
        doc = _text_of(obj[key], f"{path}:{lineno}", key, "field")
        if doc:
            yield from _document(doc, done)


def _parquet_column_check(src: Source) -> None:
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(src.path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a file that is not Parquet
        raise DataError(f"{src.path}: not a Parquet file ({' '.join(str(e).split())[:200]})") from None
    if src.field not in schema.names:
        raise DataError(f"{src.path}: no column {src.field!r} (columns: {', '.join(schema.names)}; give --column NAME)")


def read_parquet(path: Path, column: str) -> Iterator[tuple[str, bool, int]]:
    """One document per row: its ``column``, read in record batches."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    rows, size = max(1, pf.metadata.num_rows), path.stat().st_size
    seen = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[column]):
        for value in batch.column(0).to_pylist():
            seen += 1
            doc = _text_of(value, f"{path}: row {seen - 1}", column, "column")
            if doc:
                yield from _document(doc, size * seen // rows)


def load_hf(path: Path) -> Any:
    """The ``datasets.Dataset`` a ``datasets.save_to_disk`` directory holds (memory-mapped Arrow).

    Raises:
        DataError: no ``datasets`` (the hf extra), a directory it cannot read, a ``DatasetDict`` (several splits:
            give one split's directory); one line naming the directory.
    """
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading a datasets.save_to_disk directory needs the hf extra "
                        f"(pip install 'torch-handle[hf]')") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises several kinds for a directory it cannot read
        raise DataError(f"{path}: not a datasets.save_to_disk directory ({' '.join(str(e).split())[:200]})") from None
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(f"{path}: a DatasetDict (splits: {', '.join(ds)}); give one split's directory, e.g. "
                        f"{path / next(iter(ds))}")
    return ds


def read_hf(path: Path, column: str) -> Iterator[tuple[str, bool, int]]:
    """One document per row of a ``datasets.save_to_disk`` directory (its ``column``)."""
    ds = load_hf(path)
    if column not in ds.column_names:
        raise DataError(f"{path}: no column {column!r} (columns: {', '.join(ds.column_names)}; give --column NAME)")
    rows, size = max(1, len(ds)), path_bytes(path)
    seen = 0
    for batch in ds.select_columns([column]).iter(batch_size=1024):
        for value in batch[column]:
            seen += 1
            doc = _text_of(value, f"{path}: row {seen - 1}", column, "column")
            if doc:
                yield from _document(doc, size * seen // rows)


def read_memory(texts: Sequence[str]) -> Iterator[tuple[str, bool, int]]:
    done = 0
    for t in texts:
        done += len(t.encode("utf-8", "surrogatepass"))
        if t:
            yield from _document(t, done)


def read_source(src: Source) -> Iterator[tuple[str, bool, int]]:
    """The pieces of ``src``'s documents in order (see the section comment).

    Raises:
        DataError: a line that is not JSON or lacks the field, bytes that are not UTF-8, an empty source.
    """
    reader = {"text": lambda: read_text_file(src.path), "jsonl": lambda: read_jsonl(src.path, src.field),
              "parquet": lambda: read_parquet(src.path, src.field), "hf": lambda: read_hf(src.path, src.field),
              "memory": lambda: read_memory(src.texts or ())}[src.format]
    any_doc = False
    for item in reader():
        any_doc = True
        yield item
    if not any_doc:
        raise DataError(f"{src.path}: empty source (no documents with text)")
