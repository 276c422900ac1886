"""Helpers of the dashboard's tests (tests/test_tui*.py): run an async pilot test, wait for the replayed history,
read what the screen shows."""

from __future__ import annotations

import asyncio
import functools
import io
import shutil
import time
from pathlib import Path

from rich.console import Console

from handle_cli.tui.app import HandleDashboard


def async_test(fn):
    """Run an ``async def`` test with ``asyncio.run`` (no pytest async plugin needed)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return run


async def wait_for(pilot, condition, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def loaded(pilot) -> None:
    """Wait until the first batch (the replayed history) is applied and drawn."""
    app = pilot.app
    await wait_for(pilot, lambda: app.batches_applied >= 1, what="the first batch")
    await pilot.pause(0.15)  # the throttled redraw
    await pilot.pause()


def header(app: HandleDashboard) -> str:
    """The status header's text (the widget on the main screen, also while the picker or help is on top)."""
    return app.header_widget.plain


def screen_text(app: HandleDashboard) -> str:
    """What the terminal shows now, as plain text (the frame the snapshot tests save as SVG): what a user can
    see, scrolled-out lines and hidden panels left out."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, color_system="truecolor",
                      record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


def step_event(step: int) -> dict:
    """A step event of a run of 100 steps at 0.5 s a step (tests that fabricate a live run)."""
    return {"seq": step, "time": 1767700001.0 + step * 0.5, "kind": "step", "step": step, "loss": 9.0 - step * 0.01,
            "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 4000.0, "step_time_s": 0.5, "tokens": 2048}


def copy_runs(source: Path, tmp_path: Path, monkeypatch) -> Path:
    """A copy of ``source``'s recorded runs at ./runs, the working directory moved to ``tmp_path`` (relative, so
    what the screens show does not depend on tmp_path); returns ``Path("runs")``."""
    shutil.copytree(source, tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    return Path("runs")
