"""Dataset plugin ``tokens``: language modelling on prepared token shards (``handle data prepare``), one directory
or a weighted mixture of several.

Every rank reads the shards by memory map (:class:`torch_handle.data.shards.TokenSplit`): nothing is copied per
rank, and start-up time and resident memory do not grow with the corpus. The trainer's global sampler gives the
same samples for the same seed and step at any world size, so a run resumes exactly at any step and world size
with nothing stored per rank. A mixture is blended over the global sample index
(:mod:`torch_handle.data.mixture`); the step events carry each source's tokens
(:mod:`torch_handle.observe.data_mix`).

The pre-flight check (no torch) reads every directory's ``meta.json`` and the sizes of its shards, and reports
every problem at once: a missing directory, an unreadable or unprepared ``meta.json``, a truncated shard, sources
prepared with different tokenizers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from torch_handle.api import DataError, InvalidValue, hookimpl, param

_SOURCE_KEYS = ("path", "weight", "name")


@dataclass
class TokensConfig:
    """``[data]`` options of ``tokens``: language modelling on directories written by ``handle data prepare``."""

    path: str = ""
    """A prepared directory (with meta.json) or a directory of parts (part-*-of-N/); or use ``sources``."""
    sources: list[dict] = field(default_factory=list)
    """A mixture instead of ``path``: ``[{path = "DIR", weight = 0.7, name = "web"}, ...]``. Weights are per
    sample, so per token (samples are fixed-length windows), normalised to shares, rounded to 1/10,000; ``name``
    (default: the directory's name) labels the source in the telemetry. A source shorter than its share wraps
    around (upsampled; said in the log)."""
    seq_len: int = param(128, ge=2)
    """Tokens per language-modelling sample (a packed window across documents)."""
    document_mask: bool = False
    """Attend within documents only: each sample also carries ``position_ids`` restarting at every document."""
    num_workers: int = param(0, ge=0, frozen_on_resume=False)
    """DataLoader worker processes per rank (0: read in the training process; reads are memory maps)."""

    def check(self) -> Iterator[InvalidValue]:
        if bool(self.path) == bool(self.sources):
            yield InvalidValue("path", "give either path (a prepared directory) or sources (a mixture), not "
                                       f"{'both' if self.path else 'neither'}")
        names: list[str] = []
        for i, source in enumerate(self.sources):
            key = f"sources[{i}]"
            if not isinstance(source, dict):
                yield InvalidValue("sources", f"{key}: {source!r} must be a table {{path = \"DIR\", weight = W}}")
                continue
            unknown = sorted(set(source) - set(_SOURCE_KEYS))
            if unknown:
                yield InvalidValue("sources", f"{key}: unknown key {unknown[0]!r} (valid: {', '.join(_SOURCE_KEYS)})")
            path = source.get("path")
            if not isinstance(path, str) or not path:
                yield InvalidValue("sources", f"{key}.path: {path!r} must be a prepared directory")
            weight = source.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                    or weight <= 0:
                yield InvalidValue("sources", f"{key}.weight: {weight!r} must be a number > 0 (a share of the "
                                              f"samples)")
            names.append(str(source.get("name") or Path(str(path or "")).name))
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            yield InvalidValue("sources", f"two sources are named {dup[0]!r}: give each a distinct name = \"...\"")

    def source_list(self) -> list[tuple[str, str, float]]:
        """``(name, path, weight)`` of each source (``path`` alone: one source of weight 1)."""
        if self.path:
            return [(Path(self.path).name or "data", self.path, 1.0)]
        return [(str(s.get("name") or Path(s["path"]).name), s["path"], float(s.get("weight", 1.0)))
                for s in self.sources]


# ---------------------------------------------------------------------------------------------------------------
# Pre-flight (no torch): every problem of every source, one line each
# ---------------------------------------------------------------------------------------------------------------


def _open(path: str) -> Any:
    """The prepared directory ``path`` opened (meta.json, shard sizes and document offsets checked)."""
    from torch_handle.api import open_prepared

    return open_prepared(Path(path).expanduser())


def source_problems(options: TokensConfig) -> tuple[list[str], list[Any]]:
    """``(problems, prepared)``: one line per problem of the sources, and each source's opened directory (None
    where it has a problem)."""
    from torch_handle.api import mixture_problems

    problems: list[str] = []
    prepared: list[Any] = []
    for name, path, _ in options.source_list():
        try:
            prepared.append(_open(path))
        except DataError as e:
            problems.append(f"data.{'path' if options.path else 'sources'}: {e}")
            prepared.append(None)
    opened = [p for p in prepared if p is not None]
    if opened:
        problems += mixture_problems(opened)
    for (name, path, _), p in zip(options.source_list(), prepared):
        for split, tokens in ((s, getattr(p, s).n_tokens) for s in ("train", "valid")) if p is not None else ():
            if tokens < options.seq_len + 1:
                problems.append(f"{path}: the {split} split has {tokens} tokens, too few for one sample of "
                                f"data.seq_len = {options.seq_len}")
    return problems, prepared


def preflight(options: TokensConfig) -> None:
    """Raises:
        DataError: every problem of :func:`source_problems`, one line each."""
    problems, _ = source_problems(options)
    if problems:
        raise DataError("\n".join(problems))


def check_vocabulary(options: TokensConfig, preset: Any) -> Iterator[InvalidValue]:
    """The prepared vocabulary fits the model: a ``model.init_from`` base's ``vocab_size`` (its config.json) is at
    least the prepared tokenizer's, or at least that of the tokenizer it extends (``meta.json``'s
    ``tokenizer.extends``: a chat template's tokens added, :mod:`torch_handle.finetune.vocab`)."""
    init_from = getattr(preset.model.options, "init_from", None)
    if not init_from:
        return
    import json

    config = Path(init_from) / "config.json"
    try:
        theirs = json.loads(config.read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return  # the model's own pre-flight reports an unreadable base
    for _, path, _ in options.source_list():
        try:
            prepared = _open(path)
            ours = prepared.vocab_size
        except DataError:
            continue  # the pre-flight reports it
        extends = prepared.meta["tokenizer"].get("extends") or {}
        added = extends.get("added") or {}
        if extends and isinstance(theirs, int) and ours > theirs and _drifting_reference(preset):
            yield InvalidValue("path" if options.path else "sources",
                               f"{path}: adds {', '.join(sorted(added, key=added.get))} to model.init_from's "
                               f"tokenizer, so LoRA trains embed_tokens and lm_head whole, and the adapters_off "
                               f"reference would move with them: give finetune.preference.reference = "
                               f"'precomputed', or tune on conversations first and run DPO on that export")
        if isinstance(theirs, int) and extends.get("vocab_size", ours) <= theirs:
            continue  # a chat template's tokens added to the base's tokenizer: the run grows the base's rows
        if isinstance(theirs, int) and ours > theirs:
            yield InvalidValue("path" if options.path else "sources",
                               f"{path}: a vocabulary of {ours} tokens, more than model.init_from's {theirs} "
                               f"({config}): prepare with the base's tokenizer")


def _drifting_reference(preset: Any) -> bool:
    """A DPO run whose reference is the policy with its adapters off: the embedding and output rows a grown
    vocabulary trains (:mod:`torch_handle.finetune.vocab`) are no adapter, so that reference would not stay the
    model as built."""
    finetune = preset.finetune
    return getattr(finetune, "objective", "lm") == "dpo" and finetune.method in ("lora", "qlora") and \
        finetune.preference.resolved(finetune.method) == "adapters_off"


def check_objective(options: TokensConfig, preset: Any) -> Iterator[InvalidValue]:
    """``finetune.objective = "sft"`` reads conversations: a directory prepared with ``--chat`` (trained-token
    masks); ``"dpo"`` reads preference pairs (``--preference``), which ``sft`` does not."""
    from torch_handle.api import holds_pairs

    objective = getattr(preset.finetune, "objective", "lm")
    if objective not in ("sft", "dpo"):
        return
    if options.sources:
        yield InvalidValue("sources", f"finetune.objective = {objective!r} reads one prepared directory (data.path), "
                                      f"not a mixture")
        return
    for _, path, _ in options.source_list():
        try:
            prepared = _open(path)
        except DataError:
            continue  # the pre-flight reports it
        key = "path" if options.path else "sources"
        if not prepared.train.has_masks:
            yield InvalidValue(key, f"{path}: not prepared from conversations (finetune.objective = {objective!r} "
                                    f"trains on the trained tokens of `handle data prepare "
                                    f"{'--chat' if objective == 'sft' else '--preference'}`)")
        elif objective == "dpo" and not holds_pairs(prepared.meta):
            yield InvalidValue(key, f"{path}: holds no preference pairs (finetune.objective = 'dpo' trains on "
                                    f"`handle data prepare --preference`)")
        elif objective == "sft" and holds_pairs(prepared.meta):
            yield InvalidValue(key, f"{path}: holds preference pairs (train on them with finetune.objective = "
                                    f"'dpo'; sft trains on `handle data prepare --chat`)")


# ---------------------------------------------------------------------------------------------------------------
# Build (in every rank)
# ---------------------------------------------------------------------------------------------------------------


def build(options: TokensConfig, ctx: Any):
    from torch_handle.api import prepared_bundle

    problems, prepared = source_problems(options)
    if problems:
        raise DataError("\n".join(problems))
    sources = options.source_list()
    shares = ", ".join(f"{n} {w / sum(w for *_, w in sources):.0%}" for n, _, w in sources)
    description = str(options.path) if options.path else f"mixture of {len(sources)} ({shares})"
    return prepared_bundle([(name, p, weight) for (name, _, weight), p in zip(sources, prepared)], options.seq_len,
                           document_mask=options.document_mask, description=description,
                           mixture=bool(options.sources), objective=getattr(ctx, "objective", "lm"))


def identity(options: TokensConfig, cache: Any = None, progress: Any = None):
    """The launcher's ``prepare`` (nothing to prepare: ``handle data prepare`` did): the sources' identity, which a
    resume compares with its checkpoint's (:mod:`torch_handle.launch.data_identity`).

    Raises:
        DataError: every problem of :func:`source_problems`, one line each."""
    from torch_handle.api import mixture_identity

    problems, prepared = source_problems(options)
    if problems:
        raise DataError("\n".join(problems))
    return mixture_identity(prepared)


@hookimpl
def handle_register_datasets(register):
    register("tokens", TokensConfig, build, "prepared token shards (handle data prepare), memory-mapped; mixtures",
             (check_vocabulary, check_objective), preflight=preflight, prepare=identity)
