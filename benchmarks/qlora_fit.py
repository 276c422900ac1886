"""Which Llama-3 fine-tunes fit: ``handle estimate`` of presets/llama3-8b-qlora.toml (and its 70B shapes) for full
fine-tuning, LoRA, QLoRA and QLoRA + FSDP on 1, 2, 4 and 8 devices of 24 and 80 GiB, activation checkpointing on
and off. Nothing is allocated: the model is built on the meta device and run on fake tensors.

    python benchmarks/qlora_fit.py [--models 8b,70b] [--nproc 1,2,4,8] [--json]

Rows (bytes of the rank that holds the most, as ``handle estimate`` prices it):

* full: ``finetune.method = "none"`` under fsdp (FSDP2: fp32 parameters, gradients and Adam state sharded);
* lora: rank-16 adapters on every linear, the frozen base sharded by fsdp (fp32, as handle keeps it);
* qlora: the block linears in NF4 under ddp (every rank the whole NF4 base);
* qlora+fsdp: fsdp, every NF4 linear's ``weight_nf4`` (a frozen uint8 parameter) sharded on dim 0 like the rest
  (docs/qlora.md, "Sharded").

Each cell: GiB per device, then ``24`` / ``80`` where it fits a device of that many GiB (``-`` where it fits
neither). Not counted (as ``handle estimate`` says): allocator caching, communication buffers, FSDP's gathered
unit, the CUDA context.
"""

from __future__ import annotations

import argparse
import json
import sys

import _common  # noqa: F401  (puts this checkout first on sys.path)

from torch_handle.config.loader import load_preset
from torch_handle.plan.estimate import estimate_preset
from torch_handle.plan.model_states import Variant
from torch_handle.registry import get_registry

PRESET = _common.ROOT / "presets" / "llama3-8b-qlora.toml"
MODELS = {"8b": [], "70b": ["model.d_model=8192", "model.n_heads=64", "model.n_layers=80", "model.d_ff=28672"]}
COMMON = ["training.precision=bf16"]
"""The preset leaves precision at auto (every shipped preset does); the table is for a bf16 GPU."""
"""Llama-3-70B differs from 8B in these (both: 8 key/value heads, vocabulary 128,256, untied, RoPE 500,000)."""
CASES = {  # label: (overrides, strategy)
    "full": (["finetune.method=none"], "fsdp"),
    "lora": (["finetune.method=lora"], "fsdp"),
    "qlora": ([], "ddp"),
    "qlora+fsdp": ([], "fsdp"),
}
GIB = 1 << 30


def rows(models: list[str], nprocs: list[int]) -> list[dict]:
    registry = get_registry()
    out = []
    for model in models:
        for checkpointing in (True, False):
            for label, (overrides, strategy) in CASES.items():
                preset = load_preset(PRESET, [*COMMON, *MODELS[model], *overrides,
                                              f"model.activation_checkpointing={str(checkpointing).lower()}"],
                                     registry)
                for r in estimate_preset(preset, registry, nprocs, [Variant(strategy, strategy)]):
                    out.append({"model": model, "case": label, "activation_checkpointing": checkpointing,
                                **{k: v for k, v in r.as_dict().items() if k not in ("options", "fits")}})
    return out


def table(data: list[dict], nprocs: list[int]) -> list[str]:
    lines = ["| model | fine-tune | checkpointing | params / rank | " + " | ".join(f"{n} device(s)" for n in nprocs)
             + " |", "| --- | --- | --- | --- |" + " ---: |" * len(nprocs)]
    keys = sorted({(r["model"], r["case"], r["activation_checkpointing"]) for r in data},
                  key=lambda k: (list(MODELS).index(k[0]), not k[2], list(CASES).index(k[1])))
    for model, case, ac in keys:
        cells, states = [], ""
        for n in nprocs:
            r = next((r for r in data if (r["model"], r["case"], r["activation_checkpointing"], r["world_size"])
                      == (model, case, ac, n)), None)
            if r is None:
                cells.append("")
                continue
            gib = r["device_bytes"] / GIB
            fits = " ".join(str(m) for m in (24, 80) if r["device_bytes"] <= m * GIB) or "-"
            cells.append(f"{gib:.1f} ({fits})")
            if n == nprocs[-1]:
                states = f"{r['param_bytes'] / GIB:.1f} at {n}"
        lines.append(f"| {model.upper()} | {case} | {'on' if ac else 'off'} | {states} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="8b,70b", help="comma-separated: 8b, 70b")
    parser.add_argument("--nproc", default="1,2,4,8", help="world sizes (one node)")
    parser.add_argument("--json", action="store_true", help="one JSON object per estimate row")
    a = parser.parse_args()
    models, nprocs = a.models.split(","), [int(x) for x in a.nproc.split(",")]
    if any(m not in MODELS for m in models):
        sys.exit(f"--models: {a.models!r} (valid: {', '.join(MODELS)})")
    data = rows(models, nprocs)
    if a.json:
        for r in data:
            print(json.dumps(r))
        return
    print("GiB per device of the rank that holds the most (fits: a device of 24 / 80 GiB); params / rank: "
          "parameters + NF4 base in GiB at the largest world size")
    print("\n".join(table(data, nprocs)))


if __name__ == "__main__":
    main()
