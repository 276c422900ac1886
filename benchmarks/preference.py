"""LoRA DPO against LoRA SFT over the same rows (issue 47): a step's compute and a rank's peak memory, one process.

DPO's step runs the policy's forward and backward over 2B rows (each pair's chosen and rejected) and the
reference's forward over the same rows (the adapters switched off, no gradients). SFT runs the token-mean loss over
THE SAME 2B rows of the same micro-batch: the pairs' own batches, (B, 2, T) -> (2B, T), labels on both completions
(:class:`SameRows`), so the two differ by the objective alone. ``--packed`` adds the former comparison, SFT on the
pairs as packed conversations (``--chat``: the prompt with the chosen answer, the prompt with the rejected one),
2B samples a micro-batch of the same 2B x seq_len positions but other rows, with document masks.

The steps run in this process on one thread (the trainer of ``handle run``, a 1-rank gloo group), the cases' steps
in turns, each timed by the CPU time it takes (``time.process_time``: on a shared machine the wall clock measures
the neighbours too). Then one more step of each under torch's profiler (``profile_memory``: every allocation and
free of the CPU allocator) gives the step's peak above what was live before it. Printed: the median step after
the warm-up (a precomputed reference is computed in step 1, a copy built), its ratio to SFT's, the bytes autograd
saved for the first micro-batch, the rank's peak (parameters, gradients, optimizer state and the reference held
before the step, plus the step's peak above them), and the reference's own bytes (none with the adapters off: the
same weights; the copy's parameters; the precomputed table). ``--full`` adds a full fine-tune with the reference
precomputed and one with a frozen copy.

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


class SameRows:
    """SFT's token-mean loss (``TokenLoss("sft")``) over a DPO micro-batch's own rows: ``input_ids``, ``labels``
    (B, 2, T) -> (2B, T), the chosen rows first, as :class:`~torch_handle.train.objectives.pairs.DirectPreference`
    runs its policy; labels on both completions. No metrics."""

    name = "sft"

    def __init__(self) -> None:
        from torch_handle.train.objectives.tokens import TokenLoss

        self.loss = TokenLoss("sft")

    def forward_loss(self, trainer: Any, batch: dict[str, Any], *, train: bool = True) -> Any:
        batch.pop("pair", None)
        ids, labels = (batch.pop(k).transpose(0, 1).flatten(0, 1) for k in ("input_ids", "labels"))
        return self.loss.forward_loss(trainer, {"input_ids": ids, "labels": labels, **batch}, train=train)

    def attach(self, vector: Any) -> Any:
        return vector

    def fields(self, reduced: Any) -> tuple[dict[str, Any], Any]:
        return {}, reduced


def reference_bytes(trainer: Any) -> int:
    """The bytes the run's reference holds: a copy's parameters, a precomputed table, else 0."""
    objective = trainer.objective
    copy, table = getattr(objective, "copy", None), getattr(objective, "table", None) or {}
    return (copy.nbytes() if copy is not None else 0) + sum(t.numel() * t.element_size() for t in table.values())


def held_bytes(trainer: Any) -> int:
    """What the rank holds between steps: parameters, gradients, optimizer state and the reference."""
    s = trainer.strategy
    return s.param_bytes() + s.grad_bytes() + s.optimizer_bytes() + reference_bytes(trainer)


def step_peak(trainer: Any, batches: Any) -> int:
    """The bytes torch's CPU allocator held at the peak of one more step, above those live before it (the
    profiler's allocation events, summed in time order)."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train_step(batches)
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace, encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
    live = peak = 0
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        if e["args"].get("Device Type", 0) == 0:  # CPU
            live += e["args"]["Bytes"]
            peak = max(peak, live)
    return peak


def run_in_turns(work: Path, preset: Path, cases: dict[str, list[str]], steps: int) -> dict[str, Any]:
    """A trainer per case in this process, their steps in turns, then one profiled step each: name -> (trainer,
    CPU seconds of each step, the rank's peak bytes)."""
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
        p = load_preset(preset, [f"run.name={name}", *(o for o in overrides if o != "same-rows")])
        trainer = Trainer(p, create_run_dir(work / "runs", name, dump_preset(p), {"status": "starting"}), ctx,
                          get_registry())
        trainer.build()
        if "same-rows" in overrides:
            trainer.objective = SameRows()
        trainer.strategy.train(True)
        built[name] = (trainer, trainer.batches(), [])
    for _ in range(steps):
        for trainer, batches, times in built.values():
            t0 = time.process_time()
            trainer.train_step(batches)
            times.append(time.process_time() - t0)
    return {name: (trainer, times, held_bytes(trainer) + step_peak(trainer, batches))
            for name, (trainer, batches, times) in built.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="a handle export --format hf of a Llama-shaped run")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2, help="leave out the first steps (warm-up)")
    ap.add_argument("--micro-batch-size", type=int, default=4, help="pairs per micro-batch (SFT: their 2B rows)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--packed", action="store_true", help="also SFT on the pairs as packed conversations")
    ap.add_argument("--full", action="store_true", help="also a full fine-tune, reference precomputed and copied")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pairs, chat = prepare(work, a.base.resolve(), a.seq_len)
        preset = write_preset(work, model={**LLAMA, "init_from": str(a.base.resolve())},
                              data={"name": "tokens", "seq_len": a.seq_len},
                              training={"steps": a.steps + 1, "precision": "fp32", "log_every": 1,
                                        "warmup_steps": 0, "lr": 1e-3})
        lora = ["finetune.method=lora", 'finetune.target_modules=["all"]']
        dpo = [f"data.path={pairs}", "finetune.objective=dpo", f"training.micro_batch_size={a.micro_batch_size}"]
        cases = {"lora-sft": [*dpo, *lora, "same-rows"], "lora-dpo": [*dpo, *lora]}
        if a.packed:
            cases["lora-sft-packed"] = [f"data.path={chat}", "finetune.objective=sft",
                                        f"training.micro_batch_size={2 * a.micro_batch_size}", *lora]
        if a.full:
            cases["full-dpo-precomputed"] = dpo
            cases["full-dpo-copy"] = [*dpo, "finetune.preference.reference=copy"]
        results = run_in_turns(work, preset, cases, a.steps)
        rows = {}
        for name, (trainer, times, peak) in results.items():
            rows[name] = {"step_s": statistics.median(times[a.skip:]), "saved": trainer.loop.activation_saved_bytes,
                          "peak": peak, "params": trainer.strategy.param_bytes(),
                          "reference": reference_bytes(trainer)}
            trainer.close("finished")
    sft = rows["lora-sft"]
    print(f"{a.micro_batch_size} pairs = {2 * a.micro_batch_size} rows of {a.seq_len} positions a step (SFT: the same "
          f"rows), 1 thread, CPU time, median of steps {a.skip + 1}..{a.steps}; peak: held + a profiled step's")
    for name, r in rows.items():
        print(f"{name:22s} step {r['step_s'] * 1000:6.0f} ms ({r['step_s'] / sft['step_s']:.2f}x SFT)  saved "
              f"{r['saved'] / 2**20:6.1f} MiB ({r['saved'] / sft['saved']:.2f}x)  peak {r['peak'] / 2**20:6.1f} MiB "
              f"({r['peak'] / sft['peak']:.3f}x)  params {r['params'] / 2**20:5.1f} MiB  reference "
              f"{r['reference'] / 2**10:8.1f} KiB")
        print(json.dumps({"case": name, **r, "step_ratio": r["step_s"] / sft["step_s"],
                          "peak_ratio": r["peak"] / sft["peak"]}))


if __name__ == "__main__":
    main()
