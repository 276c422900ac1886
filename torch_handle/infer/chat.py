"""Talking to a run fine-tuned on conversations (``handle chat``, ``handle generate --chat``): the conversation so
far rendered by the run's chat template with the generation prompt (exactly as it was rendered for training,
:mod:`torch_handle.data.chat.template`), then tokens generated until an end-of-turn token.

The run keeps its template as ``chat_template.jinja`` beside ``tokenizer.json`` (the trainer copies it from the
prepared conversations), with the ``tokenizer_config.json`` whose special tokens the template reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from torch_handle.common.names import TOKENIZER_FILE
from torch_handle.data.chat.template import TEMPLATE_FILE, ChatTemplate, end_of_turn_ids, load_template
from torch_handle.errors import RunDirError
from torch_handle.infer.generate import sample


def run_template(run_dir: Path) -> ChatTemplate:
    """The chat template a run was fine-tuned with.

    Raises:
        RunDirError: the run has none (it was not trained on ``handle data prepare --chat`` data).
    """
    if not (Path(run_dir) / TEMPLATE_FILE).is_file():
        raise RunDirError(f"{run_dir}: no {TEMPLATE_FILE} (not fine-tuned on conversations: prepare them with "
                          f"`handle data prepare --chat` and train with finetune.objective = \"sft\")")
    return load_template(None, Path(run_dir) / TOKENIZER_FILE)



def prompt_ids(tokenizer: Any, template: ChatTemplate, messages: Sequence[dict[str, Any]]) -> list[int]:
    """The conversation rendered with the generation prompt, tokenized as for training (no special tokens added)."""
    return tokenizer.encode(template.render(messages, add_generation_prompt=True), add_special_tokens=False).ids


def reply(model: Any, tokenizer: Any, template: ChatTemplate, messages: Sequence[dict[str, Any]], *,
          max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
          generator: torch.Generator | None = None) -> Iterator[int]:
    """The assistant's next turn, token by token (KV-cached), up to and without its end-of-turn token, or
    ``max_new_tokens`` tokens."""
    stop = end_of_turn_ids(tokenizer, template)
    for token in sample(model, prompt_ids(tokenizer, template, messages), max_new_tokens, temperature=temperature,
                        top_k=top_k, generator=generator):
        if token in stop:
            return
        yield token
