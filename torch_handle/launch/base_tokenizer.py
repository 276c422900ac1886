"""Fine-tuning a base on new text: the text must be encoded with the base's tokenizer, whose ids its embedding
rows were trained on. A ``[model] init_from`` directory that holds a ``tokenizer.json`` (a ``handle export``, a
Hugging Face model directory) therefore decides the tokenizer:

* a dataset that would train its own (``text``/``pydoc`` with no ``data.tokenizer``) gets the base's instead,
  written into the resolved preset (``preset.toml`` shows what ran) and said in one ``note:`` line;
* a dataset that names another tokenizer (``data.tokenizer``, or prepared token directories made with another
  one) is refused with one line, before anything starts: the base's embeddings would meet unrelated ids;
* conversations prepared on the base's tokenizer with a template's special tokens added (``meta.json``'s
  ``tokenizer.extends`` holds the base's hash) are the base's ids plus new ones at the end: accepted, and the run
  grows the base's embedding and output rows (:mod:`torch_handle.finetune.vocab`).

Tokenizers are compared by the SHA-256 of their JSON file. No torch import.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch_handle.data.shards import META_FILE, file_sha256, open_prepared, tokenizer_problem
from torch_handle.data.tokenizer_file import find_tokenizer
from torch_handle.errors import DataError

if TYPE_CHECKING:
    from torch_handle.config.loader import Preset


def base_tokenizer(preset: Preset) -> Path | None:
    """The ``tokenizer.json`` of the preset's ``model.init_from`` directory, or None (no init_from, or none in it)."""
    init_from = getattr(preset.model.options, "init_from", None)
    return find_tokenizer(init_from) if init_from and Path(init_from).is_dir() else None


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


def tokenizer_conflicts(preset: Preset) -> list[str]:
    """One line per tokenizer the dataset names that is not ``model.init_from``'s (empty without a base
    tokenizer)."""
    base = base_tokenizer(preset)
    if base is None:
        return []
    want, options, problems = file_sha256(base), preset.data.options, []
    named = getattr(options, "tokenizer", "")
    theirs = find_tokenizer(named) if named else None
    if theirs is not None and (problem := tokenizer_problem(
            f"data.tokenizer: {named} is", file_sha256(theirs), want, f"model.init_from's ({base})",
            "the base's embeddings index its ids (leave data.tokenizer empty to use the base's)")):
        problems.append(problem)
    for d in _prepared_dirs(options):
        try:
            prepared = open_prepared(d)
            sha = prepared.identity().tokenizer_sha256
        except DataError:
            continue  # the dataset's own checks report an unreadable directory
        if (prepared.meta["tokenizer"].get("extends") or {}).get("sha256") == want:
            continue  # the base's tokenizer plus a template's tokens (--chat): the run grows the base's rows
        if problem := tokenizer_problem(f"{d} was prepared with", sha, want, f"model.init_from's ({base})",
                                        f"prepare it again with: handle data prepare ... --tokenizer {base.parent}"):
            problems.append(problem)
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
