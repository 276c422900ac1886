"""The ``comm`` field of step events: communication seconds per dimension of the layout (observe.comm)."""

from __future__ import annotations

import math

from torch_handle.observe.comm import comm_fields, read_comm
from torch_handle.observe.state import RunState

PIPELINE = {"schedule": "1f1b", "pp": 2, "impl": "scratch",
            "ranks": [{"busy_s": 0.03, "wait_s": 0.004, "idle_s": 0.0},
                      {"busy_s": 0.03, "wait_s": 0.009, "idle_s": 0.001}]}


def test_every_dimension_from_the_field_it_is_read_from() -> None:
    record = {"layout": {"dp": 2, "tp": 2, "pp": 2}, "comm_s": 0.012, "tp_comm_s": 0.03, "pipeline": PIPELINE}
    assert comm_fields(record) == {"comm": {"dp": 0.012, "tp": 0.03, "pp": 0.004}}  # pp: rank 0's receive wait
    assert list(comm_fields(record)["comm"]) == ["dp", "tp", "pp"]


def test_only_dimensions_above_1_and_only_what_was_measured() -> None:
    # tp = 1: its (zero) traffic is not a dimension of this run; pp absent from the layout: no pipeline read
    assert comm_fields({"layout": {"dp": 2, "tp": 1}, "comm_s": 0.5, "tp_comm_s": 0.0}) == {"comm": {"dp": 0.5}}
    # torch DDP/FSDP report no comm_s: dp is left out, not shown as 0
    assert comm_fields({"layout": {"dp": 2, "tp": 2}, "tp_comm_s": 0.0}) == {"comm": {"tp": 0.0}}
    # native TP reports no tp_comm_s, dp = 1: nothing to say
    assert comm_fields({"layout": {"dp": 1, "tp": 2}, "comm_s": 0.1}) == {}
    assert comm_fields({"layout": {"dp": 1, "tp": 1, "pp": 2}, "pipeline": PIPELINE}) == {"comm": {"pp": 0.004}}
    # torch's schedules wait where a stage cannot observe it (wait_s 0 by construction): pp is left out
    native = {**PIPELINE, "impl": "native", "ranks": [{"busy_s": 0.03, "wait_s": 0, "idle_s": 0.01}] * 2}
    assert comm_fields({"layout": {"dp": 1, "tp": 1, "pp": 2}, "pipeline": native}) == {}


def test_no_layout_or_malformed_fields_give_nothing() -> None:
    assert comm_fields({"comm_s": 0.1}) == {}  # a run without a layout in its step events (plain scratch-ddp)
    assert comm_fields({"layout": "dp 2", "comm_s": 0.1}) == {}
    bad = {"layout": {"dp": True, "tp": "2", "pp": 2.0}, "comm_s": 0.1, "tp_comm_s": 0.1,
           "pipeline": {"ranks": "x"}}
    assert comm_fields(bad) == {}
    assert comm_fields({"layout": {"dp": 2, "pp": 2}, "comm_s": math.nan, "pipeline": {"ranks": [None]}}) == {}
    assert comm_fields({"layout": {"dp": 2}, "comm_s": -1.0}) == {}


def test_read_back_in_dimension_order_and_into_the_run_state(tmp_path) -> None:
    assert read_comm({"pp": 0.004, "cp": 0.1, "tp": 0.03, "dp": "x", 3: 1.0}) == {"tp": 0.03, "pp": 0.004, "cp": 0.1}
    assert read_comm({"dp": None}) is None and read_comm([0.1]) is None
    state = RunState(tmp_path)
    step = {"kind": "step", "loss": 1.0, "layout": {"dp": 2, "tp": 2}}
    state.apply([{**step, "step": 1, "comm": {"dp": 0.01, "tp": 0.02}}])
    assert state.comm == {"dp": 0.01, "tp": 0.02}
    state.apply([{**step, "step": 2}])  # the newest step's figures: a step without them clears the line
    assert state.comm is None
