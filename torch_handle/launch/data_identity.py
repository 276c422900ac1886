"""What data a checkpoint was trained on, so that a resume on other data is refused.

Every checkpoint's ``layout.json`` records, under ``"data"``, the data's identity
(:class:`torch_handle.data.shards.DataIdentity`): the SHA-256 of the run's tokenizer file and, for prepared data
(``tokens``, ``text``, ``pydoc``), the data's fingerprint (a hash of every source's ``meta.json``). A resume compares
them with what the preset reads now:

* ``handle run --resume`` before anything starts (:func:`check_resume`, with the identity the dataset's launcher
  ``prepare`` returned: no torch, one line, exit 2);
* every worker after it built its data (:func:`check_layout`), for the datasets whose identity is known only once
  built (a tokenizer trained at start-up) and for restarts that do not go through the CLI.

A checkpoint written before this record, or data without a fingerprint, is not checked. No torch import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch_handle.common.names import step_of
from torch_handle.data.shards import DataIdentity, file_sha256
from torch_handle.errors import CheckpointError

DATA_KEY = "data"
"""The key of the record in a checkpoint's ``layout.json``."""
_WHAT = {"data_fingerprint": "the prepared data (meta.json of its sources)", "tokenizer_sha256": "the tokenizer"}


def record(identity: DataIdentity | None, tokenizer_path: Path | None = None) -> dict[str, dict[str, str]]:
    """``{"data": {"tokenizer_sha256": ..., "data_fingerprint": ...}}`` for ``layout.json``: the ``identity``'s, or
    without one the hash of ``tokenizer_path`` alone (keys without a value left out; ``{}`` when neither is
    known)."""
    found = identity.record() if identity is not None else \
        {"tokenizer_sha256": file_sha256(Path(tokenizer_path))} if tokenizer_path is not None else {}
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
    steps = sorted(((step, p) for p in root.iterdir() if (step := step_of(p.name)) is not None),
                   reverse=True) if root.is_dir() else []
    for _, path in steps:
        try:
            return path, json.loads((path / "layout.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    return None


def check_resume(run_dir: Path, identity: DataIdentity | None) -> None:
    """A resume of ``run_dir`` on data of ``identity`` (what the dataset's launcher ``prepare`` returned; None: not
    known before the workers build it): compared with the newest checkpoint's record.

    Raises:
        CheckpointError: one line per difference.
    """
    found = newest_layout(run_dir) if identity is not None else None
    if found is None:
        return
    path, layout = found
    if isinstance(layout, dict):
        check_layout(layout, record(identity), path)
