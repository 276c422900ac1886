"""The run directory: what a run wrote, readable by the CLI, the dashboard and a resumed run.

    runs/<name>-<UTC timestamp>/
        preset.toml     the fully resolved preset (what actually ran)
        run.json        status, strategy, world size, pids, times, restarts
        events.jsonl    rank-0 telemetry (schema: torch_handle.events; written by torch_handle.telemetry)
        logs/           rank<N>.log per rank, launcher.log for torchrun itself
        checkpoints/    step-<N>/ written atomically, newest complete one wins
        tokenizer.json  the BPE tokenizer the run used
        model.safetensors, tensorboard/, traces/

No torch import here.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from torch_handle.errors import RunDirError

PRESET_FILE = "preset.toml"
RUN_FILE = "run.json"
STOP_FILE = "STOP"
"""Created by ``handle run`` on the first Ctrl-C: the workers finish the step, checkpoint and exit."""



def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON via a temporary file and ``os.replace``, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_run_info(run_dir: Path) -> dict[str, Any]:
    """The contents of ``run.json``.

    Raises:
        RunDirError: when ``run_dir`` is not a run directory.
    """
    path = Path(run_dir) / RUN_FILE
    if not Path(run_dir).is_dir():
        what = "no such directory" if not Path(run_dir).exists() else "not a directory"
        raise RunDirError(f"{run_dir}: not a run directory ({what})")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunDirError(f"{run_dir}: not a run directory (no {RUN_FILE})") from None
    except (OSError, ValueError) as e:
        raise RunDirError(f"{path}: unreadable ({' '.join(str(e).split())})") from None
    if not isinstance(info, dict):
        raise RunDirError(f"{path}: unreadable (expected a JSON object, got {type(info).__name__})")
    return info


def update_run_info(run_dir: Path, **fields: Any) -> dict[str, Any]:
    info = read_run_info(run_dir)
    info.update(fields)
    write_json_atomic(Path(run_dir) / RUN_FILE, info)
    return info


def utc_stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")


def create_run_dir(output_dir: Path, name: str, preset_toml: str, info: dict[str, Any],
                   run_dir: Path | None = None) -> Path:
    """Create a run directory with ``preset.toml`` and ``run.json`` in one step.

    Everything is written into a hidden temporary directory that is renamed into place, so a failure leaves
    nothing half-written. Two runs started in the same second get distinct names.

    Raises:
        RunDirError: when the output directory cannot be written or ``run_dir`` exists already.
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise RunDirError(f"{output_dir}: output directory is a file, not a directory (set [run] output_dir)")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"{output_dir}: cannot create output directory ({e.strerror or e})") from None
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise RunDirError(f"{output_dir}: output directory is not writable")
    if run_dir is not None and Path(run_dir).exists():
        raise RunDirError(f"{run_dir}: already exists; use --resume {run_dir} to continue it")
    tmp = Path(output_dir) / f".tmp-{name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        tmp.mkdir()
        (tmp / "logs").mkdir()
        (tmp / "checkpoints").mkdir()
        (tmp / PRESET_FILE).write_text(preset_toml, encoding="utf-8")
        write_json_atomic(tmp / RUN_FILE, info)
        if run_dir is not None:
            Path(run_dir).parent.mkdir(parents=True, exist_ok=True)
            os.rename(tmp, run_dir)
            return Path(run_dir)
        base = output_dir / f"{name}-{utc_stamp()}"
        for i in range(1000):
            target = base if i == 0 else base.with_name(f"{base.name}-{i}")
            try:
                os.rename(tmp, target)  # atomic, and fails if target exists and is not empty
                return target
            except OSError:
                if not target.exists():
                    raise
        raise RunDirError(f"{output_dir}: too many runs named {base.name}")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RunDirError(f"{output_dir}: cannot write run directory ({e.strerror or e})") from None


def list_runs(output_dir: Path) -> list[Path]:
    """Run directories under ``output_dir``, oldest first (by start time in run.json, else mtime)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    runs = [p for p in output_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / RUN_FILE).exists()]

    def started(p: Path) -> float:
        try:
            return float(read_run_info(p).get("start_time") or 0)
        except RunDirError:
            return p.stat().st_mtime

    return sorted(runs, key=lambda p: (started(p), p.name))


def newest_run(output_dir: Path) -> Path | None:
    runs = list_runs(output_dir)
    return runs[-1] if runs else None
