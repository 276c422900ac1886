"""ChatML's special tokens for every model (issue 46, templates): tokenizers that handle trains reserve
``<|im_start|>`` (id 4) and ``<|im_end|>`` (id 5); a base whose vocabulary lacks them gets them added by ``handle
data prepare --chat --template chatml``, its embedding and output rows grow when a run loads it (mean-initialised as
transformers' ``resize_token_embeddings``), the new rows train (LoRA: embed_tokens and lm_head whole, peft's
``modules_to_save``), and the exports load in transformers and peft with handle's logits. In this process: a
random Llama written by transformers (its output projection untied, and tied) and 3 LoRA steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[dev,hf]'")

from tests.test_sft import DATA, SEQ, preset_file  # noqa: E402
from tests.test_sft import write_base as write_sft_base  # noqa: E402
from tests.unit.test_chat_template import _conversations  # noqa: E402
from tests.unit.test_trainer_step import _events, _train, process_group  # noqa: E402,F401
from torch_handle.config.loader import dump_preset, load_preset  # noqa: E402
from torch_handle.data.chat.prepare import prepare_chat  # noqa: E402
from torch_handle.data.datasets import IM_END_ID, IM_START_ID, RESERVED_TOKENS, train_tokenizer  # noqa: E402
from torch_handle.data.shards import file_sha256, open_prepared  # noqa: E402
from torch_handle.checkpoint.vocab_rows import EPSILON, GROW_SEED, grow_vocab, mean_rows  # noqa: E402
from torch_handle.plan.estimate_model import model_shape  # noqa: E402
from torch_handle.registry import get_registry  # noqa: E402
from torch_handle.rundir import create_run_dir  # noqa: E402


def _base_tokenizer(vocab: int, text_from: int = 0):
    """A byte-level BPE as handle trained them before ChatML's tokens were reserved: the four roles alone (on
    100 kB of Tiny Shakespeare from character ``text_from``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = (DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[text_from:text_from + 100_000]
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=RESERVED_TOKENS[:4], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def write_base(base: Path, *, tie: bool, text_from: int = 0) -> Path:
    """test_sft's random LlamaForCausalLM (saved by transformers) at ``base``, its output projection tied or not,
    on a tokenizer without ChatML's tokens."""
    sft = base.parent / "sft-base"
    if not sft.exists():
        write_sft_base(sft)
    tok = _base_tokenizer(400, text_from)
    config = transformers.LlamaConfig.from_pretrained(sft)
    config.vocab_size, config.tie_word_embeddings = tok.get_vocab_size(), tie
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(base)
    tok.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "pad_token": "<pad>",
                                                            "tokenizer_class": "PreTrainedTokenizerFast"}))
    return base


@pytest.fixture(scope="module", params=["untied", "tied"])
def grown(request, tmp_path_factory) -> tuple[Path, Path, dict]:
    """``(base, data, summary)``: a base lacking ChatML's tokens (its output projection untied, or tied to the
    embedding), and 80 conversations prepared on it with ``--template chatml`` (the tokens added)."""
    root = tmp_path_factory.mktemp("chat_tokens")
    base = write_base(root / "base", tie=request.param == "tied")
    rows = root / "chat.jsonl"
    rows.write_text("".join(json.dumps({"messages": m}) + "\n" for m in _conversations()), encoding="utf-8")
    summary = prepare_chat([str(rows)], root / "data", tokenizer=base, template="chatml", valid_fraction=0.25,
                           max_len=SEQ)
    return base, root / "data", summary


def test_handle_tokenizers_reserve_chatml_at_ids_4_and_5(tmp_path):
    text = (DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:50_000]
    tok = train_tokenizer([text], 400)
    assert [tok.id_to_token(i) for i in range(6)] == RESERVED_TOKENS
    assert (tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")) == (IM_START_ID, IM_END_ID) == (4, 5)
    assert tok.get_vocab_size() == 400  # the reserved tokens within vocab_size
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False).ids
    assert ids[0] == IM_START_ID and ids.count(IM_END_ID) == 1
    # so --template chatml needs nothing added, and every answer ends with a trained <|im_end|>
    tok.save(str(tmp_path / "tokenizer.json"))
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps({"messages": m}) + "\n" for m in _conversations()[:20]), encoding="utf-8")
    summary = prepare_chat([str(rows)], tmp_path / "data", tokenizer=tmp_path, template="chatml",
                           valid_fraction=0.25, max_len=SEQ)
    assert summary["added_tokens"] == {} and summary["end_of_turn_trained"] > 0


def test_prepare_adds_the_template_tokens_a_base_lacks(grown):
    base, data, summary = grown
    from tokenizers import Tokenizer

    old = Tokenizer.from_file(str(base / "tokenizer.json")).get_vocab_size()
    assert summary["added_tokens"] == {"<|im_start|>": old, "<|im_end|>": old + 1}
    assert summary["end_of_turn_trained"] > 0  # each <|im_end|> one token, trained
    meta = json.loads((data / "meta.json").read_text())["tokenizer"]
    assert meta["vocab_size"] == old + 2
    assert meta["extends"] == {"sha256": file_sha256(base / "tokenizer.json"), "vocab_size": old,
                               "added": summary["added_tokens"]}
    # the ids are transformers' on the written tokenizer: apply_chat_template(tokenize=True)
    hf_tok = transformers.AutoTokenizer.from_pretrained(data)
    prepared = open_prepared(data)
    first = prepared.train.window(0, int(prepared.train.doc_starts[1]))
    messages = next(m for m in _conversations() if hf_tok.apply_chat_template(
        m, chat_template=(data / "chat_template.jinja").read_text(), tokenize=True,
        return_dict=True)["input_ids"][-len(first):] == first.tolist())
    assert messages and old + 1 in first.tolist()  # (truncated from the left to its last SEQ + 1 tokens)
    assert {old, old + 1} <= set(prepared.train.window(0, prepared.train.n_tokens).tolist())
    # the CLI says what it added
    from click.testing import CliRunner

    from handle_cli.main import cli

    res = CliRunner().invoke(cli, ["data", "prepare", str(data.parent / "chat.jsonl"), "--chat", "--tokenizer",
                                   str(base), "--template", "chatml", "--out", str(data.parent / "again")])
    assert res.exit_code == 0 and f"note: added <|im_start|> (id {old}), <|im_end|> (id {old + 1}) to the " \
        f"tokenizer in {data.parent / 'again'}" in res.stderr, res.output
    # handle validate (the launcher's checks) accepts the extended tokenizer on its base; on another base whose
    # tokenizer (trained on other text) has the same size it is bad input: one line, exit 2
    res = CliRunner().invoke(cli, ["validate", str(_preset_file(data.parent / "ok", base, data))])
    assert res.exit_code == 0, res.output
    other = write_base(data.parent / "other", tie=False, text_from=200_000)
    res = CliRunner().invoke(cli, ["validate", str(_preset_file(data.parent / "on-other", other, data))])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert res.stderr.count("\n") == 1 and f"{data} was prepared with another tokenizer" in res.stderr, res.stderr


def test_new_rows_are_mean_initialised_as_transformers_does(grown):
    base = grown[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    old = model.config.vocab_size
    weight = model.get_input_embeddings().weight.detach().clone()
    # transformers' own function on the global generator seeded as handle seeds its own: the same rows
    resized = torch.nn.Embedding(old + 2, weight.shape[1])
    torch.manual_seed(GROW_SEED)
    model._init_added_embeddings_weights_with_mean(model.get_input_embeddings(), resized, old, 2)
    mine = mean_rows(weight, 2, torch.Generator().manual_seed(GROW_SEED))
    assert torch.allclose(mine, resized.weight[-2:].detach(), rtol=0, atol=1e-7)
    assert not torch.equal(mine[0], mine[1])  # drawn around the mean, not the mean repeated
    # and resize_token_embeddings(mean_resizing=True) itself: both within 10⁻⁹·Σ's spread of the rows' mean
    head = model.lm_head.weight.detach().clone()
    model.resize_token_embeddings(old + 2, mean_resizing=True)
    spread = 10 * EPSILON ** 0.5 * weight.std()  # 10 standard deviations of N(μ, 10⁻⁹·Σ)
    for rows, base_rows in ((mine, weight), (model.get_input_embeddings().weight[-2:].detach(), weight),
                            (model.lm_head.weight[-2:].detach(), head)):
        assert (rows - base_rows.mean(0)).abs().max() < spread
    state = {"model.embed_tokens.weight": weight, "lm_head.weight": head}
    assert grow_vocab(state, old + 2) == old and state["lm_head.weight"].shape[0] == old + 2
    assert torch.equal(state["model.embed_tokens.weight"][-2:], mine)  # embed first, as transformers resizes
    assert grow_vocab(state, old + 2) is None  # nothing to grow


def _preset_file(directory: Path, base: Path, data: Path, method: str = "lora") -> Path:
    """test_sft's SFT preset on ``(base, data)`` (4 conversations a step, 3 steps), its ``tie_embeddings`` the
    base's, made a rank-4 LoRA or QLoRA one (``method``), or a full fine-tune (``none``)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = preset_file(directory, (base, data), micro_batch_size=4, grad_accum=1, steps=3, eval_steps=1)
    tie = json.loads((base / "config.json").read_text())["tie_word_embeddings"]
    text = path.read_text(encoding="utf-8").replace("[model]\n", f"[model]\ntie_embeddings = {str(tie).lower()}\n")
    assert text.rstrip().endswith('objective = "sft"')  # [finetune] is the last table
    adapters = f'method = "{method}"\nrank = 4\nalpha = 8.0\ntarget_modules = ["all"]\n' if method != "none" else ""
    path.write_text(text + adapters, encoding="utf-8")
    return path


def _trained(tmp_path: Path, grown, method: str, process_group) -> tuple[Path, torch.Tensor, torch.Tensor, bool]:
    """``(run_dir, ids, logits, tied)``: a 3-step ``method`` run on the grown base, the first validation window
    (1, SEQ), and the logits (1, SEQ, V + 2) of the run's model on it, loaded as ``handle generate`` loads it.
    Checked here: the loss fell,
    and every new row of the embedding (and of an untied output projection) moved from its grown start, so the
    rows had gradient."""
    from torch_handle.infer.generate import load_run

    base, data, summary = grown
    old = summary["added_tokens"]["<|im_start|>"]
    preset = load_preset(_preset_file(tmp_path, base, data, method))
    run_dir = create_run_dir(tmp_path / "runs", method, dump_preset(preset), {"status": "starting"})
    assert _train(preset, run_dir, process_group) == "finished"
    losses = [e["loss"] for e in _events(run_dir) if e["kind"] == "step"]
    assert len(losses) == 3 and losses[-1] < losses[0]

    tied = preset.model.options.tie_embeddings
    start = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    start_rows = {"model.embed_tokens.weight": start.model.embed_tokens.weight.detach()}
    start_rows |= {} if tied else {"lm_head.weight": start.lm_head.weight.detach()}
    grow_vocab(start_rows, old + 2)  # the rows the run started from
    loaded = load_run(run_dir)
    trained = {"model.embed_tokens.weight": loaded.model.embed.weight, "lm_head.weight": loaded.model.lm_head.weight}
    for key in start_rows:
        rows = trained[key]
        moved = (rows.detach()[old:] - start_rows[key][old:]).abs().amax(dim=1)
        assert rows.shape[0] == old + 2 and bool((moved > 1e-4).all()), (method, key, moved)

    if method != "none":  # handle estimate prices what trains: the adapters, embed_tokens and lm_head whole
        trainable = sum(p.numel() for p in loaded.model.parameters() if p.requires_grad)
        assert sum(model_shape(preset, get_registry()).numels) == trainable > (old + 2) * loaded.model.args.d_model

    ids = torch.from_numpy(open_prepared(data).valid.window(0, SEQ).astype("int64"))[None]
    assert int(ids.max()) >= old  # the new tokens are in the input
    with torch.no_grad():
        return run_dir, ids, loaded.model(ids), tied


def _hf_logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    """The logits of the Hugging Face export ``directory`` under transformers, checked to hold the grown vocabulary
    and the extended tokenizer."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    assert model.config.vocab_size == len(tok) and tok.convert_tokens_to_ids("<|im_end|>") == len(tok) - 1
    with torch.no_grad():
        return model(ids).logits


def test_lora_trains_the_new_rows_and_exports_load_in_transformers_and_peft(grown, tmp_path, process_group):
    from torch_handle.infer.adapter_export import export_adapters
    from torch_handle.infer.hf_export import export_hf

    base, _, summary = grown
    old = summary["added_tokens"]["<|im_start|>"]
    run_dir, ids, want, tied = _trained(tmp_path, grown, "lora", process_group)
    export_hf(run_dir, tmp_path / "merged", merge=True)  # the grown vocabulary and the extended tokenizer
    assert torch.allclose(_hf_logits(tmp_path / "merged", ids), want, rtol=0, atol=1e-5)

    export_adapters(run_dir, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == (["embed_tokens"] if tied else ["embed_tokens", "lm_head"])
    peft = pytest.importorskip("peft", reason="needs peft")  # here, not at import: it costs ~5 CPU s a collection
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    hf.resize_token_embeddings(old + 2)
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.allclose(adapted(ids).logits, want, rtol=0, atol=1e-5)


def test_qlora_and_a_full_fine_tune_train_and_export_the_new_rows(grown, tmp_path, process_group):
    """QLoRA on the untied base (its NF4 linears dequantised by the merge), a full fine-tune on the tied one."""
    from torch_handle.infer.hf_export import export_hf

    method = "none" if json.loads((grown[0] / "config.json").read_text())["tie_word_embeddings"] else "qlora"
    run_dir, ids, want, _ = _trained(tmp_path, grown, method, process_group)
    export_hf(run_dir, tmp_path / "hf", merge=method == "qlora")
    assert torch.allclose(_hf_logits(tmp_path / "hf", ids), want, rtol=0, atol=1e-5)


def test_dpo_with_an_adapters_off_reference_on_a_grown_vocabulary_is_refused(grown):
    """The embedding and output rows train whole under LoRA, and adapters_off does not switch them off: that
    reference would drift. One line; a precomputed reference (the model as built) is accepted."""
    from torch_handle.data.chat.pairs import prepare_preference
    from torch_handle.errors import PresetError

    base, data, _ = grown
    chats = _conversations()
    rows = data.parent / "pairs.jsonl"
    rows.write_text("".join(json.dumps({"prompt": c[-2]["content"], "chosen": c[-1]["content"],
                                        "rejected": chats[i - 1][-1]["content"]}) + "\n"
                            for i, c in enumerate(chats)), encoding="utf-8")
    pairs = data.parent / "pairs"
    assert prepare_preference([str(rows)], pairs, tokenizer=base, template="chatml", valid_fraction=0.25,
                              max_len=SEQ)["added_tokens"]
    path = _preset_file(data.parent / "dpo", base, pairs)
    path.write_text(path.read_text().replace('objective = "sft"', 'objective = "dpo"'), encoding="utf-8")
    with pytest.raises(PresetError, match=r"adds <\|im_start\|>, <\|im_end\|> to model.init_from's tokenizer, so "
                                          r"LoRA trains embed_tokens and lm_head whole.*'precomputed'"):
        load_preset(path)
    assert load_preset(path, ["finetune.preference.reference=precomputed"]).finetune.method == "lora"
