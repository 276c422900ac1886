"""``handle data prepare --preference``: preference pairs (one prompt, a chosen and a rejected completion) rendered
by a chat template into token shards, as ``--chat`` renders conversations (:mod:`torch_handle.data.chat.prepare`:
the same template machinery, ``--template``, ``--tokenizer``, ``--valid``, ``--max-len``).

Rows, JSON Lines or Parquet:

* ``{"chosen": [messages], "rejected": [messages]}``: two conversations; the prompt is their longest common prefix
  of messages, each completion what follows it;
* ``{"prompt": "..." or [messages], "chosen": "..." or [messages], "rejected": "..." or [messages]}``: a string
  prompt is a user turn, a string completion an assistant turn.

Each side is rendered whole (prompt + its completion) and tokenized as ``apply_chat_template`` does; its trained
tokens are the completion's assistant turns (the prompt's turns are never trained, whatever they are). A pair is
two consecutive documents, chosen then rejected, each with its trained mask, always in the same split, so a pair is
never split: :class:`~torch_handle.data.chat.pair_samples.PreferencePairs` makes one sample of each.
``meta.json``'s ``"chat"`` gains ``"pairs"`` (the count) and ``"preference": {"order": ["chosen", "rejected"]}``.

Bad input is one line naming the file, row and field: a row of neither layout, a pair whose chosen equals its
rejected, chosen and rejected messages with no common prompt or one a prefix of the other, a completion without
an assistant turn, a completion with no trained token left after truncation. No torch import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from torch_handle.data.chat.prepare import Document, prepare_rendered
from torch_handle.data.chat.rows import _messages
from torch_handle.data.chat.template import ChatTemplate, encode_conversation
from torch_handle.errors import DataError

SIDES = ("chosen", "rejected")
"""The two documents of a pair, in the order they are stored."""
LAYOUTS = "chosen and rejected messages; prompt, chosen and rejected"


def holds_pairs(meta: dict[str, Any]) -> bool:
    """Whether a prepared directory's ``meta.json`` says it holds preference pairs."""
    return isinstance(meta.get("chat"), dict) and "preference" in meta["chat"]


def _side(value: Any, role: str, where: str, key: str) -> list[dict[str, Any]]:
    """A string as one ``role`` turn, else a list of messages."""
    return [{"role": role, "content": value}] if isinstance(value, str) else _messages(value, where, key)


def split_pair(row: dict[str, Any], where: str, *, column_map: dict[str, str] | None = None
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """``(prompt, chosen, rejected)`` message lists of one row (see the module docstring).

    Raises:
        DataError: one line naming ``where`` and the field: neither layout, chosen equal to rejected, no common
            prompt, an empty completion or one with no assistant turn.
    """
    if column_map:
        row = {column_map.get(k, k): v for k, v in row.items()}
    if not all(k in row for k in SIDES):
        keys = ", ".join(map(str, list(row)[:8]))
        raise DataError(f"{where}: none of the preference layouts ({LAYOUTS}); it has: {keys} (give --column-map "
                        f"OLD=NEW)")
    if "prompt" in row:
        prompt = _side(row["prompt"], "user", where, "prompt")
        chosen, rejected = (_side(row[k], "assistant", where, k) for k in SIDES)
    else:
        whole = [_messages(row[k], where, k) for k in SIDES]
        common = 0
        while common < min(map(len, whole)) and whole[0][common] == whole[1][common]:
            common += 1
        if whole[0] == whole[1]:
            raise DataError(f"{where}: chosen equals rejected (a pair needs two different completions)")
        if common == 0:
            raise DataError(f"{where}: chosen and rejected have no common prompt (their first messages differ)")
        prompt, chosen, rejected = whole[0][:common], whole[0][common:], whole[1][common:]
    if chosen == rejected:
        raise DataError(f"{where}: chosen equals rejected (a pair needs two different completions)")
    for key, completion in zip(SIDES, (chosen, rejected)):
        if not completion:
            raise DataError(f"{where}: {key}: no completion after the common prompt (it is a prefix of the other)")
        if not any(m["role"] == "assistant" for m in completion):
            raise DataError(f"{where}: {key}: a completion with no assistant turn (nothing to train on)")
    return prompt, chosen, rejected


def encode_pair(tokenizer: Any, template: ChatTemplate, row: dict[str, Any], where: str, *,
                column_map: dict[str, str] | None = None) -> list[Document]:
    """``[("chosen", ids, trained), ("rejected", ids, trained)]`` of one row: each side rendered whole, trained on
    its completion's assistant turns (:func:`~torch_handle.data.chat.template.encode_conversation`)."""
    prompt, *completions = split_pair(row, where, column_map=column_map)
    frozen = [{**m, "train": False} for m in prompt]
    return [(key, *encode_conversation(tokenizer, template, frozen + completion, "assistant"))
            for key, completion in zip(SIDES, completions)]


def prepare_preference(sources: Sequence[str], out: str | Path, *, tokenizer: str | Path,
                       template: str | None = None, valid: Sequence[str] = (), valid_fraction: float = 0.05,
                       max_len: int = 2048, max_len_policy: str = "truncate",
                       column_map: dict[str, str] | None = None, force: bool = False,
                       progress: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Prepare the preference pairs of ``sources`` into ``out`` (a side longer than ``max_len + 1`` tokens is cut
    from the left, its prompt's earliest tokens first; ``drop`` leaves the pair out).

    Returns the summary: ``{"directory", "splits": {split: {"tokens", "documents", "trained_tokens"}}, "pairs",
    "truncated", "dropped", "template", "preference", "seconds"}``.

    Raises:
        DataError: bad input (:func:`split_pair`, the template's), one line naming the file, row and field;
            nothing written.
    """
    def groups(row: dict[str, Any], where: str, tok: Any, chat: ChatTemplate) -> list[list[Document]]:
        return [encode_pair(tok, chat, row, where, column_map=column_map)]

    return prepare_rendered(sources, out, groups, unit="pairs", tokenizer=tokenizer, template=template, valid=valid,
                            valid_fraction=valid_fraction, max_len=max_len, max_len_policy=max_len_policy,
                            meta={"preference": {"order": list(SIDES)}}, force=force, progress=progress,
                            why=" (the completion was cut away)")


def pair_view(directory: Path, split: str, index: int) -> dict[str, Any]:
    """Pair ``index`` of ``split`` of a prepared preference directory, for ``handle data inspect``: ``{"chosen":
    view, "rejected": view}``, each view as :func:`~torch_handle.data.chat.prepare.conversation_view` gives it.

    Raises:
        DataError: an index out of range."""
    from torch_handle.data.chat.prepare import conversation_view
    from torch_handle.data.shards import open_prepared

    pairs = getattr(open_prepared(directory), split).n_documents // 2
    if not 0 <= index < pairs:
        raise DataError(f"--index {index}: the {split} split has pairs 0 .. {pairs - 1}")
    return {key: conversation_view(directory, split, 2 * index + k) for k, key in enumerate(SIDES)}
