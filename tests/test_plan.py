"""``handle plan``: the layouts of a tiny decoder on 4 ranks (content of --json), what drops a layout and why, bad
input, and --measure running the planned layouts through the launcher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from handle_cli.main import cli
from tests.helpers import leftovers, tagged_env, tiny_preset

ROOT = Path(__file__).resolve().parents[1]
PEAK = "0.05"  # TFLOP/s, so that no test measures the matmul peak


def write_tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(tiny_preset(tmp_path / "runs", steps=4), encoding="utf-8")
    return path


def plan_json(tmp_path: Path, *args: str) -> dict:
    """``handle plan tiny.toml --json ARGS`` in a subprocess (--measure starts workers: their leftovers are checked)."""
    env, tag = tagged_env(HANDLE_PEAK_CACHE=str(tmp_path / "peak.json"))
    proc = subprocess.run([sys.executable, "-m", "handle_cli", "plan", str(write_tiny(tmp_path)), "--json", *args],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not leftovers(tag)
    return json.loads(proc.stdout)


def plan_here(tmp_path: Path, monkeypatch, *args: str) -> dict:
    """``handle plan tiny.toml --json ARGS`` in this process (the model's estimates are cached between tests)."""
    monkeypatch.setenv("HANDLE_PEAK_CACHE", str(tmp_path / "peak.json"))
    result = CliRunner().invoke(cli, ["plan", str(write_tiny(tmp_path)), "--json", *args])
    assert result.exit_code == 0, result.output[-3000:]
    return json.loads(result.stdout)


def test_layouts_of_4_ranks(tmp_path, monkeypatch, no_launch):
    out = plan_here(tmp_path, monkeypatch, "--nproc", "4", "--peak-tflops", PEAK, "--set", "model.n_heads=2")
    rows, dropped = out["layouts"], out["dropped"]
    assert rows and dropped
    for r in rows:
        assert r["dp"] * r["tp"] * r["pp"] == 4, r["label"]
        assert r["micro_batch_size"] * r["grad_accum"] * r["dp"] == out["global_batch"] == 8
        assert r["largest_bytes"] == max(k["total_bytes"] for k in r["ranks"]) > 0
        assert r["largest_state_bytes"] > 0 and r["largest_activation_bytes"] > 0
        tokens = out["tokens_per_step"]
        assert tokens == 8 * 32
        compute = out["flops_per_token"] * tokens * (4 / 3 if r["activation_checkpointing"] else 1) / \
            (4 * 0.05e12)
        assert r["compute_s"] == pytest.approx(compute)
        assert r["step_s"] == pytest.approx(r["compute_s"] + r["bubble_s"] + r["tp_s"] + r["dp_s"] + r["pp_s"])
        assert r["predicted_tokens_per_s"] == pytest.approx(tokens / r["step_s"])
        if r["pp"] > 1:
            v, m, p = r["v"], r["microbatches"], r["pp"]
            assert r["bubble"] == pytest.approx((p - 1) / (v * m + p - 1)) and r["pp_bytes"] > 0
            assert r["bubble_s"] == pytest.approx(r["compute_s"] * (p - 1) / (v * m))
        else:
            assert r["bubble"] == 0 and r["pp_bytes"] == 0
        assert (r["tp_bytes"] > 0) == (r["tp"] > 1) and (r["dp_bytes"] > 0) == (r["dp"] > 1)
        assert r["strategy"] == ("single" if r["dp"] == 1 else "ddp")
    speeds = [r["predicted_tokens_per_s"] for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    meshes = {(r["dp"], r["tp"], r["pp"]) for r in rows}
    assert (4, 1, 1) in meshes and (1, 1, 4) not in meshes  # 2 layers cannot fill 4 stages
    assert all(d["dp"] * d["tp"] * d["pp"] == 4 and d["reason"] for d in dropped)
    tp4 = [d for d in dropped if d["tp"] == 4]
    assert tp4 and all("n_heads" in d["reason"] for d in tp4), tp4
    pp4 = [d for d in dropped if d["pp"] == 4]
    assert pp4 and all("n_layers" in d["reason"] or "micro-batches" in d["reason"] for d in pp4), pp4
    assert {False, True} == {r["activation_checkpointing"] for r in rows}
    assert "assumed: --peak-tflops 0.05" in out["peak"]["source"]
    assert out["links"]["source"].startswith(("assumed", "measured"))


def test_tp_impl_auto_plans_the_layouts_dtensor_cannot_run(tmp_path, monkeypatch, no_launch):
    """The preset's tp_impl "auto" is chosen again in each layout: DDP x TP and TP x PP run by hand, one replica
    of TP ranks with DTensor; an explicit native drops what it cannot run, with the loader's reason."""
    out = plan_here(tmp_path, monkeypatch, "--nproc", "4", "--peak-tflops", PEAK)
    assert not [d for d in out["dropped"] if "tp_impl" in d["reason"]]
    impls = {(r["dp"], r["tp"], r["pp"], r["strategy"]): r["tp_impl"] for r in out["layouts"]}
    assert impls[2, 2, 1, "ddp"] == "scratch" and impls[1, 2, 2, "single"] == "scratch"
    assert impls[1, 4, 1, "single"] == "native" and impls[4, 1, 1, "ddp"] is None
    assert any(n.startswith("tensor parallelism: tp_impl auto, DTensor where it runs") for n in out["notes"])
    pinned = plan_here(tmp_path, monkeypatch, "--nproc", "4", "--peak-tflops", PEAK, "--set", "parallel.tp_impl=native")
    refused = [d for d in pinned["dropped"] if d["reason"].startswith("parallel.tp_impl: ")]
    assert {(d["dp"], d["tp"], d["pp"]) for d in refused} == {(2, 2, 1), (1, 2, 2)}
    assert {r["tp_impl"] for r in pinned["layouts"]} == {None, "native"}
    assert len(out["layouts"]) > len(pinned["layouts"])


def test_layouts_are_not_dropped_for_a_parallel_setting_of_the_preset_alone(tmp_path, monkeypatch, no_launch):
    """Sequence parallelism and the hand-written pipeline are adapted per layout as a resume adapts them:
    sequence_parallel off where tp = 1, pp_impl native for a schedule scratch does not have; the layout's command
    carries the --set."""
    sets = ("--set", "parallel.tp=2", "--set", "launch.nproc_per_node=2", "--set", "parallel.sequence_parallel=true",
            "--set", "parallel.pp_impl=scratch")
    out = plan_here(tmp_path, monkeypatch, "--nproc", "4", "--peak-tflops", PEAK, *sets)
    assert not [d for d in out["dropped"] if "sequence_parallel" in d["reason"] or "pp_impl" in d["reason"]]
    tp1 = [r for r in out["layouts"] if r["tp"] == 1]
    assert tp1 and all("parallel.sequence_parallel=false" in r["overrides"] for r in tp1)
    interleaved = [r for r in out["layouts"] if r.get("schedule") == "interleaved-1f1b"]
    assert all("parallel.pp_impl=native" in r["overrides"] for r in interleaved)


def test_grouped_query_attention_limits_tp_to_the_divisors_of_n_kv_heads(tmp_path, monkeypatch, no_launch):
    """A Llama-shaped decoder with multi-query attention (4 query heads, 1 key/value head) on 2 ranks: tp = 2 is
    dropped for n_kv_heads, naming the tp that work (tensor_parallel_problems; tp = 2 with 2 key/value heads
    trains: tests/test_tensor_parallel.py)."""
    llama = ["model.norm=rmsnorm", "model.position=rope", "model.mlp=swiglu", "model.n_kv_heads=1",
             "model.bias=false", "model.norm_first=true", "model.tie_embeddings=false", "launch.nproc_per_node=2"]
    out = plan_here(tmp_path, monkeypatch, "--nproc", "2", "--peak-tflops", PEAK,
                    *(arg for kv in llama for arg in ("--set", kv)))
    assert out["layouts"] and {r["tp"] for r in out["layouts"]} == {1}
    tp2 = [d for d in out["dropped"] if d["tp"] == 2]
    assert tp2 and all(d["reason"] == "model.n_kv_heads: 1 is not divisible by parallel.tp = 2 (each rank takes "
                                      "whole key/value heads; tp may be 1)" for d in tp2), tp2


def test_a_tiny_device_drops_everything(tmp_path, monkeypatch, no_launch):
    out = plan_here(tmp_path, monkeypatch, "--nproc", "4", "--peak-tflops", PEAK, "--device-memory", "64KiB")
    assert out["layouts"] == []
    memory = [d for d in out["dropped"] if d["reason"].startswith("largest rank needs")]
    assert memory and all(d["reason"].split(" (rank")[0].endswith("> 64.0 KiB") for d in memory), memory[:2]


def test_tp_stays_inside_a_node(tmp_path, monkeypatch, no_launch):
    out = plan_here(tmp_path, monkeypatch, "--nproc", "4", "--nnodes", "2", "--peak-tflops", PEAK)
    assert all(r["tp"] <= 2 for r in out["layouts"])
    assert any(d["tp"] == 4 and "spans nodes" in d["reason"] for d in out["dropped"])


@pytest.mark.parametrize("args,needle", [
    (["--nproc", "0"], "--nproc"),
    (["--nproc", "four"], "--nproc"),
    (["--nproc", "3", "--nnodes", "2"], "--nproc"),
    (["--nproc", "4", "--device-memory", "lots"], "--device-memory"),
    (["--nproc", "4", "--measure", "0"], "--measure"),
    (["--nproc", "4", "--peak-tflops", "-1"], "--peak-tflops"),
])
def test_bad_input_is_one_line(tmp_path, args, needle, no_launch):
    result = CliRunner().invoke(cli, ["plan", str(write_tiny(tmp_path)), *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.output


def test_measure_runs_the_top_layouts(tmp_path):
    out = plan_json(tmp_path, "--nproc", "2", "--peak-tflops", PEAK, "--measure", "2", "--steps", "3",
                    "--output-dir", str(tmp_path / "plan"))
    measured = out["measured"]
    assert [m["label"] for m in measured] == [r["label"] for r in out["layouts"][:2]]
    for m, row in zip(measured, out["layouts"]):
        assert m["status"] == "finished", m
        assert m["tokens_per_s"] > 0 and m["predicted_tokens_per_s"] == row["predicted_tokens_per_s"]
        assert m["state_bytes"] > 0 and m["predicted_state_bytes"] == row["largest_state_bytes"]
        assert m["error_state_bytes"] == pytest.approx(m["state_bytes"] / m["predicted_state_bytes"] - 1)
        assert abs(m["error_state_bytes"]) < 0.05 and abs(m["error_activation_bytes"]) < 0.10, m
        ran = (Path(m["run_dir"]) / "preset.toml").read_text(encoding="utf-8")
        assert f"tp = {row['tp']}" in ran and f"pp = {row['pp']}" in ran
        assert f"activation_checkpointing = {str(row['activation_checkpointing']).lower()}" in ran
    assert set(out["comparison"]) == {"spearman", "fastest", "first_choice", "first_choice_ratio"}
    assert out["comparison"]["fastest"] in {m["label"] for m in measured}
