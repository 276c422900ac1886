"""The one module a plugin imports: ``from torch_handle.api import hookimpl, param, InvalidValue, ...``.

Everything a model, dataset, strategy, profiler or sink plugin needs is re-exported here, and only what is
here is promised to stay stable. Importing this module is cheap (no torch): the names that live in torch
modules (``Strategy``, ``DistContext``, ``DataBundle``, ...) are imported when first used (PEP 562), so a
plugin's module can ``from torch_handle import api`` at the top and still keep ``handle --help`` and preset
validation instant; ``from torch_handle.api import Strategy`` at module level imports torch, so do that in the
module the factory imports (see ``docs/plugins.md``).

Hooks and their signatures: :mod:`torch_handle.hookspecs`; a guide with examples: docs/plugins.md.

Options (the fields of a plugin's ``config_cls``): ``param(default, ge=, gt=, le=, lt=, frozen_on_resume=)`` gives
a field a range and, where the table's rule does not fit, whether ``handle run --resume --set`` may change it (a
reason string: frozen; False: may change; see :mod:`torch_handle.checkpoint.resume`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torch_handle.errors import CheckpointError, DataError, InvalidValue, PresetError
from torch_handle.hookspecs import hookimpl
from torch_handle.config.schema import Preset, TrainingConfig, field_docs, param

if TYPE_CHECKING:  # pragma: no cover - for type checkers and editors only (names resolved lazily below)
    from torch_handle.checkpoint.store import safe_load
    from torch_handle.data.corpus import pydoc_corpus, read_parallel, read_text, split_documents, text_files
    from torch_handle.data.datasets import (IGNORE_INDEX, SPECIAL_TOKENS, DataBundle, DataContext, LMDataset, TranslationDataset,
                                   TokenWindows, encode_stream, load_or_train_tokenizer, pad_collate)
    from torch_handle.data.bundle import prepared_bundle
    from torch_handle.data.chat.pairs import holds_pairs
    from torch_handle.data.cache import Corpus, cache_root, ensure_prepared, find_prepared
    from torch_handle.data.prepare import prepare
    from torch_handle.data.shards import DataIdentity, mixture_identity, mixture_problems, open_prepared
    from torch_handle.data.tokenizer_file import tokenizer_path
    from torch_handle.data.sources import memory_source, not_text_problem, resolve_sources
    from torch_handle.config.loader import deep_merge
    from torch_handle.observe.fields import Kind, Status
    from torch_handle.train.strategy import DistContext, Strategy, lr_lambda, optimizer_state_tensors, tensor_bytes
    from torch_handle.observe.telemetry import Sink

_LAZY: dict[str, str] = {
    # the strategy contract (torch)
    "Strategy": "torch_handle.train.strategy",
    "DistContext": "torch_handle.train.strategy",
    "lr_lambda": "torch_handle.train.strategy",
    "tensor_bytes": "torch_handle.train.strategy",
    "optimizer_state_tensors": "torch_handle.train.strategy",
    # datasets (torch, tokenizers)
    "DataBundle": "torch_handle.data.datasets",
    "DataContext": "torch_handle.data.datasets",
    "LMDataset": "torch_handle.data.datasets",
    "TranslationDataset": "torch_handle.data.datasets",
    "encode_stream": "torch_handle.data.datasets",
    "load_or_train_tokenizer": "torch_handle.data.datasets",
    "pad_collate": "torch_handle.data.datasets",
    "SPECIAL_TOKENS": "torch_handle.data.datasets",
    "IGNORE_INDEX": "torch_handle.data.datasets",
    "TokenWindows": "torch_handle.data.datasets",
    # prepared token shards (numpy, tokenizers; no torch)
    "prepare": "torch_handle.data.prepare",
    "tokenizer_path": "torch_handle.data.tokenizer_file",
    "open_prepared": "torch_handle.data.shards",
    "DataIdentity": "torch_handle.data.shards",
    "mixture_identity": "torch_handle.data.shards",
    "mixture_problems": "torch_handle.data.shards",
    "Corpus": "torch_handle.data.cache",
    "ensure_prepared": "torch_handle.data.cache",
    "find_prepared": "torch_handle.data.cache",
    "cache_root": "torch_handle.data.cache",
    "prepared_bundle": "torch_handle.data.bundle",
    "holds_pairs": "torch_handle.data.chat.pairs",
    "memory_source": "torch_handle.data.sources",
    "resolve_sources": "torch_handle.data.sources",
    "not_text_problem": "torch_handle.data.sources",
    # corpora as text (no torch, but kept lazy with the rest of the data names)
    "read_text": "torch_handle.data.corpus",
    "read_parallel": "torch_handle.data.corpus",
    "split_documents": "torch_handle.data.corpus",
    "text_files": "torch_handle.data.corpus",
    "pydoc_corpus": "torch_handle.data.corpus",
    # merging option tables (ds_config over the generated one)
    "deep_merge": "torch_handle.config.loader",
    # checkpoints
    "safe_load": "torch_handle.checkpoint.store",
    # telemetry sinks (standard library only)
    "Sink": "torch_handle.observe.telemetry",
    "Kind": "torch_handle.observe.fields",
    "Status": "torch_handle.observe.fields",
}

__all__ = ["hookimpl", "param", "field_docs", "InvalidValue", "PresetError", "DataError", "CheckpointError",
           "Preset", "TrainingConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_handle.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
