"""``handle data prepare`` (torch_handle/data/prepare.py) on real text (wikitext-2, tinyshakespeare): the same bytes
for 1 and 2 encoding processes, a prepare killed by SIGKILL mid-way leaves nothing and its rerun the same bytes,
documents are documents (<eos> only between JSON lines' texts), parts make up the whole, and each bad input is one
line, exit 2, nothing written. Encoding runs in real worker processes (a pool per prepare: about a second each)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer

from handle_cli.main import cli
from torch_handle.data.prepare import prepare
from torch_handle.data.shards import open_prepared

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if not DATA.is_dir():
    DATA = Path("/work/shared/data")
WIKI = DATA / "wikitext-2" / "valid.txt"
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"


def wiki_paragraphs() -> list[str]:
    """wikitext-2's validation paragraphs (about 2,400 non-empty lines): real documents of varied length."""
    return [line.strip() for line in WIKI.read_text(encoding="utf-8").splitlines() if line.strip()]


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def documents(split) -> list[np.ndarray]:
    ids = split.window(0, split.n_tokens)
    bounds = [*split.doc_starts.tolist(), split.n_tokens]
    return [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """A JSON Lines corpus (wikitext paragraphs, one a line, with another key beside), a directory of text files,
    and a tokenizer trained by one prepare (reused, so the other prepares only encode)."""
    root = tmp_path_factory.mktemp("corpus")
    paragraphs = wiki_paragraphs()
    with open(root / "wiki.jsonl", "w", encoding="utf-8") as f:
        for i, p in enumerate(paragraphs):
            f.write(json.dumps({"id": i, "text": p}) + "\n")
    books = root / "books"
    books.mkdir()
    text = SHAKESPEARE.read_text(encoding="utf-8")[:600_000]
    for k in range(6):
        (books / f"part{k}.txt").write_text(text[k * 100_000:(k + 1) * 100_000], encoding="utf-8")
    prepare([str(books)], root / "trained", vocab_size=1024, workers=1)
    return {"root": root, "jsonl": root / "wiki.jsonl", "books": books, "paragraphs": paragraphs,
            "tokenizer": root / "trained" / "tokenizer.json"}


def test_one_and_two_workers_write_the_same_bytes(corpus, tmp_path):
    one = prepare([str(corpus["jsonl"]), str(corpus["books"])], tmp_path / "one", tokenizer=corpus["tokenizer"],
                  workers=1)
    two = prepare([str(corpus["jsonl"]), str(corpus["books"])], tmp_path / "two", tokenizer=corpus["tokenizer"],
                  workers=2)
    assert one["splits"] == two["splits"] and one["valid_method"] == "documents"
    assert files_of(tmp_path / "one") == files_of(tmp_path / "two")
    n = len(corpus["paragraphs"]) + 6
    assert one["splits"]["train"]["documents"] + one["splits"]["valid"]["documents"] == n
    assert 0.02 * n < one["splits"]["valid"]["documents"] < 0.08 * n  # held out by hash, about 5%


def test_jsonl_documents_are_the_texts_with_eos_between(corpus, tmp_path):
    """--field text: the tokens are the texts' only (no braces, keys, escapes), <eos> ends each line's document
    and appears nowhere else."""
    res = CliRunner().invoke(cli, ["data", "prepare", str(corpus["jsonl"]), "--out", str(tmp_path / "out"),
                                   "--field", "text", "--tokenizer", str(corpus["tokenizer"]), "--valid-fraction",
                                   "0.1", "--workers", "2", "--json"])
    assert res.exit_code == 0, res.output
    p = open_prepared(tmp_path / "out")
    tok = Tokenizer.from_file(str(p.tokenizer_path))
    eos = p.meta["tokenizer"]["eos_id"]
    got = []
    for split in (p.train, p.valid):
        for doc in documents(split):
            assert doc[-1] == eos and eos not in doc[:-1]
            got.append(tok.decode(doc[:-1].tolist(), skip_special_tokens=False))
    assert sorted(got) == sorted(corpus["paragraphs"])
    assert len(documents(p.valid)) == p.meta["splits"]["valid"]["documents"] > 0


def test_text_file_is_one_document_and_tail_split_keeps_every_byte(corpus, tmp_path):
    """One text file is one document: the tail method cuts it at a line boundary, train + valid decode to it."""
    prepare([str(SHAKESPEARE)], tmp_path / "out", tokenizer=corpus["tokenizer"], workers=2, valid_fraction=0.1)
    p = open_prepared(tmp_path / "out")
    assert p.meta["valid"]["method"] == "tail" and p.train.n_documents == p.valid.n_documents == 1
    tok = Tokenizer.from_file(str(p.tokenizer_path))
    head, tail = (tok.decode(documents(s)[0][:-1].tolist()) for s in (p.train, p.valid))
    text = SHAKESPEARE.read_text(encoding="utf-8")
    assert head + tail == text and head.endswith("\n") and 0.08 < len(tail) / len(text) < 0.12
    # the document was encoded in pieces of about 1 MiB: the same ids as the whole in one go
    assert (np.concatenate([documents(p.train)[0][:-1], documents(p.valid)[0][:-1]]) ==
            tok.encode(head).ids + tok.encode(tail).ids).all()


def test_parts_make_up_the_whole(corpus, tmp_path):
    srcs = [str(corpus["jsonl"]), str(corpus["books"])]
    prepare(srcs, tmp_path / "whole", tokenizer=corpus["tokenizer"], workers=2)
    for i in range(2):
        prepare(srcs, tmp_path / "parts", tokenizer=corpus["tokenizer"], workers=1, part=(i, 2))
    whole, parts = open_prepared(tmp_path / "whole"), open_prepared(tmp_path / "parts")
    assert [m["part"] for _, m in parts.metas] == [{"index": 0, "count": 2}, {"index": 1, "count": 2}]
    for split in ("train", "valid"):
        a, b = getattr(whole, split), getattr(parts, split)
        assert (a.n_tokens, a.n_documents) == (b.n_tokens, b.n_documents)
        # part 0 holds documents 0, 2, 4, ... of the corpus, part 1 the odd ones
        assert sorted(map(bytes, documents(a))) == sorted(map(bytes, documents(b)))


_KILLED = """
import os, signal, sys
from torch_handle.data.prepare import prepare
def progress(p):
    if p.tokens:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-way: shards half written in the temporary directory
prepare([sys.argv[1]], sys.argv[2], tokenizer=sys.argv[3], workers=2, force=True, progress=progress)
"""


def test_killed_prepare_leaves_out_untouched_and_rerun_writes_the_same_bytes(corpus, tmp_path):
    big = tmp_path / "big.txt"  # 5 batches of text: the kill comes after the first is written
    big.write_text(SHAKESPEARE.read_text(encoding="utf-8") * 5, encoding="utf-8")
    ref = prepare([str(big)], tmp_path / "ref", tokenizer=corpus["tokenizer"], workers=1)
    out = tmp_path / "out"
    for before in (None, "old"):  # a new output, and one replaced with force
        if before:
            prepare([str(corpus["jsonl"])], out, tokenizer=corpus["tokenizer"], workers=1)
            old = files_of(out)
        proc = subprocess.run([sys.executable, "-c", _KILLED, str(big), str(out), str(corpus["tokenizer"])],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == -9, proc.stderr
        assert [p.name for p in tmp_path.glob(".out.*.tmp")], "the killed prepare was writing elsewhere"
        if before:
            assert files_of(out) == old
        else:
            assert not out.exists()
    prepare([str(big)], out, tokenizer=corpus["tokenizer"], workers=2, force=True)
    assert files_of(out) == files_of(tmp_path / "ref") and ref["splits"]["train"]["tokens"] > 0
    assert not list(tmp_path.glob(".out.*"))  # the killed one's temporary directory is gone


def _bad_inputs(root: Path, tokenizer: Path) -> dict[str, tuple[list[str], str]]:
    (root / "lines.jsonl").write_text('{"text": "fine"}\n{"text": "fine too"}\n', encoding="utf-8")
    (root / "notjson.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    with gzip.open(root / "nofield.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write('{"text": "a"}\n{"body": "b"}\n')
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x", "y"], "n": [1, 2]}), root / "table.parquet")
    (root / "latin1.txt").write_bytes("caf\u00e9 ".encode("utf-8") * 10 + "na\u00efve".encode("latin-1"))
    (root / "empty.txt").write_bytes(b"")
    (root / "blank.txt").write_text("  \n\n ", encoding="utf-8")
    from tokenizers import models

    vocab = {f"w{i}": i for i in range(70_000)} | {"<eos>": 70_000}  # a 70,001-token vocabulary
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(root / "far.json"))
    tok = ["--tokenizer", str(tokenizer)]
    return {
        "jsonl as text": (["lines.jsonl", "--format", "text", *tok], "lines.jsonl: a JSON Lines file, not plain text"),
        "parquet as text": (["table.parquet", "--format", "text", *tok], "table.parquet: a Parquet file, not plain"),
        "not JSON": (["notjson.jsonl", *tok], "notjson.jsonl:2: not JSON"),
        "no field": (["nofield.jsonl.gz", *tok], "nofield.jsonl.gz:2: no 'text' field (it has: body; give --field"),
        "no column": (["table.parquet", *tok], "table.parquet: no column 'text' (columns: content, n; give --column"),
        "not UTF-8": (["latin1.txt", *tok], "latin1.txt: not UTF-8 text (undecodable byte at offset 62)"),
        "empty": (["empty.txt", *tok], "empty.txt: empty source (0 bytes"),
        "blank": (["blank.txt", *tok], "blank.txt: empty source (no text)"),
        "no source": (["missing/*.txt", *tok], "missing/*.txt: no such file, or no files match"),
        "no tokenizer": (["lines.jsonl", "--tokenizer", "nowhere"], "nowhere: no such tokenizer (give a tokenizer"),
        "vocab over dtype": (["lines.jsonl", "--tokenizer", "far.json", "--dtype", "uint16"],
                             "far.json: a vocabulary of 70,001 tokens does not fit uint16"),
        "part without tokenizer": (["lines.jsonl", "--part", "0/2"], "a part needs a given tokenizer"),
        "JSON, not a tokenizer": (["lines.jsonl", "--tokenizer", "lines.jsonl"], "lines.jsonl: not a tokenizer file"),
    }


def test_bad_input_is_one_line_exit_2_and_nothing_written(corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for name, (args, message) in _bad_inputs(tmp_path, corpus["tokenizer"]).items():
        before = set(os.listdir(tmp_path))
        res = runner.invoke(cli, ["data", "prepare", *args, "--out", "out", "--workers", "1"])
        lines = res.output.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1, (name, res.output)
        assert lines[0].startswith("error: ") and message in lines[0], (name, lines[0])
        assert set(os.listdir(tmp_path)) == before, (name, "something was written")


def test_info_prints_what_meta_says(corpus):
    res = CliRunner().invoke(cli, ["data", "info", str(corpus["root"] / "trained")])
    assert res.exit_code == 0, res.output
    meta = json.loads((corpus["root"] / "trained" / "meta.json").read_text())
    assert f"train: {meta['splits']['train']['tokens']:,} tokens, {meta['splits']['train']['documents']:,} docu" \
        in res.output
    assert "tokenizer trained (vocab_size 1024)" in res.output and "books" in res.output
    res = CliRunner().invoke(cli, ["data", "info", str(corpus["root"] / "trained"), "--json"])
    assert json.loads(res.output)["parts"][0]["splits"]["valid"] == meta["splits"]["valid"]
