"""Chat templates rendered as transformers renders them, and the trained tokens of each turn (issue 46,
torch_handle/data/chat/): on conversations built from ../shared/data (self-instruct's seed tasks, Multi30k read
as translation requests with a system turn), for a base with its own template ({% generation %} markers) and for
``--template chatml``, the ids equal transformers' ``apply_chat_template(tokenize=True)`` and the masks equal the
definition computed from transformers' own renderings of the prefixes; then what ``prepare_chat`` writes and
``handle data inspect`` shows, and the bad inputs, one line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer

from handle_cli.main import cli
from torch_handle.data.chat.prepare import conversation_view, prepare_chat
from torch_handle.data.chat.rows import conversations, read_rows
from torch_handle.data.chat.template import BUILT_IN, CHATML, ChatTemplate, encode_conversation, load_template
from torch_handle.data.datasets import train_tokenizer
from torch_handle.errors import DataError

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
MARKED = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == "
          "'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
          "{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
"""TRL's ChatML with {% generation %} markers around each answer and its <|im_end|>."""


def _conversations() -> list[list[dict]]:
    out = [c for where, row in read_rows(DATA / "self-instruct" / "seed_tasks.jsonl")
           for c in conversations(row, where)][:60]
    en = (DATA / "multi30k" / "valid.en").read_text(encoding="utf-8").splitlines()
    de = (DATA / "multi30k" / "valid.de").read_text(encoding="utf-8").splitlines()
    for k in range(0, 60, 3):  # three requests a conversation, after a system turn
        turns = [{"role": "system", "content": "You translate English into German."}]
        for e, d in zip(en[k:k + 3], de[k:k + 3]):
            turns += [{"role": "user", "content": f"Translate: {e}"}, {"role": "assistant", "content": d}]
        out.append(turns)
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A base directory as transformers saves one: tokenizer.json (a byte-level BPE with ChatML's tokens) and a
    tokenizer_config.json holding its chat template."""
    d = tmp_path_factory.mktemp("base")
    tok = train_tokenizer([(DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:100_000]], 500)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<pad>", "chat_template": MARKED,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


@pytest.mark.parametrize("spec", [None, "chatml", "zephyr"], ids=["base-template", "chatml", "zephyr"])
def test_ids_are_transformers_and_masks_are_the_definition(base, spec):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(base))
    template = load_template(spec, base / "tokenizer.json")
    source = MARKED if spec is None else BUILT_IN[spec]  # zephyr ends every turn with eos_token: <|im_end|> here
    assert template.source == source and template.has_generation_markers == (spec is None)
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    convs = _conversations()
    assert len(convs) == 80
    for messages in convs:
        ids, trained = encode_conversation(tok, template, messages)
        want = hf.apply_chat_template(messages, chat_template=source, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=spec is None)
        assert ids == want["input_ids"]
        # the definition, from transformers' renderings: each assistant turn's characters are the difference
        # between the conversation through it and up to it with the generation prompt
        whole = hf.apply_chat_template(messages, chat_template=source, tokenize=False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                before = hf.apply_chat_template(messages[:i], chat_template=source, tokenize=False,
                                                add_generation_prompt=True) if i else ""
                spans.append((len(before), len(hf.apply_chat_template(messages[:i + 1], chat_template=source,
                                                                      tokenize=False))))
        offsets = tok.encode(whole, add_special_tokens=False).offsets
        assert trained == [any(s <= a < e for s, e in spans) for a, _ in offsets]
        ends = [t for i, t in zip(ids, trained) if i == tok.token_to_id("<|im_end|>")]
        assert ends.count(True) == sum(m["role"] == "assistant" for m in messages), "every end of turn trained"
        if spec is None:  # the markers' span is the answer and <|im_end|>; the definition adds the newline after
            marked = want["assistant_masks"]
            assert all(t for t, m in zip(trained, marked) if m)
            assert all(tok.decode([i]).strip() == "" for i, t, m in zip(ids, trained, marked) if t and not m)


def test_train_on_last_and_all_and_per_message_train_flags(base):
    template = load_template("chatml", base / "tokenizer.json")
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    messages = _conversations()[-1]  # system, then three requests and answers
    assistant, last, every = (encode_conversation(tok, template, messages, on)[1] for on in ("assistant", "last",
                                                                                              "all"))
    assert sum(last) < sum(assistant) < sum(every) and all(a <= e for a, e in zip(assistant, every))
    assert not any(every[:5]), "the system turn is never trained"
    flagged = [dict(m, train=False) if i == 2 else m for i, m in enumerate(messages)]  # the first answer not
    assert sum(encode_conversation(tok, template, flagged)[1]) < sum(assistant)


def test_prepare_writes_masks_and_inspect_shows_them(base, tmp_path):
    rows = tmp_path / "chat.jsonl"
    with rows.open("w", encoding="utf-8") as f:
        for messages in _conversations():
            f.write(json.dumps({"messages": messages}) + "\n")
    summary = prepare_chat([str(rows)], tmp_path / "out", tokenizer=base, valid_fraction=0.1, max_len=60)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["chat"]["template"].endswith("tokenizer_config.json") and meta["tokenizer"]["pad_id"] == 0
    assert meta["chat"]["conversations"] == 80 and summary["truncated"] == meta["chat"]["truncated"] > 0
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == MARKED
    view = conversation_view(tmp_path / "out", "train", 0)
    assert len(view["ids"]) == len(view["trained"]) <= 61 and any(view["trained"]) and all(view["end_of_turn_trained"])
    res = CliRunner().invoke(cli, ["data", "inspect", str(tmp_path / "out"), "--index", "0", "--json"])
    assert res.exit_code == 0 and json.loads(res.output) == {"ids": view["ids"], "trained": view["trained"]}
    res = CliRunner().invoke(cli, ["data", "inspect", str(tmp_path / "out"), "--index", "0"])
    assert res.exit_code == 0 and "trained" in res.output and "<|im_end|>" in res.output


@pytest.mark.parametrize("row, template, message", [
    ({"text": "no conversation here"}, "chatml", "none of the known layouts"),
    ({"messages": [{"role": "user", "content": "hello?"}]}, "chatml", "no assistant turn"),
    ({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}, "chatml",
     "role 'tool': valid are system, user, assistant"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "counts.jinja",
     "is not a prefix of its rendering"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "broken.jinja",
     "not valid Jinja"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(base, tmp_path, row, template, message):
    (tmp_path / "counts.jinja").write_text("{{ messages | length }} turns\n{% for m in messages %}{{ m.content }}"
                                           "{% endfor %}")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }")
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    spec = template if template == "chatml" else str(tmp_path / template)
    res = CliRunner().invoke(cli, ["data", "prepare", str(tmp_path / "rows.jsonl"), "--chat", "--tokenizer", str(base),
                                   "--template", spec, "--out", str(tmp_path / "out")])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and message in lines[0], res.output
    assert not (tmp_path / "out").exists()


def test_a_base_without_a_template_needs_one(tmp_path):
    tok = train_tokenizer(["some text to learn from"] * 10, 300)
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match="no chat template .* give --template chatml"):
        load_template(None, tmp_path / "tokenizer.json")
    assert isinstance(load_template("chatml", tmp_path / "tokenizer.json"), ChatTemplate)


def test_a_template_that_ends_turns_with_text_is_warned_of(tmp_path):
    """Phi-3's template ends each turn with <|end|>, text in handle's own BPE: no trained token ends a turn and a
    model trained on it never stops (trl #1623). Zephyr's ends each turn with the tokenizer's <eos>, ChatML's with
    <|im_end|>, which handle's BPE reserves (id 5)."""
    tok = train_tokenizer([(DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:20_000]], 300)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps({"messages": m}) + "\n" for m in _conversations()[60:]), encoding="utf-8")
    phi3 = tmp_path / "phi3.jinja"
    phi3.write_text("{% for message in messages %}{{'<|' + message['role'] + '|>\\n' + message['content'] + "
                    "'<|end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
    for template, warned in ((str(phi3), True), ("zephyr", False), ("chatml", False)):
        res = CliRunner().invoke(cli, ["data", "prepare", str(rows), "--chat", "--tokenizer", str(tmp_path),
                                       "--template", template, "--valid-fraction", "0.3", "--json",
                                       "--out", str(tmp_path / Path(template).stem)])
        assert res.exit_code == 0, res.output
        assert ("no trained token ends a turn" in res.stderr) == warned, res.stderr
        meta = json.loads((tmp_path / Path(template).stem / "meta.json").read_text())
        documents = meta["splits"]["train"]["documents"]
        assert meta["chat"]["end_of_turn_trained"] == (0 if warned else 3 * documents)  # 3 answers a conversation
