"""Prepared token directories for the tests of the ``tokens`` dataset, written by ``handle data prepare``'s own
function (:func:`torch_handle.data.prepare.prepare`: the meta.json the tests read is the one a user gets) from real
text (../shared/data) and a real byte-level BPE trained on it (``train_tokenizer``)."""

from __future__ import annotations

import re
from pathlib import Path

from torch_handle.common.names import TOKENIZER_FILE
from torch_handle.data.datasets import train_tokenizer

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


def prepare(out: Path, docs: list[str], tokenizer: Path, *, valid_every: int = 20) -> Path:
    """``docs`` prepared at ``out`` with ``tokenizer``: every ``valid_every``-th document is a validation source of
    its own (meta.json's valid method ``source``), the rest the training source. Returns ``out``."""
    from torch_handle.data.prepare import prepare as run_prepare
    from torch_handle.data.sources import memory_source

    valid = [d for i, d in enumerate(docs) if i % valid_every == valid_every - 1]
    train = [d for i, d in enumerate(docs) if i % valid_every != valid_every - 1]
    run_prepare([memory_source(f"{out.name}-train", train)], out, valid=[memory_source(f"{out.name}-valid", valid)],
                tokenizer=tokenizer, workers=0)
    return out


def three_sources(root: Path, vocab_size: int = 512) -> dict[str, Path]:
    """Shakespeare, WikiText-2 and Multi30k prepared with one tokenizer trained on a sample of all three."""
    docs = {"shakespeare": shakespeare_docs(), "wiki": wikitext_docs(), "captions": multi30k_docs()}
    sample = [d for ds in docs.values() for d in ds[:200]]
    tok = tokenizer_file(root / "tokenizer" / TOKENIZER_FILE, sample, vocab_size)
    return {name: prepare(root / name, ds, tok) for name, ds in docs.items()}
