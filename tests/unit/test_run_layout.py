"""One description of a run's layout (torch_handle.common.run_layout) in every view: the line's forms, run.json's
record and the fallbacks of older runs, ``handle validate``, ``handle runs --json``, ``handle run``'s summary and
the dashboard's state. In-process: no torchrun."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from torch_handle.common.run_layout import LAYOUT_KEY, RunLayout
from torch_handle.config.loader import load_preset

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"


@pytest.mark.parametrize("parts, line", [
    ((1, "single", None), "1 rank (single)"),
    ((2, "ddp", None), "dp 2 (ddp)"),
    ((4, "deepspeed", 2), "dp 4 (deepspeed ZeRO-2)"),
    ((8, "fsdp", None), "dp 8 (fsdp)"),
    ((2, "ddp", None, 2, 1, "scratch"), "dp 1 × tp 2 (tp scratch)"),  # one replica: no ddp to speak of
    ((4, "ddp", None, 2, 1, "native", True), "dp 2 × tp 2 (ddp; tp native + sp)"),
    ((2, "single", None, 1, 2, None, False, "scratch", "gpipe"), "dp 1 × pp 2 (pp GPipe scratch)"),
    ((8, "ddp", None, 2, 2, "scratch", True, "scratch", "1f1b"),
     "dp 2 × tp 2 × pp 2 (ddp; tp scratch + sp; pp 1F1B scratch)"),
    ((8, "ddp", None, 1, 4, "scratch", True, "native", "interleaved-1f1b", 2),  # tp 1: its settings left out
     "dp 2 × pp 4 (ddp; pp interleaved 1F1B v2 native)"),
    ((4, "fsdp", None, 2), "dp 2 × tp 2 (fsdp)"),  # an old run's event degrees: no implementation known
    ((2, "ddp", None, 3), "ddp, world size 2"),  # degrees that do not divide: not known
])
def test_the_line_of_each_layout(parts, line):
    layout = RunLayout.from_parts(*parts)
    assert layout.label() == line
    assert RunLayout.from_record(json.loads(json.dumps(layout.record()))) == layout  # run.json round trip


def test_presets_and_their_degrees():
    layout = RunLayout.from_preset(load_preset(str(REPO / "presets" / "3d.toml")))
    assert (layout.world_size, layout.dp, layout.tp, layout.pp, layout.tp_impl, layout.pp_impl, layout.pp_schedule,
            layout.sequence_parallel) == (8, 2, 2, 2, "scratch", "scratch", "1f1b", True)
    assert RunLayout.from_preset(load_preset(str(REPO / "presets" / "zero2.toml"))).label() == \
        "dp 2 (deepspeed ZeRO-2)"
    assert RunLayout.from_preset(load_preset(str(REPO / "presets" / "tp.toml"))).label() == \
        "dp 1 × tp 2 (tp scratch + sp)"


def test_an_old_run_falls_back_to_preset_toml_then_to_the_strategy(tmp_path):
    info = {"strategy": "ddp", "zero_stage": None, "world_size": 4}
    assert RunLayout.from_run(tmp_path, info).label() == "ddp, world size 4"  # no preset.toml
    (tmp_path / "preset.toml").write_text('[parallel]\ntp = 2\ntp_impl = "native"\n', encoding="utf-8")
    assert RunLayout.from_run(tmp_path, info).label() == "dp 2 × tp 2 (ddp; tp native)"
    (tmp_path / "preset.toml").write_text("[parallel\n", encoding="utf-8")  # unreadable: never raises
    assert RunLayout.from_run(tmp_path, info).label() == "ddp, world size 4"
    recorded = {**info, LAYOUT_KEY: RunLayout.from_parts(4, "ddp", None, 1, 2, None, False, "native", "gpipe").record()}
    assert RunLayout.from_run(tmp_path, recorded).label() == "dp 2 × pp 2 (ddp; pp GPipe native)"  # the record wins
    assert RunLayout.from_run(None, {"world_size": "x", LAYOUT_KEY: "garbage"}).label() == "-"
    # an old run's step events name the degrees that ran: they win over preset.toml's, not over a record
    assert RunLayout.from_run(tmp_path, info, {"dp": 1, "tp": 1, "pp": 4}).label() == "dp 1 × pp 4"
    assert RunLayout.from_run(tmp_path, info, {"dp": 2, "tp": True}).label() == "ddp, world size 4"  # bad: ignored
    assert RunLayout.from_run(tmp_path, recorded, {"dp": 4}).label() == "dp 2 × pp 2 (ddp; pp GPipe native)"


def test_validate_prints_the_layout():
    from handle_cli.main import cli

    result = CliRunner().invoke(cli, ["validate", str(REPO / "presets" / "3d.toml")])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith(
        ": ok: dp 2 × tp 2 × pp 2 (ddp; tp scratch + sp; pp 1F1B scratch), world size 8, 500 steps")


def test_prepare_run_records_the_layout_in_run_json(tmp_path):
    from torch_handle.launch.run import prepare_run
    from torch_handle.rundir import read_run_info

    _, run_dir = prepare_run(str(REPO / "presets" / "3d.toml"), (f"run.output_dir={tmp_path}",), None, None)
    record = read_run_info(run_dir)[LAYOUT_KEY]
    assert {k: record[k] for k in ("dp", "tp", "pp", "tp_impl", "pp_impl", "pp_schedule", "sequence_parallel")} == \
        {"dp": 2, "tp": 2, "pp": 2, "tp_impl": "scratch", "pp_impl": "scratch", "pp_schedule": "1f1b",
         "sequence_parallel": True}
    assert record["label"] == "dp 2 × tp 2 × pp 2 (ddp; tp scratch + sp; pp 1F1B scratch)"


def test_runs_json_carries_the_layout_of_new_and_old_runs(tmp_path):
    from handle_cli.main import cli

    for source in ("recorded/zero2-finished", "recorded-tp/fsdp-tp", "recorded-pipeline/pp-1f1b"):
        shutil.copytree(FIXTURES / source, tmp_path / Path(source).name)
    new = tmp_path / "pp-1f1b-new"
    shutil.copytree(FIXTURES / "recorded-pipeline/pp-1f1b", new)
    info = json.loads((new / "run.json").read_text())
    info[LAYOUT_KEY] = RunLayout.from_parts(2, "single", None, 1, 2, None, False, "scratch", "1f1b").record()
    (new / "run.json").write_text(json.dumps(info))
    result = CliRunner().invoke(cli, ["runs", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    layouts = {r["name"]: r["layout"] for r in json.loads(result.stdout)}
    assert {name: (x["dp"], x["tp"], x["pp"], x["label"]) for name, x in layouts.items()} == {
        "zero2-finished": (2, 1, 1, "dp 2 (deepspeed ZeRO-2)"),  # preset.toml without [parallel]: tp = pp = 1
        "fsdp-tp": (2, 2, 1, "dp 2 × tp 2 (fsdp)"),  # its step events' degrees
        "pp-1f1b": (1, 1, 2, "dp 1 × pp 2"),
        "pp-1f1b-new": (1, 1, 2, "dp 1 × pp 2 (pp 1F1B scratch)")}  # run.json's record: the implementations
    assert layouts["pp-1f1b-new"]["pp_impl"] == "scratch" and layouts["pp-1f1b-new"]["pp_schedule"] == "1f1b"
    table = CliRunner().invoke(cli, ["runs", str(tmp_path)]).stdout
    assert "LAYOUT" in table and "dp 2 × tp 2 (fsdp)" in table and "dp 1 × pp 2 (pp 1F1B scratch)" in table


def test_run_summary_and_dashboard_state_name_the_layout(tmp_path):
    from handle_cli.runner import summary_text
    from torch_handle.observe.state import RunState

    info = {"status": "finished", "strategy": "ddp", "zero_stage": None, "world_size": 2, "optimizer": "AdamW",
            LAYOUT_KEY: RunLayout.from_parts(2, "ddp", None, 2, 1, "scratch").record()}
    state = RunState(tmp_path, info=info)
    assert "  dp 1 × tp 2 (tp scratch), world size 2, optimizer AdamW" in summary_text(state, tmp_path, info)
    old = {k: v for k, v in info.items() if k != LAYOUT_KEY}
    assert "  ddp, world size 2, optimizer AdamW" in summary_text(RunState(tmp_path, info=old), tmp_path, old)
    ran = RunState(tmp_path, info={"steps": 3})  # handle run's: the events say what the preset does not
    ran.apply([{"kind": "status", "seq": 1, "strategy": "scratch-ddp", "zero_stage": 1},
               {"kind": "step", "seq": 2, "step": 1, "loss": 1.0, "layout": {"dp": 1, "tp": 1, "pp": 2}}])
    assert "  dp 1 × pp 2, world size 2, optimizer AdamW" in summary_text(ran, tmp_path, old)
    scratch = {**old, LAYOUT_KEY: RunLayout.from_parts(2, "scratch-ddp", None).record()}
    assert "  dp 2 (scratch-ddp ZeRO-1), world size 2," in summary_text(ran, tmp_path, scratch)
    state.apply([{"kind": "status", "seq": 1, "strategy": "deepspeed", "zero_stage": 1}])
    assert state.run_layout.strategy_text == "deepspeed ZeRO-1"  # the workers' own strategy, once they say it



@pytest.mark.parametrize("world, tp, pp", [(8, 2, 2), (8, 1, 4), (6, 3, 1), (4, 1, 1), (12, 2, 3)])
def test_rank_names_follow_the_mesh_the_workers_build(world, tp, pp):
    """Every view names a rank by its global rank and its coordinates as the training mesh places it."""
    from torch_handle.common.parallel_dims import ParallelDims

    mesh = ParallelDims(world, tp, pp)
    layout = RunLayout.from_parts(world, "ddp", None, tp, pp)
    for rank in range(world):
        where = {"dp": mesh.dp_rank(rank), "tp": mesh.tp_rank(rank), "pp": mesh.pp_rank(rank)}
        assert layout.coordinates(rank) == where
        assert layout.global_rank(**where) == rank == mesh.rank(where["pp"], where["dp"], where["tp"])
    assert layout.coordinates(world) is None and layout.global_rank(dp=mesh.dp) is None


def test_rank_names():
    layout = RunLayout.from_parts(8, "ddp", None, 2, 2, "scratch", True, "scratch", "1f1b")
    assert layout.rank_name(4) == "rank 4 (dp0 tp0 pp1)" and layout.rank_name(7) == "rank 7 (dp1 tp1 pp1)"
    assert [layout.global_rank(pp=i) for i in range(2)] == [0, 4]  # rank 0's pipeline, as estimate numbers it
    assert layout.pipeline_ranks() == [0, 4] and RunLayout.from_parts(8, "ddp", None, 1, 4).pipeline_ranks() == \
        [0, 2, 4, 6] and RunLayout(world_size=2).pipeline_ranks() is None
    assert layout.degrees_text() == "dp 2 × tp 2 × pp 2"
    assert RunLayout.from_parts(4, "ddp", None, 2).rank_name(3) == "rank 3 (dp1 tp1)"
    assert RunLayout.from_parts(2, "ddp", None).rank_name(1) == "rank 1"  # data parallel only: the rank says it
    unknown = RunLayout(world_size=4, strategy="ddp")
    assert unknown.rank_name(3) == "rank 3" and unknown.degrees_text() == "ddp, world size 4"


def test_a_qlora_run_is_named_qlora_in_the_summary_and_the_dashboard_header(tmp_path):
    """A run of presets/lora.toml with method = "qlora" keeps its preset's name, "lora": the method is named beside
    it (run.json's finetune record; preset.toml's [finetune] for a run from before the record), NF4 included."""
    from handle_cli.runner import summary_text
    from handle_cli.tui.header import StatusHeader
    from torch_handle.observe.state import RunState

    info = {"status": "finished", "preset": "presets/lora.toml", "strategy": "ddp", "world_size": 2,
            "optimizer": "AdamW", "finetune": {"method": "qlora", "rank": 8},
            LAYOUT_KEY: RunLayout.from_parts(2, "ddp", None).record()}
    state = RunState(tmp_path, info=info)
    assert "  dp 2 (ddp), world size 2, optimizer AdamW, QLoRA r8 (NF4 base)" in summary_text(state, tmp_path, info)
    header = StatusHeader()
    header.state = state
    first = header.lines(200)[0].plain
    assert "lora  dp 2 (ddp)" not in first and "lora  QLoRA r8 (NF4 base)  dp 2 (ddp)" in first
    old = {k: v for k, v in info.items() if k != "finetune"}
    (tmp_path / "preset.toml").write_text('[finetune]\nmethod = "lora"\nrank = 4\n')
    assert RunState(tmp_path, info=old).finetune == "LoRA r4"
    (tmp_path / "preset.toml").write_text('[finetune]\nmethod = "none"\n')
    assert RunState(tmp_path, info=old).finetune is None
    assert "LoRA" not in summary_text(RunState(tmp_path, info=old), tmp_path, old)
