"""handle against litgpt on presets/llama.toml's model: tokens/s of both, interleaved, and their ratio.

    python benchmarks/vs_litgpt.py --litgpt-python /work/litgpt-venv/bin/python [--rounds 3] [--steps 30]

What is compared, per case (1 or 2 CPU processes under torchrun, gloo, ``OMP_NUM_THREADS=1`` in each; fp32 or
bf16; compiled or eager):

* handle: ``handle run presets/llama.toml`` with ``--set training.compile=true|false``, ``training.precision``,
  ``launch.nproc_per_node`` (``strategy.name=single`` on one process: litgpt's Fabric then uses no DDP either),
  ``model.dropout=0`` (litgpt's GPT has no dropout: the same model, 4,000,000 parameters on both sides), and no
  evaluation or checkpoint between steps (``eval_every=0``, ``checkpoint_every=0``: both only after the last
  step, outside the timed steps). Its data is the preset's: the pydoc corpus, vocabulary 4,096, seq_len 128,
  micro-batch 8 per rank. Its time per step is the wall time between consecutive ``step`` events of rank 0, so
  everything the trainer does each step counts (data, forward, loss, backward, the loss all-reduce, clipping,
  AdamW, LR schedule, the telemetry of the step event).
* litgpt 0.5.13, as its ``pretrain`` trains (``benchmarks/litgpt_train.py``, run with ``--litgpt-python``, a
  separate environment with the same torch): ``L.Fabric`` DDP, the identical ``Config`` (RoPE, RMSNorm, SwiGLU
  ``LLaMAMLP`` 704, GQA 4 query / 2 key-value heads, no biases, tied embeddings), ``torch.compile(model)`` when
  compiled (pretrain always compiles), precision ``32-true`` or ``bf16-mixed`` (its CPU default), AdamW, clipping
  at 1, ``chunked_cross_entropy``, random token ids of the same shape. Its time per step is rank 0's wall time of
  each iteration.

Both drop the first ``--skip`` steps (compilation and warm-up) and report the median tokens/s (global: micro-batch
× seq_len × processes ÷ step time) over the rest, and its upper quartile (the faster steps' speed, less moved by
other work on a shared machine). One round runs every case's handle then litgpt (A B A B ...);
``--litgpt-malloc`` adds litgpt with the glibc malloc settings handle's launcher gives its CPU workers
(``torch_handle.launch.cores.MALLOC_ENV``: any PyTorch CPU program gains from them, so the table shows both);
the table gives the median over ``--rounds`` rounds with the range, and the ratio of the medians. litgpt is never a
dependency of handle or of its tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, handle_run, read_events
from torch_handle.launch.cores import MALLOC_ENV

SEQ_LEN, MICRO_BATCH, VOCAB = 128, 8, 4096
CASES = [(procs, precision, mode) for mode in ("compiled", "eager") for procs in (1, 2)
         for precision in ("fp32", "bf16")]


def rates_of(rates: list[float]) -> tuple[float, float]:
    """(median, upper quartile) of per-step tokens/s: the upper quartile is the speed of the run's faster steps,
    less moved by other work on a shared machine than the median."""
    return statistics.median(rates), statistics.quantiles(rates, n=4)[2]


def handle_tokens_per_s(directory: Path, procs: int, precision: str, mode: str, steps: int, skip: int
                        ) -> tuple[float, float]:
    """Global tokens/s of one ``handle run`` over its steps after ``skip`` (rank 0's step events): ``rates_of``."""
    overrides = [f"training.steps={steps}", f"training.compile={str(mode == 'compiled').lower()}",
                 f"training.precision={precision}", f"launch.nproc_per_node={procs}",
                 f"strategy.name={'ddp' if procs > 1 else 'single'}", "model.dropout=0", "training.eval_every=0",
                 "training.eval_steps=1", "training.checkpoint_every=0", f"run.output_dir={directory}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_dir = handle_run(ROOT / "presets" / "llama.toml", overrides, env=env)
    steps_ev = read_events(run_dir, "step")
    tokens = {e["step"]: e["tokens"] for e in steps_ev}
    times = {e["step"]: e["time"] for e in steps_ev}
    rates = [tokens[s] / (times[s] - times[s - 1]) for s in range(skip + 1, steps + 1) if times[s] > times[s - 1]]
    return rates_of(rates)


def litgpt_tokens_per_s(litgpt_python: str, directory: Path, procs: int, precision: str, mode: str, steps: int,
                        skip: int, malloc: bool = False) -> tuple[float, float]:
    """Global tokens/s of ``litgpt_train.py`` under torchrun over its iterations after ``skip``: ``rates_of``.
    ``malloc``: with the glibc settings handle's launcher gives its CPU workers (``cores.MALLOC_ENV``)."""
    out = directory / "litgpt.json"
    cmd = [litgpt_python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
           str(Path(__file__).with_name("litgpt_train.py")), f"--devices={procs}", f"--steps={steps}",
           f"--precision={'32-true' if precision == 'fp32' else 'bf16-mixed'}", f"--out={out}",
           f"--micro-batch-size={MICRO_BATCH}", f"--seq-len={SEQ_LEN}", f"--vocab-size={VOCAB}",
           *(["--eager"] if mode == "eager" else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(MALLOC_ENV if malloc else {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"litgpt run failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    return rates_of([result["tokens_per_step"] / t for t in result["step_time_s"][skip:]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--litgpt-python", required=True, help="Python of an environment with litgpt and the same torch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5, help="leave out the first steps (compilation, warm-up)")
    ap.add_argument("--cases", default="all",
                    help="comma-separated PROCS-PRECISION-MODE, e.g. 1-fp32-compiled,2-bf16-eager (default: all 8)")
    ap.add_argument("--litgpt-malloc", action="store_true",
                    help="also run litgpt with the glibc malloc settings handle's launcher gives its CPU workers")
    ap.add_argument("--json", action="store_true", help="one JSON object per case instead of the table")
    a = ap.parse_args()
    cases = CASES if a.cases == "all" else [(int(p), pr, m) for p, pr, m in (c.split("-") for c in a.cases.split(","))]
    figures: dict[tuple[int, str, str], dict[str, list[tuple[float, float]]]] = {
        c: {"handle": [], "litgpt": [], "litgpt_malloc": []} for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for case in cases:
                directory = Path(tmp) / f"{r}-{'-'.join(map(str, case))}"
                directory.mkdir()
                h = handle_tokens_per_s(directory, *case, a.steps, a.skip)
                lg = litgpt_tokens_per_s(a.litgpt_python, directory, *case, a.steps, a.skip)
                figures[case]["handle"].append(h)
                figures[case]["litgpt"].append(lg)
                if a.litgpt_malloc:
                    lm = litgpt_tokens_per_s(a.litgpt_python, directory, *case, a.steps, a.skip, malloc=True)
                    figures[case]["litgpt_malloc"].append(lm)
                    print(f"  litgpt with handle's malloc settings {lm[0]:,.0f} tokens/s ({h[0] / lm[0]:.2f}x)",
                          file=sys.stderr, flush=True)
                print(f"round {r + 1} {case}: handle {h[0]:,.0f} litgpt {lg[0]:,.0f} tokens/s ({h[0] / lg[0]:.2f}x; "
                      f"upper quartile {h[1] / lg[1]:.2f}x)", file=sys.stderr, flush=True)
    rows = []
    for (procs, precision, mode), f in figures.items():
        hr, lr = [x[0] for x in f["handle"]], [x[0] for x in f["litgpt"]]
        h, lg = statistics.median(hr), statistics.median(lr)
        hq, lq = statistics.median(x[1] for x in f["handle"]), statistics.median(x[1] for x in f["litgpt"])
        rows.append({"procs": procs, "precision": precision, "mode": mode, "handle_tokens_per_s": h,
                     "litgpt_tokens_per_s": lg, "ratio": h / lg, "handle_runs": hr, "litgpt_runs": lr,
                     "round_ratios": [x / y for x, y in zip(hr, lr)], "upper_quartile_ratio": hq / lq})
        if f["litgpt_malloc"]:
            lm = [x[0] for x in f["litgpt_malloc"]]
            rows[-1].update(litgpt_malloc_tokens_per_s=statistics.median(lm), litgpt_malloc_runs=lm,
                            ratio_to_litgpt_malloc=h / statistics.median(lm))
    if a.json:
        for row in rows:
            print(json.dumps(row))
        return
    extra = a.litgpt_malloc
    print("| processes | precision | mode | handle tokens/s (range) | litgpt tokens/s (range) | handle ÷ litgpt "
          "(per round) | upper quartiles' ratio |" + (" litgpt + malloc settings tokens/s | handle ÷ that |" if extra
                                                     else "") +
          "\n| ---: | --- | --- | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if extra else ""))
    for row in rows:
        hr, lr = row["handle_runs"], row["litgpt_runs"]
        ratios = ", ".join(f"{x:.2f}" for x in row["round_ratios"])
        handle, litgpt = (f"{statistics.median(x):,.0f} ({min(x):,.0f}–{max(x):,.0f})" for x in (hr, lr))
        tail = ""
        if extra:
            lm = row["litgpt_malloc_runs"]
            tail = (f" {statistics.median(lm):,.0f} ({min(lm):,.0f}–{max(lm):,.0f}) | "
                    f"{row['ratio_to_litgpt_malloc']:.2f}× |")
        print(f"| {row['procs']} | {row['precision']} | {row['mode']} | {handle} | {litgpt} "
              f"| **{row['ratio']:.2f}×** ({ratios}) | {row['upper_quartile_ratio']:.2f}× |{tail}")
    print(f"\n{a.rounds} rounds of {a.steps} steps, the first {a.skip} left out; micro-batch {MICRO_BATCH} per "
          f"process, seq_len {SEQ_LEN}, vocabulary {VOCAB}; OMP_NUM_THREADS=1 per process.")


if __name__ == "__main__":
    main()
