"""Requests per second of ``handle eval --tasks`` against ``lm_eval --model hf`` on the same run's export (issue 50,
done-when 4): the harness's requests answered by handle's own model (``HandleLM``) and by transformers'
LlamaForCausalLM loaded from ``handle export --format hf`` (``HFLM``), on the same tasks, documents, batch size,
machine and thread count, in this process, the two alternating, best of ``--repeat`` (wall seconds, and the
process's CPU seconds, steadier on a shared machine).

Each side is timed over ``lm_eval.simple_evaluate`` with its model already loaded (the harness builds the tasks'
requests, asks the model, scores the answers: what ``handle eval`` and ``lm_eval`` spend beyond their start-up).
Printed per request type (loglikelihood: the multiple-choice task's 4 endings per document; generate_until: greedy,
16 tokens at most, stop at a newline) and in all. Without ``--run`` it first trains the ``llama`` preset's model
(d256, 4 layers, 4 M parameters, fp32) for ``--steps`` steps in one process.

    python benchmarks/lm_eval_speed.py [--run RUN] [--limit 60] [--batch-size 16] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS_DIR = ROOT / "tests" / "fixtures" / "eval_tasks"
TASKS = {"loglikelihood": "handle_wikitext_cloze", "generate_until": "handle_seed_answers"}


def train(run_dir: Path, steps: int) -> None:
    subprocess.run([sys.executable, "-m", "handle_cli", "run", str(ROOT / "presets" / "llama.toml"), "--run-dir",
                    str(run_dir), "--set", f"training.steps={steps}", "--set", "training.precision=fp32",
                    "--set", "strategy.name=single", "--set", "launch.nproc_per_node=1",
                    "--set", "training.eval_every=0"], check=True)


def timed(model, task: str, limit: int, manager, specs) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: every thread) of one evaluation."""
    import lm_eval

    from torch_handle.infer import downstream

    spec = next(s for s in specs if (s["task"] if isinstance(s, dict) else s) == task)
    started, cpu = time.perf_counter(), time.process_time()
    with downstream.offline():
        lm_eval.simple_evaluate(model=model, tasks=[spec], task_manager=manager, limit=limit, log_samples=False,
                                bootstrap_iters=0)
    return time.perf_counter() - started, time.process_time() - cpu


def _row(requests: int, wall: dict[str, float], cpu: dict[str, float], **extra) -> dict:
    return {**extra, "requests": requests, **{f"{n}_s": round(s, 3) for n, s in wall.items()},
            **{f"{n}_cpu_s": round(s, 3) for n, s in cpu.items()},
            **{f"{n}_requests_per_s": round(requests / s, 2) for n, s in wall.items()},
            "speedup": round(wall["hf"] / wall["handle"], 2), "cpu_speedup": round(cpu["hf"] / cpu["handle"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="a finished Llama-shaped run (default: train one)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--limit", type=int, default=60, help="documents per task")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import logging

    import torch
    from lm_eval.models.huggingface import HFLM

    from torch_handle.infer import downstream
    from torch_handle.infer.adapter_export import export_run
    from torch_handle.infer.generate import load_run
    from torch_handle.infer.lm_eval_model import HandleLM

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    run = args.run or ROOT / "runs" / "lm-eval-speed"
    if args.run is None and not (run / "model.safetensors").is_file():
        train(run, args.steps)
    export = run.parent / f"{run.name}-hf"
    if not (export / "config.json").is_file():
        export_run(run, export)
    loaded = load_run(run)
    loaded.model.requires_grad_(False)
    ours = HandleLM(loaded.model, loaded.tokenizer, batch_size=args.batch_size)
    theirs = HFLM(pretrained=str(export), device="cpu", dtype="float32", batch_size=args.batch_size)
    specs, manager = downstream.resolve_tasks(list(TASKS.values()), [TASKS_DIR])
    rows = {}
    for kind, task in TASKS.items():
        best = {"handle": float("inf"), "hf": float("inf")}
        cpu = dict(best)
        before = ours.counts.get(kind, 0)
        for _ in range(args.repeat):
            for name, model in (("handle", ours), ("hf", theirs)):
                wall, used = timed(model, task, args.limit, manager, specs)
                best[name], cpu[name] = min(best[name], wall), min(cpu[name], used)
        requests = (ours.counts[kind] - before) // args.repeat  # the task may have fewer documents than --limit
        rows[kind] = _row(requests, best, cpu, task=task)
    rows["all"] = _row(sum(r["requests"] for r in rows.values()),
                       {n: sum(r[f"{n}_s"] for r in rows.values()) for n in ("handle", "hf")},
                       {n: sum(r[f"{n}_cpu_s"] for r in rows.values()) for n in ("handle", "hf")})
    meta = {"run": str(run), "export": str(export), "params": sum(p.numel() for p in loaded.model.parameters()),
            "max_len": loaded.model.args.max_len, "batch_size": args.batch_size, "limit": args.limit,
            "threads": torch.get_num_threads(), "repeat": args.repeat}
    if args.json:
        print(json.dumps({**meta, "results": rows}))
        return
    print(f"{run}: {meta['params']:,} parameters, {meta['max_len']} positions; batch {args.batch_size}, "
          f"{args.limit} documents a task, {meta['threads']} threads, best of {args.repeat}")
    print(f"{'requests':<16} {'n':>5} {'handle req/s':>13} {'hf req/s':>10} {'handle/hf':>10} {'CPU s handle/hf':>16}")
    for kind, r in rows.items():
        print(f"{kind:<16} {r['requests']:>5} {r['handle_requests_per_s']:>13.2f} {r['hf_requests_per_s']:>10.2f} "
              f"{r['speedup']:>9.2f}x {r['handle_cpu_s']:>7.1f}/{r['hf_cpu_s']:<6.1f} {r['cpu_speedup']:.2f}x")


if __name__ == "__main__":
    main()
