"""events.jsonl: the writer's seq numbering and flushing, the reader's handling of growing and bad files."""

from __future__ import annotations

import json

from torch_handle.telemetry import EventReader, EventWriter, RunSummary, last_seq


def test_writer_numbers_events_and_continues_after_reopen(tmp_path):
    path = tmp_path / "events.jsonl"
    w = EventWriter(path)
    w.emit("status", status="running", steps=3)
    w.emit("step", step=1, loss=2.0)
    w.close()
    w = EventWriter(path)  # a resumed run
    w.emit("step", step=2, loss=1.5)
    w.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["seq"] for e in events] == [0, 1, 2]
    assert last_seq(path) == 2
    assert all(isinstance(e["time"], float) for e in events)


def test_reader_waits_for_a_partial_line_and_reports_bad_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventReader(path)
    assert reader.poll() == []
    path.write_text('{"seq":0,"kind":"step","step":1}\n{"seq":1,"ki')
    assert [e["seq"] for e in reader.poll()] == [0]
    with open(path, "a") as f:
        f.write('nd":"step","step":2}\nnot json\n[1,2]\n{"seq":2,"kind":"eval","val_loss":1.0}\n')
    assert [e["seq"] for e in reader.poll()] == [1, 2]
    assert [b.line_no for b in reader.bad_lines] == [3, 4]


def test_summary_tracks_progress_memory_peaks_and_eta():
    s = RunSummary()
    s.update({"kind": "status", "status": "running", "steps": 10, "time": 100.0})
    for step in range(1, 5):
        s.update({"kind": "step", "step": step, "loss": 5.0 - step, "lr": 1e-3, "tokens_per_s": 1000.0 * step,
                  "step_time_s": 0.5, "time": 100.0 + step,
                  "memory": [{"rank": 0, "param_bytes": 10 * step, "rss_bytes": 5}]})
    s.update({"kind": "eval", "step": 4, "val_loss": 1.5})
    assert (s.step, s.loss, s.val_loss) == (4, 1.0, 1.5)
    assert s.peak_memory[0]["param_bytes"] == 40
    assert s.eta_s() == 3.0
    assert s.mean_tokens_per_s == 3500.0


def test_summary_ignores_fields_of_the_wrong_type():
    s = RunSummary()
    for bad in ({"kind": "step", "step": "x", "loss": "nan?", "tokens_per_s": "fast", "memory": "x"},
                {"kind": "step", "step": 2, "memory": [{"rank": "a"}, 3, {"rank": 1, "rss_bytes": "big"}]},
                {"kind": "eval", "val_loss": None}, {"kind": "status", "status": 5, "steps": "ten"}):
        s.update(bad)
    assert s.step == 2 and s.loss is None and s.val_loss is None and s.mean_tokens_per_s is None
    assert s.peak_memory == {1: {}}


def test_non_finite_figures_are_written_as_null(tmp_path):
    path = tmp_path / "events.jsonl"
    w = EventWriter(path)
    w.emit("step", step=1, loss=float("nan"), grad_norm=float("inf"), skipped=True)
    w.close()
    line = path.read_text()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line)["loss"] is None
