"""``parallel.cp`` (issue 48): a preset's every context-parallel problem at once, one line each naming its key and
what is valid, exit 2, nothing started (in-process: click's CliRunner); ``cp_impl = "auto"``'s choice; the degrees
and rank coordinates of a dp × cp layout; the batch sharded as the CP share shards it."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from handle_cli.main import cli
from torch_handle.common.run_layout import RunLayout
from torch_handle.config.context_parallel import chosen_cp_impl
from torch_handle.common.parallel_dims import ParallelDims

BAD = """\
[run]
output_dir = "out"
[model]
d_model = 64
n_heads = 8
n_kv_heads = 2
n_layers = 2
d_ff = 128
dropout = 0.1
[data]
seq_len = 30
[strategy]
name = "single"
[parallel]
cp = 4
cp_impl = "ulysses"
pp = 2
[launch]
nproc_per_node = 2
"""


@pytest.fixture
def runner(tmp_path, monkeypatch, no_launch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HANDLE_DEBUG", raising=False)
    return CliRunner()


def test_every_context_parallel_problem_is_one_line(runner, tmp_path):
    (tmp_path / "p.toml").write_text(BAD)
    result = runner.invoke(cli, ["validate", "p.toml"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    expected = [
        ("error: p.toml:15: parallel.cp: cp x tp x pp = 4 x 1 x 2 does not divide the world size 2 "
        "(launch.nproc_per_node x launch.nnodes); dp is the rest (valid cp: 1)"),
        ("error: p.toml:11: data.seq_len: 30 is not divisible by 2 x cp x tp = 8 (head-tail balancing cuts each "
        "sequence into 2 x cp chunks; e.g. 24)"),
        ("error: p.toml:16: parallel.cp_impl: \"ulysses\" gives each of the cp x tp = 4 ranks whole heads: "
        "model.n_heads = 8 and n_kv_heads = 2 must both divide by it (valid: ring, allgather)"),
        ("error: p.toml:13: strategy.name: 'single' with parallel.cp > 1 is not supported yet (valid: ddp, "
         "fsdp, deepspeed, scratch-ddp, scratch-fsdp)"),
        ("error: p.toml:9: model.dropout: 0.1: the context-parallel attentions apply no attention dropout (valid "
        "with parallel.cp > 1: 0)"),
    ]
    for line in expected:
        assert line in lines, (line, lines)


def _fixed(runner, tmp_path, cp_impl: str, *more: str):
    """``handle validate`` of :data:`BAD` with every problem fixed and ``parallel.cp_impl = cp_impl``."""
    (tmp_path / "p.toml").write_text(BAD)
    fixes = ("parallel.cp=2", "parallel.pp=1", "data.seq_len=32", "model.dropout=0.0", "strategy.name=ddp",
             f"parallel.cp_impl={cp_impl}", *more)
    return runner.invoke(cli, ["validate", "p.toml", *(a for fix in fixes for a in ("--set", fix))])


def test_native_is_refused_on_cpu_naming_why_and_the_hand_written_ones(runner, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = _fixed(runner, tmp_path, "native")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        ("error: p.toml (--set): parallel.cp_impl: \"native\" needs CUDA, and this machine has none: FlexAttention "
         "has no CPU backward in torch 2.13 and SDPA's context parallel is CUDA-only (valid: ring, allgather, "
         "ulysses, or auto)")]


def test_native_is_accepted_where_cuda_is(runner, tmp_path, monkeypatch):
    import torch

    from torch_handle.train.shares.context import _attention_function

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = _fixed(runner, tmp_path, "native")
    assert result.exit_code == 0, result.output
    assert "dp 1 × cp 2 (ddp; cp native)" in result.output
    assert _attention_function("native").__name__ == "native_attention"


def test_a_good_cp_preset_validates_with_its_layout(runner, tmp_path):
    result = _fixed(runner, tmp_path, "ring")
    assert result.exit_code == 0, result.output
    assert "dp 1 × cp 2 (ddp; cp ring)" in result.output


def test_tp_with_cp_validates_by_hand_and_dtensor(runner, tmp_path):
    result = _fixed(runner, tmp_path, "ring", "parallel.tp=2", "parallel.tp_impl=native", "strategy.name=fsdp",
                    "launch.nproc_per_node=4")
    assert result.exit_code == 0, result.output
    assert "dp 1 × cp 2 × tp 2 (cp ring; tp native)" in result.output
    result = _fixed(runner, tmp_path, "ring", "parallel.tp=2", "parallel.tp_impl=scratch", "launch.nproc_per_node=4",
                    "parallel.sequence_parallel=true")
    assert result.exit_code == 0, result.output
    assert "dp 1 × cp 2 × tp 2 (cp ring; tp scratch + sp)" in result.output


def test_pp_with_cp_validates_with_its_layout(runner, tmp_path):
    result = _fixed(runner, tmp_path, "allgather", "parallel.pp=2", "parallel.pp_impl=scratch",
                    "launch.nproc_per_node=4", "training.grad_accum=2")
    assert result.exit_code == 0, result.output
    assert "dp 1 × cp 2 × pp 2 (cp allgather; pp 1F1B scratch)" in result.output
    result = _fixed(runner, tmp_path, "allgather", "parallel.pp=2", "parallel.pp_impl=native",
                    "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=2", "model.n_layers=4",
                    "model.tie_embeddings=false", "launch.nproc_per_node=4", "training.grad_accum=2")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        ("error: p.toml (--set): parallel.pp_schedule: 'zbv' with parallel.cp > 1: a zero-bubble schedule splits "
         "each stage's backward into an input and a weight pass, which the cp attentions' backward (a collective "
         "over the cp ranks) does not survive (valid: gpipe, 1f1b, interleaved-1f1b, looped-bfs)")]


def test_auto_takes_allgather_for_packed_documents_and_ring_otherwise():
    assert chosen_cp_impl("auto", True) == "allgather"
    assert chosen_cp_impl("auto", False) == "ring"
    assert chosen_cp_impl("ulysses", True) == "ulysses"


def test_cp_sits_between_dp_and_tp_in_the_mesh_and_the_run_layout():
    """rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank: 8 ranks as dp 2 × cp 2 × tp 2."""
    layout = ParallelDims(8, tp=2, cp=2)
    assert layout.dp == 2
    assert [(layout.dp_rank(r), layout.cp_rank(r), layout.tp_rank(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert layout.describe() == {"dp": 2, "tp": 2, "cp": 2}
    run = RunLayout.from_parts(4, "ddp", None, cp=2, cp_impl="ring")
    assert (run.dp, run.cp, run.label()) == (2, 2, "dp 2 × cp 2 (ddp; cp ring)")
    assert [run.rank_name(r) for r in range(4)] == ["rank 0 (dp0 cp0)", "rank 1 (dp0 cp1)", "rank 2 (dp1 cp0)",
                                                    "rank 3 (dp1 cp1)"]
    with pytest.raises(ValueError, match="cp"):
        ParallelDims(6, cp=4)


def _preset(tmp_path, *sets: str):
    from tests.helpers import tiny_preset
    from torch_handle.config.loader import load_preset

    (tmp_path / "p.toml").write_text(tiny_preset(tmp_path / "out"))
    return load_preset(tmp_path / "p.toml", ["model.n_kv_heads=2", "model.dropout=0.0", "data.seq_len=64", *sets])


def test_estimate_prices_one_cp_rank_and_its_buffers(tmp_path):
    """A cp 2 rank's activations are the model's on seq_len / 2 tokens (the same fake-tensor measure as without
    cp), plus its attention's buffers for one layer; model states are the strategy's over dp × cp."""
    from torch_handle.plan.estimate import estimate_preset
    from torch_handle.plan.estimate_cp import cp_buffer_bytes
    from torch_handle.registry import get_registry

    registry = get_registry()
    half = estimate_preset(_preset(tmp_path, "data.seq_len=32"), registry, [2])[0]
    rows = estimate_preset(_preset(tmp_path, "parallel.cp=2", "parallel.cp_impl=ring"), registry, [2, 3, 4])
    assert [r.world_size for r in rows] == [2, 4]  # cp must divide the world size
    cp2 = rows[0]
    assert (cp2.cp, cp2.cp_impl, cp2.dp) == (2, "ring", 1)
    assert cp2.activation.saved == half.activation.saved and cp2.activation.logits == half.activation.logits
    assert cp2.cp_buffer_bytes == cp_buffer_bytes("ring", 4, 4, 2, 64, 2, 16, 4)
    assert cp2.device_bytes == half.device_bytes + cp2.cp_buffer_bytes
    assert cp2.as_dict()["cp_buffer_bytes"] == cp2.cp_buffer_bytes and "cp" not in half.as_dict()
    # B 4, H 4, H_kv 2, T 64, D 16, fp32 compute and accumulation (4 + 4 bytes)
    assert {impl: cp_buffer_bytes(impl, 4, 4, 2, 64, 2, 16, 4) for impl in ("ring", "allgather", "ulysses")} == {
        "ring": 2 * 2 * 2 * 4 * 32 * 16 * 8, "allgather": 2 * 2 * 4 * 64 * 16 * 8,
        "ulysses": 2 * (8 + 4) * 4 * 32 * 16 * 4}
    # native: the gathered K/V of 3 layers held until backward (the other rank's half), dK/dV of all 64 keys
    assert cp_buffer_bytes("native", 4, 4, 2, 64, 2, 16, 4, layers=3) == 2 * 2 * 4 * 16 * (3 * 32 + 64) * 4



def test_estimate_names_the_cp_rank_formula_and_dp_under_tp(runner, tmp_path):
    """The layout line's rank formula has the cp coordinate between dp and tp (parallel/mesh.py), and the
    tensor-parallel line's dp divides the world by cp x tp."""
    from tests.helpers import tiny_preset

    (tmp_path / "p.toml").write_text(tiny_preset(tmp_path / "out"))
    result = runner.invoke(cli, ["estimate", str(tmp_path / "p.toml"), "--nproc", "4", "--set", "model.n_kv_heads=2",
                                 "--set", "model.dropout=0.0", "--set", "data.seq_len=64", "--set", "parallel.cp=2",
                                 "--set", "parallel.tp=2", "--set", "parallel.tp_impl=scratch", "--set", "launch.nproc_per_node=4", "--set",
                                 "strategy.name=ddp"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.startswith("layout: dp 1 × cp 2 × tp 2") and line.endswith(
        "each row's rank is a global rank, ((pp_rank x dp + dp_rank) x cp + cp_rank) x tp + tp_rank") for line in lines)
    assert any(line.startswith("tensor parallel: tp = 2 (scratch") and line.endswith(
        "data parallel: dp = world / (cp x tp), the strategy over dp x cp") for line in lines)


def test_sft_and_dpo_run_under_cp_with_a_pipeline_or_without_but_a_reference_copy():
    from types import SimpleNamespace as NS

    from torch_handle.config.context_parallel import context_parallel_problems

    def problems(objective: str, reference: str = "auto", pp: int = 1) -> list[tuple[str | None, str]]:
        preset = NS(parallel=NS(cp=2, tp=1, pp=pp, ep=1, tp_impl="scratch", cp_impl="allgather",
                                pp_schedule="1f1b"), world_size=2 * pp,
                    model=NS(name="transformer", options=NS(n_heads=2, n_kv_heads=2, dropout=0.0, kind="decoder")),
                    data=NS(options=NS(seq_len=48)), strategy=NS(name="ddp"), training=NS(compile=False),
                    finetune=NS(objective=objective, preference=NS(reference=reference)))
        return [(p.key, p.message) for p in context_parallel_problems(preset)]

    assert problems("sft") == problems("lm") == problems("dpo", "adapters_off") == problems("dpo", "precomputed") == []
    refusal = ("'copy' with parallel.cp > 1: the frozen copy's attention is not split over the cp ranks (valid: "
               "'adapters_off', 'precomputed', 'none', 'auto')")
    assert problems("dpo", "copy") == [("finetune.preference.reference", refusal)]
    assert problems("sft", pp=2) == problems("lm", pp=2) == problems("dpo", "precomputed", pp=2) == []
