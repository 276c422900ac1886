"""The events layer, in-process and fast: the tail reader, the fold of events into run state, the writer's sinks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torch_handle.observe.fields import BREAKDOWN, MEMORY, Kind, Level, Status
from torch_handle.observe.state import RunState
from torch_handle.observe.tail import EventReader, Tail, integer, number, read_tail, tail_events
from torch_handle.hookspecs import hookimpl
from torch_handle.registry import PluginInfo, PluginRegistry
from torch_handle.observe.telemetry import EventWriter, NullEventWriter, Sink, last_seq


def append(path: Path, text: str | bytes) -> None:
    with open(path, "ab") as f:
        f.write(text.encode() if isinstance(text, str) else text)


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------------------
# the tail reader
# ---------------------------------------------------------------------------------------------------------------


def test_tail_keeps_a_partial_line_until_its_newline(tmp_path):
    path = tmp_path / "f.log"
    tail = Tail(path)
    assert tail.poll() == []  # no file yet: nothing, no error
    path.write_bytes(b"one\ntw")
    assert tail.poll() == [b"one"]
    assert tail.poll() == []
    append(path, "o\n\nthree\n")
    assert tail.poll() == [b"two", b"", b"three"]
    assert tail.line_no == 4


def test_tail_starts_over_after_truncation_and_replacement(tmp_path):
    path = tmp_path / "f.log"
    path.write_bytes(b"a long first line\nsecond\n")
    tail = Tail(path)
    assert tail.poll() == [b"a long first line", b"second"]
    path.write_bytes(b"new\n")  # truncated (shorter than what was read)
    assert tail.poll() == [b"new"] and tail.line_no == 1
    tmp = tmp_path / "g.log"
    tmp.write_bytes(b"replaced, and longer than before\nyes\n")
    os.replace(tmp, path)  # another inode, larger: only the inode tells
    assert tail.poll() == [b"replaced, and longer than before", b"yes"]


def test_tail_near_the_end_skips_only_a_cut_line(tmp_path):
    path = tmp_path / "f.log"
    path.write_bytes(b"0123456789\nabc\ndef\n")
    assert Tail(path, start_near_end=6).poll() == [b"def"]  # lands on the "c" of "abc": that line is cut
    # 8 bytes before the end is exactly the start of "abc": the line is whole and kept
    assert Tail(path, start_near_end=8).poll() == [b"abc", b"def"]
    assert Tail(path, start_near_end=1000).poll() == [b"0123456789", b"abc", b"def"]
    # landing inside a line that has no newline yet: skipped once it completes, then lines flow
    path.write_bytes(b"x" * 50)
    tail = Tail(path, start_near_end=10)
    assert tail.poll() == []
    append(path, "yz\nnext\n")
    assert tail.poll() == [b"next"]


def test_tail_caps_runaway_lines_and_reads(tmp_path):
    path = tmp_path / "f.log"
    path.write_bytes(b"x" * 100)
    tail = Tail(path, max_line=64)
    assert tail.poll() == [b"x" * 100]
    path.write_bytes(b"")
    tail = Tail(path, max_read=4)
    append(path, "ab\ncd\nef\n")
    assert tail.poll() == [b"ab"]
    assert tail.poll() == [b"cd"]
    assert tail.poll() == [b"ef"]


def test_event_reader_numbers_bad_lines_from_the_file_start(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventReader(path)
    path.write_text('{"seq":0}\n\nnot json\n[1]\n{"seq":1')
    assert reader.poll() == [{"seq": 0}]
    assert [(b.line_no, b.text) for b in reader.bad_lines] == [(3, "not json"), (4, "[1]")]
    append(path, "}\n")
    assert reader.poll() == [{"seq": 1}]


def test_read_tail_drops_the_cut_first_line_and_keeps_an_unterminated_last_one(tmp_path):
    path = tmp_path / "events.jsonl"
    assert read_tail(path) == [] and tail_events(path) == [] and last_seq(path) == -1
    path.write_text('{"seq":0,"kind":"step"}\n{"seq":1}\n{"seq":2}')
    assert read_tail(path, 100) == [b'{"seq":0,"kind":"step"}', b'{"seq":1}', b'{"seq":2}']
    assert read_tail(path, 19) == [b'{"seq":1}', b'{"seq":2}']  # starts exactly at a line: kept
    assert read_tail(path, 18) == [b'{"seq":2}']  # starts inside '{"seq":1}': dropped
    assert [e["seq"] for e in tail_events(path, 100)] == [0, 1, 2]
    path.write_text('{"seq":7}\n{"seq":"x"}\nnot json\n')
    assert last_seq(path) == 7


def test_number_coercion():
    assert [number(x) for x in (1, 2.5, True, "3", None, float("nan"), float("inf"))] == [1.0, 2.5] + [None] * 5
    assert integer(2.9) == 2 and integer("2") is None


# ---------------------------------------------------------------------------------------------------------------
# the fold
# ---------------------------------------------------------------------------------------------------------------


def step(seq: int, n: int, **fields) -> dict:
    return {"seq": seq, "time": 100.0 + seq, "kind": Kind.STEP, "step": n, "loss": 5.0 - n / 10, "lr": 1e-3,
            "tokens_per_s": 1000.0 * n, "step_time_s": 0.5, **fields}


def test_fold_comm_s_is_a_series_like_step_time(tmp_path):
    """``comm_s`` (scratch-ddp's step_stats) folds into a series indexed like ``steps``: None where a step has none
    or a bad value, truncated by a restart."""
    s = RunState(tmp_path)
    s.apply([step(1, 1, comm_s=0.012), step(2, 2), step(3, 3, comm_s="x"), step(4, 4, comm_s=0.02)])
    assert s.comm_s == [0.012, None, None, 0.02] and s.last(s.comm_s) == 0.02
    s.apply([step(5, 2, comm_s=0.03)])
    assert s.steps == [1, 2] and s.comm_s == [0.012, 0.03]


def test_fold_a_restart_truncates_the_series_and_keeps_the_peaks(tmp_path):
    s = RunState(tmp_path)
    s.apply([{"seq": 0, "time": 100.0, "kind": Kind.STATUS, "status": Status.RUNNING, "steps": 10},
             {"seq": 1, "time": 100.5, "kind": Kind.EVAL, "step": 0, "val_loss": 6.0},
             *(step(1 + i, i, memory=[{"rank": 0, "param_bytes": 100 * i}]) for i in range(1, 6)),
             {"seq": 7, "time": 107.0, "kind": Kind.EVAL, "step": 4, "val_loss": 4.0}])
    assert s.steps == [1, 2, 3, 4, 5] and s.val_steps == [0, 4] and s.peak_memory[0]["param_bytes"] == 500
    notices = s.apply([{"seq": 8, "time": 108.0, "kind": Kind.STATUS, "status": Status.RESTARTING, "message": "x"},
                       {"seq": 9, "time": 109.0, "kind": Kind.STATUS, "status": Status.RUNNING, "restart": 1},
                       step(10, 3, loss=9.0, memory=[{"rank": 0, "param_bytes": 1}])])
    assert [n.level for n in notices] == [Level.WARNING, Level.INFO]
    assert s.steps == [1, 2, 3] and len(s.loss) == len(s.lr) == len(s.tokens_per_s) == len(s.step_time_s) == 3
    assert s.last_loss == 9.0 and s.val_steps == [0] and s.first_val_loss == s.last_val_loss == 6.0
    assert s.memory[0] == {"param_bytes": 1} and s.peak_memory[0]["param_bytes"] == 500
    assert s.restarts == 1 and s.status == Status.RUNNING
    # the mean counts every step that ran (the redone one too), without the first 2
    assert s.mean_tokens_per_s == (3000 + 4000 + 5000 + 3000) / 4


def test_fold_keeps_the_activation_bytes_of_a_step_event(tmp_path):
    """The trainer's ``activation_saved_bytes`` (and every other memory figure it writes) reaches the run state:
    the fold once dropped the activation figure. Older events name it ``activation_bytes``."""
    s = RunState(tmp_path)
    s.apply([step(1, 1, memory=[{"rank": 0, "param_bytes": 10, "activation_saved_bytes": 4096}]),
             step(2, 2, memory=[{"rank": 0, "param_bytes": 10, "activation_saved_bytes": 2048}])])
    assert s.memory[0] == {"param_bytes": 10, "activation_saved_bytes": 2048}
    assert s.peak_memory[0]["activation_saved_bytes"] == 4096
    every = {key: i + 1 for i, key in enumerate(MEMORY)}
    s.apply([step(3, 3, memory=[{"rank": 1, **every}])])
    assert s.memory[1] == every
    s.apply([step(4, 4, memory=[{"rank": 2, "activation_bytes": 1024}])])
    assert s.memory[2] == {"activation_saved_bytes": 1024}


def test_fold_has_a_series_for_every_breakdown_field(tmp_path):
    s = RunState(tmp_path)
    s.apply([step(1, 1, **{key: 0.001 * (i + 1) for i, key in enumerate(BREAKDOWN)}), step(2, 2)])
    assert s.breakdown(0) == {key: 0.001 * (i + 1) for i, key in enumerate(BREAKDOWN)}
    assert s.breakdown(1) == dict.fromkeys(BREAKDOWN)


def test_fold_reports_seq_gaps_once_per_gap(tmp_path):
    s = RunState(tmp_path)
    notices = s.apply([step(0, 1), step(1, 2), step(5, 3), step(6, 4)])
    assert s.seq_gaps == 1 and [n.text for n in notices] == ["events 2..4 are missing from the file"]


def test_fold_ignores_bad_values(tmp_path):
    s = RunState(tmp_path)
    notices = s.apply([{"seq": 0, "kind": Kind.STEP, "step": True},  # a bool is no step
                       {"seq": 1, "kind": Kind.STEP, "step": 1, "loss": "nan", "lr": float("inf"),
                        "tokens_per_s": None, "step_time_s": [1], "memory": [{"rank": 0, "rss_bytes": "big"}]},
                       {"seq": 2, "kind": Kind.EVAL, "val_loss": 1.0},  # no step: ignored
                       {"seq": 3, "kind": Kind.LOG, "level": "WARNING", "message": "\x1b[31mhot"},
                       {"seq": 4, "kind": Kind.STATUS, "status": 5, "steps": "ten"},
                       {"seq": 5, "kind": "unknown", "step": 99}])
    assert s.steps == [1] and s.loss == [None] and s.lr == [None] and s.memory == {0: {}}
    assert s.val_steps == [] and s.steps_total is None and s.mean_tokens_per_s is None
    assert [(n.level, n.text) for n in notices] == [(Level.WARNING, "hot")]


def test_status_comes_from_run_json_once_final_else_from_the_events(tmp_path):
    s = RunState(tmp_path)
    assert s.status == Status.STARTING
    s.info = {"status": Status.RUNNING, "steps": 8}
    assert s.status == Status.RUNNING and s.steps_total == 8
    s.apply([{"seq": 0, "time": 1.0, "kind": Kind.STATUS, "status": Status.RESTARTED}])
    assert s.status == Status.RESTARTING
    s.apply([{"seq": 1, "time": 2.0, "kind": Kind.STATUS, "status": Status.FINISHED}])
    assert s.status == Status.FINISHED  # a final event before run.json says so
    s.info = {"status": Status.FAILED, "message": "launcher: rank 1 died", "start_time": 0.0, "end_time": 5.0}
    assert s.status == Status.FAILED and s.message == "launcher: rank 1 died" and s.elapsed_s() == 5.0


def test_eta_only_while_running_time_left_whatever_the_status(tmp_path):
    s = RunState(tmp_path, info={"steps": 10})
    assert s.time_left_s() is None and s.eta_s() is None
    s.apply([step(0, 4)])
    assert s.time_left_s() == 3.0 and s.eta_s() is None  # no status yet: `handle run` shows it, the dashboard not
    s.apply([{"seq": 1, "kind": Kind.STATUS, "status": Status.RUNNING}])
    assert s.eta_s() == 3.0
    s.apply([{"seq": 2, "kind": Kind.STATUS, "status": Status.STOPPED}])
    assert s.eta_s() is None and s.time_left_s() == 3.0


def test_status_constants():
    assert Status.FINAL == ("finished", "failed", "stopped")
    assert Status.RESTARTING in Status.RESTART and Kind.STEP == "step" and Level.WARNING == "warning"


# ---------------------------------------------------------------------------------------------------------------
# the writer and its sinks
# ---------------------------------------------------------------------------------------------------------------


class Recorder(Sink):
    def __init__(self, path: Path | None = None):
        self.events: list[dict] = []
        self.in_file: list[bool] = []
        self.path = path
        self.closed = False

    def emit(self, event):
        self.events.append(event)
        if self.path is not None:
            self.in_file.append(last_seq(self.path) == event["seq"])

    def close(self):
        self.closed = True


class Raising(Sink):
    def __init__(self, error: BaseException = TypeError("bad figure")):
        self.error, self.calls = error, 0

    def emit(self, event):
        self.calls += 1
        raise self.error


def warnings_in(events: list[dict]) -> list[str]:
    return [e["message"] for e in events if e["kind"] == Kind.LOG and e["level"] == Level.WARNING]


@pytest.mark.parametrize("error", [TypeError("bad figure"), SystemExit(3)])
def test_a_raising_sink_is_disabled_with_one_warning_and_the_file_is_complete(tmp_path, error):
    path = tmp_path / "events.jsonl"
    good, bad = Recorder(path), Raising(error)
    w = EventWriter(path, {"bad": bad, "good": good})
    for i in range(1, 6):
        w.emit(Kind.STEP, step=i, loss=1.0 / i)
    w.close()
    events = lines_of(path)
    assert [e["seq"] for e in events] == list(range(6))
    assert [e["step"] for e in events if e["kind"] == Kind.STEP] == [1, 2, 3, 4, 5]
    assert warnings_in(events) == [f"sink 'bad' disabled: {type(error).__name__}: {error} (in emit)"]
    assert bad.calls == 1
    assert good.events == events and all(good.in_file) and good.closed  # JSONL first, then the sinks


def test_sink_factories_and_close_errors(tmp_path):
    path = tmp_path / "events.jsonl"
    good = Recorder()

    class BadClose(Recorder):
        def close(self):
            raise OSError("disk full")

    def boom(run_dir, preset):
        raise ValueError(f"no server for {preset}")

    w = EventWriter(path)
    w.open_sinks({"good": lambda run_dir, preset: good, "none": lambda run_dir, preset: None, "boom": boom,
                  "badclose": lambda run_dir, preset: BadClose()}, tmp_path, "p")
    w.emit(Kind.STATUS, status=Status.RUNNING)
    w.close()
    events = lines_of(path)
    assert warnings_in(events) == ["sink 'boom' disabled: ValueError: no server for p (in its factory)",
                                   "sink 'badclose' disabled: OSError: disk full (in close)"]
    assert [e["seq"] for e in events] == [0, 1, 2]
    assert [e["seq"] for e in good.events] == [0, 1] and good.closed


def test_open_sinks_lets_keyboard_interrupt_through_and_null_writer_does_nothing(tmp_path):
    def interrupt(run_dir, preset):
        raise KeyboardInterrupt

    w = EventWriter(tmp_path / "events.jsonl")
    with pytest.raises(KeyboardInterrupt):
        w.open_sinks({"i": interrupt}, tmp_path, None)
    w.close()
    NullEventWriter().open_sinks({"i": interrupt}, tmp_path, None)  # non-zero ranks: factories never called


# ---------------------------------------------------------------------------------------------------------------
# sink registration
# ---------------------------------------------------------------------------------------------------------------


def plugin(name: str, register_sinks) -> tuple[object, PluginInfo]:
    obj = type(name, (), {"handle_register_sinks": staticmethod(hookimpl(register_sinks))})()
    return obj, PluginInfo(name=name, distribution="test-dist", version="0", builtin=False)


def test_sinks_register_by_name_and_a_failing_plugin_loses_its_sinks():
    reg = PluginRegistry()
    reg.add_plugin(*plugin("one", lambda register: register("tb", lambda run_dir, preset: None, "TensorBoard")))
    assert reg.plugins["one"].status == "loaded" and reg.plugins["one"].registered == {"sink": ["tb"]}
    assert reg.sinks["tb"].plugin == "one" and reg.sinks["tb"].description == "TensorBoard"

    def two(register):
        register("mine", lambda run_dir, preset: None)
        register("tb", lambda run_dir, preset: None)  # taken: the plugin fails, "mine" goes with it

    reg.add_plugin(*plugin("two", two))
    assert reg.plugins["two"].status == "failed" and "already registered by plugin 'one'" in reg.plugins["two"].error
    assert sorted(reg.sinks) == ["tb"] and reg.plugins["two"].registered == {}
    reg.add_plugin(*plugin("three", lambda register: register("x", "not callable")))
    assert reg.plugins["three"].status == "failed" and "factory must be callable" in reg.plugins["three"].error


def test_fold_breakdown_mfu_and_slowest_rank(tmp_path):
    from torch_handle.observe.state import slowest_rank

    state = RunState(tmp_path)
    base = {"kind": "step", "loss": 1.0, "step_time_s": 0.1}
    state.apply([{"seq": 0, "kind": "status", "status": "running", "peak_flops": 2e12},
                 {**base, "seq": 1, "step": 1},
                 {**base, "seq": 2, "step": 2, "data_s": 0.01, "forward_s": 0.03, "backward_s": 0.04,
                  "sync_s": 0.001, "optimizer_s": 0.019, "mfu": 0.25,
                  "ranks": [{"rank": 0, "step_time_s": 0.1, "data_s": 0.01, "wait_s": 0.001},
                            {"rank": 1, "step_time_s": 0.1, "data_s": 0.05, "wait_s": 0.001}]},
                 {**base, "seq": 3, "step": 3, "forward_s": "x", "mfu": None}])
    assert state.peak_flops == 2e12 and state.mfu == 0.25 and state.breakdown_seen
    assert state.forward_s == [None, 0.03, None] and state.data_s == [None, 0.01, None]
    assert state.slowest["rank"] == 1 and state.slowest["lag_s"] == pytest.approx(0.04)
    assert state.slowest["ratio"] == pytest.approx(0.4) and state.slowest["spread_s"] == pytest.approx(0.04)
    state.apply([{**base, "seq": 4, "step": 2}])  # a restart from step 1: the breakdown series are cut too
    assert state.forward_s == [None, None]

    # a rank slow in compute under a strategy whose waits the host sees (scratch-ddp): the others wait longer
    slow = slowest_rank([{"rank": 0, "step_time_s": 0.2, "data_s": 0.0, "wait_s": 0.08},
                         {"rank": 1, "step_time_s": 0.2, "data_s": 0.0, "wait_s": 0.0},
                         {"rank": 2, "step_time_s": 0.2, "data_s": 0.0, "wait_s": 0.08}])
    assert slow["rank"] == 1 and slow["lag_s"] == pytest.approx(0.08) and slow["ratio"] == pytest.approx(0.4)
    even = slowest_rank([{"rank": r, "step_time_s": 0.2, "data_s": 0.001, "wait_s": 0.01} for r in range(4)])
    assert even["lag_s"] == 0 and even["ratio"] == 0
    assert slowest_rank([{"rank": 0, "step_time_s": 0.2}, "junk", {"rank": "x"}]) is None
