"""The Hugging Face round trip on real runs: a tiny Llama-shaped decoder trained by ``handle run`` (2 ranks, DDP,
3 steps) exports with ``handle export --format hf`` to a directory that ``transformers`` loads with the run's own
logits and tokenizer; the same training under FSDP2 exports the same directory (and its sharded checkpoint exports
the same tensors as its final weights), and so do a tp 2 and a pp 2 run's; a run started with ``[model] init_from`` on the export (FSDP2, so the
weights go in before the model is sharded) starts at the loss the exporter ended on; and every refusal is one
line, exit 2, with nothing written or started. That a resume ignores init_from: tests/unit/test_trainer_step.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from handle_cli.main import cli
from tests.helpers import tiny_preset

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[dev,hf]'")

pytestmark = pytest.mark.dist

STEPS = 3
LLAMA = """norm = "rmsnorm"
position = "rope"
rope_theta = 500000.0
mlp = "swiglu"
n_kv_heads = 2
bias = false
scale_embeddings = false
norm_first = true
tie_embeddings = false
"""
TEXT = "def f(x):\n    return x + 1  # the docs of the with statement\n\nclass A:\n    pass"


def handle(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "handle_cli", *args], capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"handle {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_dir_of(proc: subprocess.CompletedProcess) -> Path:
    return Path(next(ln for ln in proc.stdout.splitlines() if ln.startswith("run directory: ")).split(": ", 1)[1])


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def last_eval(run_dir: Path) -> tuple[int, float]:
    last = events(run_dir, "eval")[-1]
    return last["step"], last["val_loss"]


@pytest.fixture(scope="module")
def rt(tmp_path_factory) -> dict[str, Path]:
    """The preset; run ``ddp`` and its export ``out``; run ``fsdp`` (the same training, sharded) and its exports of
    the final weights and of checkpoint 3; runs ``tp`` (tp 2: dp 1, the hand-written TP) and ``pp`` (pp 2), exported
    from the final weights and from checkpoint 3; run ``init`` (FSDP2, 1 step) started from ``out``."""
    root = tmp_path_factory.mktemp("hf")
    preset = root / "llama.toml"
    preset.write_text(tiny_preset(root / "runs", steps=STEPS, log_every=1).replace("[model]\n", "[model]\n" + LLAMA)
                      .replace("eval_every = 0\n", "eval_every = 0\neval_steps = 2\n"))
    found = {"preset": preset, "ddp": run_dir_of(handle("run", str(preset), "--set", "run.name=ddp"))}
    found["fsdp"] = run_dir_of(handle("run", str(preset), "--set", "run.name=fsdp", "--set", "strategy.name=fsdp"))
    found["tp"] = run_dir_of(handle("run", str(preset), "--set", "run.name=tp", "--set", "parallel.tp=2"))
    found["pp"] = run_dir_of(handle("run", str(preset), "--set", "run.name=pp", "--set", "parallel.pp=2",
                                    "--set", "parallel.pp_microbatches=2"))
    found["out"] = root / "export" / "ddp"
    exports = {"out": ("ddp", []), "fsdp-final": ("fsdp", []), "fsdp-ckpt": ("fsdp", ["--checkpoint", str(STEPS)]),
               **{f"{run}-{kind}": (run, extra) for run in ("tp", "pp")
                  for kind, extra in (("final", []), ("ckpt", ["--checkpoint", str(STEPS)]))}}
    for name, (run, extra) in exports.items():  # in this process: the same command, without a torch import each
        found[name] = root / "export" / name
        result = _invoke("export", str(found[run]), "--format", "hf", str(found[name]), *extra)
        assert result.exit_code == 0, result.output
    found["init"] = run_dir_of(handle("run", str(preset), "--set", "run.name=init", "--set", "strategy.name=fsdp",
                                      "--set", "training.steps=1", "--set", f"model.init_from={found['out']}"))
    return found


def _invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def test_the_export_loads_in_transformers_with_the_runs_logits(rt):
    from torch_handle.infer.generate import load_run, sample

    out = rt["out"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_run(rt["ddp"])
    assert type(model).__name__ == "LlamaForCausalLM"
    ids = ours.tokenizer.encode(TEXT).ids
    assert tokenizer(TEXT)["input_ids"] == ids and tokenizer.decode(ids) == TEXT
    assert (tokenizer.bos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<bos>", 2, 0)
    batch = torch.tensor([ids[:32]])
    with torch.no_grad():
        theirs, mine = model(batch).logits, ours.model(batch)
    assert (theirs - mine).abs().max().item() <= 1e-5
    greedy = list(sample(ours.model, ids[:8], 6, temperature=0.0))
    with torch.no_grad():
        generated = model.generate(torch.tensor([ids[:8]]), max_new_tokens=6, do_sample=False)
    assert generated[0, 8:].tolist() == greedy
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"] == 500000.0
    assert model.config.num_key_value_heads == 2 and model.config.tie_word_embeddings is False
    assert (config["torch_dtype"], config["vocab_size"]) == ("float32", ours.tokenizer.get_vocab_size())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    assert sum(p.numel() for p in model.parameters()) == ours.model.num_params()


def test_handle_generate_continues_a_rope_run_as_transformers_does(rt):
    """``handle generate`` on the Llama-shaped run (RoPE positions continued from the KV cache's length) prints
    the greedy continuation that the exported model's ``generate`` gives."""
    from torch_handle.infer.generate import load_run

    ours = load_run(rt["ddp"])
    prompt = TEXT[:12]
    ids = ours.tokenizer.encode(prompt).ids
    model = transformers.AutoModelForCausalLM.from_pretrained(rt["out"]).eval()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0].tolist()
    result = _invoke("generate", str(rt["ddp"]), prompt, "--max-new-tokens", "8", "--temperature", "0")
    assert result.exit_code == 0, result.output
    assert result.output.rstrip("\n") == ours.tokenizer.decode(theirs)


def test_a_sharded_run_exports_the_same_directory(rt):
    """FSDP2's final weights (gathered by rank 0) and its sharded checkpoint (consolidated by the export) give
    identical files; against the DDP run, identical but for the strategies' summation order (1e-6)."""
    final, ckpt = rt["fsdp-final"], rt["fsdp-ckpt"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (final / name).read_bytes() == (ckpt / name).read_bytes() == (rt["out"] / name).read_bytes(), name
    assert sorted(p.name for p in final.iterdir()) == sorted(p.name for p in rt["out"].iterdir())
    a, b, ddp = hf_tensors(final), hf_tensors(ckpt), hf_tensors(rt["out"])
    assert sorted(a) == sorted(b) == sorted(ddp)
    for key in a:
        assert torch.equal(a[key], b[key]), key
        torch.testing.assert_close(a[key], ddp[key], rtol=0, atol=1e-6, msg=key)


def test_tensor_and_pipeline_parallel_runs_export_the_same_directory(rt):
    """A tp 2 and a pp 2 run (dp 1: a global batch of their own, so weights of their own): the final weights
    (gathered by the trainer) and checkpoint 3 (consolidated from the TP shards or the stages by the export) give
    bit-identical tensors, the config and tokenizer files of every other export, and transformers' model of the
    export computes the run's own logits."""
    from torch_handle.infer.generate import load_run

    batch = torch.tensor([load_run(rt["ddp"]).tokenizer.encode(TEXT).ids[:32]])
    for run in ("tp", "pp"):
        final, ckpt = rt[f"{run}-final"], rt[f"{run}-ckpt"]
        for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (final / file).read_bytes() == (ckpt / file).read_bytes() == (rt["out"] / file).read_bytes()
        a, b = hf_tensors(final), hf_tensors(ckpt)
        assert sorted(a) == sorted(b) == sorted(hf_tensors(rt["out"])), run
        for key in a:
            assert torch.equal(a[key], b[key]), (run, key)
        model = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
        with torch.no_grad():
            theirs, mine = model(batch).logits, load_run(rt[run]).model(batch)
        assert (theirs - mine).abs().max().item() <= 1e-5, run


def test_init_from_starts_where_the_exporter_ended(rt):
    step, exported = last_eval(rt["ddp"])
    assert step == STEPS
    first = events(rt["init"], "eval")[0]
    assert first["step"] == 0 and abs(first["val_loss"] - exported) <= 1e-6
    logs = [e["message"] for e in events(rt["init"], "log")]
    assert f"init_from: weights from {rt['out']} (llama, " in "\n".join(logs)


@pytest.mark.parametrize("key, value, needs", [
    ("position", '"sinusoidal"', "position = 'rope'"), ("norm", '"layernorm"', "norm = 'rmsnorm'"),
    ("mlp", '"gelu"', "mlp = 'swiglu'"), ("norm_first", "false", "norm_first = True"),
    ("scale_embeddings", "true", "scale_embeddings = False")])
def test_a_model_transformers_cannot_express_is_refused(rt, tmp_path, key, value, needs):
    run = tmp_path / "run"
    shutil.copytree(rt["ddp"], run, ignore=shutil.ignore_patterns("checkpoints", "logs"))
    preset = (run / "preset.toml").read_text()
    line = next(ln for ln in preset.splitlines() if ln.startswith(f"{key} = "))
    (run / "preset.toml").write_text(preset.replace(line + "\n", f"{key} = {value}\n"))
    result = _invoke("export", str(run), str(tmp_path / "out"))
    shown = value.strip('"') if value.startswith('"') else value.capitalize()
    shown = f"'{shown}'" if value.startswith('"') else shown
    assert result.exit_code == 2
    assert result.stderr == (f"error: {run}: cannot export to Hugging Face format: LlamaForCausalLM needs "
                             f"model.{needs} (not {shown})\n")
    assert not (tmp_path / "out").exists()


def test_the_hf_plugins_runs_are_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "preset.toml").write_text('[model]\nname = "hf"\narchitecture = "opt"\n')
    result = _invoke("export", str(run), str(tmp_path / "out"))
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    assert result.stderr == (f"error: {run}: cannot export to Hugging Face format: model.name = 'hf' (only the "
                             f"from-scratch 'transformer' maps; the 'hf' plugin's models are transformers models "
                             f"already)\n")


def test_out_is_replaced_only_when_forced_and_a_model_directory(rt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = _invoke("export", str(rt["ddp"]), str(out))
    assert result.exit_code == 2 and "not empty (give --force" in result.stderr
    result = _invoke("export", str(rt["ddp"]), str(out), "--force")
    assert result.exit_code == 2 and "not a Hugging Face model directory (no config.json)" in result.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    shutil.rmtree(out)
    shutil.copytree(rt["out"], out)
    result = _invoke("export", str(rt["ddp"]), str(out), "--force", "--dtype", "bfloat16", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert (info["architecture"], info["model_type"], info["dtype"], info["step"]) == (
        "LlamaForCausalLM", "llama", "bfloat16", STEPS)
    assert info["directory"] == str(out) and info["params"] > 0
    assert all(t.dtype == torch.bfloat16 for t in hf_tensors(out).values())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_init_from_mismatches_stop_before_anything_starts(rt, no_launch):
    runs = rt["preset"].parent / "runs"
    before = sorted(runs.iterdir())
    out = rt["out"]
    result = _invoke("run", str(rt["preset"]), "--set", f"model.init_from={out}", "--set", "model.n_kv_heads=4")
    assert result.exit_code == 2
    assert result.stderr == f"error: model.n_kv_heads = 4 but {out}/config.json has num_key_value_heads = 2\n"
    cases = {"model.rope_theta=10000.0": f"model.rope_theta = 10000.0 but {out}/config.json has "
                                         f"rope_parameters.rope_theta = 500000.0",
             "model.tie_embeddings=true": f"model.tie_embeddings = True but {out}/config.json has "
                                          f"tie_word_embeddings = False",
             "data.vocab_size=300": f"data.vocab_size = 300 but {out}/config.json has vocab_size = 512 (the run's "
                                    f"tokenizer has at most data.vocab_size tokens)"}
    for override, message in cases.items():
        result = _invoke("validate", str(rt["preset"]), "--set", f"model.init_from={out}", "--set", override)
        assert (result.exit_code, result.stderr) == (2, f"error: {message}\n"), override
    result = _invoke("validate", str(rt["preset"]), "--set", f"model.init_from={out}-missing")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: model.init_from: {out}-missing: no such directory")
    assert sorted(runs.iterdir()) == before
