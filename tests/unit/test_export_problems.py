"""Export problems at once (issue 38): ``handle export --format hf`` names every option the closest Hugging Face
class cannot express, with the value each needs, in one line; ``handle validate --target hf`` says the same before
training, one located line per option; and the shipped ``presets/moe.toml`` is a Qwen 3 MoE model that exports
and loads in ``transformers`` (built from its config here, nothing downloaded) with our logits.
In-process: a run directory needs only its preset.toml to be refused, and the export check reads nothing else."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from handle_cli.main import cli
from torch_handle.config.loader import dump_preset, load_preset

REPO = Path(__file__).resolve().parents[2]
THREE = ["model.position=sinusoidal", "model.norm=layernorm", "model.scale_embeddings=true"]
"""Three options of presets/llama.toml that LlamaForCausalLM cannot express."""


def _sets(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture
def runner(monkeypatch, no_launch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("HANDLE_DEBUG", raising=False)
    return CliRunner()


def test_export_names_all_three_inexpressible_options_in_one_line(runner, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "preset.toml").write_text(dump_preset(load_preset("presets/llama.toml", THREE)))
    result = runner.invoke(cli, ["export", str(run), "--format", "hf", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"error: {run}: cannot export to Hugging Face format: LlamaForCausalLM needs "
                             f"model.position = 'rope' (not 'sinusoidal'); model.norm = 'rmsnorm' (not 'layernorm'); "
                             f"model.scale_embeddings = False (not True)\n")
    assert not (tmp_path / "out").exists()


def test_validate_target_hf_says_before_training_whether_a_run_will_export(runner):
    result = runner.invoke(cli, ["validate", "presets/llama.toml", "--target", "hf", *_sets(THREE)])
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr.splitlines() == [
        "error: presets/llama.toml (--set): model.position: 'sinusoidal': LlamaForCausalLM needs 'rope'",
        "error: presets/llama.toml (--set): model.norm: 'layernorm': LlamaForCausalLM needs 'rmsnorm'",
        "error: presets/llama.toml (--set): model.scale_embeddings: True: LlamaForCausalLM needs False"]
    result = runner.invoke(cli, ["validate", "presets/llama.toml", *_sets(THREE)])  # no target: a valid preset
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["validate", "presets/single.toml", "--target", "hf", "--json"])
    assert result.exit_code == 2
    out = json.loads(result.stdout)
    assert not out["ok"] and [p["key"] for p in out["problems"]] == [
        "model.position", "model.norm", "model.mlp", "model.scale_embeddings"]
    assert out["problems"][2] == {"file": "presets/single.toml", "line": 5, "key": "model.mlp",
                                  "message": "'gelu': LlamaForCausalLM needs 'swiglu'"}
    result = runner.invoke(cli, ["validate", "presets/moe.toml", "--target", "hf"])
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith("exports as Qwen3MoeForCausalLM (handle export RUN --format hf OUT)\n")


@pytest.mark.skipif(not os.environ.get("CI") and not __import__("importlib").util.find_spec("transformers"),
                    reason="needs the hf extra: pip install -e '.[dev,hf]'")
def test_the_moe_preset_exports_as_qwen3_moe_with_our_logits(tmp_path, monkeypatch):
    """The shipped preset's [model] as the plugin builds it (random weights, dropout off), written as ``handle
    export`` writes it: transformers' Qwen3MoeForCausalLM of that directory computes our logits."""
    import dataclasses

    import transformers

    from torch_handle.checkpoint import hf_dir
    from torch_handle.model.hf_names import to_hf_config, to_hf_state_dict
    from torch_handle.model.transformer import DecoderLM

    monkeypatch.chdir(REPO)
    preset = load_preset("presets/moe.toml")
    options = preset.model.options
    assert (options.n_experts, options.top_k, options.moe_every, options.qk_norm) == (8, 2, 2, True)
    torch.manual_seed(0)
    args = dataclasses.replace(_args(preset), dropout=0.0)
    ours = DecoderLM(args).eval()
    with torch.no_grad():  # every parameter random: a gain left at 1 would hide a misplaced one
        for name, p in ours.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    config = to_hf_config(args)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["decoder_sparse_step"] == 2
    hf_dir.write(tmp_path / "m", config, to_hf_state_dict(ours.state_dict(), args), None, {}, dtype="float32",
                 metadata={})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    assert sum(p.numel() for p in theirs.parameters()) == ours.num_params()
    ids = torch.randint(1, args.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(input_ids=ids).logits, atol=1e-5, rtol=0)


def _args(preset):
    """The preset's ``TransformerArgs`` as the plugin builds them, with a small vocabulary."""
    from torch_handle.registry import get_registry

    with torch.device("meta"):
        model = get_registry().get("model", preset.model.name).factory(preset.model.options, 97, 0, 64)
    return model.args
