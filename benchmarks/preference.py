"""LoRA DPO against LoRA SFT over the same positions (issue 47): a step's compute and a rank's memory, one process.

DPO's step runs the policy's forward and backward over 2B rows (each pair's chosen and rejected) and the
reference's forward over the same rows (the adapters switched off, no gradients); SFT's over 2B rows of packed
conversations. Both read the same Self-Instruct pairs (benchmarks/preference_pairs.py): DPO as pairs
(``--preference``), SFT as two conversations a pair (the prompt with the chosen answer, the prompt with the rejected
one, ``--chat``), so a micro-batch of B pairs and one of 2B packed samples compute the same 2B x seq_len
positions. The steps run in this process on one thread (the trainer of ``handle run``, a 1-rank gloo group), the
cases' steps in turns, each timed by the CPU time it takes (``time.process_time``: on a shared machine the wall
clock measures the neighbours too). Printed: the median step after the warm-up (a precomputed reference is
computed in step 1), its ratio to SFT's, the bytes autograd saved for the first micro-batch, the parameter bytes
and the reference's own bytes (none with the adapters off: the same weights; the table when precomputed).
``--full`` adds a full fine-tune with the reference precomputed.

    handle run presets/llama.toml --run-dir runs/llama && handle export runs/llama --format hf exported/llama
    python benchmarks/preference.py --base exported/llama [--steps 8 --micro-batch-size 4 --seq-len 256 --full]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, handle, write_preset

SEED_TASKS = ROOT.parent / "shared" / "data" / "self-instruct" / "seed_tasks.jsonl"
LLAMA = {"d_model": 256, "n_heads": 4, "n_layers": 4, "norm": "rmsnorm", "position": "rope", "mlp": "swiglu",
         "d_ff": 704, "n_kv_heads": 2, "bias": False, "scale_embeddings": False, "norm_first": True, "dropout": 0.0}
"""presets/llama.toml's decoder (with single.toml's width and depth)."""


def prepare(work: Path, base: Path, seq_len: int) -> tuple[Path, Path]:
    """(pairs, conversations): the seed tasks' pairs prepared both ways with the base's tokenizer and ChatML."""
    from preference_pairs import seed_task_pairs

    rows = seed_task_pairs(SEED_TASKS)
    (work / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (work / "chat.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r[k]}) + "\n"
                                             for r in rows for k in ("chosen", "rejected")), encoding="utf-8")
    common = ("--tokenizer", str(base), "--template", "chatml", "--max-len", str(seq_len), "--json")
    handle("data", "prepare", str(work / "pairs.jsonl"), "--preference", *common, "--out", str(work / "pairs"))
    handle("data", "prepare", str(work / "chat.jsonl"), "--chat", *common, "--out", str(work / "chat"))
    return work / "pairs", work / "chat"


def run_in_turns(work: Path, preset: Path, cases: dict[str, list[str]], steps: int) -> dict[str, Any]:
    """A trainer per case in this process, their steps in turns: name -> (trainer, CPU seconds of each step)."""
    import torch
    import torch.distributed as dist

    from torch_handle.config.loader import dump_preset, load_preset
    from torch_handle.registry import get_registry
    from torch_handle.rundir import create_run_dir
    from torch_handle.train.strategy import DistContext
    from torch_handle.train.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work / 'store'}", rank=0, world_size=1)
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    built = {}
    for name, overrides in cases.items():
        p = load_preset(preset, [f"run.name={name}", *overrides])
        trainer = Trainer(p, create_run_dir(work / "runs", name, dump_preset(p), {"status": "starting"}), ctx,
                          get_registry())
        trainer.build()
        trainer.strategy.train(True)
        built[name] = (trainer, trainer.batches(), [])
    for _ in range(steps):
        for trainer, batches, times in built.values():
            t0 = time.process_time()
            trainer.train_step(batches)
            times.append(time.process_time() - t0)
    return {name: (trainer, times) for name, (trainer, _, times) in built.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="a handle export --format hf of a Llama-shaped run")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2, help="leave out the first steps (warm-up)")
    ap.add_argument("--micro-batch-size", type=int, default=4, help="pairs per micro-batch (SFT: twice as many)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--full", action="store_true", help="also a full fine-tune, reference precomputed")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pairs, chat = prepare(work, a.base.resolve(), a.seq_len)
        preset = write_preset(work, model={**LLAMA, "init_from": str(a.base.resolve())},
                              data={"name": "tokens", "seq_len": a.seq_len},
                              training={"steps": a.steps, "precision": "fp32", "log_every": 1, "warmup_steps": 0,
                                        "lr": 1e-3})
        lora = ["finetune.method=lora", 'finetune.target_modules=["all"]']
        cases = {"lora-sft": [f"data.path={chat}", "finetune.objective=sft",
                              f"training.micro_batch_size={2 * a.micro_batch_size}", *lora],
                 "lora-dpo": [f"data.path={pairs}", "finetune.objective=dpo",
                              f"training.micro_batch_size={a.micro_batch_size}", *lora]}
        if a.full:
            cases["full-dpo-precomputed"] = [f"data.path={pairs}", "finetune.objective=dpo",
                                             f"training.micro_batch_size={a.micro_batch_size}"]
        results = run_in_turns(work, preset, cases, a.steps)
        rows = {}
        for name, (trainer, times) in results.items():
            table = getattr(trainer.objective, "table", None) or {}
            rows[name] = {"step_s": statistics.median(times[a.skip:]), "saved": trainer.loop.activation_saved_bytes,
                          "params": sum(p.numel() * p.element_size() for p in trainer.strategy.unwrapped()
                                        .parameters()),
                          "reference": sum(t.numel() * t.element_size() for t in table.values())}
            trainer.close("finished")
    sft = rows["lora-sft"]
    print(f"{a.micro_batch_size} pairs (SFT: {2 * a.micro_batch_size} packed samples) of 2 x {a.seq_len} positions a "
          f"step, 1 thread, CPU time, median of steps {a.skip + 1}..{a.steps}")
    for name, r in rows.items():
        print(f"{name:22s} step {r['step_s'] * 1000:6.0f} ms ({r['step_s'] / sft['step_s']:.2f}x SFT)  saved "
              f"activations {r['saved'] / 2**20:6.1f} MiB ({r['saved'] / sft['saved']:.2f}x)  params "
              f"{r['params'] / 2**20:5.1f} MiB  reference {r['reference'] / 2**10:.1f} KiB")


if __name__ == "__main__":
    main()
