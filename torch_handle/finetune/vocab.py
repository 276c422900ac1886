"""A base's vocabulary grown by a chat template's special tokens: how the new rows train and export.

``handle data prepare --chat`` adds the tokens a template needs and the base's tokenizer lacks (ChatML's
``<|im_start|>`` / ``<|im_end|>``: :func:`torch_handle.data.chat.template.add_template_tokens`) after the base's
last id; a run on that base (``model.init_from``) then has more token rows than the base's weights, and loading
them appends rows initialised as transformers' ``resize_token_embeddings`` does
(:mod:`torch_handle.checkpoint.vocab_rows`).

A full fine-tune trains the new rows with the rest. LoRA and QLoRA freeze the base; a grown run keeps the embedding
and output projection trainable (:data:`TRAINED_MODULES`), as peft's ``modules_to_save = ["embed_tokens",
"lm_head"]`` does (axolotl asks for exactly that when tokens are added under LoRA), saves them with the adapters
and exports them under peft's names (:mod:`torch_handle.finetune.peft_format`): ``PeftModel.from_pretrained`` loads
them on the base after ``base.resize_token_embeddings(n)``. No torch import.
"""

from __future__ import annotations

import json
from pathlib import Path

TRAINED_MODULES = ("embed", "lm_head")
"""This model's modules that a grown LoRA run trains whole (peft's ``embed_tokens`` and ``lm_head``)."""


def grown_vocab(init_from: str | None, vocab_size: int) -> bool:
    """Whether a model of ``vocab_size`` token rows has more than its base ``init_from`` (a Hugging Face directory's
    ``config.json`` ``vocab_size``): a chat template's tokens were added. False without a base, or one without a
    readable config (its loading reports that)."""
    if not init_from:
        return False
    try:
        rows = json.loads((Path(init_from) / "config.json").read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(rows, int) and rows < vocab_size
