"""Test hooks: environment variables that make one rank slow or hung, so that tests can create what the launcher
and the dashboard must notice. Each is ``RANK:VALUE[:VALUE]`` and acts on rank ``RANK`` only; an empty or
malformed value does nothing (:data:`RUN_INFO_DELAY_ENV`, for every process, is plain SECONDS). Standard library
only.
"""

from __future__ import annotations

DELAY_ENV = "HANDLE_TEST_DELAY_RANK"
"""``RANK:SECONDS`` (e.g. ``1:0.05``): that rank sleeps SECONDS in the data phase of every micro-batch (a slow input
pipeline; :func:`parse_test_delay`)."""
HANG_ENV = "HANDLE_TEST_HANG_RANK"
"""``RANK:STEP[:SECONDS]``: that rank sleeps SECONDS (default 3600) before the loss all-reduce of step STEP
(1-based), so its peers wait in the collective (:func:`parse_test_hang`). ``RANK:STEP:SECONDS:MB`` (a pipeline
run): it sleeps inside the schedule instead, before the forward of micro-batch MB (0-based) of its first stage,
so the other stages wait in their receives (:func:`parse_test_stall`)."""
RUN_INFO_DELAY_ENV = "HANDLE_TEST_RUN_INFO_DELAY"
"""``SECONDS``: every writer of run.json (launcher and workers) sleeps that long between reading it and writing it
back (:func:`torch_handle.rundir.modify_run_info`), which makes an unserialized read-modify-write lose updates."""


def rank_values(spec: str, rank: int, counts: tuple[int, ...]) -> list[str] | None:
    """The values of ``RANK:V1[:V2...]`` (stripped) when RANK is ``rank`` and there are ``counts`` of them, else
    None: ``rank_values("1:3:12.5", 1, (1, 2))`` -> ``["3", "12.5"]``."""
    target, *values = (p.strip() for p in spec.split(":"))
    try:
        return values if len(values) in counts and int(target) == rank else None
    except ValueError:
        return None


def parse_seconds(spec: str) -> float:
    """``spec`` as seconds > 0 (:data:`RUN_INFO_DELAY_ENV`); 0.0 for an empty, invalid or non-positive one."""
    try:
        seconds = float(spec.strip())
    except ValueError:
        return 0.0
    return seconds if 0 < seconds < float("inf") else 0.0


def parse_test_delay(spec: str, rank: int) -> float:
    """Seconds that ``rank`` sleeps per micro-batch under :data:`DELAY_ENV` = ``spec``; 0.0 for other ranks or an
    empty/invalid spec."""
    values = rank_values(spec, rank, (1,))
    try:
        return float(values[0]) if values and float(values[0]) > 0 else 0.0
    except ValueError:
        return 0.0


def parse_test_hang(spec: str, rank: int) -> tuple[int, float] | None:
    """``(STEP, SECONDS)`` of :data:`HANG_ENV` = ``spec`` for ``rank``; None for another rank or an empty/invalid
    spec. SECONDS defaults to 3600 (a hang that only a kill ends)."""
    values = rank_values(spec, rank, (1, 2))
    if values is None:
        return None
    try:
        step, seconds = int(values[0]), float(values[1]) if len(values) == 2 else 3600.0
    except ValueError:
        return None
    return (step, seconds) if step >= 1 and seconds > 0 else None


def parse_test_stall(spec: str, rank: int) -> tuple[int, float, int] | None:
    """``(STEP, SECONDS, MB)`` of :data:`HANG_ENV` = ``RANK:STEP:SECONDS:MB`` for ``rank``; None for another rank,
    the forms without MB, or an invalid spec."""
    values = rank_values(spec, rank, (3,))
    if values is None:
        return None
    try:
        step, seconds, microbatch = int(values[0]), float(values[1]), int(values[2])
    except ValueError:
        return None
    return (step, seconds, microbatch) if step >= 1 and seconds > 0 and microbatch >= 0 else None
