"""Every preset problem at once (issue 29): ``handle validate`` and ``handle run`` print one line per problem,
structure first (the model's shape, then the layout, then the details), and exit 2 with nothing started.
In-process (click's CliRunner), no torch for the checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from handle_cli.main import cli

REPO = Path(__file__).resolve().parents[2]

THREE = """\
[run]
output_dir = "out"
[training]
lr = 0.0
micro_batch_size = 4
grad_accum = 2
[strategy]
name = "deepspeed"
[parallel]
pp = 2
[launch]
nproc_per_node = 2
[model]
d_model = 64
n_heads = 3
n_layers = 2
d_ff = 128
"""
"""Three independent mistakes, written details first: a detail (training.lr), a layout mistake that spans tables
(deepspeed has no pipeline split) and the model's shape (3 heads do not divide d_model = 64)."""


@pytest.fixture
def runner(tmp_path, monkeypatch, no_launch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HANDLE_DEBUG", raising=False)
    return CliRunner()


@pytest.mark.parametrize("command", ["validate", "run"])
def test_three_independent_mistakes_are_reported_together_structure_first(runner, tmp_path, command):
    (tmp_path / "p.toml").write_text(THREE)
    result = runner.invoke(cli, [command, "p.toml"])
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "error: p.toml:15: model.n_heads: 3 does not divide d_model=64 (or give head_dim)",
        "error: p.toml:8: strategy.name: 'deepspeed' does not support parallel.pp = 2 (valid with pp > 1: ddp, "
        "fsdp, scratch-ddp, single)",
        "error: p.toml:4: training.lr: 0.0 must be > 0.0",
    ]
    assert not (tmp_path / "out").exists()  # nothing started


def test_each_mistake_alone_is_the_one_line(runner, tmp_path):
    """The three are independent: fixing any two leaves the third alone; fixing all three gives a valid preset."""
    fixes = {"model.n_heads": "model.n_heads=4", "strategy.name": "strategy.name=ddp",
             "training.lr": "training.lr=0.01"}
    (tmp_path / "p.toml").write_text(THREE)
    for key in fixes:
        others = [a for other, f in fixes.items() if other != key for a in ("--set", f)]
        result = runner.invoke(cli, ["validate", "p.toml", *others])
        assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1, result.stderr
        assert f": {key}: " in result.stderr
    result = runner.invoke(cli, ["validate", "p.toml", *[a for f in fixes.values() for a in ("--set", f)]])
    assert result.exit_code == 0, result.stderr
    assert "ok: dp 1 × pp 2" in result.stdout


@pytest.mark.parametrize("preset, sets, lines", [
    # issue 29: four tries before, one now
    ("translate.toml", ["parallel.pp=2"], [
        "presets/translate.toml:9: model.kind: 'encoder-decoder' has no pipeline split",
        "presets/zero2.toml:8: strategy.name: 'deepspeed' does not support parallel.pp = 2 (valid with pp > 1: ddp, "
        "fsdp, scratch-ddp, single)",
        "presets/translate.toml:16: data.path: is required: a directory with train.<src>, train.<tgt>, valid.* files",
        "presets/translate.toml: parallel.pp_microbatches: 1 micro-batches are fewer than the 2 stages 1f1b needs "
        "(0 is training.grad_accum = 1; valid: 2, 4, 8, 16, 32, e.g. --set parallel.pp_microbatches=2)"]),
    # 8 stages cannot split 4 layers: said first, before the micro-batches of the 8 stages
    ("ddp.toml", ["parallel.pp=8", "launch.nproc_per_node=8"], [
        "presets/single.toml:8: model.n_layers: 4 layers cannot fill 8 pipeline stages (parallel.pp x "
        "parallel.pp_stages_per_rank): every stage needs at least one (valid parallel.pp: 1, 2, 4)",
        "presets/ddp.toml: parallel.pp_microbatches: 1 micro-batches are fewer than the 8 stages 1f1b needs (0 is "
        "training.grad_accum = 1; valid: 8, e.g. --set parallel.pp_microbatches=8)"]),
], ids=["translate-pp2", "ddp-pp8-on-4-layers"])
def test_a_shipped_preset_with_a_new_layout_reports_every_problem(monkeypatch, no_launch, preset, sets, lines):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("HANDLE_DEBUG", raising=False)
    args = [a for s in sets for a in ("--set", s)]
    for command in ("validate", "run"):
        result = CliRunner().invoke(cli, [command, f"presets/{preset}", *args])
        assert result.exit_code == 2, result.output
        got = result.stderr.splitlines()
        assert len(got) == len(lines) and result.stdout == "", result.stderr
        for line, want in zip(got, lines):
            assert line.startswith(f"error: {want}"), (line, want)


def test_a_problem_of_one_model_key_hides_no_other(monkeypatch, no_launch):
    """Heads that do not divide d_model and a top_k above n_experts: independent, so both are reported (issue 38)."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("HANDLE_DEBUG", raising=False)
    result = CliRunner().invoke(cli, ["validate", "presets/moe.toml", "--set", "model.d_model=250",
                                      "--set", "model.top_k=9"])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        "error: presets/single.toml:7: model.n_heads: 4 does not divide d_model=250 (or give head_dim)",
        "error: presets/moe.toml (--set): model.top_k: 9 is more than n_experts=8 (each token goes to top_k different "
        "experts)"]


def test_init_from_mismatches_are_reported_in_one_go(monkeypatch, no_launch, tmp_path):
    """A Hugging Face directory whose d_model, n_layers and d_ff all differ from the preset's: one line each, in one
    ``handle validate`` (not one per try); head_dim, which follows d_model, is not named again."""
    from torch_handle.model.args import TransformerArgs
    from torch_handle.model.hf_names import to_hf_config

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("HANDLE_DEBUG", raising=False)
    llama = dict(norm="rmsnorm", position="rope", mlp="swiglu", n_kv_heads=2, bias=False, scale_embeddings=False,
                 norm_first=True)
    other = TransformerArgs(100, d_model=128, n_heads=4, n_layers=2, d_ff=352, **llama)
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(other)))
    result = CliRunner().invoke(cli, ["validate", "presets/llama.toml", "--set", f"model.init_from={tmp_path}"])
    assert result.exit_code == 2, result.output
    where = tmp_path / "config.json"
    assert result.stderr.splitlines() == [f"error: model.d_model = 256 but {where} has hidden_size = 128",
                                          f"error: model.n_layers = 4 but {where} has num_hidden_layers = 2",
                                          f"error: model.d_ff = 704 but {where} has intermediate_size = 352"]
