"""The hang watchdog's pure parts: the stack-summary parser, the decision on a fake clock, the flight-recorder
environment, the `hang` event in the fold, the launcher's append beside rank 0's writer, the config check."""

from __future__ import annotations

import json
import threading

import pytest

from torch_handle.config.loader import load_preset
from torch_handle.errors import PresetError
from torch_handle.launch.hang import HangWatchdog, flight_recorder_env
from torch_handle.observe.fields import Kind, Status
from torch_handle.common.testhooks import parse_test_hang
from torch_handle.observe.heartbeat import RankBeat
from torch_handle.observe.stacks import (Frame, call_on_line, describe, main_thread, parse_faulthandler,
                                         parse_py_spy_json, waiting_point)
from torch_handle.observe.state import RunState
from torch_handle.observe.tail import EventReader
from torch_handle.observe.telemetry import EventWriter, append_event

SITE = "/venv/lib/python3.11/site-packages"
STDLIB = "/usr/lib/python3.11"

# what faulthandler wrote for the two ranks of tests/test_hang.py's injected hang (paths shortened)
RANK0 = f"""Thread 0x00007f576de636c0 (most recent call first):
  File "{STDLIB}/threading.py", line 331 in wait
  File "/work/main/torch_handle/observe/watchdog.py", line 152 in _run
  File "{STDLIB}/threading.py", line 1002 in _bootstrap

Current thread 0x00007f576efbfb80 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/work/main/torch_handle/train/trainer.py", line 424 in train_step
  File "/work/main/torch_handle/train/trainer.py", line 614 in train
  File "/work/main/torch_handle/train/worker.py", line 152 in main
  File "/work/main/torch_handle/train/worker.py", line 184 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
"""
RANK1 = f"""Current thread 0x00007f28c874d6c0 (most recent call first):
  File "{STDLIB}/threading.py", line 331 in wait
  File "/work/main/torch_handle/observe/watchdog.py", line 152 in _run

Thread 0x00007f28c9a8ab80 (most recent call first):
  File "/work/main/torch_handle/train/trainer.py", line 423 in train_step
  File "/work/main/torch_handle/train/trainer.py", line 614 in train
  File "/work/main/torch_handle/train/worker.py", line 184 in <module>
"""
SOURCES = {("trainer.py", 423): "time.sleep(self.test_hang[1])  # HANDLE_TEST_HANG_RANK: this rank hangs",
           ("trainer.py", 424): "dist.all_reduce(stats)"}


def source(frame: Frame) -> str:
    return SOURCES.get((frame.file.rsplit("/", 1)[-1], frame.line), "")


def test_faulthandler_dump_names_the_collective_and_the_sleep() -> None:
    threads = parse_faulthandler(RANK0)
    assert [len(t.frames) for t in threads] == [3, 8] and threads[1].current
    main = main_thread(threads, 0x7F576EFBFB80)
    assert main is threads[1]
    assert describe(0, main.frames, source) == "rank 0 in all_reduce (trainer.py:424 train_step)"

    threads = parse_faulthandler(RANK1)
    main = main_thread(threads, 0x7F28C9A8AB80)  # not the "Current thread": the heartbeat thread took the signal
    assert main is threads[1]
    assert describe(1, main.frames, source) == "rank 1 in time.sleep (trainer.py:423 train_step)"


def test_main_thread_without_an_id_is_the_one_running_a_module() -> None:
    threads = parse_faulthandler(RANK1)
    assert main_thread(threads, None) is threads[1]
    assert main_thread([], None) is None


def test_py_spy_json_with_native_frames() -> None:
    text = json.dumps([
        {"pid": 7, "thread_id": 140001, "thread_name": "handle-heartbeat", "os_thread_id": 12, "active": False,
         "owns_gil": False, "frames": [{"name": "wait", "filename": f"{STDLIB}/threading.py", "line": 331}]},
        {"pid": 7, "thread_id": 140000, "thread_name": "MainThread", "os_thread_id": 11, "active": True,
         "owns_gil": False, "frames": [
             {"name": "ncclGroupEnd", "filename": "libnccl.so.2", "module": "libnccl.so.2", "line": 0},
             {"name": "c10d::ProcessGroupNCCL::allreduce", "filename": "ProcessGroupNCCL.cpp", "line": 0},
             {"name": "all_reduce", "filename": f"{SITE}/torch/distributed/distributed_c10d.py", "line": 3252},
             {"name": "wrapper", "filename": f"{SITE}/torch/distributed/c10d_logger.py", "line": 83},
             {"name": "train_step", "filename": "/work/main/torch_handle/train/trainer.py", "line": 424}]}])
    threads = parse_py_spy_json(text)
    main = main_thread(threads, 140000)
    assert main is threads[1] and main.name == "MainThread"
    assert main_thread(threads, None) is threads[1]  # by name
    assert [f.python for f in main.frames] == [False, False, True, True, True]
    assert describe(0, main.frames, source) == "rank 0 in all_reduce (trainer.py:424 train_step)"
    with pytest.raises(ValueError):
        parse_py_spy_json('{"not": "a list"}')


def frames(*specs: tuple[str, int, str]) -> list[Frame]:
    return [Frame(f, line, func) for f, line, func in specs]


def test_waiting_point_picks_the_api_the_run_called() -> None:
    # deepspeed's comm layer wraps torch's: the outermost collective that is not a decorator's inner function
    ds = frames((f"{SITE}/torch/distributed/distributed_c10d.py", 3252, "all_reduce"),
                (f"{SITE}/torch/distributed/c10d_logger.py", 83, "wrapper"),
                (f"{SITE}/deepspeed/comm/torch.py", 210, "all_reduce"),
                (f"{SITE}/deepspeed/comm/comm.py", 117, "timed_op.<locals>.log_wrapper"),  # py-spy's qualname
                (f"{SITE}/deepspeed/runtime/zero/stage_1_and_2.py", 1040, "allreduce_bucket"),
                (f"{SITE}/deepspeed/runtime/engine.py", 2200, "backward"),
                ("/work/main/plugins/strategies/deepspeed.py", 88, "backward"))
    call, where = waiting_point(ds, source)
    assert call == "all_reduce" and where.func == "backward" and where.short == "deepspeed.py:88"
    # all_gather_object calls all_gather: the run asked for all_gather_object
    obj = frames((f"{SITE}/torch/distributed/distributed_c10d.py", 4000, "all_gather"),
                 (f"{SITE}/torch/distributed/c10d_logger.py", 83, "wrapper"),
                 (f"{SITE}/torch/distributed/distributed_c10d.py", 3100, "all_gather_object"),
                 (f"{SITE}/torch/distributed/c10d_logger.py", 83, "wrapper"),
                 ("/work/main/torch_handle/train/trainer.py", 470, "gather_memory"))
    assert describe(0, obj, source) == "rank 0 in all_gather_object (trainer.py:470 gather_memory)"
    # no collective on the stack: the library function the run's code called
    bw = frames((f"{SITE}/torch/autograd/graph.py", 829, "_engine_run_backward"),
                (f"{SITE}/torch/autograd/__init__.py", 347, "backward"),
                (f"{SITE}/torch/_tensor.py", 648, "backward"),
                ("/work/main/plugins/strategies/ddp.py", 61, "backward"))
    assert describe(1, bw, source) == "rank 1 in backward (ddp.py:61 backward)"
    # only library frames (stuck in an import): the innermost Python frame
    lib = frames((f"{STDLIB}/threading.py", 331, "wait"), (f"{STDLIB}/queue.py", 180, "get"))
    assert describe(2, lib, source) == "rank 2 in wait (threading.py:331 wait)"
    assert describe(3, [], source) == "rank 3: no Python frames"


def test_call_on_line() -> None:
    assert call_on_line("time.sleep(self.test_hang[1])  # x(y)") == "time.sleep"
    assert call_on_line("stats = stats.cpu()") == "stats.cpu"
    assert call_on_line("if torch.cuda.is_available():") == "torch.cuda.is_available"
    assert call_on_line("with lock:") == "" and call_on_line("") == ""


def beat(rank: int, progress: int, pid: int = 100) -> RankBeat:
    return RankBeat(rank=rank, pid=pid + rank, create_time=1.0, host="h", progress=progress)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_watchdog_fires_once_per_stall_and_rearms_after_progress() -> None:
    clock = Clock()
    wd = HangWatchdog(5.0, clock=clock)
    assert wd.observe([]) is None  # nothing to watch: nothing decided
    assert wd.observe([beat(0, 1), beat(1, 1)]) is None  # first sight counts as an advance
    clock.t += 4.9
    assert wd.observe([beat(0, 1), beat(1, 1)]) is None
    clock.t += 0.1
    stall = wd.observe([beat(0, 1), beat(1, 1)])
    assert stall is not None and stall.stalled_s == pytest.approx(5.0) and [b.rank for b in stall.ranks] == [0, 1]
    clock.t += 60
    assert wd.observe([beat(0, 1), beat(1, 1)]) is None  # once per stall
    assert wd.observe([beat(0, 2), beat(1, 1)]) is None  # rank 0 moved: re-armed
    clock.t += 5
    assert wd.observe([beat(0, 2), beat(1, 1)]) is not None  # the next stall fires again


def test_one_rank_advancing_is_enough() -> None:
    clock = Clock()
    wd = HangWatchdog(5.0, clock=clock)
    for i in range(10):  # rank 1 waits (a barrier) while rank 0 works (or is busy: the tokenizer)
        assert wd.observe([beat(0, i), beat(1, 7)]) is None
        clock.t += 2
    assert wd.last_advance() == clock.t - 2


def test_a_restarted_process_counts_as_progress_and_a_gone_rank_is_forgotten() -> None:
    clock = Clock()
    wd = HangWatchdog(5.0, clock=clock)
    wd.observe([beat(0, 3), beat(1, 3)])
    clock.t += 4
    assert wd.observe([beat(0, 3, pid=500), beat(1, 3, pid=500)]) is None  # torchrun restarted the group
    clock.t += 4
    assert wd.observe([beat(0, 3, pid=500)]) is None  # rank 1 gone: 4 s since the restart
    clock.t += 1
    assert wd.observe([]) is None  # no rank: nothing decided, state cleared
    assert wd.observe([beat(0, 3, pid=500)]) is None  # seen again: a first sight


def test_watchdog_rejects_a_non_positive_timeout() -> None:
    with pytest.raises(ValueError):
        HangWatchdog(0)


def test_parse_test_hang() -> None:
    assert parse_test_hang("1:3", 1) == (3, 3600.0)
    assert parse_test_hang("1:3:12.5", 1) == (3, 12.5)
    assert parse_test_hang("1:3", 0) is None
    for bad in ("", "1", "x:3", "1:0", "1:3:0", "1:3:4:5", "1:three"):
        assert parse_test_hang(bad, 1) is None, bad


def test_flight_recorder_env_respects_the_user_and_the_torch_version(tmp_path) -> None:
    new = flight_recorder_env(tmp_path, {}, torch_version=(2, 13))
    prefix = str(tmp_path.resolve() / "logs" / "nccl_trace_rank_")
    assert new == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": prefix}
    old = flight_recorder_env(tmp_path, {}, torch_version=(2, 5))
    assert old["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and old["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == prefix
    user = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert flight_recorder_env(tmp_path, user, torch_version=(2, 13)) == {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": prefix}


HANG = {"seq": None, "time": 20.0, "kind": "hang", "source": "launcher", "stacks": "logs/stacks-1.txt",
        "message": "hang: no rank advanced for 6 s (launch.hang_timeout_s = 5): rank 0 in all_reduce (...)"}


def test_the_fold_shows_a_hang_until_the_run_moves(tmp_path) -> None:
    state = RunState(tmp_path, info={"status": "running"})
    state.apply([{"seq": 0, "time": 1.0, "kind": "status", "status": "running", "steps": 10},
                 {"seq": 1, "time": 2.0, "kind": "step", "step": 1, "loss": 5.0}])
    notices = state.apply([HANG])
    assert state.status == Status.HUNG and state.message == HANG["message"]
    assert [(n.level, n.text) for n in notices] == [("error", HANG["message"])]
    assert state.seq_gaps == 0 and state.last_seq == 1  # the launcher's event has no seq of rank 0's
    assert state.eta_s() is None
    notices = state.apply([{"seq": 2, "time": 30.0, "kind": "step", "step": 2, "loss": 4.9}])
    assert state.status == Status.RUNNING and state.hang["stacks"] == "logs/stacks-1.txt"  # kept
    assert "moves again" in notices[0].text and state.seq_gaps == 0


def test_a_final_status_beats_the_hang(tmp_path) -> None:
    state = RunState(tmp_path, info={"status": "failed", "message": HANG["message"] + "; stopped"})
    state.apply([{"seq": 0, "time": 1.0, "kind": "status", "status": "running"}, HANG])
    assert state.status == Status.FAILED and state.message.startswith("hang: ")


def test_launcher_events_interleave_whole_with_rank0s_writer(tmp_path) -> None:
    """Rank 0's EventWriter (a thread, lines over 8 KiB too) and the launcher's O_APPEND writes into one file:
    every line is one whole event."""
    path = tmp_path / "events.jsonl"
    writer = EventWriter(path)
    big = "x" * 20000

    def launcher() -> None:
        for i in range(200):
            append_event(path, Kind.HANG, message=f"hang {i}", pad=big[: i * 50])

    t = threading.Thread(target=launcher)
    t.start()
    for i in range(400):
        writer.emit(Kind.STEP, step=i + 1, loss=1.0, pad=big if i % 3 == 0 else "")
    t.join()
    writer.close()
    reader = EventReader(path)
    events = reader.poll()
    assert not reader.bad_lines
    assert sum(e["kind"] == "hang" for e in events) == 200
    assert [e["seq"] for e in events if e["kind"] == "step"] == list(range(400))
    # rank 0's numbering goes on after a restart: the launcher's null seq is skipped
    assert EventWriter(path)._seq == 400


def test_hang_timeout_must_be_well_below_the_collective_timeout(tmp_path) -> None:
    preset = tmp_path / "p.toml"
    preset.write_text("[launch]\ntimeout_s = 100\nhang_timeout_s = 60\n")
    with pytest.raises(PresetError, match=r"p\.toml:3: launch\.hang_timeout_s: 60 must be at most half of "
                                          r"launch\.timeout_s \(100 s"):
        load_preset(preset)
    preset.write_text("[launch]\ntimeout_s = 100\nhang_timeout_s = 50\non_hang = \"stop\"\n")
    loaded = load_preset(preset)
    assert loaded.launch.hang_timeout_s == 50 and loaded.launch.on_hang == "stop"
    assert load_preset(tmp_path / "p.toml", ("launch.hang_timeout_s=2.5",)).launch.hang_timeout_s == 2.5
    with pytest.raises(PresetError, match="must be > 0"):
        load_preset(preset, ("launch.hang_timeout_s=0",))
    with pytest.raises(PresetError, match="on_hang"):
        load_preset(preset, ("launch.on_hang=kill",))


def test_stopping_the_heartbeat_waits_for_a_write_in_progress(tmp_path, monkeypatch) -> None:
    """A worker ends with os._exit, which kills daemon threads mid-write: stop() must wait for the writer, or a
    temporary .rank0.json.*.tmp stays in heartbeats/ (seen in test_hang)."""
    import time

    import torch_handle.observe.heartbeat as heartbeat
    from torch_handle.common.fsio import write_json_atomic

    writing = threading.Event()

    def slow_write(path, data, **kw):
        writing.set()
        time.sleep(0.3)
        write_json_atomic(path, data, **kw)

    hb = heartbeat.Heartbeat(tmp_path, 0, interval_s=0.01).start()
    monkeypatch.setattr(heartbeat, "write_json_atomic", slow_write)
    assert writing.wait(5.0)
    hb.stop()
    assert not hb._thread.is_alive()
    assert sorted(p.name for p in (tmp_path / "heartbeats").iterdir()) == ["rank0.json"]
