"""The child processes of tests/unit/test_run_info_lock.py: writers of one run.json, each in a process of its own
(``multiprocessing`` spawn imports this module, not the test's: a child starts in a fraction of a second)."""

from __future__ import annotations

import os
from pathlib import Path

from torch_handle.common.testhooks import RUN_INFO_DELAY_ENV
from torch_handle.rundir import modify_run_info, run_info_lock, update_run_info

UPDATES = 15
"""Updates of each :func:`hammer` writer."""


def hammer(run: str, index: int, delay: float, started) -> None:
    """One writer: UPDATES updates of its own field and of the shared counter; writer 0 promotes midway."""
    os.environ[RUN_INFO_DELAY_ENV] = str(delay)
    started.wait()
    for k in range(UPDATES):
        modify_run_info(Path(run), lambda info: {**info, "count": info.get("count", 0) + 1})
        update_run_info(Path(run), **{f"w{index}": k})
        if index == 0 and k == UPDATES // 2:
            from torch_handle.checkpoint.resume import promote  # here: the others start without its imports

            promote(Path(run), 3)


def promote_slowly(run: str, reading) -> None:
    """The launcher promoting a resume, 1 s between its read and its write of run.json."""
    from torch_handle.checkpoint.resume import promote

    os.environ[RUN_INFO_DELAY_ENV] = "1.0"
    reading.set()
    promote(Path(run), 2)


def write_late(run: str, holding) -> None:
    """Rank 0's closing update, still under way when the launcher settles."""
    os.environ[RUN_INFO_DELAY_ENV] = "1.0"
    holding.set()
    update_run_info(Path(run), status="finished", step=4)


def hold(run: str, holding, release) -> None:
    """Hold run.json's lock until ``release`` (or a kill)."""
    with run_info_lock(Path(run)):
        holding.set()
        release.wait(60)
