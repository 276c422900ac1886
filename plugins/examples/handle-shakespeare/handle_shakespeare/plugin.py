"""The hooks of the ``shakespeare`` plugin. Cheap to import: no torch, no tokenizers (those are imported by the
factory, on the workers, when a run starts)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import click

from handle_shakespeare import SAMPLE
from torch_handle.api import InvalidValue, hookimpl, param


@dataclass
class ShakespeareConfig:
    """``[data]`` options of ``shakespeare``: language modelling on a local text file, one token per character
    (or byte-level BPE)."""

    task: ClassVar[str] = "lm"
    """Tells the model plugin this is language modelling (the transformer then requires kind = 'decoder')."""
    path: str = ""
    """A UTF-8 text file; empty = the bundled sample (12 of Shakespeare's sonnets)."""
    tokenizer: Literal["char", "bpe"] = "char"
    """char = one token per character of the training split; bpe = torch-handle's byte-level BPE."""
    vocab_size: int = param(512, ge=262)
    """BPE vocabulary size (tokenizer = 'bpe' only; its 6 special tokens and 256 byte symbols included)."""
    seq_len: int = param(64, ge=2)
    """Tokens per sample."""
    valid_fraction: float = param(0.1, gt=0.0, le=0.5)
    """Fraction of the text (its tail) held out for validation."""
    lowercase: bool = False
    """Lower-case the text first (a smaller character vocabulary)."""
    num_workers: int = param(0, ge=0, frozen_on_resume=False)
    """DataLoader worker processes per rank."""

    def check(self) -> None:
        if self.path and Path(self.path).expanduser().is_dir():
            raise InvalidValue("path", f"{self.path!r} is a directory; give one text file")

    @property
    def file(self) -> Path:
        return Path(self.path).expanduser() if self.path else SAMPLE


def build(options: ShakespeareConfig, ctx):
    """``factory(options, ctx: DataContext) -> DataBundle``: called on every rank when a run starts."""
    from handle_shakespeare.data import build_bundle

    return build_bundle(options, ctx)


def preflight(options: ShakespeareConfig) -> None:
    """Run by ``handle run`` / ``handle validate`` before anything starts: the file exists and is UTF-8."""
    from torch_handle.api import DataError

    f = options.file
    try:
        text = f.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise DataError(f"{f}: no such file (data.path)") from None
    except OSError as e:
        raise DataError(f"{f}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{f}: not UTF-8 text (undecodable byte at offset {e.start})") from None
    if not text.strip():
        raise DataError(f"{f}: empty corpus")


@hookimpl
def handle_register_datasets(register):
    register("shakespeare", ShakespeareConfig, build, "character-level (or BPE) LM on a text file; "
             "default: 12 sonnets", preflight=preflight)


@hookimpl
def handle_register_presets(register):
    register(Path(__file__).with_name("presets"))


@click.command("shakespeare-stats")
@click.argument("path", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--lowercase", is_flag=True, help="Count as data.lowercase = true would.")
def stats(path: Path | None, lowercase: bool) -> None:
    """The corpus of the shakespeare dataset in numbers (PATH, default: the bundled sonnets)."""
    from collections import Counter

    f = path or SAMPLE
    text = f.read_text(encoding="utf-8")
    if lowercase:
        text = text.lower()
    counts = Counter(text)
    click.echo(f"{f}: {len(text):,} characters, {len(text.splitlines()):,} lines, {len(text.split()):,} words")
    click.echo(f"char vocabulary: {len(counts)} characters + 4 special tokens = {len(counts) + 4}")
    common = ", ".join(f"{c!r} {n}" for c, n in counts.most_common(8))
    click.echo(f"most common: {common}")


@hookimpl
def handle_register_commands(register):
    register(stats)
