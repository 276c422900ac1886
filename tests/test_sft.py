"""Supervised fine-tuning on conversations (``[finetune] objective = "sft"``, issue 46) in this process: a
Llama-shaped base written by transformers, conversations from ../shared/data prepared with ``--chat``, packed
best-fit-decreasing with document masks. The step-0 validation loss equals transformers' own computation (the mean
cross-entropy over the trained tokens of the same conversations, each run alone, unpacked); the training losses
are the global batch's mean over trained tokens whatever the micro-batching (grad_accum 1 and 4)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[dev,hf]'")

from tests.unit.test_chat_template import _conversations  # noqa: E402
from tests.unit.test_trainer_step import _events, _train, fake_peak, process_group  # noqa: E402,F401
from torch_handle.config.loader import dump_preset, load_preset  # noqa: E402
from torch_handle.data.chat.packing import PackedConversations, best_fit_decreasing  # noqa: E402
from torch_handle.data.chat.prepare import prepare_chat  # noqa: E402
from torch_handle.data.datasets import train_tokenizer  # noqa: E402
from torch_handle.data.shards import open_prepared  # noqa: E402
from torch_handle.launch.run import check_inputs  # noqa: E402
from torch_handle.errors import PresetError  # noqa: E402
from torch_handle.rundir import create_run_dir  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SEQ = 48


def write_base(base: Path) -> Path:
    """A random LlamaForCausalLM saved by transformers at ``base`` with a ChatML tokenizer (a byte-level BPE trained
    on Tiny Shakespeare, plus <|im_start|> and <|im_end|>)."""
    base.mkdir(parents=True)
    tok = train_tokenizer([(DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:100_000]], 500)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<pad>",
                                                            "tokenizer_class": "PreTrainedTokenizerFast"}))
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(base)
    return base


def write_conversations(root: Path, base: Path) -> Path:
    """The 80 conversations of tests/unit/test_chat_template.py prepared with ``--template chatml`` at
    ``root/data`` (a quarter held out)."""
    rows = root / "chat.jsonl"
    rows.write_text("".join(json.dumps({"messages": m}) + "\n" for m in _conversations()), encoding="utf-8")
    prepare_chat([str(rows)], root / "data", tokenizer=base, template="chatml", valid_fraction=0.25, max_len=SEQ)
    return root / "data"


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> tuple[Path, Path]:
    """``(base, data)``: a base written by transformers and 80 conversations prepared with its tokenizer."""
    root = tmp_path_factory.mktemp("sft")
    base = write_base(root / "base")
    return base, write_conversations(root, base)


def _preset(tmp_path: Path, chat, *, micro_batch_size: int, grad_accum: int, steps: int, eval_steps: int = 100):
    return load_preset(preset_file(tmp_path, chat, micro_batch_size=micro_batch_size, grad_accum=grad_accum,
                                   steps=steps, eval_steps=eval_steps))


def preset_file(tmp_path: Path, chat, *, micro_batch_size: int, grad_accum: int, steps: int, eval_steps: int = 100
                ) -> Path:
    """The SFT preset on ``chat`` (base, data), written at ``tmp_path`` (tests/test_dpo.py makes it a DPO one)."""
    base, data = chat
    text = f"""
[run]
output_dir = "{tmp_path / 'runs'}"
[model]
norm = "rmsnorm"
position = "rope"
mlp = "swiglu"
norm_first = true
scale_embeddings = false
bias = false
d_model = 32
n_heads = 2
n_layers = 1
d_ff = 48
dropout = 0.0
init_from = "{base}"
[data]
name = "tokens"
path = "{data}"
seq_len = {SEQ}
[training]
steps = {steps}
micro_batch_size = {micro_batch_size}
grad_accum = {grad_accum}
precision = "fp32"
eval_every = {steps}
eval_steps = {eval_steps}
log_every = 1
warmup_steps = 0
lr = 0.003
[finetune]
objective = "sft"
"""
    path = tmp_path / f"p{micro_batch_size}x{grad_accum}.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_packing_is_best_fit_decreasing_and_never_splits():
    lengths = np.array([30, 5, 20, 18, 10, 7, 40])
    bins = best_fit_decreasing(lengths, 48)
    assert sorted(i for b in bins for i in b) == list(range(7)) and all(lengths[b].sum() <= 48 for b in bins)
    # 40 (room 8), 30 (18), 20 (28); 18 fills 30's exactly; 10 -> 20's (18 left); 7 -> 40's (8: the least room
    # that holds it); 5 -> 20's (40's has 1 left)
    assert bins == [[6, 5], [0, 3], [2, 4, 1]]


def test_step_0_validation_loss_is_transformers_on_the_trained_tokens(chat, tmp_path, process_group):
    base, data = chat
    preset = _preset(tmp_path, chat, micro_batch_size=2, grad_accum=1, steps=1)
    run_dir = create_run_dir(tmp_path / "runs", "sft", dump_preset(preset), {"status": "starting"})
    assert _train(preset, run_dir, process_group) == "finished"
    step0 = next(e for e in _events(run_dir) if e["kind"] == "eval")["val_loss"]

    prepared = open_prepared(data)
    valid = PackedConversations(prepared.valid, SEQ, fill_id=prepared.eos_id)
    assert valid.efficiency > 0.7 and len(valid) >= 2
    evaluated = [d for i in range(len(valid) // 2 * 2) for d in valid.samples[i]]  # micro-batches of 2, remainder dropped
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for d in evaluated:  # each conversation alone: no packing, no document mask
        start, stop = int(valid.starts[d]), int(valid.starts[d]) + int(valid.positions[d]) + 1
        ids, trained = prepared.valid.window(start, stop), prepared.valid.mask(start, stop)
        with torch.no_grad():
            logits = model(torch.from_numpy(ids)[None]).logits[0, :-1].double()
        labels = torch.from_numpy(ids[1:])
        keep = torch.from_numpy(trained[1:])
        total += float(torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum"))
        count += int(keep.sum())
    assert count > 0 and step0 == pytest.approx(total / count, abs=1e-5)

    # the trained run answers as transformers' greedy generate on its export (same prompt, same tokens)
    from click.testing import CliRunner

    from handle_cli.main import cli
    from torch_handle.infer.hf_export import export_hf

    assert (run_dir / "chat_template.jinja").read_text() == (data / "chat_template.jinja").read_text()
    export_hf(run_dir, tmp_path / "export")  # with the template and a generation_config.json
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    im_end = hf_tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in trained.generation_config.eos_token_id
    for message in ("Translate: Two dogs run.", "Name a color."):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": message}]
        prompt = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        with torch.no_grad():
            out = trained.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                                   pad_token_id=im_end)[0, len(prompt):].tolist()
        want = hf_tok.decode(out[:out.index(im_end)] if im_end in out else out)
        res = CliRunner().invoke(cli, ["generate", str(run_dir), "--chat", message, "--system", "Be brief.",
                                       "--temperature", "0", "--max-new-tokens", "12"])
        assert res.exit_code == 0 and res.output == want + "\n", (res.output, want)
    res = CliRunner().invoke(cli, ["chat", str(run_dir), "--system", "Be brief.", "--max-new-tokens", "12"],
                             input="Name a color.\n\n")
    assert res.exit_code == 0 and want in res.output, res.output


def test_the_loss_is_the_global_mean_over_trained_tokens_for_any_accumulation(chat, tmp_path, process_group):
    losses, trained = {}, {}
    for mb, ga in ((4, 1), (1, 4)):
        preset = _preset(tmp_path, chat, micro_batch_size=mb, grad_accum=ga, steps=3, eval_steps=1)
        run_dir = create_run_dir(tmp_path / "runs", f"sft{mb}x{ga}", dump_preset(preset), {"status": "starting"})
        assert _train(preset, run_dir, process_group) == "finished"
        steps = [e for e in _events(run_dir) if e["kind"] == "step"]
        losses[(mb, ga)] = [e["loss"] for e in steps]
        trained[(mb, ga)] = [e["trained_tokens"] for e in steps]
        # the step events: the positions computed (4 samples of SEQ), the trained ones among them
        assert all(e["tokens"] == 4 * SEQ and 0 < e["trained_tokens"] < e["tokens"] for e in steps)
        assert all(e["trained_share"] == e["trained_tokens"] / e["tokens"] for e in steps)
        assert all(e["trained_tokens_per_s"] == pytest.approx(e["trained_tokens"] / e["step_time_s"]) for e in steps)
    assert len(losses[(4, 1)]) == 3 and trained[(4, 1)] == trained[(1, 4)]
    assert losses[(4, 1)] == pytest.approx(losses[(1, 4)], abs=1e-6)
    assert losses[(4, 1)][0] != pytest.approx(losses[(4, 1)][2], abs=1e-3)  # it trains


def test_sft_needs_conversations_and_takes_every_layout(chat, tmp_path):
    preset = _preset(tmp_path, chat, micro_batch_size=2, grad_accum=1, steps=1)
    text = (tmp_path / "p2x1.toml").read_text()
    (tmp_path / "bad.toml").write_text(text.replace('name = "tokens"', 'name = "pydoc"').replace(
        f'path = "{chat[1]}"\n', ""))
    with pytest.raises(PresetError, match="objective = 'sft' trains on .*prepared with .handle data prepare --chat."):
        load_preset(tmp_path / "bad.toml")
    for split in (("parallel.tp=2",), ("parallel.pp=2", "parallel.pp_microbatches=2")):  # tests/test_objectives_split
        load_preset(tmp_path / "p2x1.toml", (*split, "launch.nproc_per_node=2", "model.n_layers=2"))
    check_inputs(preset)
