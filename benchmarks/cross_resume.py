"""What a resume on another strategy or world size costs: checkpoint sizes, the conversion to the portable form,
and the load, for the demo model (presets/zero2.toml: 4.2 M parameters) on 2 CPU processes.

    python benchmarks/cross_resume.py [--preset presets/zero2.toml] [--precision fp32] [--out DIR]

1. Three source runs of 3 steps with a checkpoint at step 2 (and the final one at step 3): DeepSpeed ZeRO-2 and
   FSDP2 on 2 ranks, ``single`` on 1 rank with grad_accum 2 (the same global batch). The step-2 checkpoint's write
   time is its ``checkpoint`` event's time minus the step-2 event's (the strategy's save, the trainer state, the
   manifest's SHA-256 and the rename; no evaluation in between).
2. Each source is copied without its step-3 checkpoint and resumed under other settings; the resumed run's
   ``resumed from`` message gives the conversion time (rank 0, once per checkpoint: ``portable/`` is kept and
   reused) and the load time.
3. In this process, ``--repeat`` times each on fresh copies of the ZeRO-2 checkpoint: the whole conversion
   (:func:`torch_handle.checkpoint.convert.ensure_portable`), and DeepSpeed's ``ds_to_universal`` alone (with the size of the
   universal checkpoint it writes: a temporary directory the conversion deletes after mapping it). Medians.

Prints one JSON object (sizes in bytes, times in seconds) and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import time
from pathlib import Path

from _common import ROOT, handle, read_events, sets


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def slug(name: str) -> str:
    return re.sub(r"\W+", "-", name).strip("-")


SOURCES = {
    "deepspeed ZeRO-2, 2 ranks": ["strategy.name=deepspeed", "strategy.zero_stage=2"],
    "fsdp, 2 ranks": ["strategy.name=fsdp"],
    "single, 1 rank": ["strategy.name=single", "launch.nproc_per_node=1", "training.grad_accum=2"],
}
TARGETS = {
    "deepspeed ZeRO-2, 2 ranks": [("deepspeed ZeRO-3, 2 ranks", ["strategy.zero_stage=3"]),
                                  ("fsdp, 2 ranks", ["strategy.name=fsdp"]),
                                  ("single, 1 rank", ["strategy.name=single", "launch.nproc_per_node=1",
                                                      "training.grad_accum=2"])],
    "fsdp, 2 ranks": [("deepspeed ZeRO-2, 2 ranks", ["strategy.name=deepspeed", "strategy.zero_stage=2"]),
                      ("single, 1 rank", ["strategy.name=single", "launch.nproc_per_node=1",
                                          "training.grad_accum=2"])],
    "single, 1 rank": [("fsdp, 2 ranks", ["strategy.name=fsdp", "launch.nproc_per_node=2",
                                          "training.grad_accum=1"]),
                       ("deepspeed ZeRO-3, 2 ranks", ["strategy.name=deepspeed", "strategy.zero_stage=3",
                                                      "launch.nproc_per_node=2", "training.grad_accum=1"])],
}
RESUMED = re.compile(r"written by (?P<by>.+?); (?:converted to the portable form in (?P<conv>[\d.]+) s \((?P<size>"
                     r"[^)]+)\), )?loaded in (?P<load>[\d.]+) s\)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=str(ROOT / "presets" / "zero2.toml"))
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions of the in-process timings")
    args = parser.parse_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="cross-resume-"))
    common = sets("training.steps=3", "training.checkpoint_every=2", "training.eval_every=0",
                  f"training.precision={args.precision}", "training.log_every=1")
    result: dict = {"preset": args.preset, "precision": args.precision, "sources": {}, "resumes": []}
    for name, source_sets in SOURCES.items():
        run = out / slug(name)
        handle("run", args.preset, "--run-dir", str(run), *common, *sets(*source_sets))
        evs = read_events(run)
        step2 = next(e for e in evs if e["kind"] == "step" and e["step"] == 2)["time"]
        saved = next(e for e in evs if e["kind"] == "checkpoint" and e["step"] == 2)["time"]
        ckpt = run / "checkpoints" / "step-2"
        params = next(e for e in evs if e["kind"] == "status" and e.get("status") == "running").get("model_params")
        result["sources"][name] = {"checkpoint_bytes": dir_bytes(ckpt), "write_s": round(saved - step2, 3),
                                   "model_params": params}
        for target, target_sets in TARGETS[name]:
            copy = out / f"{run.name}-to-{slug(target)}"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(run, copy)
            shutil.rmtree(copy / "checkpoints" / "step-3")
            start = time.perf_counter()
            handle("run", "--resume", str(copy), *sets("training.steps=3", *target_sets))
            wall = time.perf_counter() - start
            message = next(e["message"] for e in read_events(copy) if e["kind"] == "log"
                           and e["message"].startswith("resumed from"))
            m = RESUMED.search(message)
            portable = copy / "checkpoints" / "step-2" / "portable"
            result["resumes"].append({
                "source": name, "target": target, "convert_s": float(m["conv"]) if m and m["conv"] else 0.0,
                "portable_bytes": dir_bytes(portable) if portable.is_dir() else 0,
                "load_s": float(m["load"]) if m else None, "resume_wall_s": round(wall, 1), "message": message})

    # in this process, on fresh copies: the whole conversion, and ds_to_universal alone
    import argparse as _argparse
    import statistics

    import torch
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    from torch_handle.checkpoint import convert
    from torch_handle.checkpoint.store import read_layout

    ckpt = out / slug("deepspeed ZeRO-2, 2 ranks") / "checkpoints" / "step-2"
    states = torch.load(ckpt / "ds" / "mp_rank_00_model_states.pt", weights_only=False)
    names = [n for shapes in states["param_shapes"] for n in shapes]
    whole, alone, universal_bytes = [], [], 0
    for i in range(args.repeat):
        copy = out / f"convert-{i}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(ckpt, copy, ignore=shutil.ignore_patterns("portable"))
        start = time.perf_counter()
        convert.ensure_portable(copy, read_layout(copy), names)
        whole.append(time.perf_counter() - start)
        universal = out / f"universal-{i}" / "ds"
        start = time.perf_counter()
        ds_to_universal(_argparse.Namespace(input_folder=str(copy / "ds"), output_folder=str(universal),
                                            num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                            strict=True, inject_missing_state=True))
        alone.append(time.perf_counter() - start)
        universal_bytes = dir_bytes(universal)
    result["deepspeed_conversion"] = {"ensure_portable_s": round(statistics.median(whole), 3),
                                      "ds_to_universal_s": round(statistics.median(alone), 3),
                                      "universal_bytes": universal_bytes, "ds_bytes": dir_bytes(ckpt / "ds"),
                                      "repeat": args.repeat}
    print(json.dumps(result, indent=1))
    mib = 1 / 2**20
    print("\n| checkpoint written by | size | write |")
    print("|---|---|---|")
    for name, s in result["sources"].items():
        print(f"| {name} | {s['checkpoint_bytes'] * mib:.1f} MiB | {s['write_s']:.2f} s |")
    print("\n| resumed as | from | conversion (rank 0, once) | portable/ | load |")
    print("|---|---|---|---|---|")
    for r in result["resumes"]:
        conv = f"{r['convert_s']:.2f} s" if r["portable_bytes"] else "none"
        size = f"{r['portable_bytes'] * mib:.1f} MiB" if r["portable_bytes"] else "-"
        print(f"| {r['target']} | {r['source']} | {conv} | {size} | {r['load_s']:.2f} s |")
    u = result["deepspeed_conversion"]
    print(f"\nZeRO-2 -> portable in this process (median of {u['repeat']}): {u['ensure_portable_s']:.2f} s, of which "
          f"ds_to_universal {u['ds_to_universal_s']:.2f} s (universal checkpoint {u['universal_bytes'] * mib:.1f} MiB, "
          f"temporary; the ds/ directory: {u['ds_bytes'] * mib:.1f} MiB)")


if __name__ == "__main__":
    main()
