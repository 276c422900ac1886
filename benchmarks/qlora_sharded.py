"""QLoRA sharded (docs/qlora.md, "Sharded"): each rank's NF4 base bytes against the one-process QLoRA base, and the
step time against LoRA under the same strategy, measured by real 2-rank ``handle run``s on this machine's CPU.

    python benchmarks/qlora_sharded.py [--d-model 512] [--n-layers 4] [--steps 8] [--cases ddp,fsdp,...] [--json]

A Llama-shaped decoder (RMSNorm, RoPE, SwiGLU, no biases; 8 heads, d_ff 4 d_model, vocabulary 4096, random
initial weights), rank-8 adapters on every linear, fp32 (``--precision``), run once with ``finetune.method = "qlora"``
on 1 process (the whole NF4 base) and, per strategy of ``--cases``, with QLoRA and with LoRA on 2. Per row:

* ``nf4 / rank``: the NF4 bytes each rank stores (run.json's ``nf4_bytes``: the bytes of its part of every
  ``weight_nf4``, which the run hashes before the first step and after the last), and their ratio to the
  one-process base (0.5 plus the padding of each tensor's last chunk under fsdp, scratch-fsdp and ZeRO-3; 1 under
  ddp and ZeRO-2);
* ``frozen / rank`` (rank 0's ``frozen_param_bytes``: the NF4 base plus the embeddings, norms and head) for QLoRA
  and LoRA;
* the median step time (``step_time_s``, after ``--skip`` warm-up steps) of QLoRA and of LoRA, and their ratio.

Bytes do not depend on the machine's load; times do (2 ranks on a shared CPU: read the ratios).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import _common

CASES = {"ddp": ["strategy.name=ddp"], "fsdp": ["strategy.name=fsdp"],
         "scratch-fsdp": ["strategy.name=scratch-fsdp"],
         "zero2": ["strategy.name=deepspeed", "strategy.zero_stage=2"],
         "zero3": ["strategy.name=deepspeed", "strategy.zero_stage=3"]}
LLAMA = {"n_heads": 8, "norm": "rmsnorm", "position": "rope", "mlp": "swiglu", "bias": False, "norm_first": True,
         "dropout": 0.0}
MIB = 1 << 20


def _run(preset: Path, method: str, sets: list[str], name: str, skip: int) -> dict:
    """One ``handle run``: rank NF4 bytes (run.json), rank 0's frozen bytes, the median step time."""
    run = _common.handle_run(preset, [f"finetune.method={method}", f"run.name={name}", *sets])
    info = json.loads((run / "run.json").read_text())
    memory = [e for e in _common.read_events(run, "step") if "memory" in e][-1]["memory"][0]
    return {"nf4_bytes": info.get("nf4_bytes"), "frozen_param_bytes": memory["frozen_param_bytes"],
            "step_time_s": _common.step_medians(run, skip, ("step_time_s",))["step_time_s"]}


def main() -> None:
    a = _common.bench_args(__doc__, CASES, d_model=512, n_layers=4, steps=8, precision="fp32")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        model = {"d_model": a.d_model, "n_layers": a.n_layers, "d_ff": 4 * a.d_model, **LLAMA}
        training = {"steps": a.steps, "micro_batch_size": a.micro_batch_size, "precision": a.precision,
                    "log_every": 1}
        preset = _common.write_preset(directory, model=model, data={"seq_len": a.seq_len, "vocab_size": 4096},
                                      training=training, launch={"nproc_per_node": 2},
                                      finetune={"method": "qlora", "rank": 8, "alpha": 16.0,
                                                "target_modules": ["all"]})
        one = _run(preset, "qlora", ["strategy.name=single", "launch.nproc_per_node=1"], "single", a.skip)
        whole = one["nf4_bytes"][0]
        rows = []
        for case in a.cases.split(","):
            q = _run(preset, "qlora", CASES[case], f"qlora-{case}", a.skip)
            lora = _run(preset, "lora", CASES[case], f"lora-{case}", a.skip)
            rows.append({"strategy": case, "nf4_bytes": q["nf4_bytes"], "nf4_ratio": max(q["nf4_bytes"]) / whole,
                         "qlora_frozen_bytes": q["frozen_param_bytes"], "lora_frozen_bytes": lora["frozen_param_bytes"],
                         "qlora_step_s": q["step_time_s"], "lora_step_s": lora["step_time_s"]})
    if a.json:
        for r in rows:
            print(json.dumps({"one_process_nf4_bytes": whole, **r}))
        return
    print(f"one process: NF4 base {whole:,} bytes")
    print("| strategy | nf4 / rank (bytes) | x one process | frozen / rank QLoRA | frozen / rank LoRA | step QLoRA (s) "
          "| step LoRA (s) | QLoRA / LoRA |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['strategy']} | {' / '.join(f'{b:,}' for b in r['nf4_bytes'])} | {r['nf4_ratio']:.3f} | "
              f"{r['qlora_frozen_bytes'] / MIB:.2f} MiB | {r['lora_frozen_bytes'] / MIB:.2f} MiB | "
              f"{r['qlora_step_s']:.3f} | {r['lora_step_s']:.3f} | {r['qlora_step_s'] / r['lora_step_s']:.2f} |")


if __name__ == "__main__":
    main()
