"""Data at scale: set-up time before step 1 and peak worker RSS for 10 MB, 100 MB and 1 GB corpora: ``handle data
prepare`` once, then ``tokens`` memory-maps it; the ``text`` dataset's first start (the launcher prepares into the
run's cache before the workers start: in ``run_wall_s``, not in the workers' ``data_setup_s``) and second start
(it memory-maps the cache); prepare's throughput from 1 worker to the usable cores against
the plain ``tokenizers`` ``encode_batch`` ceiling (one process, one thread); the loader's delivered tokens/s.

    python benchmarks/data_scale.py                       # 10 MB and 100 MB (minutes)
    python benchmarks/data_scale.py --sizes 10,100,1000   # and 1 GB (prepare alone takes minutes on 2 cores)
    python benchmarks/data_scale.py --before-max 100      # run the `text` dataset only up to 100 MB

The corpora are built on this machine from the Python sources and documentation of the running environment
(``sys.prefix`` and the standard library): one document per file, concatenated in a fixed order and repeated in
a shifted order when the environment has fewer bytes than asked (repeated documents do not change what is
measured here: bytes read, tokens written, memory held). Figures print as a table; ``--json`` prints one object
per row.

Data set-up is the time from the worker's start of the data step to its log line ``data ...: N train / M
validation samples`` (rank 0's log), peak RSS the largest resident set any worker process of the run reached
(polled every 0.1 s with psutil).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from _common import ROOT, sets

PRESET = ROOT / "presets" / "llama.toml"
MB = 1_000_000


def build_corpus(directory: Path, n_bytes: int, file_bytes: int = 8 * MB) -> Path:
    """``directory``: about ``n_bytes`` of UTF-8 text in files of about ``file_bytes`` (each file one document),
    made of the environment's source files, each ended by a blank line. Returns ``directory``."""
    if directory.is_dir() and sum(f.stat().st_size for f in directory.iterdir()) >= n_bytes:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    roots = [Path(sys.prefix), Path(os.__file__).parent]
    files = sorted({p for r in roots for ext in ("*.py", "*.rst", "*.md", "*.txt") for p in r.rglob(ext)
                    if p.is_file()})
    written, rnd, k, out = 0, 0, 0, None
    while written < n_bytes:
        for f in files[rnd % 7:] + files[: rnd % 7]:
            try:
                text = f.read_text(encoding="utf-8").rstrip("\n") + "\n\n"
            except (UnicodeDecodeError, OSError):
                continue
            if out is None or out.tell() >= file_bytes:
                if out is not None:
                    out.close()
                out = open(directory / f"part-{k:04d}.txt", "w", encoding="utf-8")
                k += 1
            out.write(text)
            written += len(text.encode("utf-8"))
            if written >= n_bytes:
                break
        rnd += 1
    out.close()
    return directory


def run_and_watch(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[str, int, float]:
    """Run ``cmd``; its stdout, the peak RSS (bytes) of its largest descendant process, and the wall time."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    parent, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            for child in parent.children(recursive=True):
                try:
                    peak = max(peak, child.memory_info().rss)
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        time.sleep(0.1)
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode})\n{out[-3000:]}")
    return out, peak, time.perf_counter() - t0


def data_setup_s(run_dir: Path) -> float:
    """Seconds between rank 0's first log line of the data step and its ``data ...: N train`` line."""
    log = (run_dir / "logs" / "rank0.log").read_text(encoding="utf-8").splitlines()
    stamp = re.compile(r"^(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[.,]\d+)")

    def when(line: str) -> datetime:
        m = stamp.match(line)
        if not m:
            raise SystemExit(f"{run_dir}/logs/rank0.log: no timestamp in {line!r}")
        return datetime.fromisoformat(m.group(1).replace(",", "."))

    timed = [ln for ln in log if stamp.match(ln)]
    done = next(ln for ln in timed if re.search(r"\bdata .*train / .*validation samples", ln))
    m = re.search(r"data set-up ([0-9.]+) s", done)
    return float(m.group(1)) if m else (when(done) - when(timed[0])).total_seconds()


def train_row(work: Path, label: str, size_mb: int, data: list[str]) -> dict:
    """One ``handle run presets/llama.toml`` of 2 steps on ``data`` overrides."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    overrides = ["training.steps=2", "training.eval_every=0", "training.checkpoint_every=0",
                 f"run.output_dir={work / 'runs'}", *data]
    out, peak, wall = run_and_watch([sys.executable, "-m", "handle_cli", "run", str(PRESET), *sets(*overrides)],
                                    ROOT, env)
    run_dir = Path(next(ln for ln in out.splitlines() if ln.startswith("run directory: ")).split(": ", 1)[1])
    run_dir = run_dir if run_dir.is_absolute() else ROOT / run_dir
    return {"case": label, "corpus_mb": size_mb, "data_setup_s": round(data_setup_s(run_dir), 2),
            "peak_worker_rss_mb": round(peak / MB), "run_wall_s": round(wall, 1)}


def prepare(corpus: Path, out: Path, workers: int, tokenizer: Path | None, vocab_size: int = 4096) -> float:
    """Seconds of ``handle data prepare`` (with the given tokenizer, or training one)."""
    cmd = [sys.executable, "-m", "handle_cli", "data", "prepare", str(corpus), "--out", str(out), "--force",
           "--workers", str(workers), "--json"]
    cmd += ["--tokenizer", str(tokenizer)] if tokenizer else ["--vocab-size", str(vocab_size)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def ceiling_mb_s(corpus: Path, tokenizer: Path, limit: int = 50 * MB) -> float:
    """MB/s of one process's ``Tokenizer.encode_batch`` over the corpus's first ``limit`` bytes (in memory)."""
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread, as each prepare worker
    tok = Tokenizer.from_file(str(tokenizer))
    text = b"".join(f.read_bytes() for f in sorted(corpus.iterdir()))[:limit].decode("utf-8", "ignore")
    docs = text.split("\n\n")
    t0 = time.perf_counter()
    for i in range(0, len(docs), 1024):
        tok.encode_batch(docs[i: i + 1024])
    return len(text.encode("utf-8")) / MB / (time.perf_counter() - t0)


def loader_tokens_per_s(prepared: Path, seq_len: int = 128, micro_batch_size: int = 8, batches: int = 500) -> float:
    """Tokens/s one rank's DataLoader delivers from a prepared directory (the training order, no model)."""
    from torch.utils.data import DataLoader

    from torch_handle.data.datasets import GlobalBatchSampler, TokenWindows
    from torch_handle.data.shards import open_prepared

    ds = TokenWindows(open_prepared(prepared).train, seq_len)
    sampler = GlobalBatchSampler(len(ds), micro_batch_size=micro_batch_size, world_size=2, rank=0)
    loader = iter(DataLoader(ds, batch_sampler=sampler))
    next(loader)
    t0 = time.perf_counter()
    n = 0
    for _, batch in zip(range(batches), loader):
        n += batch["input_ids"].numel()
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,100", help="corpus sizes in MB, comma-separated")
    ap.add_argument("--before-max", type=int, default=100, help="largest corpus (MB) to run the `text` dataset on")
    ap.add_argument("--scaling-max", type=int, default=100,
                    help="largest corpus (MB) to prepare with 1 worker too (above it: the usable cores only)")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a tokenizer.json to prepare with (default: train one on the smallest corpus)")
    ap.add_argument("--work", type=Path, default=None, help="where corpora and prepared data go (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="data_scale-"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in a.sizes.split(",")]
    cores = len(os.sched_getaffinity(0))
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row) if a.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    tokenizer = a.tokenizer
    for size in sizes:
        corpus = build_corpus(work / f"corpus-{size}mb", size * MB)
        out = work / f"prepared-{size}mb"
        if tokenizer is None:  # the first (smallest) corpus trains the tokenizer that every later one reuses
            secs = prepare(corpus, out, cores, None)
            tokenizer = work / "tokenizer.json"
            tokenizer.write_bytes((out / "tokenizer.json").read_bytes())
            emit({"case": "prepare (trains BPE)", "corpus_mb": size, "workers": cores, "s": round(secs, 1)})
        for workers in sorted({1, cores}) if size <= a.scaling_max else [cores]:
            secs = prepare(corpus, out, workers, tokenizer)
            emit({"case": "prepare", "corpus_mb": size, "workers": workers, "s": round(secs, 1),
                  "mb_s": round(size / secs, 2), "mb_s_per_worker": round(size / secs / workers, 2)})
        emit({"case": "encode_batch ceiling (1 process, 1 thread)", "corpus_mb": size,
              "mb_s": round(ceiling_mb_s(corpus, tokenizer), 2)})
        emit(train_row(work, "tokens (prepared)", size, ["data.name=tokens", f"data.path={out}"]))
        if size <= a.before_max:  # a first start (preparing into the cache) and a second (memory-mapping it)
            for start in ("first", "second"):
                emit(train_row(work / f"text-{size}", f"text ({start} start)", size,
                               ["data.name=text", f"data.path={corpus}"]))
    last = work / f"prepared-{sizes[-1]}mb"
    emit({"case": "loader (rank 0 of 2, seq 128 x micro-batch 8)", "tokens_per_s": round(loader_tokens_per_s(last))})
    if not a.json:
        print(f"\nwork directory: {work}")


if __name__ == "__main__":
    main()
