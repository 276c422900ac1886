"""Fine-tuning a base on new text: the text must be encoded with the base's tokenizer, whose ids its embedding
rows were trained on. A ``[model] init_from`` directory that holds a ``tokenizer.json`` (a ``handle export``, a
Hugging Face model directory) therefore decides the tokenizer:

* a dataset that would train its own (``text``/``pydoc`` with no ``data.tokenizer``) gets the base's instead,
  written into the resolved preset (``preset.toml`` shows what ran) and said in one ``note:`` line;
* a dataset that names another tokenizer (``data.tokenizer``, or prepared token directories made with another
  one) is refused with one line, before anything starts: the base's embeddings would meet unrelated ids.

Tokenizers are compared by the SHA-256 of their JSON file. No torch import.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch_handle.data.shards import META_FILE, file_sha256
from torch_handle.errors import DataError

if TYPE_CHECKING:
    from torch_handle.config.loader import Preset

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_file(path: str | Path) -> Path | None:
    """``path`` itself when it is a file, else ``path/tokenizer.json`` when that exists, else None."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    return p / TOKENIZER_FILE if (p / TOKENIZER_FILE).is_file() else None


def base_tokenizer(preset: Preset) -> Path | None:
    """The ``tokenizer.json`` of the preset's ``model.init_from`` directory, or None (no init_from, or none in it)."""
    init_from = getattr(preset.model.options, "init_from", None)
    return tokenizer_file(init_from) if init_from and Path(init_from).is_dir() else None


def _prepared_dirs(options: Any) -> list[Path]:
    """The prepared token directories a dataset's options name (``path`` and each ``sources[*].path`` holding a
    meta.json, or parts of one)."""
    paths = [getattr(options, "path", "")] + [s.get("path", "") if isinstance(s, dict) else getattr(s, "path", "")
                                               for s in getattr(options, "sources", None) or []]
    out = []
    for p in filter(None, paths):
        d = Path(p).expanduser()
        if (d / META_FILE).is_file() or (d.is_dir() and any(d.glob(f"part-*-of-*/{META_FILE}"))):
            out.append(d)
    return out


def _prepared_tokenizer_sha(directory: Path) -> str | None:
    meta = directory / META_FILE
    if not meta.is_file():
        meta = next(iter(sorted(directory.glob(f"part-*-of-*/{META_FILE}"))), None)
    try:
        return json.loads(meta.read_text(encoding="utf-8"))["tokenizer"]["sha256"] if meta else None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the dataset's own checks report an unreadable meta.json


def tokenizer_conflicts(preset: Preset) -> list[str]:
    """One line per tokenizer the dataset names that is not ``model.init_from``'s (empty without a base
    tokenizer)."""
    base = base_tokenizer(preset)
    if base is None:
        return []
    want, options, problems = file_sha256(base), preset.data.options, []
    named = getattr(options, "tokenizer", "")
    if named:
        theirs = tokenizer_file(named)
        if theirs is not None and file_sha256(theirs) != want:
            problems.append(f"data.tokenizer: {named} is not model.init_from's tokenizer ({base}): the base's "
                            f"embeddings index its ids (leave data.tokenizer empty to use the base's)")
    for d in _prepared_dirs(options):
        sha = _prepared_tokenizer_sha(d)
        if sha is not None and sha != want:
            problems.append(f"{d}: prepared with another tokenizer than model.init_from's ({base}); prepare it "
                            f"again with: handle data prepare ... --tokenizer {base.parent}")
    return problems


def check_base_tokenizer(preset: Preset) -> None:
    """Raises:
        DataError: every conflict of :func:`tokenizer_conflicts`, one line each."""
    problems = tokenizer_conflicts(preset)
    if problems:
        raise DataError("\n".join(problems))


def resolve_base_tokenizer(preset: Preset) -> tuple[Preset, str | None]:
    """``(preset, note)``: the preset with ``data.tokenizer`` set to the base's tokenizer when the dataset takes a
    ``tokenizer`` option and names none, and the note that says so; else the preset unchanged and None."""
    base = base_tokenizer(preset)
    if base is None or not hasattr(preset.data.options, "tokenizer") or preset.data.options.tokenizer:
        return preset, None
    out = copy.deepcopy(preset)
    out.data.options.tokenizer = str(base)
    return out, (f"data.tokenizer: using model.init_from's tokenizer {base} (the base's embeddings index its "
                 f"ids; set data.tokenizer to choose)")
