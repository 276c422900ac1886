"""What data a checkpoint was trained on, so that a resume on other data is refused.

Every checkpoint's ``layout.json`` records, under ``"data"``, the SHA-256 of the run's tokenizer file and, for a
dataset that has one (the ``tokens`` plugin: :attr:`torch_handle.data.shards.Prepared.fingerprint`, a hash of
every source's ``meta.json``), the data's fingerprint. A resume compares them with what the preset reads now:

* ``handle run --resume`` before anything starts (:func:`check_resume`, through the dataset options'
  ``identity()`` method when they have one: no torch, one line, exit 2);
* every worker after it built its data (:func:`check_layout`), for the datasets whose identity is known only once
  built (a tokenizer trained at start-up) and for restarts that do not go through the CLI.

A checkpoint written before this record, or data without a fingerprint, is not checked. No torch import.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from torch_handle.data.shards import file_sha256
from torch_handle.errors import CheckpointError

DATA_KEY = "data"
"""The key of the record in a checkpoint's ``layout.json``."""
_WHAT = {"data_fingerprint": "the prepared data (meta.json of its sources)", "tokenizer_sha256": "the tokenizer"}
_STEP_DIR = re.compile(r"^step-(\d+)$")


def record(tokenizer_path: Path | None, fingerprint: str | None) -> dict[str, dict[str, str]]:
    """``{"data": {"tokenizer_sha256": ..., "data_fingerprint": ...}}`` for ``layout.json`` (keys without a value
    left out; ``{}`` when neither is known)."""
    found = {"tokenizer_sha256": file_sha256(Path(tokenizer_path)) if tokenizer_path is not None else None,
             "data_fingerprint": fingerprint}
    found = {k: v for k, v in found.items() if v}
    return {DATA_KEY: found} if found else {}


def differences(saved: dict[str, Any] | None, now: dict[str, Any] | None, where: Path) -> list[str]:
    """One line per identity key both records have and that differs."""
    saved, now = saved or {}, now or {}
    return [f"{where}: {_WHAT.get(key, key)} changed since this checkpoint ({key} {saved[key][:12]} -> "
            f"{now[key][:12]}): resuming would continue on other tokens; prepare the data as before or start a new "
            f"run" for key in _WHAT if saved.get(key) and now.get(key) and saved[key] != now[key]]


def check_layout(layout: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    """Raises:
        CheckpointError: the checkpoint's record (``layout[DATA_KEY]``) differs from ``now`` (:func:`record`'s
            value), one line per difference."""
    problems = differences(layout.get(DATA_KEY), now.get(DATA_KEY), path)
    if problems:
        raise CheckpointError("\n".join(problems))


def newest_layout(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest ``checkpoints/step-N`` with a readable ``layout.json``, and that layout; None if none."""
    root = Path(run_dir) / "checkpoints"
    steps = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))),
                   reverse=True) if root.is_dir() else []
    for _, path in steps:
        try:
            return path, json.loads((path / "layout.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    return None


def check_resume(run_dir: Path, options: Any) -> None:
    """A resume of ``run_dir`` with the dataset ``options``: when they have an ``identity()`` (``{"data_fingerprint",
    "tokenizer_sha256"}`` or None), compare it with the newest checkpoint's record.

    Raises:
        CheckpointError: one line per difference.
    """
    identity = getattr(options, "identity", None)
    found = newest_layout(run_dir) if callable(identity) else None
    if found is None:
        return
    path, layout = found
    now = identity()
    if isinstance(layout, dict) and now:
        check_layout(layout, {DATA_KEY: now}, path)
