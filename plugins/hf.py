"""Model plugin ``hf``: a causal language model from a Hugging Face ``transformers`` architecture.

``[model] name = "hf"`` builds OPT, GPT-2 or Llama from the dims in the preset (a ``transformers`` config object
and ``AutoModelForCausalLM.from_config``: random initial weights, nothing downloaded), or any causal-LM
architecture from a local ``config.json`` (``config_path``), or local pretrained weights (``pretrained_path``,
``from_pretrained(local_files_only=True)``). The vocabulary size always comes from the dataset's tokenizer and
the position table (OPT, GPT-2) from ``data.seq_len``. The wrapped model follows the contract of the
from-scratch one (``plugins/hf_model.py``): ``model(input_ids)`` returns logits (B, T, V), ``blocks()`` lists the
decoder layers (FSDP2 shards each; activation checkpointing recomputes each), ``flops_per_token`` feeds MFU.

``transformers`` is the optional extra ``torch-handle[hf]``. This module never imports it (``handle --help`` and
preset validation stay fast, and the plugin loads without it); a preset that names ``hf`` without it installed
fails validation with one line saying which extra to install.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from torch_handle.api import InvalidValue, hookimpl, param

EXTRA = "hf"
REQUIRES = "transformers"
"""The module the extra installs (``pip install 'torch-handle[hf]'``)."""
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
"""What ``from_pretrained`` reads from a local directory (one of them must be there)."""


def missing_extra_message() -> str:
    return f"model 'hf' needs the {EXTRA} extra: pip install 'torch-handle[{EXTRA}]'"


def transformers_available() -> bool:
    """Whether ``transformers`` can be imported (looked up, not imported: no cost)."""
    try:
        return importlib.util.find_spec(REQUIRES) is not None
    except (ImportError, ValueError):  # a broken or half-removed install reads as absent
        return False


@dataclass
class HFConfig:
    """``[model]`` options of the ``hf`` plugin. With ``config_path`` or ``pretrained_path`` the architecture and
    the sizes come from that ``config.json`` and ``architecture`` ... ``tie_embeddings`` are not used."""

    architecture: Literal["opt", "gpt2", "llama"] = "opt"
    """opt = OPT (Zhang et al. 2022: pre-LN, learned positions, ReLU); gpt2 = GPT-2 (Radford et al. 2019: pre-LN,
    learned positions, GELU); llama = Llama (Touvron et al. 2023: RMSNorm, rotary positions, SwiGLU)."""
    d_model: int = param(128, ge=8)
    """Hidden size (``hidden_size``; ``n_embd`` for GPT-2)."""
    n_layers: int = param(2, ge=1)
    """Decoder layers (``num_hidden_layers``)."""
    n_heads: int = param(4, ge=1)
    """Attention heads (``num_attention_heads``); must divide d_model."""
    n_kv_heads: int | None = param(None, ge=1)
    """Llama only: key/value heads (grouped-query attention, Ainslie et al. 2023); unset = n_heads."""
    d_ff: int = param(512, ge=1)
    """Feed-forward hidden width (``ffn_dim``, ``n_inner``, ``intermediate_size``)."""
    dropout: float = param(0.0, ge=0.0, le=0.9, frozen_on_resume=False)
    """Dropout (OPT: residual and attention; GPT-2: embedding, residual and attention; Llama: attention)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection (``tie_word_embeddings``)."""
    attention: Literal["sdpa", "eager"] = param("sdpa", frozen_on_resume=False)
    """``attn_implementation``: sdpa = torch's scaled_dot_product_attention; eager = the explicit softmax."""
    activation_checkpointing: bool = param(False, frozen_on_resume=False)
    """Recompute each decoder layer's activations in backward (transformers' activation checkpointing,
    torch.utils.checkpoint with use_reentrant=False)."""
    config_path: str = ""
    """A local ``config.json`` (or a directory holding one) of any causal-LM architecture transformers knows;
    random initial weights. vocab_size is set from the data."""
    pretrained_path: str = ""
    """A local directory with ``config.json`` and weights (``model.safetensors`` or ``pytorch_model.bin``, maybe
    sharded), loaded with ``from_pretrained(local_files_only=True)``. The data's tokenizer is the project's own:
    when its size differs from the checkpoint's vocabulary, the embedding is resized."""

    def check(self) -> None:
        if self.config_path and self.pretrained_path:
            raise InvalidValue("pretrained_path", "give config_path or pretrained_path, not both")
        if self.d_model % self.n_heads:
            raise InvalidValue("n_heads", f"{self.n_heads} does not divide d_model={self.d_model}")
        if self.n_kv_heads is not None:
            if self.architecture != "llama":
                raise InvalidValue("n_kv_heads", f"is for architecture 'llama' only (got {self.architecture!r})")
            if self.n_heads % self.n_kv_heads:
                raise InvalidValue("n_kv_heads", f"{self.n_kv_heads} does not divide n_heads={self.n_heads}")


def config_file(options: HFConfig) -> Path | None:
    """The ``config.json`` that ``config_path`` / ``pretrained_path`` point at (None without a path)."""
    raw = options.pretrained_path or options.config_path
    if not raw:
        return None
    path = Path(raw).expanduser()
    return path / "config.json" if path.is_dir() or options.pretrained_path else path


def read_local_config(options: HFConfig) -> dict | None:
    """The parsed ``config.json`` of ``config_path`` / ``pretrained_path`` (None without a path).

    Raises:
        InvalidValue: the file or the weights are missing, or the file is not a JSON object with a
            ``model_type``.
    """
    path = config_file(options)
    if path is None:
        return None
    key = "pretrained_path" if options.pretrained_path else "config_path"
    given = getattr(options, key)
    if options.pretrained_path and not Path(given).expanduser().is_dir():
        raise InvalidValue(key, f"{given!r} is not a directory (expected one with config.json and weights)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidValue(key, f"{str(path)!r} does not exist (expected a transformers config.json)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidValue(key, f"{str(path)!r} is not a readable JSON file: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise InvalidValue(key, f"{str(path)!r} has no \"model_type\" (not a transformers config.json)")
    if options.pretrained_path and not any((path.parent / name).is_file() for name in WEIGHT_FILES):
        raise InvalidValue(key, f"{given!r} has no weights ({', '.join(WEIGHT_FILES)})")
    return data


POSITION_KEYS = ("max_position_embeddings", "n_positions")
"""config.json keys of the longest sequence a learned or rotary position scheme was built for."""


def check_preset(options: HFConfig, preset) -> None:
    """The extra is installed; the data is language modelling without packed documents' masks; a local config is
    readable and long enough."""
    if not transformers_available():
        raise InvalidValue("name", missing_extra_message())
    task = getattr(preset.data.options, "task", "lm")
    if task != "lm":
        raise InvalidValue("name", f"'hf' builds causal language models: it cannot train on data "
                                   f"{preset.data.name!r} ({task}); use a language-modelling dataset")
    if getattr(preset.data.options, "document_mask", False):
        raise InvalidValue("data.document_mask", "packed documents' masks are built by the 'transformer' model; "
                                                 "'hf' takes no position_ids: set data.document_mask = false")
    local = read_local_config(options)
    seq_len = getattr(preset.data.options, "seq_len", None)
    if local is not None and options.pretrained_path and isinstance(seq_len, int):
        limit = next((local[k] for k in POSITION_KEYS if isinstance(local.get(k), int)), None)
        if limit is not None and seq_len > limit:
            raise InvalidValue("data.seq_len", f"{seq_len} is longer than the {limit} positions of the pretrained "
                                               f"model in {options.pretrained_path!r}")


def build(options: HFConfig, vocab_size: int, pad_id: int, max_len: int):
    """``factory(options, vocab_size, pad_id, max_len) -> nn.Module`` (``handle_plugins.hf_model.HFCausalLM``).

    Raises:
        InvalidValue: the local config or weights are gone since validation.
    """
    from handle_plugins.hf_model import build_hf

    return build_hf(options, vocab_size, pad_id, max_len, read_local_config(options))


@hookimpl
def handle_register_models(register):
    register("hf", HFConfig, build, "Hugging Face causal LM (OPT, GPT-2, Llama or a local config/checkpoint); "
                                    "extra: pip install 'torch-handle[hf]'", check_preset)
