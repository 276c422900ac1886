"""``handle profile RUN --pipeline``: the schedule of a step as it ran, from the recorded pp = 2 run (a golden
text) and from a real pp = 2 run (its structure: rows, the schedule's order per rank, the bubble line)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from handle_cli.main import cli
from tests.helpers import tiny_preset
from torch_handle.observe.pipeline_view import (format_pipeline, gantt_rows, nearest_drawn, pipeline_steps,
                                                steps_text)
from torch_handle.parallel.pipeline.schedules import one_f_one_b

FIXTURE = Path(__file__).parent / "fixtures" / "recorded-pipeline" / "pp-1f1b"

GOLDEN = """\
step 12 · 1f1b (scratch) · pp 2 · m 4 · window 32.0 ms
        0                 8.0               16.0              24.0       32.0 ms
rank 0  F0██F1███~~~~~~~~~~~B0▓▓▓▓▓▓▓F2███B1▓▓▓▓▓▓▓F3██~~B2▓▓▓▓▓▓▓~~~~~B3▓▓▓▓▓▓▓
rank 1  ~~~~~~F0██B0▓▓▓▓▓▓▓F1███B1▓▓▓▓▓▓▓~~F2██B2▓▓▓▓▓▓▓F3███B3▓▓▓▓▓▓▓··········
        F forward  B backward  W weight grad  ~ recv wait  · idle
           busy   wait   idle  ms
rank 0     24.0    8.0   0.00     ██████████████████████████████████~~~~~~~~~~~~
rank 1     24.0    3.5    4.5     ██████████████████████████████████~~~~~~······
bubble measured 25.0%  theory 20.0% = (p-1)/(m+p-1), p 2 m 4"""


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def _tokens(row: str) -> list[tuple[str, str]]:
    """The compute cells' labels of one chart row, in order: (kind, micro-batch digits or "" when cut)."""
    return re.findall(r"([FBW])(\d*)", row)


def test_recorded_run_golden() -> None:
    steps = pipeline_steps(_events(FIXTURE))
    step, pipeline = steps[-1]
    assert step == 12 and len(steps) == 12
    text = format_pipeline(pipeline, step=step)
    assert text == GOLDEN
    assert max(len(line) for line in text.splitlines()) <= 80


def test_every_compute_span_keeps_a_column_in_order() -> None:
    """Spans far shorter than a column (a microsecond forward beside a second-long wait) still show, in order."""
    tiny = [[0, "F", i, 0, 1e-6 * i, 1e-6 * i + 5e-7] for i in range(6)]
    pipeline = {"pp": 1, "window_s": 1.0, "timeline": tiny + [[0, "recv", 0, 0, 0.5, 1.0], [0, "B", 10, 0, 0.99, 1.0]]}
    (row,) = gantt_rows(pipeline, 20)
    assert _tokens(row.text) == [("F", str(i)) for i in range(6)] + [("B", "10")]  # room for every label
    assert row.text.endswith("B10") and "~" in row.text and len(row.text) == 20
    (row,) = gantt_rows(pipeline, 12)  # no room for the labels: a kind letter each, still in order
    assert [k for k, _ in _tokens(row.text)] == ["F"] * 6 + ["B"] and row.text.endswith("B") and len(row.text) == 12


def test_rows_are_global_ranks_of_a_3d_run() -> None:
    """The recorded dp 2 × tp 2 × pp 2 run: rank 0's pipeline is ranks 0 and 4 (dp 0, tp 0), as handle estimate
    and the dashboard name them, not pipeline ranks 0 and 1."""
    out = CliRunner().invoke(cli, ["profile", str(FIXTURE.parents[1] / "recorded-3d" / "3d-running"), "--pipeline"])
    assert out.exit_code == 0, out.output
    rows = [line.split("  ")[0] for line in out.output.splitlines() if line.startswith("rank ")]
    assert rows == ["rank 0", "rank 4"] * 2 and out.output.startswith("step 35 · 1f1b (scratch) · pp 2 · m 4")


def test_narrow_rows_keep_every_micro_batch_label() -> None:
    """At 80x24 the dashboard's chart has about 29 columns for a 1F1B step of 4 micro-batches: the spans move off
    their time rather than lose their micro-batch (``F0`` drawn as ``F``)."""
    _, pipeline = pipeline_steps(_events(FIXTURE))[-1]
    for width in (16, 20, 29, 40):
        rows = gantt_rows(pipeline, width)
        assert [_tokens(row.text) for row in rows] == [
            [(a.kind, str(a.microbatch)) for a in one_f_one_b(2, rank, 4)] for rank in range(2)], width
        assert all(len(row.text) == width for row in rows)


def test_one_row_per_stage_when_a_rank_runs_several() -> None:
    timeline = [[r, "F", 0, s, 0.001 * s, 0.001 * s + 0.001] for r, stages in ((0, (0, 2)), (1, (1, 3)))
                for s in stages]
    rows = gantt_rows({"pp": 2, "v": 2, "timeline": timeline}, 40)
    assert [row.label for row in rows] == ["r0 s0", "r0 s2", "r1 s1", "r1 s3"]
    text = format_pipeline({"pp": 2, "v": 2, "microbatches": 4, "bubble": 0.5, "bubble_theory": 1 / 9,
                            "timeline": timeline, "ranks": [{"busy_s": 0.002}] * 2})
    assert "theory 11.1% = (p-1)/(v·m+p-1), p 2 v 2 m 4" in text


def test_the_nearest_step_with_spans_and_the_steps_named_in_one_line() -> None:
    drawn = [(4, {"id": "a"}), (8, {}), (4, {"id": "b"})]  # step 4 ran twice (a restart): the later one counted
    assert nearest_drawn(drawn, 5) == (4, {"id": "b"}) and nearest_drawn(drawn, 6)[0] == 4
    assert nearest_drawn(drawn, 7)[0] == 8 and nearest_drawn(drawn, 100)[0] == 8
    assert steps_text([12, 4, 8, 4]) == "4, 8, 12" and steps_text([]) == "none"
    assert steps_text(range(10, 1001, 10)) == "10, 20, 30, …, 990, 1000 (100 steps)"


def test_cli_draws_prints_json_and_refuses_what_it_cannot_draw(tmp_path: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(cli, ["profile", str(FIXTURE), "--pipeline"])
    assert out.exit_code == 0 and out.output.rstrip("\n") == GOLDEN
    out = runner.invoke(cli, ["profile", str(FIXTURE), "--pipeline", "--step", "8", "--json"])
    assert out.exit_code == 0
    assert json.loads(out.output) == dict(pipeline_steps(_events(FIXTURE)))[8]
    # step 5 is not a log step (log_every 4): it kept figures but no spans; the nearest step that has them is drawn
    out = runner.invoke(cli, ["profile", str(FIXTURE), "--pipeline", "--step", "5"])
    assert out.exit_code == 0 and out.stdout.startswith("step 4 · 1f1b") and "F0" in out.stdout
    assert out.stderr == ("note: step 5 kept no spans: a pipeline timeline is recorded on log steps only "
                          "(training.log_every); steps with spans: 4, 8, 12; drawing step 4, the nearest\n")
    for asked, drawn in ((6, 4), (7, 8), (1, 4)):  # a tie goes to the earlier one
        out = runner.invoke(cli, ["profile", str(FIXTURE), "--pipeline", "--step", str(asked)])
        assert out.stdout.startswith(f"step {drawn} · ") and out.stderr.endswith(f"drawing step {drawn}, the nearest\n")
    out = runner.invoke(cli, ["profile", str(FIXTURE), "--pipeline", "--step", "5", "--json"])  # the data asked for
    assert json.loads(out.stdout) == dict(pipeline_steps(_events(FIXTURE)))[5] and "timeline" not in out.stdout
    assert out.stderr.startswith("note: step 5 kept no spans") and "drawing" not in out.stderr
    out = runner.invoke(cli, ["profile", str(FIXTURE), "--pipeline", "--step", "99"])
    assert out.exit_code == 2 and "--step 99 has no pipeline figures; steps with a timeline: 4, 8, 12" in out.output
    plain = Path(__file__).parent / "fixtures" / "recorded" / "zero2-finished"
    out = runner.invoke(cli, ["profile", str(plain), "--pipeline"])
    assert out.exit_code == 2 and "no pipeline steps" in out.output and len(out.output.strip().splitlines()) == 1
    assert "handle profile runs/tiny-20260101-120000 --pipeline" in runner.invoke(cli, ["profile", "--help"]).output


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """A real pp = 2 run: scratch 1F1B, m = 4, fp32, dropout 0, 3 steps with a timeline on each."""
    root = tmp_path_factory.mktemp("pp-view")
    preset = root / "tiny.toml"
    preset.write_text(tiny_preset(root / "runs", steps=3, strategy="single", log_every=1))
    proc = subprocess.run([sys.executable, "-m", "handle_cli", "run", str(preset), "--set", "run.name=pp",
                           "--set", "launch.nproc_per_node=2", "--set", "parallel.pp=2",
                           "--set", "parallel.pp_impl=scratch", "--set", "parallel.pp_schedule=1f1b",
                           "--set", "parallel.pp_microbatches=4", "--set", "model.dropout=0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return Path(next(ln for ln in proc.stdout.splitlines() if ln.startswith("run directory: ")).split(": ", 1)[1])


def test_a_real_run_drawn(real_run: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "handle_cli", "profile", str(real_run), "--pipeline"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("step 3 · 1f1b (scratch) · pp 2 · m 4 · window ")
    assert max(len(line) for line in lines) <= 80
    rows = {int(m.group(1)): m.group(2) for m in (re.match(r"rank (\d)  (\S{72})$", ln) for ln in lines) if m}
    assert sorted(rows) == [0, 1]
    for rank, row in rows.items():
        planned = [(a.kind, str(a.microbatch)) for a in one_f_one_b(2, rank, 4)]
        drawn = _tokens(row)
        assert [k for k, _ in drawn] == [k for k, _ in planned], (rank, row)
        assert all(mb in ("", want) for (_, mb), (_, want) in zip(drawn, planned)), (rank, row)
    busy = [ln for ln in lines if re.match(r"rank \d +[\d.]+ +[\d.]+ +[\d.]+ +[█~·]+$", ln)]
    assert len(busy) == 2
    assert re.fullmatch(r"bubble measured \d+\.\d% {2}theory 20\.0% = \(p-1\)/\(m\+p-1\), p 2 m 4", lines[-1])
