"""Prepared token directories for the tests of the ``tokens`` dataset, written with the format's own writer
(:class:`torch_handle.data.shards.ShardWriter`, :func:`~torch_handle.data.shards.write_meta`) from real text
(../shared/data) and a real byte-level BPE trained on it (``train_tokenizer``)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from torch_handle.data.datasets import EOS_ID, train_tokenizer
from torch_handle.data.shards import TOKENIZER_FILE, ShardWriter, file_sha256, token_dtype, write_meta

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def shakespeare_docs() -> list[str]:
    """Tiny Shakespeare's speeches (blank-line separated), one document each."""
    text = (DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    return [d for d in text.split("\n\n") if d.strip()]


def wikitext_docs() -> list[str]:
    """WikiText-2 (validation file) articles, split at their ``= Title =`` headings."""
    text = (DATA / "wikitext-2" / "valid.txt").read_text(encoding="utf-8")
    return [d for d in re.split(r"\n(?= = [^=])", text) if d.strip()]


def multi30k_docs(per_doc: int = 20) -> list[str]:
    """Multi30k English captions, ``per_doc`` lines a document."""
    lines = (DATA / "multi30k" / "train.en").read_text(encoding="utf-8").splitlines()
    return ["\n".join(lines[i: i + per_doc]) for i in range(0, len(lines), per_doc)]


def tokenizer_file(path: Path, texts: list[str], vocab_size: int = 512) -> Path:
    """A byte-level BPE of ``vocab_size`` trained on ``texts``, saved at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    train_tokenizer(texts, vocab_size).save(str(path))
    return path


def prepare(out: Path, docs: list[str], tokenizer: Path, *, valid_every: int = 20,
            shard_tokens: int = 1 << 28) -> Path:
    """Write ``docs`` as a prepared directory at ``out``: every ``valid_every``-th document to the validation
    split, the rest to train; ``tokenizer`` copied in. Returns ``out``."""
    from tokenizers import Tokenizer

    out.mkdir(parents=True)
    shutil.copyfile(tokenizer, out / TOKENIZER_FILE)
    tok = Tokenizer.from_file(str(tokenizer))
    dtype = token_dtype(tok.get_vocab_size())
    writers = {s: ShardWriter(out, s, dtype, EOS_ID, shard_tokens=shard_tokens) for s in ("train", "valid")}
    for i, enc in enumerate(tok.encode_batch(docs)):
        writers["valid" if i % valid_every == valid_every - 1 else "train"].add(enc.ids)
    splits = {s: w.close() for s, w in writers.items()}
    write_meta(out, {"dtype": dtype.name, "splits": splits,
                     "tokenizer": {"file": TOKENIZER_FILE, "sha256": file_sha256(out / TOKENIZER_FILE),
                                   "vocab_size": tok.get_vocab_size(), "eos_id": EOS_ID},
                     "sources": [{"path": str(out), "format": "text", "documents": len(docs), "split": "both"}],
                     "valid": {"method": "documents", "fraction": 1 / valid_every}, "part": None})
    return out


def three_sources(root: Path, vocab_size: int = 512) -> dict[str, Path]:
    """Shakespeare, WikiText-2 and Multi30k prepared with one tokenizer trained on a sample of all three."""
    docs = {"shakespeare": shakespeare_docs(), "wiki": wikitext_docs(), "captions": multi30k_docs()}
    sample = [d for ds in docs.values() for d in ds[:200]]
    tok = tokenizer_file(root / "tokenizer" / TOKENIZER_FILE, sample, vocab_size)
    return {name: prepare(root / name, ds, tok) for name, ds in docs.items()}
