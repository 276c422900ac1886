"""The ``shakespeare`` dataset: imported on the workers only (torch, tokenizers)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from torch_handle.api import (SPECIAL_TOKENS, DataBundle, DataContext, DataError, LMDataset, encode_stream,
                              load_or_train_tokenizer, read_text, split_documents)


def char_tokenizer(train_text: str, cache_dir: Path, *, is_main: bool, barrier):
    """A character tokenizer as a ``tokenizers`` JSON file (so the run directory gets a real tokenizer.json):
    the 4 special tokens, then every character of the training split in sorted order; a character seen only
    in validation becomes ``<unk>``. Rank 0 writes it (atomically) while the other ranks wait at ``barrier``."""
    from tokenizers import Tokenizer, decoders, models

    chars = sorted(set(train_text))
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + [c for c in chars if c not in SPECIAL_TOKENS])}
    digest = hashlib.sha256("\0".join(vocab).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    path = Path(cache_dir) / f"tokenizer-char-{digest}.json"
    if is_main and not path.exists():
        # BPE without merges and without a pre-tokenizer is exactly "one token per character"
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens(SPECIAL_TOKENS)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tok.save(str(tmp))
        os.replace(tmp, path)
    barrier()
    return vocab, path


def char_ids(vocab: dict[str, int], text: str) -> torch.Tensor:
    unk = vocab["<unk>"]
    return torch.tensor([vocab.get(c, unk) for c in text], dtype=torch.long)


def build_bundle(options, ctx: DataContext) -> DataBundle:
    text = read_text(options.file)
    if options.lowercase:
        text = text.lower()
    if not text.strip():
        raise DataError(f"{options.file}: empty corpus")
    (train,), (valid,) = split_documents([text], options.valid_fraction)
    name = f"shakespeare:{options.file.name}"
    if options.tokenizer == "char":
        vocab, tok_path = char_tokenizer(train, ctx.cache_dir, is_main=ctx.is_main, barrier=ctx.barrier)
        train_ids, valid_ids, vocab_size = char_ids(vocab, train), char_ids(vocab, valid), len(vocab)
    else:
        tok, tok_path = load_or_train_tokenizer([train], options.vocab_size, ctx.cache_dir, is_main=ctx.is_main,
                                                barrier=ctx.barrier)
        train_ids, valid_ids = encode_stream(tok, [train]), encode_stream(tok, [valid])
        vocab_size = tok.get_vocab_size()
    return DataBundle(train=LMDataset(train_ids, options.seq_len, f"{name} (train split)"),
                      valid=LMDataset(valid_ids, options.seq_len, f"{name} (validation split)"),
                      vocab_size=vocab_size, max_len=options.seq_len, tokenizer_path=tok_path,
                      description=f"{name} ({options.tokenizer})")
