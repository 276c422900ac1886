"""The ``text`` and ``pydoc`` datasets go through ``handle data prepare``'s path: prepared by the launcher into the
run cache before any worker starts (torch_handle/data/cache.py), opened by the ranks, which never prepare or hash;
a second start finds the directory by the files' sizes and times alone, a touched file costs one hash and no
prepare; <eos> between documents only (a paragraph break stays text). ``handle validate`` reads what the run reads:
a missing ``data.tokenizer``, a ``.jsonl`` path, and a bad file in a subdirectory are refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer

import handle_plugins.datasets as plugin
import torch_handle.data.prepare as prepare_module
from handle_cli.main import cli
from torch_handle.data.datasets import DataContext
from torch_handle.data.sources import Source
from torch_handle.errors import DataError

SHAKESPEARE = Path("/work/shared/data/tinyshakespeare/input.txt")
if not SHAKESPEARE.is_file():
    SHAKESPEARE = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare" / "input.txt"


def _ctx(cache: Path) -> DataContext:
    def barrier() -> None:
        raise AssertionError("a rank waited at a collective for the data")

    return DataContext(cache_dir=cache, is_main=True, barrier=barrier)


def test_the_launcher_prepares_once_and_the_ranks_only_open(tmp_path, monkeypatch):
    corpus = tmp_path / "plays"
    (corpus / "act2").mkdir(parents=True)
    text = SHAKESPEARE.read_text(encoding="utf-8")[:200_000]
    scenes = text.split("\n\n")
    for k, name in enumerate(["play0.txt", "play1.txt", "act2/play2.txt"]):  # a subdirectory is read too
        (corpus / name).write_text("\n\n".join(scenes[k::3]), encoding="utf-8")
    options = plugin.TextConfig(path=str(corpus), vocab_size=512, seq_len=32)
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="not prepared"):  # a rank never prepares
        plugin.build_lm(options, _ctx(cache))
    identity = plugin.prepare_lm(options, cache)  # the launcher
    [prepared] = list(cache.glob("tokens-*"))
    first = plugin.build_lm(options, _ctx(cache))
    assert first.identity == identity and first.pad_id == 0  # the trained BPE's <pad>, as meta.json records it
    tok = Tokenizer.from_file(str(first.tokenizer_path))
    eos = tok.token_to_id("<eos>")
    stream = [s.window(0, s.n_tokens) for s in (first.train.split, first.valid.split)]
    assert sum(int((s == eos).sum()) for s in stream) == first.train.split.n_documents + first.valid.split.n_documents
    assert first.train.split.n_documents + first.valid.split.n_documents == 4  # 3 files, the last cut by the tail
    assert tok.decode(stream[0][:200].tolist()).count("\n\n") > 0  # paragraph breaks stay text

    def refuse(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"{what} again")
        return fail

    hashed = []
    monkeypatch.setattr(Source, "_hash", lambda self: hashed.append(self.path) or "h")
    monkeypatch.setattr(prepare_module, "prepare", refuse("prepared"))
    assert plugin.prepare_lm(options, cache) == identity and not hashed  # unchanged files: found by their stat
    second = plugin.build_lm(options, _ctx(cache))
    assert len(second.train) == len(first.train) and (second.train[5]["input_ids"] == first.train[5]["input_ids"]).all()
    monkeypatch.undo()
    os.utime(corpus / "play0.txt", ns=(1, 1))  # touched, not changed: hashed once, not prepared
    monkeypatch.setattr(prepare_module, "prepare", refuse("prepared"))
    assert plugin.prepare_lm(options, cache) == identity and list(cache.glob("tokens-*")) == [prepared]
    monkeypatch.undo()
    (corpus / "play0.txt").write_text("changed\n" * 100, encoding="utf-8")  # other content: another directory
    with pytest.raises(DataError, match="not prepared"):
        plugin.build_lm(options, _ctx(cache))
    assert plugin.prepare_lm(options, cache) != identity and len(list(cache.glob("tokens-*"))) == 2


def test_validate_reads_the_files_the_run_reads(tmp_path, monkeypatch):
    """A file that is not UTF-8 in a subdirectory of data.path: refused by `handle validate` (the run reads
    directories recursively), exit 2, one line naming it."""
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus"
    (corpus / "deeper").mkdir(parents=True)
    (corpus / "a.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    (corpus / "deeper" / "b.txt").write_bytes(b"fine text, then \xff a byte that is not UTF-8")
    preset = Path(__file__).resolve().parents[2] / "presets" / "zero2.toml"
    res = CliRunner().invoke(cli, ["validate", str(preset), "--set", "data.name=text", "--set",
                                   f"data.path={corpus}"])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert f"{corpus / 'deeper' / 'b.txt'}: not UTF-8 text (undecodable byte at offset 16)" in lines[0]


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


def test_a_vocabulary_whose_id_0_is_text_has_no_padding(tmp_path):
    """A given byte-level BPE with no padding token (as GPT-2's, Llama 3's and Qwen's: id 0 is an ordinary token,
    ``!`` in theirs): meta.json records ``pad_id`` null, the bundle hands the model None, and a window full of id 0
    is attended to as text: the model's logits equal those of a model told there is no padding."""
    import json

    import torch
    from tokenizers import Tokenizer as Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from handle_plugins.transformer import TransformerConfig, build as build_model

    text = SHAKESPEARE.read_text(encoding="utf-8")[:100_000]
    tok = Tok(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(["<|endoftext|>"])  # after the merges, as GPT-2's: id 0 stays a piece of text
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    options = plugin.TextConfig(path=str(tmp_path / "corpus.txt"), tokenizer=str(tmp_path / "tokenizer.json"),
                                vocab_size=512, seq_len=64)
    identity = plugin.prepare_lm(options, tmp_path / "cache")
    [meta] = list((tmp_path / "cache").glob("tokens-*/meta.json"))
    assert json.loads(meta.read_text())["tokenizer"]["pad_id"] is None and identity.pad_id is None
    bundle = plugin.build_lm(options, _ctx(tmp_path / "cache"))
    assert bundle.pad_id is None
    windows = [bundle.train[i]["input_ids"] for i in range(len(bundle.train))]
    ids = max(windows, key=lambda w: int((w == 0).sum()))[None]  # (1, 64): the window with most id-0 tokens
    assert int((ids == 0).sum()) >= 2, f"id 0 ({tok.id_to_token(0)!r}) is common text"
    config = TransformerConfig(kind="decoder", d_model=32, n_heads=2, n_layers=1, d_ff=64, dropout=0.0)
    torch.manual_seed(0)
    model = build_model(config, bundle.vocab_size, bundle.pad_id, bundle.max_len).eval()
    torch.manual_seed(0)
    unpadded = build_model(config, bundle.vocab_size, None, bundle.max_len).eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids), unpadded(input_ids=ids))


@pytest.mark.parametrize("config, want", [({}, None), ({"pad_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
                                                       None), ({"pad_token": "<pad>"}, "<pad>")])
def test_meta_records_the_tokenizers_own_pad_token_or_none(tmp_path, config, want):
    """``pad_id``: tokenizer_config.json's pad_token, unless it is the end-of-document token (Qwen's bases pad with
    <|endoftext|>: packed samples hold it at every document end); none at all: null."""
    import json

    from torch_handle.data.datasets import train_tokenizer
    from torch_handle.data.prepare import prepare
    from torch_handle.data.shards import open_prepared

    tok = train_tokenizer([SHAKESPEARE.read_text(encoding="utf-8")[:20_000]], 300)
    if "pad_token" not in config:  # a tokenizer without <pad>: rebuild the vocabulary's special tokens
        tok = Tokenizer.from_str(tok.to_str().replace('"<pad>"', '"<|unused|>"'))
    tok.add_special_tokens(["<|endoftext|>"])
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "a.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    prepare([str(tmp_path / "a.txt")], tmp_path / "out", tokenizer=tmp_path / "tok", workers=0)
    prepared = open_prepared(tmp_path / "out")
    assert prepared.pad_id == (tok.token_to_id(want) if want else None)
    assert prepared.meta["tokenizer"]["pad_id"] == prepared.pad_id
