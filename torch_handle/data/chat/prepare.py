"""``handle data prepare --chat``: conversations, rendered by a chat template, into token shards with a per-token
trained mask (:mod:`torch_handle.data.shards`: ``<split>-NNNNN.mask`` beside each ``.bin``, one byte a token).

Each conversation is one document: its rendering's ids (:func:`torch_handle.data.chat.template.encode_conversation`,
no ``<eos>`` appended: it ends with its own end-of-turn) and whether each is trained. The validation split holds
whole conversations out by a hash of their source and number, as a plain-text prepare does. A conversation longer
than ``max_len + 1`` tokens is truncated from the left (its earliest tokens: the system turn and the first
prompts) or dropped (``max_len_policy``); one left with no trained token is refused. ``meta.json`` gains
``"chat"``: the template (its name and SHA-256; the template itself is written as ``chat_template.jinja``),
``train_on``, and the counts of conversations, truncated and dropped ones. A tokenizer whose vocabulary lacks the
template's special tokens (ChatML's ``<|im_start|>`` / ``<|im_end|>``) gets them added after its last id
(:func:`~torch_handle.data.chat.template.add_template_tokens`): the ``tokenizer.json`` written beside the shards is
the extended one, and ``meta.json``'s ``"tokenizer"`` records ``"extends"``: the given tokenizer's SHA-256 and
vocabulary and the ids added (a run on ``model.init_from`` that tokenizer's base grows its embedding and output
rows to match: :mod:`torch_handle.finetune.vocab`). No torch import.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from torch_handle.common.fsio import replace_problem, replacing_dir
from torch_handle.common.names import TOKENIZER_FILE
from torch_handle.data.chat.rows import conversations, read_rows
from torch_handle.data.chat.template import (TEMPLATE_FILE, TRAIN_ON, ChatTemplate, add_template_tokens,
                                             end_of_turn_ids, load_template, trained_of, turn_spans)
from torch_handle.data.shards import META_FILE, ShardWriter, file_sha256, token_dtype, write_meta
from torch_handle.data.sources import path_bytes, path_sha256
from torch_handle.data.prepare import held_out
from torch_handle.data.tokenizer_file import eos_id, load_tokenizer, pad_id_of, tokenizer_path, vocab_size_of
from torch_handle.errors import DataError

MAX_LEN_POLICIES = ("truncate", "drop")


def prepare_chat(sources: Sequence[str], out: str | Path, *, tokenizer: str | Path, template: str | None = None,
                 train_on: str = "assistant", valid: Sequence[str] = (), valid_fraction: float = 0.05,
                 max_len: int = 2048, max_len_policy: str = "truncate", messages_field: str = "messages",
                 column_map: dict[str, str] | None = None, force: bool = False,
                 progress: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Prepare the conversations of ``sources`` (JSON Lines or Parquet files, ``datasets.save_to_disk``
    directories, directories of files, globs) into ``out``.

    Returns the summary: ``{"directory", "splits": {split: {"tokens", "documents", "trained_tokens"}},
    "conversations", "truncated", "dropped", "template", "train_on", "seconds"}``.

    Raises:
        DataError: bad input, one line naming the file, row and field (see :mod:`torch_handle.data.chat.rows` and
            :mod:`torch_handle.data.chat.template`); nothing written.
    """
    if train_on not in TRAIN_ON:
        raise DataError(f"--train-on {train_on!r}: valid are {', '.join(TRAIN_ON)}")

    def groups(row: dict[str, Any], where: str, tok: Any, chat: ChatTemplate) -> list[list[Document]]:
        return [[("a conversation", Rendered(*turn_spans(chat, messages, train_on)), None)]
                for messages in conversations(row, where, messages_field=messages_field, column_map=column_map)]

    return prepare_rendered(sources, out, groups, unit="conversations", tokenizer=tokenizer, template=template,
                            valid=valid, valid_fraction=valid_fraction, max_len=max_len,
                            max_len_policy=max_len_policy, meta={"train_on": train_on}, force=force,
                            progress=progress, why=f" (train_on {train_on})")


@dataclass(frozen=True)
class Rendered:
    """A document rendered and not yet tokenized: its ``text`` and the character ``spans`` of its trained turns
    (:func:`~torch_handle.data.chat.template.turn_spans`). :func:`prepare_rendered` tokenizes the rendered
    documents of :data:`ENCODE_BATCH` rows at once (``encode_batch``: the tokenizer's threads) and takes the
    trained tokens from the offsets (:func:`~torch_handle.data.chat.template.trained_of`)."""

    text: str
    spans: list[tuple[int, int]]


ENCODE_BATCH = 512
"""Rows whose rendered documents are tokenized together."""
Document = tuple[str, "list[int] | Rendered", "list[bool] | None"]
"""One document to write: ``(what, ids, trained)``, ``what`` naming it in an error (``a conversation``,
``chosen``); or ``(what, Rendered, None)``, tokenized by :func:`prepare_rendered`."""


def prepare_rendered(sources: Sequence[str], out: str | Path,
                     groups: Callable[[dict[str, Any], str, Any, ChatTemplate], list[list[Document]]], *, unit: str,
                     tokenizer: str | Path, template: str | None, valid: Sequence[str], valid_fraction: float,
                     max_len: int, max_len_policy: str, meta: dict[str, Any], force: bool,
                     progress: Callable[[Any], None] | None, why: str = "") -> dict[str, Any]:
    """The prepare of rows rendered by a chat template: ``groups(row, where, tokenizer, template)`` gives each
    row's groups of documents (a conversation: a group of one; a preference pair: chosen and rejected); a group
    goes whole to one split (held out by a hash of its source and number) and, under ``--max-len-policy drop``,
    is dropped whole. ``meta`` joins ``meta.json``'s ``"chat"``; the counts are named ``unit``.

    Raises:
        DataError: see :func:`prepare_chat`.
    """
    from torch_handle.data.prepare import Progress

    t0 = time.perf_counter()
    out = Path(out)
    if max_len_policy not in MAX_LEN_POLICIES:
        raise DataError(f"--max-len-policy {max_len_policy!r}: valid are {', '.join(MAX_LEN_POLICIES)}")
    if max_len < 2:
        raise DataError(f"--max-len {max_len}: valid are 2 or more tokens")
    if problem := replace_problem(out, force, marker=META_FILE, kind="a prepared", what="the token shards"):
        raise DataError(problem)
    tok_path = tokenizer_path(tokenizer)
    tok = load_tokenizer(tok_path)
    chat = load_template(template, tok_path)
    base_vocab = vocab_size_of(tok)
    added = add_template_tokens(tok, chat)  # ChatML's tokens, where the base lacks them
    eos = eos_id(tok, tok_path)
    vocab = vocab_size_of(tok)
    dtype = token_dtype(vocab)
    train_files = _files(sources)
    valid_files = _files(valid) if valid else []
    total = sum(path_bytes(f) for f in [*train_files, *valid_files])
    counts = {unit: 0, "truncated": 0, "dropped": 0}
    with replacing_dir(out) as tmp:
        if added:
            tok.save(str(tmp / TOKENIZER_FILE))
        else:
            shutil.copyfile(tok_path, tmp / TOKENIZER_FILE)
        (tmp / TEMPLATE_FILE).write_text(chat.source, encoding="utf-8")
        if (tok_path.parent / "tokenizer_config.json").is_file():  # the special tokens the template reads
            shutil.copyfile(tok_path.parent / "tokenizer_config.json", tmp / "tokenizer_config.json")
        writers = {s: ShardWriter(tmp, s, dtype, None, masks=True) for s in ("train", "valid")}
        trained = {"train": 0, "valid": 0}
        state = Progress(0, total, 0, 0, 0.0)
        pending: list[tuple[str, str, list[Document]]] = []  # (split, where, group): rows not yet written

        def write(split: str, where: str, group: list[Document]) -> None:
            if max_len_policy == "drop" and any(len(ids) > max_len + 1 for _, ids, _ in group):
                counts["dropped"] += 1
                return
            kept = []
            for what, ids, mask in group:
                if len(ids) > max_len + 1:
                    ids, mask = ids[-(max_len + 1):], mask[-(max_len + 1):]
                    counts["truncated"] += 1
                if not any(mask[1:]):  # the first token is never a label
                    cut = f" after truncation to --max-len {max_len}" if len(ids) > max_len else ""
                    raise DataError(f"{where}: {what} with no trained token{cut}{why}")
                kept.append((ids, mask))
            for ids, mask in kept:
                writers[split].add(ids, mask=mask)
                trained[split] += int(sum(mask[1:]))
                state.documents += 1
                state.tokens += len(ids)
            counts[unit] += 1

        def flush() -> None:
            texts = [ids.text for _, _, group in pending for _, ids, _ in group if isinstance(ids, Rendered)]
            encoded = iter(tok.encode_batch(texts, add_special_tokens=False) if texts else ())
            for split, where, group in pending:
                write(split, where, [(what, *trained_of(next(encoded), ids.spans)) if isinstance(ids, Rendered)
                                     else (what, ids, mask) for what, ids, mask in group])
            pending.clear()

        for is_valid, files in ((False, train_files), (True, valid_files)):
            for path in files:
                number = 0
                for where, row in read_rows(path):
                    for group in groups(row, where, tok, chat):
                        split = "valid" if is_valid or (not valid_files and held_out(str(path.name), number,
                                                                                      valid_fraction)) else "train"
                        number += 1
                        pending.append((split, where, group))
                    if len(pending) >= ENCODE_BATCH:
                        flush()
                flush()
                state.bytes += path_bytes(path)
                state.seconds = time.perf_counter() - t0
                if progress is not None:
                    progress(state)
        splits = {split: w.close() for split, w in writers.items()}
        for split in ("train", "valid"):
            if not splits[split]["documents"]:
                fix = "lower --valid-fraction" if split == "train" else "give --valid SRC or a larger --valid-fraction"
                raise DataError(f"{', '.join(map(str, [*train_files, *valid_files][:3]))}: no {split} {unit} "
                                f"({fix})")
        ends = trained_ends(tmp, splits["train"], dtype, end_of_turn_ids(tok, chat))
        info = {"dtype": dtype.name, "splits": splits,
                "tokenizer": {"file": TOKENIZER_FILE, "sha256": file_sha256(tmp / TOKENIZER_FILE), "vocab_size": vocab,
                              "eos_id": eos, "pad_id": pad_id_of(tok, tok_path, eos), "given": str(tok_path),
                              **({"extends": {"sha256": file_sha256(tok_path), "vocab_size": base_vocab,
                                              "added": added}} if added else {})},
                "sources": [{"path": str(f), "format": "chat", "sha256": path_sha256(f), "bytes": path_bytes(f),
                             "split": "valid" if f in valid_files else "both"} for f in [*train_files, *valid_files]],
                "valid": {"method": "source" if valid_files else "documents",
                          "fraction": 0.0 if valid_files else valid_fraction},
                "part": None,
                "chat": {"template": chat.name, "template_sha256": chat.sha256, "template_file": TEMPLATE_FILE,
                         **meta, "max_len": max_len, "max_len_policy": max_len_policy, "trained_tokens": trained,
                         "end_of_turn_trained": ends, **counts}}
        write_meta(tmp, info)
    return {"directory": str(out), "splits": {s: {"tokens": v["tokens"], "documents": v["documents"],
                                                  "trained_tokens": trained[s]} for s, v in splits.items()},
            **counts, "template": chat.name, **meta, "end_of_turn_trained": ends, "added_tokens": added,
            "seconds": round(time.perf_counter() - t0, 3)}


def trained_ends(directory: Path, split: dict[str, Any], dtype: Any, ends: set[int]) -> int:
    """How many trained tokens of a written split (``split``: its ``meta.json`` entry, shards in ``directory``) are
    end-of-turn tokens (``ends``: :func:`~torch_handle.data.chat.template.end_of_turn_ids`). 0 means a model trained
    on it never learns to stop (trl #1623, axolotl #3754): the template ends its turns with text, not a token of the
    vocabulary that generation stops at."""
    count = 0
    for shard in split["shards"]:
        ids = np.fromfile(directory / shard["bin"], dtype=dtype)
        mask = np.fromfile(directory / shard["mask"], dtype=np.uint8).astype(bool)
        count += int(np.isin(ids[mask], np.fromiter(ends, dtype=np.int64, count=len(ends))).sum())
    return count


def _files(specs: Sequence[str]) -> list[Path]:
    """The JSON Lines and Parquet files and ``datasets.save_to_disk`` directories ``specs`` select (other
    directories recursively, in a fixed order)."""
    from torch_handle.data.sources import expand, is_hf_dir

    out: list[Path] = []
    for spec in specs:
        found = [p for p, _ in expand(str(spec)) if p.is_file() or is_hf_dir(p)]
        if not found:
            raise DataError(f"{spec}: no such file, or no files match")
        for path in found:
            if not (is_hf_dir(path) or path.name.lower().endswith((".jsonl", ".jsonl.gz", ".parquet"))):
                raise DataError(f"{path}: conversations are read from .jsonl, .jsonl.gz or .parquet files or "
                                f"datasets.save_to_disk directories")
            out.append(path)
    return out


def conversation_view(directory: Path, split: str, index: int) -> dict[str, Any]:
    """Conversation ``index`` of ``split`` of a prepared chat directory: ``{"ids", "trained", "tokens"}`` (each
    token's text too), for ``handle data inspect``.

    Raises:
        DataError: not a chat directory, an index out of range.
    """
    from tokenizers import Tokenizer

    from torch_handle.data.shards import open_prepared

    data = open_prepared(directory)
    part = getattr(data, split)
    if not part.has_masks:
        raise DataError(f"{directory}: not prepared from conversations (no trained-token masks; prepare with --chat)")
    if not 0 <= index < part.n_documents:
        raise DataError(f"--index {index}: the {split} split has conversations 0 .. {part.n_documents - 1}")
    start = int(part.doc_starts[index])
    stop = int(part.doc_starts[index + 1]) if index + 1 < part.n_documents else part.n_tokens
    ids = part.window(start, stop)
    trained = part.mask(start, stop)
    tok = Tokenizer.from_file(str(data.tokenizer_path))
    return {"ids": ids.tolist(), "trained": [bool(t) for t in trained],
            "tokens": [tok.decode([int(i)], skip_special_tokens=False) for i in ids],
            "trained_share": float(np.mean(trained[1:])) if len(ids) > 1 else 0.0,
            "end_of_turn_trained": _end_of_turn_trained(tok, ids, trained)}


def _end_of_turn_trained(tok: Any, ids: np.ndarray, trained: np.ndarray) -> list[bool]:
    """For each end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ``<|end|>``) in ``ids``: is it
    trained."""
    ends = {i for name in ("<|im_end|>", "<|eot_id|>", "</s>", "<|end|>", "<eos>") if (i := tok.token_to_id(name))
            is not None}
    return [bool(t) for i, t in zip(ids.tolist(), trained) if i in ends]
