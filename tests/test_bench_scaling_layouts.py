"""``handle bench scaling --layouts``: one run per dp x tp x pp layout on its product of ranks, layouts the preset's
checks refuse skipped with their reason, bad items refused before anything starts; one real dp1/pp2 pair."""

from __future__ import annotations

import json
import time
import tomllib
from pathlib import Path

import pytest

from tests.helpers import leftovers, tagged_env
from tests.test_bench_comm import handle
from tests.test_bench_scaling import invoke, only_dir, write_tiny


def test_layouts_run_on_their_product_of_ranks_and_refused_ones_are_notes(monkeypatch, tmp_path):
    result = invoke(monkeypatch, tmp_path, "--layouts", "dp1,dp2,tp2,pp2,dp2xpp2,tp2xpp2,pp4", "--steps", "3",
                    "--set", "training.grad_accum=2")
    assert result.exit_code == 0, result.output
    bench = only_dir(tmp_path / "bench")
    records = json.loads((bench / "results.json").read_text())["results"]
    assert [(r["strategy"], r["layout"], r["plugin"], r["nproc"], r["dp"], r["tp"], r["pp"]) for r in records] == [
        ("ddp", "dp1", "ddp", 1, 1, 1, 1), ("ddp", "dp2", "ddp", 2, 2, 1, 1), ("ddp", "tp2", "single", 2, 1, 2, 1),
        ("ddp", "pp2", "single", 2, 1, 1, 2), ("ddp", "dp2xpp2", "ddp", 4, 2, 1, 2),
        ("ddp", "tp2xpp2", "single", 4, 1, 2, 2)]
    assert [r["efficiency"] for r in records] == pytest.approx([1.0] + [2 ** 0.9 / 2] * 3 + [4 ** 0.9 / 4] * 2)
    assert [r["global_batch"] for r in records] == [8, 16, 8, 8, 16, 8]  # weak: per replica
    for r in records:
        preset = tomllib.loads((bench / f"ddp-{r['layout']}" / "preset.toml").read_text())
        assert (preset["parallel"]["tp"], preset["parallel"]["pp"]) == (r["tp"], r["pp"])
        assert preset["launch"]["nproc_per_node"] == r["nproc"] and preset["strategy"]["name"] == r["plugin"]
    out = result.stdout
    # tp2xpp2 runs (tp_impl = "auto": DTensor TP where it runs, by hand inside pipeline stages); pp4 cannot
    assert "note: ddp pp4 skipped: model.n_layers: 2 layers cannot fill 4 pipeline stages" in out
    assert "tp2xpp2 skipped" not in out
    assert "layouts: dp1, dp2, tp2, pp2, dp2xpp2, tp2xpp2, each on dp x tp x pp ranks" in out
    assert "┃ strategy ┃ layout " in out and "tokens/s (global) by layout" in out
    # each row names its layout as every view does: a replica of tp or pp ranks (dp 1) runs no ddp
    assert [r["layout_label"] for r in records] == [
        "1 rank (ddp)", "dp 2 (ddp)", "dp 1 × tp 2 (tp native)", "dp 1 × pp 2 (pp 1F1B native)",
        "dp 2 × pp 2 (ddp; pp 1F1B native)", "dp 1 × tp 2 × pp 2 (tp scratch; pp 1F1B native)"]
    assert "│ dp 2 (ddp) " in out and "│ 1 rank (ddp) " in out
    assert "[5/6] ddp dp2xpp2 on 4 ranks: finished" in result.stderr


def _plan(layouts: str, *overrides: str, strong: bool = False):
    from handle_cli.bench_scaling_cmd import _scaling_plan
    from torch_handle.plan.bench_scaling import parse_layouts

    return _scaling_plan("presets/ddp.toml", overrides, [1], None, None, 2, strong, None, parse_layouts(layouts))


def test_readme_layouts_plan_a_pp_row_with_valid_microbatches():
    """The README's ``--layouts dp2,tp2,pp2`` on presets/ddp.toml (micro-batch 8, grad_accum 1, weak scaling):
    1F1B on 2 stages refuses the 1 pipeline micro-batch grad_accum gives, so the pp2 row runs with the smallest
    valid ``parallel.pp_microbatches`` (2) and the tp2 row's micro_batch_size and grad_accum, said in a note."""
    runs, notes, _ = _plan("dp2,tp2,pp2")
    assert [r["layout"] for r in runs] == ["dp2", "tp2", "pp2"]
    dp2, tp2, pp2 = runs
    assert "parallel.pp_microbatches=2" in pp2["overrides"] and pp2["preset"].parallel.pp_microbatches == 2
    assert not any(o.startswith("parallel.pp_microbatches") for r in (dp2, tp2) for o in r["overrides"])
    assert [(r["micro_batch_size"], r["grad_accum"], r["global_batch"]) for r in runs] == [
        (8, 1, 16), (8, 1, 8), (8, 1, 8)]
    assert notes == ["ddp pp2: parallel.pp_microbatches = 2 chosen (1f1b on 2 stages cannot run 1 micro-batch; the "
                     "step's 8 x 1 = 8 samples per replica split into 2 of 4; micro_batch_size and grad_accum as in "
                     "the other rows)"]


@pytest.mark.parametrize("overrides, m, note", [
    (("parallel.pp_microbatches=3",), 2, "cannot run 3 micro-batches; the step's 8 x 1 = 8 samples"),
    (("parallel.pp_schedule=gpipe",), 0, None),
    (("training.grad_accum=2",), 0, None),
    (("training.micro_batch_size=1",), None, "skipped: parallel.pp_microbatches: 1 micro-batches are fewer"),
])
def test_pp_row_keeps_a_valid_setup_and_skips_when_none_is_valid(overrides, m, note):
    runs, notes, _ = _plan("dp1,pp2", *overrides)
    assert [r["preset"].parallel.pp_microbatches for r in runs if r["layout"] == "pp2"] == ([] if m is None else [m])
    assert (note in " ".join(notes)) if note else notes == []


def test_strong_scaling_pp_row_needs_no_choice():
    """--strong halves the replicas' share by raising grad_accum to 2: enough micro-batches already."""
    runs, notes, _ = _plan("dp2,tp2,pp2", strong=True)
    assert notes == [] and [r["global_batch"] for r in runs] == [16] * 3
    assert [r["preset"].parallel.pp_microbatches for r in runs] == [0, 0, 0]


@pytest.mark.parametrize("args, message", [
    (["--layouts", "dp2,tp0"], "error: --layouts: 'tp0' is not a layout (valid: dp<N>, tp<N>, pp<N>, or several "
                               "joined by x such as dp2xtp2xpp2"),
    (["--layouts", "dp2xdp2"], "error: --layouts: 'dp2xdp2' is not a layout"),
    (["--layouts", "dp2,"], "error: --layouts: 'dp2,': expected a comma list of layouts"),
    (["--layouts", "dp2", "--nproc", "2"], "error: --layouts sets each run's world size and tp: leave out --nproc"),
    (["--layouts", "dp2", "--tp", "2"], "error: --layouts sets each run's world size and tp: leave out --nproc"),
    (["--layouts", "tp2xpp2", "--set", "parallel.tp_impl=native"],
     "error: nothing to run: ddp tp2xpp2 skipped: parallel.tp_impl: "),
])
def test_bad_layouts_exit_2_with_one_line(monkeypatch, tmp_path, args, message):
    result = invoke(monkeypatch, tmp_path, *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(message), result.stderr
    assert result.stdout == "" and not (tmp_path / "bench").exists()


@pytest.mark.dist
def test_real_dp1_and_pp2_json(tmp_path):
    """The pp2 row runs though grad_accum 1 is too few micro-batches for 1F1B (it picks 2). The pp2 run's step
    events carry ``comm`` (rank 0's receive wait in the hand-written pipeline), and its
    median reaches the JSON."""
    env, tag = tagged_env()
    t0 = time.perf_counter()
    proc = handle("bench", "scaling", str(write_tiny(tmp_path)), "--layouts", "dp1,pp2", "--steps", "2", "--skip",
                  "1", "--set", "parallel.pp_impl=scratch", "--json",
                  "--output-dir", str(tmp_path / "bench"), env=env, timeout=300)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["layout"], r["plugin"], r["nproc"], r["pp"], r["status"]) for r in records] == [
        ("dp1", "ddp", 1, 1, "finished"), ("pp2", "single", 2, 2, "finished")]
    one, pp = records
    # grad_accum 1 gives 1F1B one micro-batch, too few for 2 stages: the row chose 2 (issue 29)
    pp_preset = tomllib.loads((Path(pp["run_dir"]) / "preset.toml").read_text())
    assert (pp_preset["parallel"]["pp_microbatches"], pp_preset["training"]["grad_accum"]) == (2, 1)
    assert one["efficiency"] == 1.0
    assert pp["efficiency"] == pytest.approx(pp["tokens_per_s"] / (2 * one["tokens_per_s"]))
    assert one["comm_pp_s"] is None and pp["comm_pp_s"] >= 0 and pp["comm_dp_s"] is None
    steps = [json.loads(line) for line in (Path(pp["run_dir"]) / "events.jsonl").read_text().splitlines()]
    steps = [e for e in steps if e["kind"] == "step"]
    assert [e["layout"] for e in steps] == [{"dp": 1, "tp": 1, "pp": 2}] * 2
    assert [e["comm"] for e in steps] == [{"pp": e["pipeline"]["ranks"][0]["wait_s"]} for e in steps]
    print(f"bench scaling --layouts dp1,pp2, 2 steps each: {wall:.1f} s")
    assert leftovers(tag) == []
