"""Conversations from rows: the layouts ``handle data prepare --chat`` reads, each turned into a list of messages
(``{"role", "content"}``, optionally ``"train": bool``).

* OpenAI-style ``messages`` (or ``--messages-field NAME``): ``[{"role": "system" | "user" | "assistant",
  "content": "...", "train": true}, ...]``;
* ``prompt`` and ``completion``: strings (a user turn and an assistant turn) or message lists;
* Alpaca: ``instruction``, ``input`` (optional) and ``output``: one user turn (the instruction, then a blank line and
  the input when there is one) and one assistant turn; ``instruction`` with ``instances`` (self-instruct's seed
  tasks): one conversation per instance.

A column map (``--column-map old=new``) renames a row's keys first. Rows come from JSON Lines (``.jsonl``,
``.jsonl.gz``) or Parquet files or ``datasets.save_to_disk`` directories (the ``hf`` extra), read in order. Every
error is one line naming the file, row and field. No torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from torch_handle.data.sources import jsonl_rows
from torch_handle.errors import DataError

ROLES = ("system", "user", "assistant")
LAYOUTS = "messages; prompt and completion; instruction, input and output (or instances)"


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` of each row of a JSON Lines or Parquet file or of a ``datasets.save_to_disk`` directory
    (``where``: ``FILE:LINE``, ``FILE: row N`` or ``DIR: row N``). In Parquet and ``datasets`` rows a null
    column is an absent key, and a message's null ``train`` an absent one (Arrow fills what a row lacks with
    null).

    Raises:
        DataError: a line that is not one JSON object, bytes that are not UTF-8, an unreadable file; a directory
            ``datasets`` cannot read or that holds several splits (:func:`~torch_handle.data.sources.load_hf`).
    """
    if path.is_dir():
        from torch_handle.data.sources import load_hf

        row = 0
        for batch in load_hf(path).iter(batch_size=1024):  # columns of lists: rows rebuilt from them
            for values in zip(*batch.values()):
                yield f"{path}: row {row}", {k: v for k, v in zip(batch, values) if v is not None}
                row += 1
        return
    name = path.name.lower()
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a file that is not Parquet
            raise DataError(f"{path}: not a Parquet file ({' '.join(str(e).split())[:200]})") from None
        row = 0
        for batch in pf.iter_batches(batch_size=1024):
            for obj in batch.to_pylist():  # a column a row has no value in is null: absent, as in JSON Lines
                yield f"{path}: row {row}", {k: v for k, v in obj.items() if v is not None}
                row += 1
        return
    for lineno, obj, _ in jsonl_rows(path):
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{lineno}: a JSON {type(obj).__name__}, not an object")
        yield f"{path}:{lineno}", obj


def _messages(value: Any, where: str, key: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {key!r} must be a non-empty list of messages, not {type(value).__name__}")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(f"{where}: {key}[{k}] must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: {key}[{k}].role {role!r}: valid are {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: {key}[{k}].content must be text, not {type(content).__name__}")
        train = True if m.get("train") is None else m["train"]  # Arrow rows give null where a message has none
        if not isinstance(train, bool):
            raise DataError(f"{where}: {key}[{k}].train must be true or false, not {train!r}")
        out.append({"role": role, "content": content, **({"train": False} if m.get("train") is False else {})})
    return out


def _turn(value: Any, role: str, where: str, key: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value, where, key)


def conversations(row: dict[str, Any], where: str, *, messages_field: str = "messages",
                  column_map: dict[str, str] | None = None) -> list[list[dict[str, Any]]]:
    """The conversations of one row (one, or one per instance of a self-instruct task), each with at least one
    assistant turn.

    Raises:
        DataError: none of the known layouts, a role that is not system/user/assistant, content that is not text, a
            conversation with no assistant turn.
    """
    if column_map:
        row = {column_map.get(k, k): v for k, v in row.items()}
    if messages_field in row:
        found = [_messages(row[messages_field], where, messages_field)]
    elif "prompt" in row and "completion" in row:
        found = [_turn(row["prompt"], "user", where, "prompt") + _turn(row["completion"], "assistant", where,
                                                                       "completion")]
    elif "instruction" in row and ("output" in row or "instances" in row):
        instances = row["instances"] if "instances" in row else [row]
        if not isinstance(instances, list) or not instances:
            raise DataError(f"{where}: 'instances' must be a non-empty list of {{input, output}}")
        found = []
        for k, inst in enumerate(instances):
            if not isinstance(inst, dict) or not isinstance(inst.get("output"), str):
                raise DataError(f"{where}: {'instances[%d].' % k if 'instances' in row else ''}output must be text")
            prompt, extra = row["instruction"], inst.get("input") or ""
            if not isinstance(prompt, str) or not isinstance(extra, str):
                raise DataError(f"{where}: instruction and input must be text")
            found.append([{"role": "user", "content": prompt + (f"\n\n{extra}" if extra else "")},
                          {"role": "assistant", "content": inst["output"]}])
    else:
        keys = ", ".join(map(str, list(row)[:8]))
        raise DataError(f"{where}: none of the known layouts ({LAYOUTS}); it has: {keys} (give --messages-field "
                        f"NAME or --column-map OLD=NEW)")
    for messages in found:
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: a conversation with no assistant turn (nothing to train on)")
    return found
