"""``handle data prepare --chat`` reads a ``datasets.save_to_disk`` directory as it reads JSON Lines (issue 46): the
same rows give byte-identical shards and masks (Arrow's nulls for what a row lacks read as absent keys); a
directory holding several splits is one line, exit 2. In-process: the Self-Instruct seed tasks (nested
``instances``) and ChatML conversations with per-message ``train`` flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from handle_cli.main import cli
from torch_handle.data.chat.prepare import prepare_chat
from torch_handle.data.datasets import train_tokenizer

datasets = pytest.importorskip("datasets", reason="needs the hf extra: pip install -e '.[dev,hf]'")

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
FILES = ("train-00000.bin", "train-00000.mask", "valid-00000.bin", "valid-00000.mask")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer([(DATA / "self-instruct" / "seed_tasks.jsonl").read_text(encoding="utf-8")], 400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(d / "tokenizer.json"))
    return d / "tokenizer.json"


def _rows() -> dict[str, list[dict]]:
    seed = [json.loads(line) for line in (DATA / "self-instruct" / "seed_tasks.jsonl").read_text().splitlines()]
    en = (DATA / "multi30k" / "valid.en").read_text(encoding="utf-8").splitlines()[:40]
    de = (DATA / "multi30k" / "valid.de").read_text(encoding="utf-8").splitlines()[:40]
    chats = [{"messages": [{"role": "system", "content": "You translate."}, *[
        m for k in (i, i + 1) for m in ({"role": "user", "content": f"Translate to German: {en[k]}"},
                                        {"role": "assistant", "content": de[k], **({"train": False} if k == i else {})})
    ]]} for i in range(0, 40, 2)]  # the first answer of each is not trained: the others have no "train" key
    return {"seed": seed[:60], "chats": chats}


@pytest.mark.parametrize("name", ["seed", "chats"])
def test_a_datasets_directory_prepares_as_its_json_lines(tokenizer, tmp_path, name):
    rows = _rows()[name]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    # the directory named as the file: the validation split is held out by a hash of the source's name
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf" / "rows.jsonl"))
    kw = {"tokenizer": tokenizer, "template": "chatml", "valid_fraction": 0.2, "max_len": 512}
    a = prepare_chat([str(tmp_path / "rows.jsonl")], tmp_path / "a", **kw)
    b = prepare_chat([str(tmp_path / "hf" / "rows.jsonl")], tmp_path / "b", **kw)
    assert a["splits"] == b["splits"] and a["conversations"] == b["conversations"] > len(rows) // 2
    for f in FILES:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert meta["sources"][0]["path"] == str(tmp_path / "hf" / "rows.jsonl") and len(meta["sources"][0]["sha256"]) == 64
    if name == "chats":  # the untrained first answers: fewer trained tokens than with every answer trained
        every = [{"messages": [{k: v for k, v in m.items() if k != "train"} for m in r["messages"]]} for r in rows]
        datasets.Dataset.from_list(every).save_to_disk(str(tmp_path / "every" / "rows.jsonl"))
        c = prepare_chat([str(tmp_path / "every" / "rows.jsonl")], tmp_path / "c", **kw)
        assert c["splits"]["train"]["trained_tokens"] > b["splits"]["train"]["trained_tokens"]


def test_a_directory_of_several_splits_is_one_line(tokenizer, tmp_path):
    split = datasets.Dataset.from_list(_rows()["chats"][:4])
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dict"))
    res = CliRunner().invoke(cli, ["data", "prepare", str(tmp_path / "dict"), "--chat", "--tokenizer",
                                   str(tokenizer), "--template", "chatml", "--out", str(tmp_path / "out")])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and "a DatasetDict (splits: train, test)" in lines[0], res.output
    assert not (tmp_path / "out").exists()
