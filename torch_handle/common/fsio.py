"""Files written whole or not at all. Standard library only.

A reader (the dashboard, ``handle runs``, a resumed run, another node on a shared filesystem) must never see half
a file: everything is written to a hidden temporary file beside the target and then renamed over it
(``os.replace``, atomic on POSIX within one filesystem). The temporary name carries the host, process and thread,
so that writers on several nodes, processes or threads never share one.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_HOST = os.uname().nodename


def temporary_path(path: Path) -> Path:
    """``DIR/.NAME.<host>.<pid>.<thread>.tmp`` beside ``path``: hidden, and this writer's own."""
    path = Path(path)
    return path.with_name(f".{path.name}.{_HOST}.{os.getpid()}.{threading.get_ident()}.tmp")


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to (by any means: ``tokenizer.save``,
    ``safetensors``); on leaving without an exception it replaces ``path``, otherwise it is removed.

    Raises:
        OSError: when the temporary file cannot be renamed over ``path``.
    """
    tmp = temporary_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def replacing_dir(out: Path) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``out`` to write ``out``'s new content into; on leaving without
    an exception it takes ``out``'s place (an old ``out`` is moved aside, then removed), otherwise it is removed:
    ``out`` is either untouched or complete.

    Raises:
        OSError: the directory cannot be created or renamed (whatever the body raises passes through).
    """
    import shutil

    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        old = out.parent / f".{out.name}.{os.getpid()}.old"
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically.

    Raises:
        OSError: when the file cannot be written.
    """
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: Path, data: Any, *, indent: int | None = 2) -> None:
    """Write ``data`` as JSON (``indent`` spaces, None: one line) and a newline to ``path`` atomically.

    Raises:
        OSError: when the file cannot be written.
        TypeError: when ``data`` is not JSON-serialisable (nothing is written).
    """
    write_text_atomic(path, json.dumps(data, indent=indent) + "\n")


def read_json_object(path: Path, error: type[Exception]) -> dict[str, Any]:
    """The JSON object in ``path`` (run.json, a model directory's config.json).

    Raises:
        FileNotFoundError: no such file (the caller says what the file's absence means).
        error: unreadable or not valid JSON, or JSON that is not an object; one line naming ``path``.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise error(f"{path}: unreadable ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: unreadable (expected a JSON object, got {type(data).__name__})")
    return data


def read_toml(path: Path) -> dict[str, Any] | None:
    """The TOML document at ``path`` as a dict, or None when it is missing, unreadable or not TOML (a display or a
    best-effort lookup, e.g. a run directory's ``preset.toml`` read without loading the preset)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None


def replace_problem(out: Path, force: bool, *, marker: str, kind: str, what: str) -> str | None:
    """Why directory ``out`` may not receive ``what`` (e.g. "the export"), or None: it is a file; or it holds
    something and ``force`` is off; or it holds something that is not a ``kind`` directory (no ``marker`` file
    in it), which even ``force`` does not replace."""
    if out.is_file():
        return f"{out}: is a file (give a directory to write {what} into)"
    if not out.is_dir() or not any(out.iterdir()):
        return None
    if not force:
        return f"{out}: not empty (give --force to replace {kind} directory, or an empty or new directory)"
    if not (out / marker).is_file():
        return f"{out}: not empty and not {kind} directory (no {marker}): --force replaces only those"
    return None
