"""``handle data``: prepare a corpus into token shards once (``prepare``) and say what a prepared directory holds
(``info``). Click and the standard library at import; the library (:mod:`torch_handle.data.prepare`) and rich are
imported when a command runs."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import click

from handle_cli.common import fail


@click.group()
def data() -> None:
    """Prepare corpora into memory-mapped token shards (docs/data.md).

    \b
    Examples:
      handle data prepare corpus/*.txt --out data/corpus --vocab-size 8192
      handle data info data/corpus
    """


def _part(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        fail(f"--part {value}: give I/N, e.g. 0/8 (part I of N, counting from 0)")
    if not 0 <= i < n:
        fail(f"--part {value}: I must be in 0..N-1")
    return i, n


@data.command()
@click.argument("sources", nargs=-1, required=True, metavar="SRC...")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Directory to write the shards into.")
@click.option("--tokenizer", metavar="PATH", help="Encode with this tokenizer.json (or a directory holding one: "
                                                  "a `handle export`, a Hugging Face model) instead of training one.")
@click.option("--vocab-size", type=click.IntRange(min=262), default=4096, show_default=True,
              help="Vocabulary of the byte-level BPE trained when no --tokenizer is given.")
@click.option("--tokenizer-sample-bytes", type=click.IntRange(min=1), default=64 << 20, show_default=True,
              help="Train the BPE on the first this many bytes of the training documents.")
@click.option("--format", "fmt", type=click.Choice(["auto", "text", "jsonl", "parquet", "hf"]), default="auto",
              show_default=True, help="How to read SRC: auto by suffix (.jsonl/.jsonl.gz, .parquet, a "
                                      "datasets.save_to_disk directory, else plain text).")
@click.option("--field", default="text", show_default=True, help="JSON Lines: the key holding each document.")
@click.option("--column", default="text", show_default=True, help="Parquet / hf: the column holding each document.")
@click.option("--valid-fraction", type=click.FloatRange(0, 1, max_open=True), default=0.05, show_default=True,
              help="Share of the documents held out for validation (by a hash of source and document number).")
@click.option("--valid", "valid", multiple=True, metavar="SRC",
              help="Validation documents of their own (repeatable); then nothing of SRC is held out.")
@click.option("--workers", type=click.IntRange(min=1), help="Encoding processes [default: the usable cores].")
@click.option("--part", metavar="I/N", help="Prepare part I of N of the documents (number modulo N) into "
                                            "OUT/part-IIIII-of-NNNNN; needs --tokenizer.")
@click.option("--dtype", type=click.Choice(["auto", "uint16", "uint32"]), default="auto", show_default=True,
              help="Token dtype (auto: uint16 when the vocabulary fits).")
@click.option("--force", is_flag=True, help="Replace OUT when it is a prepared directory already.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object (no progress bar).")
@click.option("--chat", is_flag=True, help="SRC holds conversations (JSON Lines, Parquet or datasets.save_to_disk "
                                           "rows of messages, prompt/completion or instruction/input/output): render "
                                           "each with a chat template and store which tokens are trained (needs "
                                           "--tokenizer).")
@click.option("--template", metavar="chatml|zephyr|FILE.jinja",
              help="--chat: the template [default: the tokenizer's own, chat_template.jinja or "
                   "tokenizer_config.json's]; zephyr ends each turn with the tokenizer's eos_token (a vocabulary "
                   "without ChatML's tokens).")
@click.option("--train-on", type=click.Choice(["assistant", "last", "all"]), default="assistant", show_default=True,
              help="--chat: train every assistant turn, the last one, or every turn but the system's.")
@click.option("--max-len", type=click.IntRange(min=2), default=2048, show_default=True,
              help="--chat: longest conversation in tokens (as data.seq_len); longer ones per --max-len-policy.")
@click.option("--max-len-policy", type=click.Choice(["truncate", "drop"]), default="truncate", show_default=True,
              help="--chat: cut a longer conversation's earliest tokens, or leave it out (counted in meta.json).")
@click.option("--messages-field", default="messages", show_default=True, help="--chat: the key holding messages.")
@click.option("--column-map", multiple=True, metavar="OLD=NEW", help="--chat: rename a row's key first "
                                                                     "(repeatable), e.g. conversation=messages.")
@click.option("--preference", is_flag=True, help="SRC holds preference pairs (rows of chosen/rejected messages, or "
                                                 "prompt + chosen/rejected): render both sides as --chat does, their "
                                                 "completions trained, a pair never split (needs --tokenizer).")
def prepare(sources: tuple[str, ...], out: Path, tokenizer: str | None, vocab_size: int, tokenizer_sample_bytes: int,
            fmt: str, field: str, column: str, valid_fraction: float, valid: tuple[str, ...], workers: int | None,
            part: str | None, dtype: str, force: bool, as_json: bool, chat: bool, template: str | None, train_on: str,
            max_len: int, max_len_policy: str, messages_field: str, column_map: tuple[str, ...],
            preference: bool) -> None:
    """Encode SRC (files, directories, globs) into token shards in OUT, once; train on them with
    [data] name = "tokens", path = "OUT".

    One document is a text file, a JSON Lines line (--field), a Parquet row (--column) or a row of a
    datasets.save_to_disk directory (hf extra); <eos> ends each. The shards are the same bytes for any --workers;
    OUT appears only when complete (a killed prepare leaves no OUT).

    \b
    Examples:
      handle data prepare notes/ books/*.txt --out data/books --vocab-size 8192
      handle data prepare web.jsonl.gz --field text --tokenizer exported/llama --out data/web --json
      handle data prepare shards/*.parquet --column content --tokenizer tok.json --out data/big --part 0/8
      handle data prepare chats.jsonl --chat --tokenizer runs/llama-export --template chatml --out data/chat
      handle data prepare seed_tasks.jsonl --chat --tokenizer exported/llama --template zephyr --out data/sft
      handle data prepare pairs.jsonl --preference --tokenizer runs/llama-export --out data/pairs

    Exit code 2 with one line on stderr, and nothing written, for bad input.
    """
    if chat or preference:
        _prepare_chat(sources, out, tokenizer, template, train_on, valid, valid_fraction, max_len, max_len_policy,
                      messages_field, column_map, force, as_json, preference)
        return
    from torch_handle.data.prepare import prepare as run_prepare

    kwargs = dict(valid=valid, tokenizer=tokenizer, vocab_size=vocab_size,
                  tokenizer_sample_bytes=tokenizer_sample_bytes, valid_fraction=valid_fraction, workers=workers,
                  part=_part(part), force=force, dtype=dtype, fmt=fmt, field=field, column=column)
    if as_json:
        click.echo(json.dumps(run_prepare(list(sources), out, **kwargs)))
        return
    with progress_bar() as show:
        result = run_prepare(list(sources), out, progress=show, **kwargs)
    s = result["splits"]
    click.echo(f"prepared {result['directory']}: train {s['train']['tokens']:,} tokens in "
               f"{s['train']['documents']:,} documents, valid {s['valid']['tokens']:,} tokens in "
               f"{s['valid']['documents']:,} ({result['valid_method']}); {result['dtype']}, vocabulary "
               f"{result['vocab_size']:,}; {result['bytes'] / 1e6:.1f} MB in {result['seconds']:.1f} s "
               f"({result['mb_per_s']:.2f} MB/s, {result['workers']} workers)")


def _prepare_chat(sources, out, tokenizer, template, train_on, valid, valid_fraction, max_len, max_len_policy,
                  messages_field, column_map, force, as_json, preference=False) -> None:
    from torch_handle.data.chat.pairs import prepare_preference
    from torch_handle.data.chat.prepare import prepare_chat

    flag = "--preference" if preference else "--chat"
    if not tokenizer:
        fail(f"{flag} needs --tokenizer (the base's tokenizer.json, or a directory holding one)")
    mapping = {}
    for item in column_map:
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            fail(f"--column-map {item}: give OLD=NEW, e.g. conversation=messages")
        mapping[old] = new
    common = dict(tokenizer=tokenizer, template=template, valid=list(valid), valid_fraction=valid_fraction,
                  max_len=max_len, max_len_policy=max_len_policy, column_map=mapping, force=force)
    with contextlib.nullcontext(None) if as_json else progress_bar() as show:
        result = prepare_preference(list(sources), out, progress=show, **common) if preference else \
            prepare_chat(list(sources), out, train_on=train_on, messages_field=messages_field, progress=show, **common)
    if result.get("added_tokens"):  # the base lacked the template's tokens: its rows grow when the run loads it
        added = ", ".join(f"{t} (id {i})" for t, i in result["added_tokens"].items())
        click.echo(f"note: added {added} to the tokenizer in {result['directory']}: a run on its base grows the "
                   f"embedding and output rows to match (mean-initialised, trained)", err=True)
    if not result["end_of_turn_trained"]:  # a model trained on it never stops (trl #1623)
        click.echo(f"warning: {result['directory']}: no trained token ends a turn (template {result['template']} ends "
                   f"its turns with text, not a token of this vocabulary): a model trained on it never learns to "
                   f"stop; give --template zephyr, or a base whose vocabulary has the template's tokens", err=True)
    if as_json:
        click.echo(json.dumps(result))
        return
    s = result["splits"]
    if preference:
        click.echo(f"prepared {result['directory']}: {result['pairs']:,} pairs (template {result['template']}); "
                   f"train {s['train']['tokens']:,} tokens, {s['train']['trained_tokens']:,} trained; valid "
                   f"{s['valid']['tokens']:,} tokens; {result['truncated']} sides truncated, {result['dropped']} "
                   f"pairs dropped")
        return
    click.echo(f"prepared {result['directory']}: {result['conversations']:,} conversations (template "
               f"{result['template']}, train on {result['train_on']}); train {s['train']['tokens']:,} tokens, "
               f"{s['train']['trained_tokens']:,} trained; valid {s['valid']['tokens']:,} tokens; "
               f"{result['truncated']} truncated, {result['dropped']} dropped")


@data.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--split", type=click.Choice(["train", "valid"]), default="train", show_default=True)
@click.option("--index", type=click.IntRange(min=0), default=0, show_default=True,
              help="Which conversation (or pair).")
@click.option("--json", "as_json", is_flag=True, help='Print {"ids": [...], "trained": [...]} (pairs: {"chosen": '
                                                      '{...}, "rejected": {...}}).')
def inspect(directory: Path, split: str, index: int, as_json: bool) -> None:
    """Show conversation INDEX of a --chat prepared DIRECTORY (or pair INDEX of a --preference one, chosen then
    rejected): its tokens, the trained ones highlighted (loss is taken on them), the trained share and whether
    each end-of-turn token is trained.

    \b
    Examples:
      handle data inspect data/chat --index 3
      handle data inspect data/chat --split valid --index 0 --json
    """
    from torch_handle.data.chat.pairs import holds_pairs, pair_view
    from torch_handle.data.chat.prepare import conversation_view
    from torch_handle.data.shards import open_prepared

    if holds_pairs(open_prepared(directory).meta):
        views = pair_view(directory, split, index)
        if as_json:
            click.echo(json.dumps({k: {"ids": v["ids"], "trained": v["trained"]} for k, v in views.items()}))
            return
        for key, view in views.items():
            _show(view, f"{split} pair {index}, {key}")
        return
    view = conversation_view(directory, split, index)
    if as_json:
        click.echo(json.dumps({"ids": view["ids"], "trained": view["trained"]}))
        return
    _show(view, f"{split} conversation {index}")


def _show(view: dict[str, Any], title: str) -> None:
    """A conversation's tokens, trained ones in green, and a line of counts."""
    from rich.console import Console
    from rich.text import Text

    text = Text()
    for token, trained in zip(view["tokens"], view["trained"]):
        text.append(token, style="bold green" if trained else "dim")
    console = Console(highlight=False)
    console.print(text)
    ends = view["end_of_turn_trained"]
    console.print(f"{title}: {len(view['ids'])} tokens, {sum(view['trained'])} trained "
                  f"({view['trained_share']:.0%} of the labels; green); end-of-turn tokens trained: "
                  f"{sum(ends)} of {len(ends)}")


@contextlib.contextmanager
def progress_bar(label: str = "preparing") -> Iterator[Callable[[Any], None]]:
    """A transient rich progress bar on stderr when it is a terminal, shown from the first call of the callback it
    yields: the ``progress`` of :func:`torch_handle.data.prepare.prepare` (``handle data prepare``, and ``handle
    run`` preparing its data). Elsewhere (a pipe, a log) the callback does nothing: no partial lines."""
    import sys

    from rich.console import Console
    from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    shown: list[Any] = []

    def show(p: Any) -> None:
        if not sys.stderr.isatty():
            return
        if not shown:
            bar = Progress(TextColumn(label), BarColumn(), TaskProgressColumn(), TextColumn("{task.fields[what]}"),
                           TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), transient=True,
                           console=Console(stderr=True))
            bar.start()
            shown.extend([bar, bar.add_task("prepare", total=None, what="reading")])
        shown[0].update(shown[1], total=p.total_bytes, completed=p.bytes,
                        what=f"{p.documents:,} docs, {p.tokens:,} tokens, {p.mb_per_s:.1f} MB/s")

    try:
        yield show
    finally:
        if shown:
            shown[0].stop()


@data.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print meta.json's content (of each part) as JSON.")
def info(directory: Path, as_json: bool) -> None:
    """What the prepared DIRECTORY holds: splits, tokens, documents, sources, tokenizer.

    \b
    Examples:
      handle data info data/books
      handle data info data/big --json
    """
    from torch_handle.data.shards import prepared_parts

    metas = prepared_parts(directory)
    if as_json:
        click.echo(json.dumps({"directory": str(directory), "parts": [{"directory": str(d), **m} for d, m in metas]}))
        return
    first = metas[0][1]
    tok = first["tokenizer"]
    origin = tok.get("given") or f"trained (vocab_size {tok.get('trained', {}).get('vocab_size')})"
    click.echo(f"{directory}: {len(metas)} part(s), {first['dtype']}, tokenizer {origin}, vocabulary "
               f"{tok['vocab_size']:,}, eos id {tok.get('eos_id')}, sha256 {tok.get('sha256', '')[:12]}")
    for split in ("train", "valid"):
        tokens = sum(m["splits"].get(split, {}).get("tokens", 0) for _, m in metas)
        docs = sum(m["splits"].get(split, {}).get("documents", 0) for _, m in metas)
        click.echo(f"  {split}: {tokens:,} tokens, {docs:,} documents")
    valid = first.get("valid", {})
    click.echo(f"  validation: {valid.get('method')} (fraction {valid.get('fraction')})")
    sources = first.get("sources", [])
    for s in sources[:10]:
        click.echo(f"  source {s['path']} ({s['format']}, {s['bytes']:,} bytes, {s['documents']:,} documents, "
                   f"{s['split']})")
    if len(sources) > 10:
        click.echo(f"  ... {len(sources) - 10} more sources (--json lists them)")
