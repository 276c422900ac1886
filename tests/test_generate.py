"""``handle generate``, ``translate`` and ``eval`` on real (tiny) runs, trained in this process by the real
``Trainer`` (strategy single, a gloo group of world size 1, a few steps: seconds), and their bad inputs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from handle_cli.main import cli
from torch_handle.config.loader import dump_preset, load_preset
from torch_handle.data.corpus import pydoc_corpus
from torch_handle.registry import get_registry
from torch_handle.rundir import create_run_dir
from torch_handle.train.strategy import DistContext
from torch_handle.train.trainer import Trainer
from torch_handle.launch.run import prepare_data

from tests.helpers import parallel_corpus


def _preset_text(tmp: Path, kind: str) -> str:
    if kind == "decoder":
        corpus = tmp / "corpus.txt"
        corpus.write_text("\n\n".join(pydoc_corpus())[:40_000], encoding="utf-8")
        model = 'kind = "decoder"'
        data = f'name = "text"\npath = "{corpus}"\nseq_len = 16\nvocab_size = 300'
    else:
        model = 'kind = "encoder-decoder"'
        data = f'name = "parallel"\npath = "{parallel_corpus(tmp / "pairs")}"\nseq_len = 16\nvocab_size = 300'
    return f"""
[run]
output_dir = "{tmp / 'runs'}"
[model]
{model}
d_model = 32
n_heads = 2
n_layers = 1
d_ff = 64
[data]
{data}
[training]
steps = 3
micro_batch_size = 4
precision = "fp32"
eval_every = 0
eval_steps = 1
log_every = 1
warmup_steps = 0
lr = 0.01
checkpoint_every = 2
keep_last = 5
[strategy]
name = "single"
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A finished tiny decoder run and a finished tiny translation run (each with checkpoints 2 and 3)."""
    tmp = tmp_path_factory.mktemp("gen")
    peak = tmp / "peak.json"
    from torch_handle.observe import peak as peak_mod
    key = peak_mod.device_key("cpu", torch.get_num_threads())
    peak.write_text(json.dumps({key: {"device": "cpu", "fp32": 1e12, "bf16": 2e12, "fp16": 3e12}}))
    mp = pytest.MonkeyPatch()
    mp.setenv("HANDLE_PEAK_CACHE", str(peak))
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    out = {}
    try:
        for kind in ("decoder", "encoder-decoder"):
            path = tmp / f"{kind}.toml"
            path.write_text(_preset_text(tmp, kind), encoding="utf-8")
            preset = load_preset(path)
            run_dir = create_run_dir(tmp / "runs", kind, dump_preset(preset), {"status": "starting"})
            prepare_data(preset)  # what the launcher does before the workers start
            trainer = Trainer(preset, run_dir, ctx, get_registry())
            trainer.build()
            status = trainer.train()
            trainer.close(status)
            assert status == "finished"
            out[kind] = run_dir
    finally:
        dist.destroy_process_group()
        mp.undo()
    return out


def _invoke(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_generate_prints_n_tokens(runs):
    res = _invoke("generate", runs["decoder"], "The", "--max-new-tokens", "12", "--seed", "0")
    assert res.exit_code == 0, res.output
    assert res.output.startswith("The")
    again = _invoke("generate", runs["decoder"], "The", "--max-new-tokens", "12", "--seed", "0")
    assert again.output == res.output  # a seed reproduces
    greedy = _invoke("generate", runs["decoder"], "--max-new-tokens", "5", "--temperature", "0",
                     "--checkpoint", "2")
    assert greedy.exit_code == 0, greedy.output


def test_generate_streams_tokens_as_they_are_produced(runs):
    """A real process: the output arrives in pieces (one write per token), and exactly N tokens come out."""
    from tokenizers import Tokenizer

    n = 20
    proc = subprocess.Popen([sys.executable, "-m", "handle_cli", "generate", str(runs["decoder"]), "--max-new-tokens",
                             str(n), "--temperature", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reads = []
    while chunk := proc.stdout.read1(65536):
        reads.append(chunk)
    assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    text = b"".join(reads).decode()
    assert len(reads) >= 2, reads  # streamed, not printed once at the end
    tok = Tokenizer.from_file(str(runs["decoder"] / "tokenizer.json"))
    # greedy from an empty prompt, recomputed here: the same N tokens, decoded
    from torch_handle.infer.generate import load_run, sample

    loaded = load_run(runs["decoder"])
    ids = list(sample(loaded.model, [], n, temperature=0.0))
    assert len(ids) == n
    expected = "\n\n".join(tok.decode(part) for part in _split_eos(ids))
    assert text.rstrip("\n") == expected.rstrip("\n")


def _split_eos(ids: list[int]) -> list[list[int]]:
    parts: list[list[int]] = [[]]
    for i in ids:
        if i == 2:
            parts.append([])
        else:
            parts[-1].append(i)
    return parts


def test_translate_greedy_beam_and_input_file(runs, tmp_path):
    run = runs["encoder-decoder"]
    one = _invoke("translate", run, "a big dog runs", "--beam", "1")
    assert one.exit_code == 0, one.output
    assert len(one.output.splitlines()) == 1
    src = tmp_path / "in.en"
    src.write_text("a dog\nthe cat sleeps\nsmall red man eats\n", encoding="utf-8")
    res = _invoke("translate", run, "--input", src, "--beam", "3", "--max-len", "10")
    assert res.exit_code == 0, res.output
    assert len(res.output.splitlines()) == 3


def test_eval_json_reports_bleu_and_chrf_for_translation(runs):
    res = _invoke("eval", runs["encoder-decoder"], "--split", "test", "--json", "--beam", "2")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert {"bleu", "chrf", "loss", "perplexity", "bleu_signature"} <= set(out)
    assert out["split"] == "test" and out["sentences"] == 12
    assert 0.0 <= out["bleu"] <= 100.0 and 0.0 <= out["chrf"] <= 100.0
    assert out["perplexity"] == pytest.approx(2.718281828 ** out["loss"], rel=1e-3)
    valid = json.loads(_invoke("eval", runs["encoder-decoder"], "--json", "--beam", "1").output)
    assert valid["split"] == "valid" and valid["sentences"] == 20


def test_eval_lm_loss_matches_the_runs_last_validation(runs):
    res = _invoke("eval", runs["decoder"], "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert "bleu" not in out and out["kind"] == "decoder" and out["tokens"] > 0
    events = [json.loads(line) for line in (runs["decoder"] / "events.jsonl").read_text().splitlines()]
    last = [e for e in events if e["kind"] == "eval"][-1]["val_loss"]
    # the trainer evaluates eval_steps=1 batch, eval the whole split: close, not equal
    assert abs(out["loss"] - last) < 1.0, (out["loss"], last)
    text = _invoke("eval", runs["decoder"])
    assert text.exit_code == 0 and text.output.startswith("valid: loss ")


def _one_error_line(res) -> str:
    assert res.exit_code == 2, (res.exit_code, res.output)
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


def test_bad_inputs_are_one_line_and_exit_2(runs, tmp_path):
    assert "not a run directory" in _one_error_line(_invoke("generate", tmp_path / "nope"))
    assert "not a run directory" in _one_error_line(_invoke("eval", tmp_path))
    line = _one_error_line(_invoke("generate", runs["encoder-decoder"], "hello"))
    assert "encoder-decoder run" in line and "handle translate" in line
    assert "handle generate" in _one_error_line(_invoke("translate", runs["decoder"], "hello"))
    assert "no such checkpoint (available: 2, 3)" in _one_error_line(
        _invoke("generate", runs["decoder"], "--checkpoint", "7"))
    assert "give either TEXT or --input FILE" in _one_error_line(_invoke("translate", runs["encoder-decoder"]))
    assert "only a validation split" in _one_error_line(_invoke("eval", runs["decoder"], "--split", "test"))

    # a copy without weights, and one whose checkpoint is in another strategy's format
    bare = tmp_path / "bare"
    shutil.copytree(runs["decoder"], bare)
    (bare / "model.safetensors").unlink()
    assert "no model.safetensors (the run has not finished); checkpoints: 2, 3 (use --checkpoint STEP)" in \
        _one_error_line(_invoke("generate", bare))
    step = bare / "checkpoints" / "step-3"
    (step / "model.pt").unlink()
    (step / "ds").mkdir()
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"].pop("model.pt")
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert "DeepSpeed checkpoint (ds/): use the run's model.safetensors" in _one_error_line(
        _invoke("generate", bare, "--checkpoint", "3"))
    (bare / "model.safetensors").write_bytes(b"not safetensors")
    assert "model.safetensors: cannot be read" in _one_error_line(_invoke("generate", bare))


@pytest.mark.dist
def test_fsdp_checkpoint_loads_the_final_weights(tmp_path):
    """A real 2-process FSDP2 run (torchrun, gloo): its sharded dcp/ checkpoint of the last step, consolidated in
    this process, holds exactly the weights of model.safetensors."""
    from tests.helpers import tiny_preset
    from torch_handle.infer.generate import load_run

    preset = tmp_path / "fsdp.toml"
    preset.write_text(tiny_preset(tmp_path / "runs", steps=2, strategy="fsdp"), encoding="utf-8")
    run_dir = tmp_path / "runs" / "f"
    proc = subprocess.run([sys.executable, "-m", "handle_cli", "run", str(preset), "--run-dir", str(run_dir),
                           "--set", "training.checkpoint_every=2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    final, ckpt = load_run(run_dir).model.state_dict(), load_run(run_dir, checkpoint=2).model.state_dict()
    assert final.keys() == ckpt.keys() and all(torch.equal(final[k], ckpt[k]) for k in final)
    res = _invoke("generate", run_dir, "The", "--checkpoint", "2", "--max-new-tokens", "3")
    assert res.exit_code == 0, res.output
