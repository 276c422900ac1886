"""``handle estimate`` of an SFT preset (``finetune.objective = "sft"``, issue 46): packed conversations price as
pretraining windows of ``seq_len`` positions plus their document mask, which a real packed micro-batch saves for
backward to the byte; the vocabulary comes from the prepared directory's ``meta.json``, or before it is prepared
from ``model.init_from``'s ``config.json``. In-process: a small tokenizer, 24 Multi30k translation requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from handle_cli.main import cli
from torch_handle.config.loader import load_preset
from torch_handle.data.chat.packing import PackedConversations
from torch_handle.data.chat.prepare import prepare_chat
from torch_handle.data.datasets import train_tokenizer
from torch_handle.data.shards import open_prepared
from torch_handle.plan.estimate import estimate_preset
from torch_handle.plan.estimate_activations import saved_activation_bytes
from torch_handle.plan.estimate_model import build_model, model_build, prepared_vocab_size
from torch_handle.registry import get_registry

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "multi30k"
SEQ = 320
PRESET = """
[model]
norm = "rmsnorm"
position = "rope"
mlp = "swiglu"
d_model = 32
n_heads = 2
n_layers = 1
d_ff = 48
dropout = 0.0
[data]
name = "tokens"
path = "{data}"
seq_len = {seq}
[training]
micro_batch_size = 2
precision = "fp32"
[finetune]
objective = "sft"
"""


def translations(root: Path) -> tuple[list[str], list[str]]:
    """24 Multi30k sentences in English and in German, and a 300-token BPE with ChatML's tokens trained on them in
    ``root/tokenizer.json`` (also the DPO estimate's, tests/unit/test_estimate_dpo.py)."""
    en, de = ((DATA / f"valid.{x}").read_text(encoding="utf-8").splitlines()[:24] for x in ("en", "de"))
    tok = train_tokenizer([" ".join(en + de)], 300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(root / "tokenizer.json"))
    return en, de


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sft-estimate")
    en, de = translations(root)
    rows = root / "chat.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Translate to German: {e}", "completion": d}) + "\n"
                            for e, d in zip(en, de)), encoding="utf-8")
    prepare_chat([str(rows)], root / "data", tokenizer=root / "tokenizer.json", template="chatml",
                 valid_fraction=0.25, max_len=SEQ // 2)
    (root / "sft.toml").write_text(PRESET.format(data=root / "data", seq=SEQ), encoding="utf-8")
    return root


def test_the_estimate_prices_what_a_packed_micro_batch_saves(prepared):
    preset = load_preset(prepared / "sft.toml")
    registry = get_registry()
    row = estimate_preset(preset, registry, [1])[0]
    data = open_prepared(prepared / "data")
    assert model_build(preset, registry).vocab_size == data.vocab_size  # from its meta.json
    packed = PackedConversations(data.train, SEQ, fill_id=data.eos_id)
    items = [packed[i] for i in range(len(packed)) if len(packed.samples[i]) > 1][:2]
    batch = {k: torch.stack([item[k] for item in items]) for k in items[0]}
    labels = batch.pop("labels")
    assert all(int((row == 0).sum()) > 1 for row in batch["position_ids"])  # each sample packs conversations
    torch.manual_seed(0)
    model = build_model(model_build(preset, registry)).train()

    def step():
        logits = model(**batch)
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()

    assert row.activation.saved == saved_activation_bytes(step, model)
    lm = estimate_preset(load_preset(prepared / "sft.toml", ["finetune.objective=lm"]), registry, [1])[0]
    assert row.activation.saved > lm.activation.saved  # the document mask (and what attention saves with it)


def test_the_vocabulary_of_a_preset_whose_data_is_not_prepared_yet_is_the_bases(prepared, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"vocab_size": 320}))
    preset = load_preset(prepared / "sft.toml", [f"data.path={tmp_path / 'later'}", f"model.init_from={base}"])
    assert prepared_vocab_size(preset) == (320, f"{base}/config.json")
    preset = load_preset(prepared / "sft.toml", [f"data.path={tmp_path / 'later'}"])
    assert prepared_vocab_size(preset) == (None, "")


def test_the_cli_says_what_an_sft_estimate_assumes(prepared, monkeypatch):
    result = CliRunner().invoke(cli, ["estimate", str(prepared / "sft.toml"), "--nproc", "1"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"sft: each micro-batch is 2 sample(s) of {SEQ} positions packed with conversations" in text
    assert f"(bool, 2 x 1 x {SEQ} x {SEQ}: 200 KiB) is priced with the activations" in text
    assert f"vocabulary {open_prepared(prepared / 'data').vocab_size} from " in text  # the path may wrap
