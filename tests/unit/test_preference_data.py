"""Preference pairs (issue 47): ``handle data prepare --preference`` renders both sides of a pair with the chat
template as ``--chat`` renders a conversation (torch_handle/data/chat/pairs.py), marks each completion's tokens,
stores a pair as two consecutive documents that :class:`PreferencePairs` turns into one sample; ``handle data
inspect --json`` shows both sides; bad rows are one line naming the file, row and field, exit 2, nothing written.
Pairs from ../shared/data's Self-Instruct seed tasks (benchmarks/preference_pairs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer

from benchmarks.preference_pairs import seed_task_pairs
from handle_cli.main import cli
from tests.unit.test_chat_template import DATA, base  # noqa: F401 - the module's fixture
from torch_handle.data.chat.pair_samples import PreferencePairs
from torch_handle.data.chat.pairs import holds_pairs, prepare_preference
from torch_handle.data.chat.template import encode_conversation, load_template
from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.data.shards import open_prepared

ROWS = [r for r in seed_task_pairs(DATA / "self-instruct" / "seed_tasks.jsonl")
        if len(r["prompt"]) + max(len(r["chosen"]), len(r["rejected"])) < 250][:40]
"""40 short pairs: none is truncated at --max-len 200 (with the test's 500-token BPE)."""


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def pairs(base, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("pairs")
    summary = prepare_preference([str(_write(root / "pairs.jsonl", ROWS))], root / "data", tokenizer=base,
                                 template="chatml", valid_fraction=0.2, max_len=200)
    return root / "data", summary


def test_sides_are_rendered_as_conversations_and_completions_trained(base, pairs):  # noqa: F811
    directory, summary = pairs
    data = open_prepared(directory)
    assert holds_pairs(data.meta) and data.meta["chat"]["pairs"] == summary["pairs"] == 40
    assert summary["truncated"] == 0
    assert data.train.n_documents + data.valid.n_documents == 80 and data.train.n_documents % 2 == 0
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    template = load_template("chatml", base / "tokenizer.json")
    res = CliRunner().invoke(cli, ["data", "inspect", str(directory), "--index", "1", "--json"])
    assert res.exit_code == 0, res.output
    view = json.loads(res.output)
    assert set(view) == {"chosen", "rejected"} and set(view["chosen"]) == {"ids", "trained"}
    # which row is train pair 1: the rows whose chosen side renders to these ids
    found = []
    for row in ROWS:
        prompt = [{"role": "user", "content": row["prompt"], "train": False}]
        sides = [encode_conversation(tok, template, prompt + [{"role": "assistant", "content": row[k]}])
                 for k in ("chosen", "rejected")]
        if sides[0][0] == view["chosen"]["ids"]:
            found.append((row, sides))
    assert len(found) == 1
    row, sides = found[0]
    for k, (ids, trained) in zip(("chosen", "rejected"), sides):
        assert view[k] == {"ids": ids, "trained": trained}
        answer = tok.decode([i for i, t in zip(ids, trained) if t], skip_special_tokens=False)
        assert answer == row[k] + "<|im_end|>\n", "the completion and its end of turn, nothing of the prompt"


def test_the_two_layouts_give_the_same_pair(base, tmp_path):  # noqa: F811
    """A prompt of several turns: its assistant turn is never trained."""
    row, first = ROWS[3], ROWS[4]
    history = [{"role": "user", "content": first["prompt"]}, {"role": "assistant", "content": first["chosen"]},
               {"role": "user", "content": row["prompt"]}]
    messages_row = {"chosen": history + [{"role": "assistant", "content": row["chosen"]}],
                    "rejected": history + [{"role": "assistant", "content": row["rejected"]}]}
    row = {**row, "prompt": history}
    got = []
    for name, r in (("prompt", row), ("messages", messages_row)):
        prepare_preference([str(_write(tmp_path / f"{name}.jsonl", [r]))], tmp_path / name, tokenizer=base,
                           template="chatml", valid=[str(tmp_path / f"{name}.jsonl")])
        got.append(json.loads(CliRunner().invoke(cli, ["data", "inspect", str(tmp_path / name), "--json"]).output))
    assert got[0] == got[1]
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    trained = tok.decode([i for i, t in zip(got[0]["chosen"]["ids"], got[0]["chosen"]["trained"]) if t],
                         skip_special_tokens=False)
    assert trained == row["chosen"] + "<|im_end|>\n"


def test_a_pair_is_one_sample_of_two_rows(pairs):
    directory, _ = pairs
    data = open_prepared(directory)
    samples = PreferencePairs(data.train, 200, fill_id=data.eos_id)
    assert len(samples) == data.train.n_documents // 2
    item = samples[2]
    assert item["input_ids"].shape == item["labels"].shape == (2, 200)
    for side in range(2):
        start = int(data.train.doc_starts[4 + side])
        stop = int(data.train.doc_starts[5 + side]) if 5 + side < data.train.n_documents else data.train.n_tokens
        ids, trained = data.train.window(start, stop), data.train.mask(start, stop)
        n = len(ids) - 1
        assert 0 < trained[1:].sum() < n, "the prompt untrained, the completion trained"
        assert item["input_ids"][side, :n].tolist() == ids[:-1].tolist()
        assert item["labels"][side].tolist() == [int(i) if t else IGNORE_INDEX for i, t in zip(ids[1:], trained[1:])] \
            + [IGNORE_INDEX] * (200 - n)
    short = PreferencePairs(data.train, 60, fill_id=data.eos_id)
    assert short.dropped > 0 and len(short) + short.dropped == len(samples)


USER = {"role": "user", "content": "Name a colour."}


@pytest.mark.parametrize("row, message", [
    ({"prompt": "Hi", "answer": "x"}, "none of the preference layouts"),
    ({"prompt": "Hi", "chosen": "Red.", "rejected": "Red."}, "chosen equals rejected"),
    ({"chosen": [USER, {"role": "assistant", "content": "Red."}],
      "rejected": [{"role": "user", "content": "Other."}, {"role": "assistant", "content": "Blue."}]},
     "no common prompt"),
    ({"chosen": [USER, {"role": "assistant", "content": "Red."}], "rejected": [USER]}, "rejected: no completion"),
    ({"prompt": "Hi", "chosen": [USER], "rejected": "Blue."}, "chosen: a completion with no assistant turn"),
    ({"prompt": "Hi", "chosen": [{"role": "assistant", "content": "Red.", "train": False}], "rejected": "Blue."},
     "chosen with no trained token"),
], ids=["layout", "equal", "no-prompt", "prefix", "no-assistant", "untrained"])
def test_bad_pairs_are_one_line_exit_2_and_nothing_written(base, tmp_path, row, message):  # noqa: F811
    rows = _write(tmp_path / "rows.jsonl", [ROWS[0], row])
    res = CliRunner().invoke(cli, ["data", "prepare", str(rows), "--preference", "--tokenizer", str(base),
                                   "--template", "chatml", "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and f"{rows}:2: " in lines[0] and message in lines[0], lines
    assert not (tmp_path / "out").exists()


def _validate(tmp_path: Path, data: Path, *overrides: str):
    (tmp_path / "p.toml").write_text(f"""
[data]
name = "tokens"
path = "{data}"
seq_len = 64
[finetune]
method = "lora"
objective = "dpo"
""", encoding="utf-8")
    return CliRunner().invoke(cli, ["validate", str(tmp_path / "p.toml"), *[a for o in overrides
                                                                          for a in ("--set", o)]])


def test_a_dpo_preset_on_pairs_is_valid(pairs, tmp_path):
    res = _validate(tmp_path, pairs[0])
    assert res.exit_code == 0 and "ok" in res.output, res.output


@pytest.mark.parametrize("overrides, message", [
    (("finetune.preference.beta=0",), "finetune.preference.beta: 0.0 must be > 0"),
    (("finetune.preference.beta=-0.1",), "finetune.preference.beta: -0.1 must be > 0"),
    (("finetune.preference.reference=none",), "finetune.preference.reference: 'none': loss 'sigmoid' compares "
                                              "with a reference model"),
    (("finetune.preference.loss=orpo", "finetune.preference.reference=adapters_off"), "is reference-free"),
    (("finetune.method=none", "finetune.preference.reference=adapters_off"),
     "finetune.preference.reference: 'adapters_off' needs adapters"),
    (("finetune.objective=sft",), "holds preference pairs"),
    (("data.path=", "data.sources=[{path=\"DIR\"}]"), "data.sources: finetune.objective = 'dpo' reads one prepared "
                                                       "directory"),
], ids=["beta-0", "beta-negative", "reference-none", "free-with-reference", "full-fine-tune", "sft",
        "mixture"])
def test_bad_dpo_presets_are_one_line_exit_2(pairs, tmp_path, overrides, message):
    res = _validate(tmp_path, pairs[0], *(o.replace("DIR", str(pairs[0])) for o in overrides))
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.startswith("error")]
    assert len(lines) == 1 and message in lines[0], res.output


def test_dpo_on_shards_without_pairs_is_one_line(base, tmp_path):  # noqa: F811
    from torch_handle.data.chat.prepare import prepare_chat

    rows = _write(tmp_path / "chat.jsonl", [{"prompt": r["prompt"], "completion": r["chosen"]} for r in ROWS])
    prepare_chat([str(rows)], tmp_path / "chat", tokenizer=base, template="chatml", valid_fraction=0.2)
    res = _validate(tmp_path, tmp_path / "chat")
    assert res.exit_code == 2 and "holds no preference pairs (finetune.objective = 'dpo'" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1
