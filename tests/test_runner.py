"""`handle run`'s terminal output: the progress line and the summary, and that log text cannot inject control
sequences into the user's terminal."""

from __future__ import annotations

from pathlib import Path

from handle_cli.runner import progress_line, summary_text
from torch_handle.observe.state import RunState


def test_progress_line_before_and_after_the_first_step():
    s = RunState(Path("runs/x"), info={"steps": 10})  # what `handle run` starts with: the preset's total
    assert progress_line(s).startswith("step 0/10") and "ETA --:--" in progress_line(s)
    s.apply([{"kind": "step", "step": 5, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 1234.0, "step_time_s": 1.0}])
    line = progress_line(s)
    assert "step 5/10" in line and "loss 2.5000" in line and "1,234 tok/s" in line and "ETA 00:05" in line


def test_summary_escapes_control_sequences_from_logs():
    s = RunState(Path("runs/x"))
    s.apply([{"kind": "step", "step": 1, "loss": 1.0, "memory": [{"rank": 0, "param_bytes": 2048, "rss_bytes": 1}]}])
    text = summary_text(s, Path("runs/x"), {"status": "failed", "message": "boom \x1b[2J\x1b]0;pwned\x07 done",
                                             "strategy": "deepspeed", "zero_stage": 2, "world_size": 2})
    assert "\x1b" not in text and "\x07" not in text
    assert "failed: runs/x" in text and "deepspeed ZeRO-2" in text and "params 2.0 KiB" in text
