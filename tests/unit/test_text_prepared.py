"""The ``text`` and ``pydoc`` datasets go through ``handle data prepare``'s path: prepared into the run cache on
first use, memory-mapped afterwards (a second start encodes nothing), <eos> between documents only (a paragraph
break stays text), and a missing ``data.tokenizer`` or a ``.jsonl`` path is refused by ``handle validate``."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer

import handle_plugins.datasets as plugin
import torch_handle.api as api
from handle_cli.main import cli
from torch_handle.data.datasets import DataContext

SHAKESPEARE = Path("/work/shared/data/tinyshakespeare/input.txt")
if not SHAKESPEARE.is_file():
    SHAKESPEARE = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare" / "input.txt"


def _ctx(cache: Path) -> DataContext:
    return DataContext(cache_dir=cache, is_main=True, barrier=lambda: None)


def test_text_prepares_once_then_maps(tmp_path, monkeypatch):
    corpus = tmp_path / "plays"
    corpus.mkdir()
    text = SHAKESPEARE.read_text(encoding="utf-8")[:200_000]
    scenes = text.split("\n\n")
    for k in range(3):  # three documents, each with many blank-line paragraph breaks
        (corpus / f"play{k}.txt").write_text("\n\n".join(scenes[k::3]), encoding="utf-8")
    options = plugin.TextConfig(path=str(corpus), vocab_size=512, seq_len=32)
    first = plugin.build_text(options, _ctx(tmp_path / "cache"))
    [prepared] = list((tmp_path / "cache").glob("tokens-*"))
    tok = Tokenizer.from_file(str(first.tokenizer_path))
    eos = tok.token_to_id("<eos>")
    stream = [s.window(0, s.n_tokens) for s in (first.train.split, first.valid.split)]
    assert sum(int((s == eos).sum()) for s in stream) == first.train.split.n_documents + first.valid.split.n_documents
    assert first.train.split.n_documents + first.valid.split.n_documents == 4  # 3 files, the last cut by the tail
    assert tok.decode(stream[0][:200].tolist()).count("\n\n") > 0  # paragraph breaks stay text

    def no_prepare(*args, **kwargs):
        raise AssertionError("prepared again")

    monkeypatch.setattr(api, "prepare", no_prepare)
    second = plugin.build_text(options, _ctx(tmp_path / "cache"))
    assert len(second.train) == len(first.train) and (second.train[5]["input_ids"] == first.train[5]["input_ids"]).all()
    assert list((tmp_path / "cache").glob("tokens-*")) == [prepared]
    (corpus / "play0.txt").write_text("changed\n", encoding="utf-8")  # other content: another key
    monkeypatch.undo()
    plugin.build_text(options, _ctx(tmp_path / "cache"))
    assert len(list((tmp_path / "cache").glob("tokens-*"))) == 2


@pytest.mark.parametrize("key, value, message", [
    ("data.tokenizer", "nowhere/tok", "data.tokenizer: nowhere/tok: no such tokenizer"),
    ("data.path", "JSONL", "a JSON Lines file, not plain text: `handle data prepare` reads it"),
])
def test_validate_refuses_what_text_cannot_read(tmp_path, monkeypatch, key, value, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n', encoding="utf-8")
    value = str(tmp_path / "a.jsonl") if value == "JSONL" else value
    preset = Path(__file__).resolve().parents[2] / "presets" / "zero2.toml"
    res = CliRunner().invoke(cli, ["validate", str(preset), "--set", "data.name=text", "--set",
                                   f"data.path={tmp_path / 'a.txt'}", "--set", f"{key}={value}"])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and message in lines[0], res.output
    assert not (tmp_path / "runs").exists()
