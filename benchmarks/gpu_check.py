"""Prove handle's CUDA path on a GPU machine with one command, and measure it: a markdown table and a JSON file.

    python benchmarks/gpu_check.py --out DIR [--only tests,demo,gpt2,multi,long,native-cp] [--smoke]

The steps (docs/gpu.md: how to install, what each row means): 1 ``tests``, ``python -m pytest -m cuda tests``;
2 ``demo``, presets/zero2.toml on nccl over every GPU, 300 steps; 3 ``gpt2``, presets/gpt2-small.toml on one GPU
trained on the Python standard library's source, at the largest micro-batch that fits (two ``handle estimate``
calls, then the run itself; on CUDA out of memory again at 3/4), eager and with ``training.compile``, and
benchmarks/attention_mask.py (attention with a mask tensor against ``is_causal`` alone); 4 ``multi``,
with 2 or more GPUs, ``handle bench comm`` on nccl and 2-rank ZeRO-2 and FSDP2 runs of the GPT-2-small model;
5 ``long``, the chunked loss against the whole logits (benchmarks/loss_memory.py) and the longest seq_len of
presets/long-context.toml on one device (``_gpu_long.py``); 6 ``native-cp``, cp_impl native's forward and backward
against the hand-written attentions on one GPU (``_gpu_native_cp.py``; skipped on a CPU). MFU
is reported against the measured bf16 peak (``handle env --peak``, what step events divide by) and against the
datasheet's dense bf16 peak (``_rows.DATASHEET_BF16``); ``_rows.consistency`` checks that each row's figures multiply.

Without a CUDA device it says so in one line and runs the CPU smoke version of the same steps (gloo, 2 processes
standing in for 2 devices, tiny models, a few steps, the CUDA tests skipped, no compile); tests/test_gpu_check.py
runs it. Everything goes through the CLI (``handle env/run/estimate/bench comm``, ``--set``, ``--json``) and the run
directories' events.jsonl, run.json and preset.toml. Writes DIR/gpu_check.json, DIR/runs/, DIR/bench/, DIR/logs/
(each command's output) and DIR/cuda_tests.xml. ``--only`` keeps the other steps' rows of an earlier
DIR/gpu_check.json. Exit code 0 when no row failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for a module loaded by its path (the tests)
from _gpu_long import long_context_row, loss_memory_row  # noqa: E402
from _gpu_native_cp import native_cp_row  # noqa: E402
from _rows import PARTS, binary, compare, consistency, datasheet_peak, table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("tests", "demo", "gpt2", "multi", "long", "native-cp")
MEMORY_FRACTION = 0.85
"""Share of the GPU's memory the micro-batch search lets ``handle estimate``'s device bytes fill: the estimate leaves
out the allocator's caching, backward temporaries (the logits' gradient among them) and the CUDA context."""
MAX_ATTEMPTS = 4
LLAMA = ["model.norm=rmsnorm", "model.position=rope", "model.mlp=swiglu", "model.bias=false",
         "model.scale_embeddings=false"]
TINY = ["model.d_model=64", "model.n_heads=4", "model.n_layers=2", "model.d_ff=128", "data.vocab_size=512"]


@dataclass
class Plan:
    """What each step runs: the GPU figures' settings, or the CPU smoke version's."""

    smoke: bool
    devices: int
    """GPUs present (smoke: the 2 CPU processes standing in for them)."""
    backend: str
    device_memory: int
    """Bytes of one device (smoke: a made-up budget that leaves the search something to find)."""
    demo_sets: list[str]
    demo_skip: int
    gpt2_sets: list[str]
    gpt2_skip: int
    corpus_bytes: int
    max_micro_batch: int
    compile: bool
    multi_steps: int
    multi_runs: tuple[str, ...]
    """2-rank runs of step 4 (none in the smoke version: its demo is a 2-rank ZeRO-2 run already, and the suite
    runs FSDP2 on 2 processes in many places)."""
    bench_args: list[str]
    test_paths: list[str]
    timeout_s: float

    @property
    def model(self) -> str:
        return "tiny GPT-2 stand-in" if self.smoke else "GPT-2 small"

    @classmethod
    def cuda(cls, devices: int, memory: int) -> "Plan":
        return cls(False, devices, "nccl", memory,
                   demo_sets=[f"launch.nproc_per_node={devices}", "training.steps=300"], demo_skip=20,
                   gpt2_sets=["training.steps=60"], gpt2_skip=10, corpus_bytes=8 << 20, max_micro_batch=128,
                   compile=True, multi_steps=40, multi_runs=("zero2-2", "fsdp-2"),
                   bench_args=["--sizes", "64K:512M", "--dtype", "bf16"], test_paths=["tests"], timeout_s=900)

    @classmethod
    def cpu_smoke(cls) -> "Plan":
        run = ["training.eval_every=0", "training.checkpoint_every=0", "training.log_every=1"]
        return cls(True, 2, "gloo", 6 << 20,
                   demo_sets=["launch.nproc_per_node=2", "training.steps=4", "training.micro_batch_size=4",
                              "data.seq_len=32", *TINY, *run], demo_skip=1,
                   gpt2_sets=["training.steps=4", "data.seq_len=64", *TINY, *run], gpt2_skip=1,
                   corpus_bytes=96 << 10, max_micro_batch=16, compile=False, multi_steps=2, multi_runs=(),
                   bench_args=["--ops", "all_reduce,all_gather", "--sizes", "1K:2K", "--iters", "2", "--warmup", "1"],
                   test_paths=["tests/test_cuda.py"], timeout_s=300)


# ---------------------------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------------------------


def run_command(cmd: list[str], log: Path, timeout_s: float) -> tuple[int | None, str]:
    """(exit code, output) of ``cmd`` run from the repository root, its output also in ``log``; on a timeout the
    exit code is None after SIGTERM (``handle run``: stop after the step), a second SIGTERM, then SIGKILL."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=f, stdin=subprocess.DEVNULL, text=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            for grace in (60, 30, None):
                if grace is None:
                    proc.kill()
                else:
                    proc.terminate()
                try:
                    out, _ = proc.communicate(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = None
        f.write(out or "")
    return rc, out or ""


def handle(*args: str) -> list[str]:
    return [sys.executable, "-m", "handle_cli", *args]


def sets(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def fresh(parent: Path, name: str) -> Path:
    """``parent/name``, or ``name-2``, ``name-3``... when taken (an earlier check in the same DIR)."""
    path, n = parent / name, 1
    while path.exists():
        n += 1
        path = parent / f"{name}-{n}"
    return path


def environment(out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``handle env --json`` (versions, CUDA devices, backends) and ``handle env --peak --json --threads 1`` (cached per
    device: GPU 0's, else the CPU's at the 1 thread a rank of a 2-process CPU run has; ``{}`` when it fails), both
    at once."""
    with ThreadPoolExecutor(2) as pool:
        env = pool.submit(run_command, handle("env", "--json"), out / "logs" / "env.log", 120)
        peak = pool.submit(run_command, handle("env", "--peak", "--json", "--threads", "1"), out / "logs" / "peak.log",
                           300)
        (rc, text), (peak_rc, peak_text) = env.result(), peak.result()
    if rc != 0:
        raise SystemExit(f"handle env --json failed (exit {rc}): see {out / 'logs' / 'env.log'}")
    return json.loads(text), json.loads(peak_text) if peak_rc == 0 else {}


# ---------------------------------------------------------------------------------------------------------------
# step 1: the CUDA tests
# ---------------------------------------------------------------------------------------------------------------


def junit_counts(path: Path) -> dict[str, Any]:
    """passed, failed (failures and errors), skipped and the failing tests' ids from pytest's JUnit XML."""
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            counts["failed"] += 1
            counts["failures"].append(f"{case.get('classname')}::{case.get('name')}")
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def step_tests(plan: Plan, out: Path) -> list[dict[str, Any]]:
    xml = out / "cuda_tests.xml"
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *plan.test_paths]
    rc, _ = run_command(cmd, out / "logs" / "cuda_tests.log", 2400)
    row: dict[str, Any] = {"id": "tests", "step": 1, "title": f"CUDA tests: pytest -m cuda {' '.join(plan.test_paths)}",
                           "returncode": rc}
    if not xml.exists():
        return [{**row, "status": "failed", "message": f"pytest wrote no report (exit {rc}): see logs/cuda_tests.log"}]
    row.update(junit_counts(xml))
    status = "failed" if row["failed"] or rc not in (0, 5) else "ok" if row["passed"] else "skipped"
    row["note"] = f"{row['passed']} passed, {row['failed']} failed, {row['skipped']} skipped"
    return [{**row, "status": status}]


# ---------------------------------------------------------------------------------------------------------------
# training runs
# ---------------------------------------------------------------------------------------------------------------


def _median(values: list[Any]) -> float | None:
    xs = [float(v) for v in values if isinstance(v, (int, float))]
    return statistics.median(xs) if xs else None


def summarize_run(run_dir: Path, skip: int, datasheet: dict[str, Any] | None) -> dict[str, Any]:
    """A row from a run directory: medians over the step events after the first ``skip`` (start-up, warm-up,
    compilation), the largest CUDA memory any rank reported, and what run.json says of its end."""
    info = json.loads((run_dir / "run.json").read_text(encoding="utf-8")) if (run_dir / "run.json").exists() else {}
    events_file = run_dir / "events.jsonl"
    lines = events_file.read_text(encoding="utf-8").splitlines() if events_file.exists() else []
    steps = [e for e in map(json.loads, lines) if e.get("kind") == "step" and not e.get("skipped")]
    measured = steps[skip:] if len(steps) > skip else steps
    preset = tomllib.loads((run_dir / "preset.toml").read_text(encoding="utf-8")) \
        if (run_dir / "preset.toml").exists() else {}
    message = info.get("message") or ""
    world = info.get("world_size") or 1
    training, data = preset.get("training", {}), preset.get("data", {})
    row: dict[str, Any] = {
        "status": "ok" if info.get("status") == "finished" else "failed", "run_dir": str(run_dir),
        "message": message or None, "oom": "out of memory" in message.lower(),
        "strategy": info.get("strategy"), "zero_stage": info.get("zero_stage"), "world_size": world,
        "precision": info.get("precision"), "params": info.get("model_params"), "peak_flops": info.get("peak_flops"),
        "micro_batch_size": training.get("micro_batch_size"), "grad_accum": training.get("grad_accum", 1),
        # as built (run.json): the tokenizer may stop short of data.vocab_size; the preset's, to compare
        "seq_len": info.get("max_len", data.get("seq_len")), "vocab_size": info.get("vocab_size"),
        "preset_seq_len": data.get("seq_len"), "preset_vocab_size": data.get("vocab_size"),
        "flops_per_token": info.get("flops_per_token"), "compile": training.get("compile"),
        "steps": len(steps), "measured_steps": len(measured),
        "tokens_per_step": _median([e.get("tokens") for e in measured]),
        "tokens_per_s": _median([e.get("tokens_per_s") for e in measured]),
        "step_ms": None, "breakdown_ms": {}, "tflops": _median([e.get("tflops") for e in measured]),
        "mfu": _median([e.get("mfu") for e in measured]), "mfu_datasheet": None,
        "loss_first": steps[0]["loss"] if steps else None, "loss_last": steps[-1]["loss"] if steps else None,
    }
    if (step_s := _median([e.get("step_time_s") for e in measured])) is not None:
        row["step_ms"] = step_s * 1e3
    for part in PARTS:
        if (value := _median([e.get(f"{part}_s") for e in measured])) is not None:
            row["breakdown_ms"][part] = value * 1e3
    if datasheet and row["tflops"] is not None:
        row["mfu_datasheet"] = row["tflops"] * 1e12 / (datasheet["bf16_flops"] * world)
    memory = [m for e in steps for m in e.get("memory") or []]
    for key in ("cuda_max_allocated_bytes", "cuda_reserved_bytes"):
        values = [m[key] for m in memory if isinstance(m.get(key), int)]
        row[key] = max(values) if values else None
    if row["vocab_size"] is not None and row["vocab_size"] != row["preset_vocab_size"]:
        row["note"] = f"vocabulary {row['vocab_size']:,} (the tokenizer stopped short of {row['preset_vocab_size']:,})"
    row["checks"] = consistency(row, datasheet)
    if row["status"] == "ok" and (wrong := [c["what"] for c in row["checks"] if not c["ok"]]):
        row.update(status="failed", message="the row's figures disagree: " + "; ".join(wrong))
    return row


class Runner:
    """Starts ``handle run`` / ``handle estimate`` for one check (all run directories under ``DIR/runs``)."""

    def __init__(self, plan: Plan, out: Path, datasheet: dict[str, Any] | None):
        self.plan, self.out, self.datasheet = plan, out, datasheet
        self.runs = out / "runs"

    def train(self, name: str, preset: str, overrides: list[str], skip: int) -> dict[str, Any]:
        run_dir = fresh(self.runs, name)
        cmd = handle("run", str(ROOT / preset), "--run-dir", str(run_dir),
                     *sets([f"run.output_dir={self.runs}", f"launch.backend={self.plan.backend}", *overrides]))
        rc, _ = run_command(cmd, self.out / "logs" / f"{run_dir.name}.log", self.plan.timeout_s)
        row = summarize_run(run_dir, skip, self.datasheet)
        if rc != 0 and row["status"] == "ok":
            row.update(status="failed", message=f"handle run exited {rc}")
        if not row["message"] and row["status"] != "ok":
            row["message"] = f"handle run exited {rc}: see logs/{run_dir.name}.log"
        return {**row, "returncode": rc, "command": " ".join(cmd[2:])}

    def estimate(self, preset: str, overrides: list[str], micro_batch_size: int) -> dict[str, Any]:
        return self.estimate_bytes(preset, [*overrides, f"training.micro_batch_size={micro_batch_size}"],
                                   f"mb{micro_batch_size}")

    def estimate_bytes(self, preset: str, overrides: list[str], name: str) -> dict[str, Any]:
        """``handle estimate --json`` of ``preset`` with ``overrides`` on one rank (logged as estimate-NAME.log)."""
        cmd = handle("estimate", str(ROOT / preset), "--nproc", "1", "--json", *sets(overrides))
        rc, text = run_command(cmd, self.out / "logs" / f"estimate-{name}.log", 300)
        if rc != 0:
            raise RuntimeError(f"handle estimate exited {rc}: see logs/estimate-{name}.log")
        return json.loads(text.splitlines()[0])


# ---------------------------------------------------------------------------------------------------------------
# steps 2-4
# ---------------------------------------------------------------------------------------------------------------


def step_demo(plan: Plan, runner: Runner) -> list[dict[str, Any]]:
    row = runner.train("demo", "presets/zero2.toml", plan.demo_sets, plan.demo_skip)
    where = "CPU processes" if plan.smoke else "GPUs" if plan.devices > 1 else "GPU"
    title = f"demo: presets/zero2.toml, ZeRO-2 on {plan.devices} {where}"
    return [{"id": "demo", "step": 2, "title": title, **row}]


def largest_micro_batch(at_1: dict[str, Any], at_2: dict[str, Any], memory: int, cap: int,
                        fraction: float = MEMORY_FRACTION) -> dict[str, Any]:
    """The largest micro-batch whose estimated device bytes fit in ``fraction`` of ``memory`` (at most ``cap``, at
    least 1), from ``handle estimate --json`` at micro-batch 1 and 2: device bytes grow by the same activation
    bytes per sample (the estimate is affine in the micro-batch)."""
    per_sample = at_2["activation_bytes"] - at_1["activation_bytes"]
    budget = fraction * memory
    fits = int((budget - at_1["device_bytes"]) // per_sample) + 1 if per_sample > 0 else cap
    return {"micro_batch_size": max(1, min(cap, fits)), "fits": fits, "cap": cap, "device_memory_bytes": memory,
            "fraction": fraction, "bytes_at_1": at_1["device_bytes"], "bytes_per_sample": per_sample,
            "params": at_1["params"]}


def confirm(run_at: Callable[[int], dict[str, Any]], micro_batch_size: int,
            attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """Run at ``micro_batch_size``; on CUDA out of memory again at 3/4 of it (at most :data:`MAX_ATTEMPTS` runs).
    Each run is appended to ``attempts``; returns the last run's row."""
    while True:
        row = run_at(micro_batch_size)
        attempts.append({"micro_batch_size": micro_batch_size, "status": row["status"], "oom": row["oom"]})
        if row["status"] == "ok" or not row["oom"] or micro_batch_size == 1 or len(attempts) >= MAX_ATTEMPTS:
            return row
        micro_batch_size = max(1, micro_batch_size * 3 // 4)


def write_corpus(path: Path, max_bytes: int) -> Path:
    """The Python standard library's own source (its .py files in sorted order, site-packages left out) up to about
    ``max_bytes``: text that needs no download, with words enough for a 50k-entry BPE vocabulary (8 MiB: 50,304)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        for source in sorted(root.rglob("*.py")):
            if written >= max_bytes:
                break
            if "site-packages" in source.parts or not source.is_file():
                continue
            text = source.read_bytes().decode("utf-8", "replace")
            f.write(text + "\n\n")
            written += len(text.encode("utf-8")) + 2
    return path


def gpt2_overrides(plan: Plan, out: Path) -> list[str]:
    """The GPT-2 runs' ``--set``s: the ``text`` dataset on the corpus, with the preset's seq_len and vocab_size
    restated. ``data.name=text`` switches the data plugin, which starts the ``[data]`` table afresh
    (config/loader.py): without them the runs trained at the text plugin's defaults, seq_len 128 and a 4,096-entry
    vocabulary (issue 40: the H100 rows' micro-batch 128 "at seq_len 1,024")."""
    corpus = out / "corpus.txt"
    if not corpus.exists() or corpus.stat().st_size < plan.corpus_bytes:
        write_corpus(corpus, plan.corpus_bytes)
    data = tomllib.loads((ROOT / "presets" / "gpt2-small.toml").read_text(encoding="utf-8"))["data"]
    return ["data.name=text", f"data.path={corpus}", f"data.seq_len={data['seq_len']}",
            f"data.vocab_size={data['vocab_size']}", "launch.nproc_per_node=1", *plan.gpt2_sets]


def search(plan: Plan, runner: Runner, overrides: list[str]) -> dict[str, Any]:
    with ThreadPoolExecutor(2) as pool:  # two processes: their start-up (torch, the model on fake tensors) overlaps
        at = list(pool.map(lambda mb: runner.estimate("presets/gpt2-small.toml", overrides, mb), (1, 2)))
    return largest_micro_batch(at[0], at[1], plan.device_memory, plan.max_micro_batch)


def step_gpt2(plan: Plan, runner: Runner, out: Path) -> list[dict[str, Any]]:
    overrides = gpt2_overrides(plan, out)
    title = f"{plan.model}, 1 {'CPU process' if plan.smoke else 'GPU'}, bf16, SDPA"
    try:
        found = search(plan, runner, overrides)
    except RuntimeError as e:
        return [{"id": "gpt2-eager", "step": 3, "title": title, "status": "failed", "message": str(e)}]
    attempts: list[dict[str, Any]] = []
    eager = confirm(lambda mb: runner.train(f"gpt2-eager-mb{mb}", "presets/gpt2-small.toml",
                                            [*overrides, f"training.micro_batch_size={mb}"], plan.gpt2_skip),
                    found["micro_batch_size"], attempts)
    rows = [{"id": "gpt2-eager", "step": 3, "title": f"{title}, eager", **eager,
             "estimate": {**found, "attempts": attempts}}]
    compiled = {"id": "gpt2-compile", "step": 3, "title": f"{title}, training.compile"}
    if not plan.compile:
        rows.append({**compiled, "status": "skipped", "message": "no compile in the CPU smoke version (inductor on a "
                                                                  "CPU takes minutes)"})
    elif eager["status"] != "ok":
        rows.append({**compiled, "status": "skipped", "message": "the eager run failed"})
    else:
        mb = attempts[-1]["micro_batch_size"]
        on = [*overrides, f"training.micro_batch_size={mb}", "training.compile=true"]
        rows.append({**compiled, **runner.train(f"gpt2-compile-mb{mb}", "presets/gpt2-small.toml", on, plan.gpt2_skip)})
    return [*rows, *llama_rows(plan, runner, overrides, attempts[-1] if eager["status"] == "ok" else None),
            attention_row(plan, out)]


def llama_rows(plan: Plan, runner: Runner, overrides: list[str], fit: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The modern decoder at GPT-2 small's width and depth (issue 40): RMSNorm, RoPE, SwiGLU (d_ff 2,304), GQA (4
    key/value heads for 12 query heads), no biases, ~121 M parameters; eager and compiled at the micro-batch the
    GPT-2 run fitted."""
    title = f"Llama-shaped {'tiny stand-in' if plan.smoke else '~121 M'}, 1 {'CPU process' if plan.smoke else 'GPU'}"
    rows = [{"id": "llama-eager", "step": 3, "title": f"{title}, eager"},
            {"id": "llama-compile", "step": 3, "title": f"{title}, training.compile"}]
    if fit is None:
        return [{**r, "status": "skipped", "message": "the GPT-2 eager run failed"} for r in rows]
    shape = ["model.d_ff=128", "model.n_kv_heads=2"] if plan.smoke else ["model.d_ff=2304", "model.n_kv_heads=4"]

    def run(mb: int, *more: str) -> dict[str, Any]:
        name = f"llama-{'compile' if more else 'eager'}-mb{mb}"
        return runner.train(name, "presets/gpt2-small.toml",
                            [*overrides, f"training.micro_batch_size={mb}", *shape, *LLAMA, *more], plan.gpt2_skip)

    attempts: list[dict[str, Any]] = []  # on CUDA out of memory again at 3/4 (SwiGLU keeps more than GELU)
    rows[0].update(confirm(run, fit["micro_batch_size"], attempts))
    if not plan.compile:
        rows[1].update(status="skipped", message="no compile in the CPU smoke version (inductor on a CPU takes "
                                                 "minutes)")
    elif rows[0]["status"] != "ok":
        rows[1].update(status="skipped", message="the eager run failed")
    else:
        rows[1].update(run(attempts[-1]["micro_batch_size"], "training.compile=true"))
    return rows


def attention_row(plan: Plan, out: Path) -> dict[str, Any]:
    """benchmarks/attention_mask.py: attention forward + backward with a mask tensor (the old path) and without."""
    cmd = [sys.executable, "benchmarks/attention_mask.py", "--json", "--smoke" if plan.smoke else "--device=cuda"]
    rc, text = run_command(cmd, out / "logs" / "attention.log", plan.timeout_s)
    cases = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    note = "; ".join(f"{c['case']}: {c['mask_ms']:.2f} -> {c['causal_ms']:.2f} ms" for c in cases)
    return {"id": "attention", "step": 3, "title": "attention fwd+bwd ms: mask tensor -> is_causal", "returncode": rc,
            "cases": cases, "status": "ok" if rc == 0 and cases else "failed", "note": note or f"exit {rc}: see log"}


def bench_row(plan: Plan, out: Path) -> dict[str, Any]:
    cmd = handle("bench", "comm", "--nproc", str(plan.devices), "--backend", plan.backend, "--json",
                 "--output-dir", str(out / "bench"), *plan.bench_args)
    rc, text = run_command(cmd, out / "logs" / "bench-comm.log", plan.timeout_s)
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    row: dict[str, Any] = {"id": "bench-comm", "step": 4, "title": f"handle bench comm, {plan.backend}, "
                           f"{plan.devices} ranks", "returncode": rc, "command": " ".join(cmd[2:]),
                           "world_size": plan.devices, "measurements": len(records),
                           "correct": sum(bool(r.get("correct")) for r in records), "ops": {}}
    for op in dict.fromkeys(r["op"] for r in records):
        mine = [r for r in records if r["op"] == op]
        top = max(mine, key=lambda r: r["bytes"])
        row["ops"][op] = {"bytes": top["bytes"], "busbw_gbps": top["busbw_gbps"], "backend": top["backend"],
                          "best_busbw_gbps": max(r["busbw_gbps"] for r in mine)}
    ok = rc == 0 and records and row["correct"] == len(records)
    row["status"] = "ok" if ok else "failed"
    if not ok:
        row["message"] = f"exit {rc}, {row['correct']}/{len(records)} results correct: see logs/bench-comm.log"
    if "all_reduce" in row["ops"]:
        a = row["ops"]["all_reduce"]
        row["note"] = (f"all_reduce {binary(a['bytes'])}: busbw {a['busbw_gbps']:.3g} GB/s; "
                       f"{row['correct']}/{len(records)} correct")
    return row


def step_multi(plan: Plan, runner: Runner, out: Path, micro_batch_size: int | None) -> list[dict[str, Any]]:
    titles = {"zero2-2": f"{plan.model}, ZeRO-2 on 2 ranks", "fsdp-2": f"{plan.model}, FSDP2 on 2 ranks"}
    if plan.devices < 2:
        why = f"needs 2 or more GPUs ({plan.devices} present)"
        return [{"id": i, "step": 4, "title": t, "status": "skipped", "message": why}
                for i, t in {"bench-comm": "handle bench comm", **titles}.items()]
    rows = [bench_row(plan, out)]
    overrides = gpt2_overrides(plan, out)
    if micro_batch_size is None:
        micro_batch_size = search(plan, runner, overrides)["micro_batch_size"]
    common = [*overrides, "launch.nproc_per_node=2", f"training.steps={plan.multi_steps}",
              f"training.micro_batch_size={micro_batch_size}"]
    for row_id, strategy in (("zero2-2", ["strategy.name=deepspeed", "strategy.zero_stage=2"]),
                             ("fsdp-2", ["strategy.name=fsdp"])):
        if row_id not in plan.multi_runs:
            rows.append({"id": row_id, "step": 4, "title": titles[row_id], "status": "skipped",
                         "message": "the smoke version's demo row is a 2-rank run already"})
            continue
        row = runner.train(f"{row_id}-mb{micro_batch_size}", "presets/gpt2-small.toml", [*common, *strategy],
                           min(plan.gpt2_skip, plan.multi_steps - 1))
        rows.append({"id": row_id, "step": 4, "title": titles[row_id], **row})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------------------------


def header(report: dict[str, Any]) -> list[str]:
    d, p = report["device"], report["peak"]
    measured, sheet = p.get("measured_bf16_flops"), p.get("datasheet")
    return [f"gpu_check {report['created']} ({report['mode']}): {d['label']}, torch {d['torch']}, CUDA "
            f"{d['cuda'] or '-'}, NCCL {d['nccl'] or '-'}, backend {d['backend']}",
            "bf16 peak: measured " + (f"{measured / 1e12:.3f} TFLOP/s (handle env --peak)" if measured else "-")
            + (f"; datasheet {sheet['bf16_flops'] / 1e12:.0f} TFLOP/s ({sheet['card']}: {sheet['source']})"
               if sheet else "; datasheet: none for this device")]


def device_info(env: dict[str, Any], plan: Plan) -> dict[str, Any]:
    t = env["torch"]
    gpus = t.get("cuda_devices") or []
    if plan.smoke:
        name, label = "cpu", f"{plan.devices} gloo processes on {env['cpu']['count']} CPU cores"
    else:
        name = gpus[0]["name"]
        label = f"{plan.devices} x {name} ({gpus[0]['memory_bytes'] / 2**30:.1f} GiB)"
    return {"name": name, "label": label, "count": plan.devices, "memory_bytes": None if plan.smoke else
            gpus[0]["memory_bytes"], "torch": t.get("version"), "cuda": t.get("cuda_build"),
            "nccl": t.get("nccl_version"), "backend": plan.backend, "python": env["python"]["version"]}


def run_step(step: str, plan: Plan, runner: Runner, out: Path, done: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One step's rows; an exception in the check itself becomes a failed row, so the other steps still run."""
    try:
        if step == "tests":
            return step_tests(plan, out)
        if step == "demo":
            return step_demo(plan, runner)
        if step == "gpt2":
            return step_gpt2(plan, runner, out)
        if step == "long":  # benchmarks/_gpu_long.py; smoke: a made-up 16 MiB the tiny model fits at 512 tokens
            start = 512 if plan.smoke else tomllib.loads((ROOT / "presets" / "long-context.toml").read_text(
                encoding="utf-8"))["data"]["seq_len"]
            return [loss_memory_row(plan.smoke, out, run_command, plan.timeout_s),
                    long_context_row(plan.smoke, 16 << 20 if plan.smoke else plan.device_memory, runner, start)]
        if step == "native-cp":
            return [native_cp_row(plan.smoke, out, run_command, plan.timeout_s)]
        known = next((r.get("micro_batch_size") for r in done if r["id"] == "gpt2-eager" and r["status"] == "ok"), None)
        return step_multi(plan, runner, out, known)
    except Exception as e:  # noqa: BLE001 - reported in the row
        return [{"id": step, "step": STEPS.index(step) + 1, "title": step, "status": "failed",
                 "message": f"gpu_check: {type(e).__name__}: {e}"}]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json, runs/, bench/, logs/")
    ap.add_argument("--only", default=",".join(STEPS), help=f"steps to run, of {','.join(STEPS)}")
    ap.add_argument("--smoke", action="store_true", help="the CPU smoke version even where CUDA is present")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if not only or set(only) - set(STEPS):
        ap.error(f"--only: choose from {','.join(STEPS)}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # every command below runs on the CPU
    env, peak = environment(out)
    t = env["torch"]
    gpus = len(t.get("cuda_devices") or []) if t.get("cuda_available") else 0
    if args.smoke or gpus == 0:
        why = "--smoke" if args.smoke else f"no CUDA device found (torch {t.get('version')})"
        print(f"{why}: running the CPU smoke version (gloo, 2 processes, tiny models, a few steps)", flush=True)
        plan = Plan.cpu_smoke()
    else:
        plan = Plan.cuda(gpus, t["cuda_devices"][0]["memory_bytes"])
    mode = "cpu-smoke" if plan.smoke else "cuda"
    device = device_info(env, plan)
    sheet = None if plan.smoke else datasheet_peak(device["name"])
    runner = Runner(plan, out, sheet)
    report_path = out / "gpu_check.json"
    earlier = json.loads(report_path.read_text(encoding="utf-8")) if report_path.exists() else {}
    rows = [r for r in earlier.get("rows", []) if earlier.get("mode") == mode and STEPS[r["step"] - 1] not in only]
    command = " ".join(["benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    report: dict[str, Any] = {"version": 1, "mode": mode, "device": device, "command": command,
                              "peak": {"measured_bf16_flops": peak.get("bf16"), "measured_key": peak.get("key"),
                                       "datasheet": sheet}}
    start = time.perf_counter()
    for step in [s for s in STEPS if s in only]:
        began = time.perf_counter()
        new = run_step(step, plan, runner, out, rows)
        for r in new:
            r.setdefault("wall_s", round(time.perf_counter() - began, 1))
        print(f"{step}: " + ", ".join(f"{r['id']} {r['status']}" for r in new), flush=True)
        rows = sorted([*rows, *new], key=lambda r: r["step"])
        compare(rows)
        report.update(created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), rows=rows,
                      wall_s=round(time.perf_counter() - start, 1), ok=all(r["status"] != "failed" for r in rows))
        # written after every step: a check cut off by a time limit keeps the rows it has
        report_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print("\n".join(["", *header(report), "", *table(rows), "", f"written: {report_path}"]))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
