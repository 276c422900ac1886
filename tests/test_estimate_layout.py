"""``handle estimate`` for any dp x tp x pp layout (torch_handle.plan.estimate_layout, issue 21).

- Content, on the meta device and fake tensors (fast): every rank's parameter bytes add up to the model's times
  its replication (TP-replicated norms and biases, dp replicas, a tied head's copy), tp = 2 halves a split linear,
  the first and last stages carry the embedding and the head, FSDP shards over dp, the largest rank is named;
  hundreds of layouts estimate in seconds.
- Measured: every rank's telemetry of real composed runs against the estimate, per rank, within 5% (parameters,
  gradients, optimizer state) and 10% (activations), on tests/test_nd_parallel.py's runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from handle_cli.estimate_cmd import estimate
from tests.helpers import tiny_preset
from torch_handle.config.loader import load_preset
from torch_handle.model.parallelize import replicated_numel
from torch_handle.plan import estimate_layout as L
from torch_handle.plan.estimate_model import build_model, model_build
from torch_handle.registry import get_registry

ROOT = Path(__file__).resolve().parents[1]
HANDLE = [sys.executable, "-m", "handle_cli"]


@pytest.fixture(scope="module")
def preset_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layout")
    path = root / "tiny.toml"
    path.write_text(tiny_preset(root / "runs", strategy="single", steps=2, log_every=1))
    return path


def _preset(path: Path, *sets: str, world: int = 8, tp: int = 1, pp: int = 1, **parallel):
    """The tiny preset under any layout (the loader checks the model and the batch; the layout is set after it,
    unchecked, as a planner sets it)."""
    base = load_preset(path, ["launch.nproc_per_node=1", "training.grad_accum=4", *sets], get_registry())
    return L.with_layout(base, nproc_per_node=world, tp=tp, pp=pp, **parallel)


def _strategy(path: Path, name: str, *sets: str):
    return load_preset(path, [f"strategy.name={name}", "launch.nproc_per_node=2", *sets], get_registry()).strategy


def _model_counts(path: Path, *sets: str) -> dict[str, int]:
    """Of the whole one-process model, independently of the estimate: parameters (tied once), those a TP split
    keeps whole on every rank (the plan's norms and row-parallel biases), the token table."""
    preset = load_preset(path, ["launch.nproc_per_node=1", *sets], get_registry())
    with torch.device("meta"):
        model = build_model(model_build(preset, get_registry()))
    return {"params": sum(p.numel() for p in model.parameters()), "replicated": replicated_numel(model),
            "embed": model.embed.weight.numel(), "head": model.lm_head.weight.numel(),
            "final_norm": sum(p.numel() for p in model.final_norm.parameters()),
            "layer": sum(p.numel() for p in model.layers[0].parameters())}


# ---------------------------------------------------------------------------------------------------------------
# content
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 2), (1, 4, 2), (4, 2, 1), (2, 1, 4)])
def test_every_rank_adds_up_to_the_model_times_its_replication(preset_path, strategy, tie, dp, tp, pp):
    sets = [f"model.tie_embeddings={str(tie).lower()}", "model.n_layers=4"]
    preset = _preset(preset_path, *sets, world=dp * tp * pp, tp=tp, pp=pp)
    preset.strategy = _strategy(preset_path, strategy)
    est = L.estimate_layout(preset, get_registry(), every_rank=True)
    n = _model_counts(preset_path, *sets)
    assert [r.rank for r in est.ranks] == list(range(dp * tp * pp))
    assert (est.dp, est.tp, est.pp, est.params) == (dp, tp, pp, n["params"])
    # one replica of tp x pp ranks: split tensors once, TP-replicated ones tp times, a tied head's copy once more
    replica = n["params"] + (tp - 1) * n["replicated"] + (n["embed"] if tie and pp > 1 else 0)
    copies = dp if strategy == "ddp" else 1  # ddp replicates over dp, fsdp shards (every size here divides)
    assert sum(r.params_bytes for r in est.ranks) == 4 * replica * copies
    assert sum(r.grads_bytes for r in est.ranks) == 4 * replica * copies
    for r in est.ranks:  # every rank of a (pp_rank, tp_rank) holds the same number of parameters
        assert r.params == next(x.params for x in est.ranks if x.pp_rank == r.pp_rank)


def test_tp_2_halves_the_split_linears(preset_path):
    one, two = (L.estimate_layout(_preset(preset_path, world=tp, tp=tp), get_registry()) for tp in (1, 2))
    n = _model_counts(preset_path)
    assert two.ranks[0].params == (n["params"] - n["replicated"]) // 2 + n["replicated"]
    assert len(two.ranks) == 2 and two.ranks[0].params_bytes == two.ranks[1].params_bytes
    assert one.ranks[0].params == n["params"] and two.tp_shard_params == two.ranks[0].params
    # one layer's linears: a (d_ff, d_model) column-parallel weight becomes (d_ff / 2, d_model) on each rank
    key = L._cached_build(model_build(_preset(preset_path, world=2, tp=2), get_registry()))
    first = L._params(L._cached_build(model_build(_preset(preset_path, world=1), get_registry()))).parts[1]
    split = L._params(key).parts[1]
    halved = [(a, b) for a, b in zip(first, split) if b[0] * 2 == a[0]]
    kept = [(a, b) for a, b in zip(first, split) if b == a]
    assert len(halved) + len(kept) == len(first) and (128 * 64, 128) in [a for a, _ in halved]


@pytest.mark.parametrize("tie", [False, True])
def test_first_and_last_stage_carry_the_embedding_and_the_head(preset_path, tie):
    sets = [f"model.tie_embeddings={str(tie).lower()}", "model.n_layers=4"]
    n = _model_counts(preset_path, *sets)
    est = L.estimate_layout(_preset(preset_path, *sets, world=2, pp=2), get_registry())
    first, last = est.ranks
    assert (first.stages, last.stages) == ((0,), (1,))
    assert first.params == n["embed"] + 2 * n["layer"]
    assert last.params == 2 * n["layer"] + n["final_norm"] + n["head"]  # a tied head: its own copy
    assert (first.activation_logits_bytes, last.activation_logits_bytes) == (0, 2 * 4 * 32 * 512 * 4)  # full_loss_bytes
    # V-shaped: rank 0 runs the first and the last stage, and holds a tied matrix once
    v = L.estimate_layout(_preset(preset_path, *sets, world=2, pp=2, pp_schedule="zbv", pp_stages_per_rank=2),
                          get_registry())
    assert v.ranks[0].stages == (0, 3)
    assert v.ranks[0].params == n["embed"] + 2 * n["layer"] + n["final_norm"] + (0 if tie else n["head"])


def test_fsdp_shards_over_dp_what_ddp_replicates(preset_path):
    rows = {}
    for name in ("ddp", "fsdp", "scratch-fsdp"):
        preset = _preset(preset_path, world=8, tp=2, pp=2)
        preset.strategy = _strategy(preset_path, name)
        rows[name] = L.estimate_layout(preset, get_registry())
    for ddp, fsdp in zip(rows["ddp"].ranks, rows["fsdp"].ranks):
        assert (fsdp.params_bytes, fsdp.grads_bytes) == (ddp.params_bytes // 2, ddp.grads_bytes // 2)
        assert fsdp.optimizer_bytes < 0.51 * ddp.optimizer_bytes
        assert fsdp.activation_saved_bytes == ddp.activation_saved_bytes and fsdp.activation_gathered_bytes > 0
        assert ddp.activation_gathered_bytes == 0
    assert sum(r.params_bytes for r in rows["scratch-fsdp"].ranks) < 0.51 * sum(
        r.params_bytes for r in rows["ddp"].ranks)


def test_the_largest_rank_is_named(preset_path):
    # 1F1B: the first stage holds p micro-batches, the last one
    est = L.estimate_layout(_preset(preset_path, "model.n_layers=4", world=4, pp=4), get_registry())
    assert [r.in_flight for r in est.ranks] == [(4,), (3,), (2,), (1,)]
    assert est.largest.rank == 0 and est.as_dict()["largest_rank"] == 0
    # GPipe: every stage holds all m; the head, its logits and a big vocabulary make the last stage the largest
    big = L.estimate_layout(_preset(preset_path, "model.n_layers=4", "data.vocab_size=8192", world=4, pp=4,
                                    pp_schedule="gpipe"), get_registry())
    assert big.largest.pp_rank == 3 and big.largest.total_bytes == max(r.total_bytes for r in big.ranks)
    result = CliRunner().invoke(estimate, [str(preset_path), "--set", "parallel.pp=2", "--set",
                                           "training.grad_accum=4", "--nproc", "2"])
    assert result.exit_code == 0, result.output
    # 2 micro-batches in flight on stage 0, 1 on stage 1 with the head's three fp32 logits-sized loss buffers
    # (1.47 against 1.45 MiB of activations here): the line names the rank the rows star
    assert "largest rank (*): dp 1 × pp 2 (pp 1F1B native): rank 1 (stage 1)" in result.output
    assert " 1* " in result.output


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_extended_from_three_layers_equal_the_whole_models(preset_path, checkpointing):
    """A 5-layer decoder's activations, measured on 3 layers and extended, against one forward and backward of the
    whole model (pp = 1) and against each stage run on its own (pp = 2, interleaved: 4 stages), to the byte."""
    from torch_handle.plan.estimate_activations import activation_bytes
    from torch_handle.plan.estimate_pipeline import pipeline_ranks

    sets = ["model.n_layers=5", f"model.activation_checkpointing={str(checkpointing).lower()}"]
    whole = _preset(preset_path, *sets, world=1)
    (rank,) = L.estimate_layout(whole, get_registry()).ranks
    ref = activation_bytes(whole, get_registry())
    assert (rank.activation_saved_bytes, rank.activations_bytes) == (ref.saved, ref.total)
    split = _preset(preset_path, *sets, world=2, pp=2, pp_schedule="interleaved-1f1b", pp_stages_per_rank=2)
    est = L.estimate_layout(split, get_registry())
    stages = pipeline_ranks(split, get_registry(), "fp32")
    assert [(r.params, r.microbatch_saved_bytes, r.in_flight, r.activations_bytes) for r in est.ranks] == [
        (s.shape.n_params, s.microbatch_saved, s.in_flight, s.activation.total) for s in stages]


@pytest.mark.parametrize("tp,checkpointing", [(1, True), (2, False)])
def test_activations_interpolated_in_the_batch_equal_measured_ones(preset_path, tp, checkpointing):
    """Measured at 2 and 4 samples, a micro-batch of 6 or 8 is on their line, part by part, to the byte."""
    preset = _preset(preset_path, "model.n_layers=4", f"model.activation_checkpointing={str(checkpointing).lower()}",
                     world=tp, tp=tp)
    key = L._cached_build(model_build(preset, get_registry()))
    for batch in (6, 8):
        line = L._activations(key, batch, 32, "fp32", "fp32", checkpointing)
        measured = L._measured(key, batch, 32, "fp32", "fp32", checkpointing)
        assert line is not measured and line.whole == measured.whole
        assert line.parts.saved == measured.parts.saved and line.parts.params == measured.parts.params


def test_a_planner_estimates_a_hundred_layouts_in_seconds(preset_path):
    registry, count = get_registry(), 0
    start = time.process_time()
    for strategy in ("ddp", "fsdp"):
        base = _preset(preset_path, "model.n_layers=4", "training.grad_accum=8")
        base.strategy = _strategy(preset_path, strategy)
        for tp, pp in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)):
            for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)) if pp > 1 else (("1f1b", 1),):
                for m in (4, 8, 16) if pp > 1 else (0,):
                    if pp * v > 4:
                        continue
                    est = L.estimate_layout(L.with_layout(base, nproc_per_node=4 if tp * pp < 4 else 8, tp=tp,
                                                          pp=pp, pp_schedule=schedule, pp_stages_per_rank=v,
                                                          pp_microbatches=m), registry)
                    assert est.largest.total_bytes > 0
                    count += 1
    seconds = time.process_time() - start
    assert count >= 50 and seconds < 20, (count, seconds)
    print(f"{count} layouts in {seconds:.1f} CPU s")


def test_bad_layouts_raise_one_line(preset_path):
    with pytest.raises(ValueError, match="must divide the world size 6"):
        L.estimate_layout(_preset(preset_path, world=6, tp=4), get_registry())
    with pytest.raises(ValueError, match="2 layers cannot fill"):
        L.estimate_layout(_preset(preset_path, world=4, pp=4), get_registry())
    with pytest.raises(ValueError, match="pp_microbatches: 3 micro-batches do not divide"):
        L.estimate_layout(_preset(preset_path, world=2, pp=2, pp_microbatches=3), get_registry())
    with pytest.raises(ValueError, match="pp_microbatches: 1 micro-batches are fewer than the 2 stages 1f1b"):
        L.estimate_layout(_preset(preset_path, world=2, pp=2, pp_microbatches=1), get_registry())
    with pytest.raises(ValueError, match="'single' runs one replica"):
        L.estimate_layout(_preset(preset_path, world=4, tp=2), get_registry())


def test_the_command_lists_every_pipeline_rank_of_a_mesh(preset_path):
    sets = ["parallel.tp=2", "parallel.tp_impl=scratch", "parallel.pp=2", "strategy.name=fsdp",
            "training.grad_accum=4"]
    proc = subprocess.run([*HANDLE, "estimate", str(preset_path), *(x for s in sets for x in ("--set", s)),
                           "--nproc", "4,8", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    # rank: the global rank, (pp_rank x dp + dp_rank) x tp + tp_rank, the numbering of the mesh and the dashboard
    assert [(r["world_size"], r["dp"], r["pp_rank"], r["rank"]) for r in rows] == [
        (4, 1, 0, 0), (4, 1, 1, 2), (8, 2, 0, 0), (8, 2, 1, 4)]
    assert [r["layout"] for r in rows] == ["dp 1 × tp 2 × pp 2 (tp scratch; pp 1F1B native)"] * 2 + [
        "dp 2 × tp 2 × pp 2 (fsdp; tp scratch; pp 1F1B native)"] * 2
    assert [r["largest"] for r in rows].count(True) == 2
