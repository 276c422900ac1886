"""BLEU and chrF of the translation presets on Multi30k test2016 (en->de): `handle run`, then `handle eval`.

    python benchmarks/translate_bleu.py [--presets presets/translate.toml,presets/translate-long.toml]
                                        [--data ../shared/data/multi30k] [--beam 4] [--alpha 0.6]
                                        [--out runs/bleu] [--eval-only] [--json]

For each preset: `handle run PRESET --set data.path=DATA --run-dir OUT/<preset name>` (skipped with
``--eval-only``, which evaluates the run directories a previous invocation left), then
`handle eval OUT/<preset name> --split test --beam B --alpha A --json`: beam search with the GNMT length penalty
(Wu et al. 2016) over the 1000 sentences of test2016, scored by sacrebleu (BLEU 13a and chrF, detokenized; Post
2018). Prints one markdown row per preset: steps, parameters, training wall time (run.json start to end),
median tokens/s of the steps after the first 5 (target tokens, all ranks) and the total target tokens trained
on, the last validation loss, the test loss, BLEU and chrF, and the decoding time; plus the load average before
and after, since a shared machine stretches every wall time (a quiet-machine estimate of the training time is
``tokens / tokens_per_s`` taken from a quiet run). ``--json``: one JSON object per preset instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from _common import ROOT, handle, read_events


def train_figures(run_dir: Path, skip: int = 5) -> dict:
    """Figures of a finished run from run.json and rank 0's events.jsonl."""
    info = json.loads((run_dir / "run.json").read_text())
    events = read_events(run_dir)
    steps = [e for e in events if e["kind"] == "step"]
    evals = [e for e in events if e["kind"] == "eval"]
    if info.get("status") != "finished" or not steps:
        raise SystemExit(f"{run_dir}: run did not finish (status {info.get('status')!r})")
    after = steps[skip:] or steps
    return {"steps": steps[-1]["step"], "params": info.get("model_params"), "world_size": info.get("world_size"),
            "strategy": info.get("strategy"), "precision": info.get("precision"),
            "train_wall_s": round(info["end_time"] - info["start_time"], 1),
            "tokens_per_s": round(statistics.median(e["tokens_per_s"] for e in after)),
            "tokens": sum(e["tokens"] for e in steps), "restarts": info.get("restarts", 0),
            "val_loss": round(evals[-1]["val_loss"], 4) if evals else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="presets/translate.toml,presets/translate-long.toml",
                    help="comma-separated translation presets")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multi30k"),
                    help="directory with train/valid/test.{en,de}")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--out", default="runs/bleu", help="run directories go to OUT/<preset name>")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the run directories under --out")
    ap.add_argument("--json", action="store_true", help="one JSON object per preset instead of the table")
    a = ap.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    for preset in a.presets.split(","):
        run_dir = (ROOT / a.out / Path(preset).stem).resolve()
        if not a.eval_only:
            if run_dir.exists():
                raise SystemExit(f"{run_dir} exists: remove it, or pass --eval-only to score it")
            print(f"training {preset} -> {run_dir}", file=sys.stderr)
            handle("run", preset, "--set", f"data.path={a.data}", "--run-dir", str(run_dir))
        print(f"decoding test2016 with {run_dir.name}", file=sys.stderr)
        scores = json.loads(handle("eval", str(run_dir), "--split", "test", "--beam", str(a.beam), "--alpha",
                                    str(a.alpha), "--json"))
        rows.append({"preset": preset, "run": str(run_dir), **train_figures(run_dir),
                     **{k: scores.get(k) for k in ("loss", "bleu", "chrf", "beam", "alpha", "seconds",
                                                   "bleu_signature")}})
    load_after = os.getloadavg()[0]
    if a.json:
        for r in rows:
            print(json.dumps({**r, "load_before": load_before, "load_after": load_after}))
        return
    print(f"Multi30k test2016 en->de, beam {a.beam}, alpha {a.alpha}; load average {load_before:.1f} before, "
          f"{load_after:.1f} after")
    print("| preset | steps | params | training wall | tokens/s | tokens | val loss | test loss | BLEU | chrF | "
          "decode |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['preset']} | {r['steps']} | {r['params'] / 1e6:.1f} M | {r['train_wall_s'] / 60:.1f} min | "
              f"{r['tokens_per_s']:,} | {r['tokens'] / 1e6:.2f} M | {r['val_loss']} | {r['loss']} | {r['bleu']:.2f} | "
              f"{r['chrf']:.2f} | {r['seconds']:.0f} s |")


if __name__ == "__main__":
    main()
