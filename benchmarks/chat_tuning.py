"""Conversations for supervised fine-tuning (issue 46), measured on Multi30k read as chat: each English-German pair
of ``../shared/data/multi30k/train.{en,de}`` is a translation request, user ``Translate to German: <en>``,
assistant ``<de>`` (29,000 conversations, rendered with ChatML).

* **Packing efficiency**: the conversations' positions over the positions of the samples they are packed into
  (best-fit-decreasing, :class:`~torch_handle.data.chat.packing.PackedConversations`), at each ``--seq-lens``
  (the target: at least 95 %).
* **Prepare throughput**: ``handle data prepare --chat`` of the conversations (JSON Lines of ``messages``) against
  a plain-text prepare of the same text (JSON Lines whose ``text`` is each conversation's rendering: the same
  tokens), each run ``--rounds`` times, the fastest kept; MB/s of the source file, tokens/s written, and the CPU
  seconds spent (this process's threads and the encoding processes: the figure a loaded machine changes least).
  The plain prepare runs as ``handle data prepare`` does (an encoding process per usable core) and in one process
  (``workers = 0``); the target: conversations within 20 % of plain text.

The tokenizer is handle's byte-level BPE (8,192 tokens) trained on the Multi30k training text, which reserves
ChatML's ``<|im_start|>`` and ``<|im_end|>`` (ids 4 and 5; ``--tokenizer``: another one). Everything is written under ``--work``
(default: a temporary directory)::

    python benchmarks/chat_tuning.py [--seq-lens 128,256,512,1024] [--rounds 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from _common import ROOT

DATA = ROOT.parent / "shared" / "data" / "multi30k"


def write_rows(directory: Path, data: Path, limit: int | None = None) -> tuple[Path, Path]:
    """``(chat.jsonl, plain.jsonl)`` in ``directory``: the translation requests as ``messages`` rows, and the
    same conversations rendered with ChatML as ``text`` rows."""
    from torch_handle.data.chat.template import CHATML, ChatTemplate

    en = (data / "train.en").read_text(encoding="utf-8").splitlines()[:limit]
    de = (data / "train.de").read_text(encoding="utf-8").splitlines()[:limit]
    chatml = ChatTemplate(CHATML, "chatml")
    chat, plain = directory / "chat.jsonl", directory / "plain.jsonl"
    with chat.open("w", encoding="utf-8") as c, plain.open("w", encoding="utf-8") as p:
        for e, d in zip(en, de):
            messages = [{"role": "user", "content": f"Translate to German: {e}"}, {"role": "assistant", "content": d}]
            c.write(json.dumps({"messages": messages}) + "\n")
            p.write(json.dumps({"text": chatml.render(messages)}) + "\n")
    return chat, plain


def train_chat_tokenizer(directory: Path, data: Path, vocab_size: int = 8192) -> Path:
    """handle's byte-level BPE trained on the Multi30k training text (ChatML's tokens reserved, ids 4 and 5):
    ``directory/tokenizer.json``."""
    from torch_handle.data.datasets import train_tokenizer

    path = directory / "tokenizer.json"
    if not path.is_file():
        texts = [(data / f"train.{x}").read_text(encoding="utf-8") for x in ("en", "de")]
        train_tokenizer(texts, vocab_size).save(str(path))
    return path


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (its threads) and of its children that have exited (the
    encoding processes of a plain prepare, joined when it ends)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(fn, rounds: int) -> tuple[float, float, dict]:
    """The fastest of ``rounds`` calls of ``fn()``: wall seconds, and the CPU seconds of the least costly call
    (what a shared, loaded machine changes least), and its result."""
    best, cpu, result = float("inf"), float("inf"), {}
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), cpu_seconds()
        result = fn()
        best, cpu = min(best, time.perf_counter() - t0), min(cpu, cpu_seconds() - c0)
    return best, cpu, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the multi30k directory")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json (default: trained on Multi30k)")
    parser.add_argument("--seq-lens", default="128,256,512,1024")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--limit", type=int, help="the first N pairs only")
    parser.add_argument("--work", type=Path, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from torch_handle.common.procs import usable_cores
    from torch_handle.data.chat.packing import PackedConversations
    from torch_handle.data.chat.prepare import prepare_chat
    from torch_handle.data.prepare import prepare
    from torch_handle.data.shards import open_prepared

    work = args.work or Path(tempfile.mkdtemp(prefix="chat-tuning-"))
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = args.tokenizer or train_chat_tokenizer(work, args.data)
    chat, plain = write_rows(work, args.data, args.limit)

    def run(fn, out: Path):
        def once():
            shutil.rmtree(out, ignore_errors=True)
            return fn(out)
        return once

    rows = []
    kw = {"tokenizer": tokenizer, "valid_fraction": 0.05}
    cases = [("conversations (--chat)", chat, run(lambda o: prepare_chat([str(chat)], o, template="chatml",
                                                                         max_len=4096, **kw), work / "chat")),
             (f"plain text, {usable_cores()} encoders", plain, run(lambda o: prepare([str(plain)], o, **kw),
                                                                    work / "plain")),
             ("plain text, in process", plain, run(lambda o: prepare([str(plain)], o, workers=0, **kw),
                                                   work / "plain0"))]
    for name, source, fn in cases:
        seconds, cpu, result = timed(fn, args.rounds)
        tokens = sum(s["tokens"] for s in result["splits"].values())
        rows.append({"case": name, "source_bytes": source.stat().st_size, "tokens": tokens, "seconds": seconds,
                     "cpu_seconds": cpu, "mb_per_s": source.stat().st_size / 1e6 / seconds,
                     "tokens_per_s": tokens / seconds, "tokens_per_cpu_s": tokens / cpu})
    data = open_prepared(work / "chat")
    packing = []
    for seq_len in (int(x) for x in args.seq_lens.split(",")):
        packed = PackedConversations(data.train, seq_len, fill_id=data.eos_id)
        packing.append({"seq_len": seq_len, "conversations": data.train.n_documents - packed.dropped,
                        "samples": len(packed), "efficiency": packed.efficiency, "dropped": packed.dropped})
    ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    cpu_ratio = rows[0]["tokens_per_cpu_s"] / rows[2]["tokens_per_cpu_s"]
    if args.json:
        print(json.dumps({"prepare": rows, "chat_over_plain": ratio, "chat_over_plain_cpu": cpu_ratio,
                          "packing": packing}))
        return
    print(f"Multi30k as chat: {data.train.n_documents:,} training conversations, {data.train.n_tokens:,} tokens "
          f"({tokenizer})")
    print(f"{'prepare':<28} {'source MB':>9} {'tokens':>10} {'seconds':>8} {'MB/s':>6} {'tokens/s':>10} "
          f"{'CPU s':>6} {'tokens/CPU s':>12}")
    for r in rows:
        print(f"{r['case']:<28} {r['source_bytes'] / 1e6:>9.2f} {r['tokens']:>10,} {r['seconds']:>8.2f} "
              f"{r['mb_per_s']:>6.2f} {r['tokens_per_s']:>10,.0f} {r['cpu_seconds']:>6.2f} "
              f"{r['tokens_per_cpu_s']:>12,.0f}")
    print(f"conversations / plain text: {ratio:.0%} of the tokens/s of {rows[1]['case']} (target: at least 80%), "
          f"{cpu_ratio:.0%} of the tokens per CPU second of {rows[2]['case']}")
    print(f"{'seq_len':>7} {'samples':>8} {'packing efficiency':>19} {'dropped':>8}")
    for p in packing:
        print(f"{p['seq_len']:>7} {p['samples']:>8,} {p['efficiency']:>19.2%} {p['dropped']:>8}")


if __name__ == "__main__":
    main()
