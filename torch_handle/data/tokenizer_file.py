"""A tokenizer on disk (an HF ``tokenizers`` JSON, :data:`~torch_handle.common.names.TOKENIZER_FILE`): where a
path's tokenizer is, how many embedding rows its ids need, and which of its ids end a document and pad a batch.

These facts are decided here once and recorded by ``handle data prepare`` in ``meta.json``
(:mod:`torch_handle.data.shards`): every reader of a prepared directory takes them from there.

No torch import: ``handle run`` trains a corpus's tokenizer (:func:`train_tokenizer`) in the launcher, before
any worker imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch_handle.common.names import TOKENIZER_FILE
from torch_handle.data.chat.template import CHATML_TOKENS
from torch_handle.errors import DataError

TOKENIZER_VERSION = "bpe-bytelevel-v2"
"""The byte-level BPE that :func:`train_tokenizer` trains, in the keys of what is cached
from it (trained tokenizers, prepared corpora): v2 reserves ChatML's tokens, so nothing cached with v1 is reused."""
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
RESERVED_TOKENS = [*SPECIAL_TOKENS, *CHATML_TOKENS]
"""The special tokens of every tokenizer :func:`train_tokenizer` trains, ids 0-5: the four roles, then ChatML's
``<|im_start|>`` (:data:`IM_START_ID`) and ``<|im_end|>`` (:data:`IM_END_ID`). Within ``vocab_size``: the BPE learns
two merges fewer than with the roles alone."""
IM_START_ID, IM_END_ID = 4, 5
EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>")
"""End-of-document tokens looked up by name when no ``tokenizer_config.json`` names one."""
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>")
"""Padding tokens looked up by name when neither ``tokenizer_config.json`` nor the tokenizer's own padding names
one."""


def find_tokenizer(path: str | Path) -> Path | None:
    """``path`` itself when it is a file, else ``path/tokenizer.json`` when that exists, else None."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    return p / TOKENIZER_FILE if (p / TOKENIZER_FILE).is_file() else None


def tokenizer_path(path: str | Path) -> Path:
    """The tokenizer.json that ``path`` names (the file, or ``path/tokenizer.json``).

    Raises:
        DataError: neither exists.
    """
    found = find_tokenizer(path)
    if found is None:
        raise DataError(f"{path}: no such tokenizer (give a tokenizer.json, or a directory holding one such as a "
                        f"`handle export` or a Hugging Face model directory)")
    return found


def load_tokenizer(path: Path) -> Any:
    """The ``tokenizers.Tokenizer`` in the file ``path``.

    Raises:
        DataError: a file that is not a tokenizer (JSON of another kind, or not JSON), one line naming it.
    """
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a file it cannot read
        raise DataError(f"{path}: not a tokenizer file ({' '.join(str(e).split())[:200]})") from None


def vocab_size_of(tok: Any) -> int:
    """Rows an embedding needs for ``tok``'s ids: its largest id + 1 (added tokens included)."""
    return max(max(tok.get_vocab(with_added_tokens=True).values()) + 1, tok.get_vocab_size())


def _config_token(path: Path, key: str) -> str | None:
    """The ``key`` (``eos_token``, ``pad_token``) of a ``tokenizer_config.json`` beside ``path``, or None."""
    try:
        value = json.loads((path.parent / "tokenizer_config.json").read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def eos_id(tok: Any, path: Path) -> int:
    """The id that ends a document: the ``eos_token`` of a ``tokenizer_config.json`` beside ``path``, else the
    first of :data:`EOS_NAMES` in the vocabulary.

    Raises:
        DataError: none of them is in the vocabulary.
    """
    for name in (_config_token(path, "eos_token"), *EOS_NAMES):
        if name is not None and (i := tok.token_to_id(name)) is not None:
            return int(i)
    raise DataError(f"{path}: no end-of-document token (none of {', '.join(EOS_NAMES)} in its vocabulary)")


def pad_id_of(tok: Any, path: Path, eos: int) -> int | None:
    """The id that pads a batch, or None when the tokenizer has none: the ``pad_token`` of a
    ``tokenizer_config.json`` beside ``path``, else the tokenizer's own padding (``tokenizer.json``'s
    ``padding``), else the first of :data:`PAD_NAMES` in the vocabulary.

    A padding token that is also ``eos`` (Qwen's base models pad with ``<|endoftext|>``) gives None: packed
    samples hold an ``eos`` at every document end, and the model hides padding from attention.
    """
    padding = tok.padding or {}
    for name in (_config_token(path, "pad_token"), padding.get("pad_token"), *PAD_NAMES):
        if name is not None and (i := tok.token_to_id(name)) is not None:
            return None if int(i) == eos else int(i)
    return None


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """Train a byte-level BPE tokenizer (Sennrich et al. 2016; GPT-2's byte-level variant) on ``texts``: at most
    ``vocab_size`` ids, the :data:`RESERVED_TOKENS` first (ids 0-5), then the 256 byte symbols, then the merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=RESERVED_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
