"""A ``text`` run whose data takes longer to prepare than the collective timeout (``launch.timeout_s``) still runs:
the launcher prepares before any worker starts, so no rank waits at a collective while another prepares; and the
workers never prepare: they leave the cache as the launcher left it (issue 45). The test lowers the timeout to its
floor (10 s) and makes the prepare slower than that through its progress callback, instead of growing the corpus."""

from __future__ import annotations

import time
from pathlib import Path

from handle_cli.runner import supervise
from tests.helpers import tiny_preset
from torch_handle.data.cache import CACHE_ENV
from torch_handle.launch.run import prepare_run
from torch_handle.rundir import read_run_info

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"


def _cache_state(cache: Path) -> dict[str, int]:
    return {str(p.relative_to(cache)): p.stat().st_mtime_ns for p in cache.rglob("*")}


def test_a_prepare_longer_than_the_collective_timeout_runs_and_the_workers_never_prepare(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))  # a cache of its own: this run's launcher prepares
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "plays.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:300_000],
                                                   encoding="utf-8")
    (tmp_path / "p.toml").write_text(tiny_preset(tmp_path / "runs", steps=2))
    seen: list[float] = []

    def slow(progress) -> None:  # the prepare's progress: longer than the 10 s collective timeout in all
        if not seen:
            time.sleep(10.5)
        seen.append(progress.bytes)

    t0 = time.monotonic()
    loaded, run_dir = prepare_run(str(tmp_path / "p.toml"), (
        "data.name=text", f"data.path={tmp_path / 'corpus'}", "launch.timeout_s=10", "launch.hang_timeout_s=5"),
        None, None, progress=slow)
    assert seen and time.monotonic() - t0 > 10 and loaded.launch.timeout_s == 10
    prepared = _cache_state(cache)
    assert [p for p in prepared if p.startswith("tokens-") and p.endswith("meta.json")]
    assert supervise(loaded, run_dir, quiet=True) == 0, read_run_info(run_dir).get("message")
    assert read_run_info(run_dir)["status"] == "finished"
    assert _cache_state(cache) == prepared, "a worker wrote into the cache"
    logs = "".join(p.read_text(encoding="utf-8") for p in (run_dir / "logs").glob("*"))
    assert "data " in logs and "preparing" not in logs
