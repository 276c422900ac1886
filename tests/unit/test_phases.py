"""The step breakdown's timer: laps tile the step, micro-batches accumulate, the CUDA path reads events only in
``read()`` (exercised here with a stand-in event class: no GPU on the test machines), profiler ranges."""

from __future__ import annotations

import time

import pytest
import torch

from torch_handle.train import phases
from torch_handle.train.phases import PhaseTimer


def test_laps_tile_and_accumulate_over_micro_batches():
    timer = PhaseTimer("cpu")
    start = time.perf_counter()
    timer.begin()
    for _ in range(2):
        with timer.phase("data"):
            time.sleep(0.01)
        with timer.phase("forward"):
            time.sleep(0.002)
        with timer.phase("backward"):
            pass
    with timer.phase("sync"):
        pass
    with timer.phase("optimizer"):
        pass
    total = time.perf_counter() - start
    parts = timer.read()
    assert list(parts) == list(phases.PHASES)
    assert parts["data"] >= 0.02 and parts["forward"] >= 0.004
    assert sum(parts.values()) == pytest.approx(total, rel=0.02)
    timer.begin()  # a new step forgets the old laps
    with timer.phase("data"):
        pass
    assert timer.read()["forward"] == 0.0


def test_disabled_timer_reads_nothing():
    timer = PhaseTimer("cpu", enabled=False)
    timer.begin()
    with timer.phase("data"):
        pass
    assert timer.read() == {}


class FakeEvent:
    """``torch.cuda.Event`` stand-in: ``record`` stamps a clock, ``elapsed_time`` returns milliseconds."""

    created = 0
    clock = 0.0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        FakeEvent.created += 1
        self.t = None

    def record(self):
        FakeEvent.clock += 1.0  # one "millisecond" per boundary
        self.t = FakeEvent.clock

    def elapsed_time(self, end: "FakeEvent") -> float:
        return end.t - self.t


def test_cuda_path_records_events_and_reads_them_only_at_read(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = PhaseTimer("cpu")
    timer.cuda = True  # the CUDA branch, without a GPU
    for _ in range(3):
        timer.begin()
        for name in ("data", "forward", "backward", "data", "forward", "backward", "sync", "optimizer"):
            with timer.phase(name):
                pass
        parts = timer.read()
    assert parts == {"data": 0.002, "forward": 0.002, "backward": 0.002, "sync": 0.001, "optimizer": 0.001}
    assert FakeEvent.created == 9  # one pool, reused step after step


def test_ranges_appear_in_a_profile_only_while_it_records():
    timer = PhaseTimer("cpu")
    with torch.profiler.profile() as prof:
        timer.begin()
        for name in phases.PHASES:
            with timer.phase(name):
                torch.ones(4).sum()
    names = {e.name for e in prof.events()}
    assert {"handle/data", "handle/forward", "handle/backward", "handle/comm", "handle/optimizer"} <= names
