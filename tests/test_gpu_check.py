"""benchmarks/gpu_check.py: its CPU smoke version end to end (what a machine without CUDA runs: every step through
the real CLI, the table and DIR/gpu_check.json), and in-process the parts only a GPU reaches: the micro-batch
search and its out-of-memory retries, the datasheet peaks, a run directory with CUDA memory."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import leftovers, tagged_env
from torch_handle.launch.precision import probe_cpu, resolve_cpu

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
PARTS = ("data", "forward", "backward", "sync", "optimizer")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("gpu_check", None)


@pytest.mark.dist
def test_the_smoke_version_runs_every_step_through_the_cli(tmp_path):
    out = tmp_path / "gc"
    env, tag = tagged_env(CUDA_VISIBLE_DEVICES="")  # the CPU version on a GPU machine too
    # every step but multi, which needs 2 devices for anything of its own (its rows: tested in this process below)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--only", "tests,demo,gpt2,long"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert leftovers(tag) == []
    assert proc.stdout.splitlines()[0].startswith("no CUDA device found") and "CPU smoke version" in proc.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert (report["mode"], report["ok"], report["device"]["backend"]) == ("cpu-smoke", True, "gloo")
    assert report["peak"]["measured_bf16_flops"] > 0 and report["peak"]["datasheet"] is None
    rows = {r["id"]: r for r in report["rows"]}
    assert list(rows) == ["tests", "demo", "gpt2-eager", "gpt2-compile", "llama-eager", "llama-compile", "attention",
                          "loss-memory", "long-context"]

    tests = rows["tests"]  # the marker selects tests/test_cuda.py's tests, and each skips without CUDA
    assert (tests["status"], tests["passed"], tests["failed"]) == ("skipped", 0, 0) and tests["skipped"] >= 5, tests

    demo = rows["demo"]
    assert demo["status"] == "ok", demo
    # the presets' precision is "auto": bf16 on a GPU (capability >= 8.0); on this CPU what its probe chose
    auto = resolve_cpu(probe_cpu()).precision
    assert (demo["strategy"], demo["zero_stage"], demo["world_size"], demo["precision"]) == ("deepspeed", 2, 2, auto)
    assert (demo["steps"], demo["measured_steps"], demo["micro_batch_size"], demo["seq_len"]) == (4, 3, 4, 32)
    assert demo["tokens_per_step"] == 2 * 4 * 32
    assert demo["tokens_per_s"] == pytest.approx(demo["tokens_per_step"] / demo["step_ms"] * 1e3, rel=1e-3)
    assert demo["mfu"] == pytest.approx(demo["tflops"] * 1e12 / (demo["peak_flops"] * 2), rel=1e-3)
    assert list(demo["breakdown_ms"]) == list(PARTS)
    assert sum(demo["breakdown_ms"].values()) == pytest.approx(demo["step_ms"], rel=0.25)
    assert demo["mfu_datasheet"] is None and demo["cuda_max_allocated_bytes"] is None

    eager, found = rows["gpt2-eager"], rows["gpt2-eager"]["estimate"]
    assert eager["status"] == "ok" and (eager["strategy"], eager["world_size"], eager["seq_len"]) == ("single", 1, 64)
    fits = int((found["fraction"] * found["device_memory_bytes"] - found["bytes_at_1"]) // found["bytes_per_sample"]) + 1
    assert 1 < fits < found["cap"] and found["micro_batch_size"] == fits == eager["micro_batch_size"], found
    assert found["attempts"] == [{"micro_batch_size": fits, "status": "ok", "oom": False}]
    assert eager["params"] == found["params"]  # the run's tokenizer reached the vocabulary the estimate assumed
    assert eager["tokens_per_step"] == fits * 64 and (out / "corpus.txt").stat().st_size >= 96 << 10
    # what the run built (run.json), and the row's figures multiplied back together (benchmarks/_rows.py)
    assert (eager["seq_len"], eager["vocab_size"], eager["preset_vocab_size"]) == (64, 512, 512)
    llama = rows["llama-eager"]  # the modern decoder at the GPT-2 run's micro-batch: RMSNorm, RoPE, SwiGLU, GQA
    assert (llama["status"], llama["micro_batch_size"], llama["seq_len"]) == ("ok", fits, 64), llama
    assert llama["params"] != eager["params"] and rows["llama-compile"]["status"] == "skipped"
    for r in (demo, eager, llama, rows["long-context"]):
        assert r["flops_per_token"] > 0 and r["peak_flops"] > 0, r
        assert [(c["name"], c["ok"]) for c in r["checks"]] == [("tokens_per_step", True), ("tokens_per_s", True),
                                                               ("mfu", True)], r["checks"]
        assert r["mfu"] == pytest.approx(r["tokens_per_step"] / (r["step_ms"] / 1e3) * r["flops_per_token"]
                                         / (r["peak_flops"] * r["world_size"]), rel=0.01)
    assert rows["gpt2-compile"]["status"] == "skipped" and "compile" in rows["gpt2-compile"]["message"]

    attention = rows["attention"]  # benchmarks/attention_mask.py --smoke: one tiny shape, SDPA and dropout, 2 dtypes
    assert attention["status"] == "ok" and [c["case"] for c in attention["cases"]] == [
        "tiny fp32", "tiny fp32, dropout 0.1", "tiny bf16", "tiny bf16, dropout 0.1"]
    assert all(c["mask_ms"] > 0 and c["causal_ms"] > 0 for c in attention["cases"])
    assert "tiny bf16:" in attention["note"]


    # step 5 (benchmarks/_gpu_long.py): the loss path's figures, and the longest seq_len the made-up 16 MiB holds
    (case,) = rows["loss-memory"]["cases"]
    assert rows["loss-memory"]["status"] == "ok" and (case["vocab"], case["micro_batch"], case["seq_len"]) == (512, 1, 64)
    assert 0 < case["transient_ratio"] < 1 and case["time_ratio"] > 0 and case["chunked_estimate_ratio"] > 0
    long = rows["long-context"]
    fits_long = [e["seq_len"] for e in long["estimates"] if e["device_bytes"] <= long["fraction"] * (16 << 20)]
    assert long["status"] == "ok" and long["longest_seq_len"] == max(fits_long) == long["seq_len"], long
    assert long["estimates"][-1]["device_bytes"] > long["fraction"] * (16 << 20)  # the search stopped past the budget
    assert long["attempts"] == [{"seq_len": long["seq_len"], "status": "ok", "oom": False}]
    assert (long["world_size"], long["micro_batch_size"], long["tokens_per_step"]) == (1, 1, long["seq_len"])

    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    for r in report["rows"]:
        assert sum(line.startswith(f"| {r['step']} | {r['title']} | {r['status']} |") for line in table) == 1, r
    demo_line = next(line for line in table if "| demo" in line)
    assert f"| {demo['tokens_per_s']:,.0f} |" in demo_line and "| 32 | 512 | 256 |" in demo_line  # seq, vocab, tokens
    assert f"| {demo['flops_per_token'] / 1e9:.3f} |" in demo_line
    assert all((Path(r["run_dir"]) / "events.jsonl").exists() for r in rows.values() if r.get("run_dir"))



def test_the_largest_micro_batch_from_two_estimates(gpu_check):
    at_1 = {"params": 10, "device_bytes": 1000, "activation_bytes": 300}
    at_2 = {"params": 10, "device_bytes": 1100, "activation_bytes": 400}
    found = gpu_check.largest_micro_batch(at_1, at_2, memory=10_000, cap=128, fraction=0.85)
    assert (found["micro_batch_size"], found["bytes_per_sample"]) == (76, 100)  # 1000 + 75 * 100 = 8500 bytes
    assert gpu_check.largest_micro_batch(at_1, at_2, memory=10_000, cap=64)["micro_batch_size"] == 64
    assert gpu_check.largest_micro_batch(at_1, at_2, memory=1_000, cap=64)["micro_batch_size"] == 1


def test_out_of_memory_steps_down_and_other_failures_stop(gpu_check):
    def runs(fits: int | None, calls: list[int]):
        def run_at(mb: int) -> dict:
            calls.append(mb)
            oom = fits is not None and mb > fits
            return {"status": "ok" if fits is not None and not oom else "failed", "oom": oom}
        return run_at

    calls, attempts = [], []
    assert gpu_check.confirm(runs(20, calls), 32, attempts)["status"] == "ok"
    assert calls == [32, 24, 18] and [a["oom"] for a in attempts] == [True, True, False]
    calls = []
    assert gpu_check.confirm(runs(None, calls), 32, [])["status"] == "failed" and calls == [32]  # not memory: no retry
    calls = []
    gpu_check.confirm(runs(0, calls), 64, [])
    assert calls == [64, 48, 36, 27]  # MAX_ATTEMPTS


def test_a_step_that_raises_becomes_a_failed_row(gpu_check, monkeypatch, tmp_path):
    def broken(plan, runner):
        raise KeyError("tokens_per_s")

    monkeypatch.setattr(gpu_check, "step_demo", broken)
    (row,) = gpu_check.run_step("demo", gpu_check.Plan.cpu_smoke(), None, tmp_path, [])
    assert (row["id"], row["step"], row["status"]) == ("demo", 2, "failed")
    assert row["message"] == "gpu_check: KeyError: 'tokens_per_s'"


@pytest.mark.parametrize("name, card", [("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
                                        ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-80GB", "A100"),
                                        ("NVIDIA H100 NVL", None), ("NVIDIA GeForce RTX 4090", None)])
def test_datasheet_peaks(gpu_check, name, card):
    found = gpu_check.datasheet_peak(name)
    assert (found and found["card"]) == card
    if card:
        assert found["bf16_flops"] == {"H100 SXM": 989e12, "H100 PCIe": 756e12, "H200": 989e12, "A100": 312e12}[card]


def test_a_run_directory_with_cuda_memory_becomes_a_row(gpu_check):
    run = REPO / "tests" / "fixtures" / "recorded-breakdown" / "ddp-breakdown"
    row = gpu_check.summarize_run(run, skip=10, datasheet={"bf16_flops": 989e12})
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["kind"] == "step"]
    assert (row["steps"], row["measured_steps"], row["world_size"]) == (len(steps), len(steps) - 10, 2)
    assert row["cuda_max_allocated_bytes"] == max(m["cuda_max_allocated_bytes"] for e in steps
                                                    for m in e.get("memory", []))
    assert row["mfu_datasheet"] == pytest.approx(row["tflops"] * 1e12 / (989e12 * 2))
    assert row["status"] == "failed"  # run.json says running: not a finished run


def test_the_gpt2_runs_keep_the_presets_sequence_length_and_vocabulary(gpu_check, tmp_path):
    """``--set data.name=text`` starts the [data] table afresh: the H100 rows of docs/gpu.md trained at the text
    plugin's defaults (seq_len 128, vocabulary 4,096) while the table said 1,024 and 50,304."""
    from torch_handle.config.loader import load_preset

    plan = gpu_check.Plan.cuda(1, 80 << 30)
    plan.corpus_bytes = 1 << 10
    data = load_preset(REPO / "presets" / "gpt2-small.toml", gpu_check.gpt2_overrides(plan, tmp_path)).data
    assert (data.name, data.options.seq_len, data.options.vocab_size) == ("text", 1024, 50304)
    smoke = load_preset(REPO / "presets" / "gpt2-small.toml", gpu_check.gpt2_overrides(gpu_check.Plan.cpu_smoke(),
                                                                                       tmp_path)).data
    assert (smoke.options.seq_len, smoke.options.vocab_size) == (64, 512)  # the smoke plan's own sets come after


def test_a_row_whose_figures_do_not_multiply_fails(gpu_check):
    """docs/gpu.md's H100 GPT-2 row as it read: micro-batch 128 at seq_len 1,024 in 40.9 ms cannot be 400,825
    tokens/s, nor that times 0.86 GFLOP a token 22.0% of 989 TFLOP/s; as the run built it (seq_len 128, 4,096
    tokens: 0.544 GFLOP a token) it adds up."""
    sheet = {"bf16_flops": 989e12}
    row = {"world_size": 1, "micro_batch_size": 128, "grad_accum": 1, "seq_len": 1024, "tokens_per_step": 128 * 1024,
           "step_ms": 40.9, "tokens_per_s": 400_825, "flops_per_token": 0.86e9, "peak_flops": None,
           "mfu_datasheet": 0.220}
    checks = {c["name"]: c["ok"] for c in gpu_check.consistency(row, sheet)}
    assert checks == {"tokens_per_step": True, "tokens_per_s": False, "mfu_datasheet": False}
    built = {**row, "seq_len": 128, "tokens_per_step": 128 * 128, "step_ms": 128 * 128 / 400_825 * 1e3,
             "flops_per_token": 0.544e9, "mfu_datasheet": 400_825 * 0.544e9 / 989e12}
    assert all(c["ok"] for c in gpu_check.consistency(built, sheet))
    assert not gpu_check.consistency({**built, "tokens_per_step": 128 * 1024}, sheet)[0]["ok"]


def test_two_rank_rows_are_compared_per_device_and_compiled_ones_to_eager(gpu_check):
    """What the smoke version no longer runs (its demo is the 2-rank run): a multi-GPU row's tokens/s per device
    over the 1-GPU eager run's, compile over eager."""
    rows = [{"id": "gpt2-eager", "status": "ok", "tokens_per_s": 1000.0, "world_size": 1},
            {"id": "gpt2-compile", "status": "ok", "tokens_per_s": 1500.0, "world_size": 1},
            {"id": "fsdp-2", "status": "ok", "tokens_per_s": 1800.0, "world_size": 2},
            {"id": "zero2-2", "status": "failed", "tokens_per_s": 1.0, "world_size": 2}]
    gpu_check.compare(rows)
    assert rows[1]["vs_eager"] == 1.5 and rows[1]["note"] == "1.50 x eager"
    assert rows[2]["vs_eager"] == 0.9 and rows[2]["note"] == "per device 0.90 x the 1-device eager run"
    assert "vs_eager" not in rows[3]


def test_the_long_context_search_halves_on_out_of_memory(gpu_check):
    """The estimate's longest fitting seq_len is run first; CUDA out of memory halves it (at most 3 runs)."""
    from _gpu_long import long_context_row

    budget, ran = 100, []

    class Runner:
        def estimate_bytes(self, preset, overrides, name):
            seq_len = int(next(o for o in overrides if o.startswith("data.seq_len=")).split("=")[1])
            return {"device_bytes": seq_len // 10}  # fits 0.85 x 100 up to seq_len 850

        def train(self, name, preset, overrides, skip):
            seq_len = int(overrides[-1].split("=")[1])
            ran.append(seq_len)
            oom = seq_len > 256
            return {"status": "failed" if oom else "ok", "oom": oom, "message": "CUDA out of memory" if oom else None,
                    "seq_len": seq_len, "tokens_per_s": 10.0}

    row = long_context_row(False, budget, Runner(), 128)
    assert [e["seq_len"] for e in row["estimates"]] == [128, 256, 512, 1024]
    assert ran == [512, 256] and row["longest_seq_len"] == 256 and row["status"] == "ok"
    assert row["attempts"] == [{"seq_len": 512, "status": "failed", "oom": True},
                               {"seq_len": 256, "status": "ok", "oom": False}]


def test_only_runs_the_steps_named_and_keeps_the_others_rows(gpu_check, monkeypatch, tmp_path):
    """``--only`` (a machine that limits one command's time): the steps named run again, the earlier rows of the
    other steps stay, the command is recorded. ``handle env`` and the steps stood in for (their rows are the smoke
    test's)."""
    env = {"torch": {"version": "2.13.0", "cuda_available": False}, "cpu": {"count": 2}, "python": {"version": "3.11"}}
    monkeypatch.setattr(gpu_check, "environment", lambda out: (env, {}))
    ran = []

    def step(name, plan, runner, out, done):
        ran.append(name)
        return [{"id": f"{name}-row", "step": gpu_check.STEPS.index(name) + 1, "title": name, "status": "ok",
                 "note": f"run {len(ran)}"}]

    monkeypatch.setattr(gpu_check, "run_step", step)
    assert gpu_check.main(["--out", str(tmp_path), "--only", "tests,demo"]) == 0
    assert gpu_check.main(["--out", str(tmp_path), "--only", "demo,long"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert ran == ["tests", "demo", "demo", "long"] and report["command"].endswith("--only demo,long")
    assert [(r["id"], r["note"]) for r in report["rows"]] == [("tests-row", "run 1"), ("demo-row", "run 3"),
                                                               ("long-row", "run 4")]


def test_the_multi_step_skips_on_one_device_and_reads_bench_comm(gpu_check, monkeypatch, tmp_path):
    """Step 4 on one GPU: every row skipped, saying why; on two, ``handle bench comm --json``'s records become the
    bench-comm row (its largest size per op, how many were correct)."""
    one = gpu_check.Plan.cuda(1, 80 << 30)
    assert [(r["id"], r["status"]) for r in gpu_check.step_multi(one, None, tmp_path, 8)] == [
        ("bench-comm", "skipped"), ("zero2-2", "skipped"), ("fsdp-2", "skipped")]
    records = [{"op": op, "bytes": size, "busbw_gbps": size / 1e3, "backend": "nccl", "correct": True}
               for op in ("all_reduce", "all_gather") for size in (1024, 2048)]
    monkeypatch.setattr(gpu_check, "run_command",
                        lambda cmd, log, timeout: (0, "\n".join(json.dumps(r) for r in records)))
    row = gpu_check.bench_row(gpu_check.Plan.cuda(2, 80 << 30), tmp_path)
    assert (row["status"], row["measurements"], row["correct"], row["world_size"]) == ("ok", 4, 4, 2)
    assert row["ops"]["all_reduce"] == {"bytes": 2048, "busbw_gbps": 2.048, "backend": "nccl",
                                        "best_busbw_gbps": 2.048}
    assert row["note"] == "all_reduce 2 KiB: busbw 2.05 GB/s; 4/4 correct"


def test_the_native_cp_row_reads_its_cases(gpu_check, tmp_path):
    """Step 6 (benchmarks/_gpu_native_cp.py): skipped on a CPU saying why; on CUDA its ``--json`` cases become the
    row, a hand-written attention's error noted, native's failing the row."""
    from _gpu_native_cp import native_cp_row

    assert native_cp_row(True, tmp_path, None, 1)["status"] == "skipped"
    errors = {"out": 2e-3, "dq": 4e-3, "dk": 3e-3, "dv": 1e-3}
    cases = [{"seq_len": 2048, "dtype": "bfloat16", "native": errors, "allgather": errors, "ring": {"error": "E: x"},
              "ms": {"native": 1.5, "allgather": 9.25}},
             {"seq_len": 1000, "dtype": "float32", "native": {"out": 1e-6}, "allgather": errors, "ring": errors},
             {"seq_len": 1000, "dtype": "bfloat16", "native": {"out": 1e-3}, "allgather": errors, "ring": errors}]
    row = native_cp_row(False, tmp_path, lambda cmd, log, timeout: (0, "\n".join(map(json.dumps, cases))), 1)
    assert (row["status"], row["cases"]) == ("ok", cases)
    assert row["note"] == ("bfloat16 T 2048 ring: E: x; bfloat16: native rel. error 4.00e-03; float32: native rel. "
                           "error 1.00e-06; bfloat16 T 2048 fwd+bwd ms native 1.50, allgather 9.25")
    cases[1]["native"] = {"error": "RuntimeError: no"}
    row = native_cp_row(False, tmp_path, lambda cmd, log, timeout: (0, "\n".join(map(json.dumps, cases))), 1)
    assert row["status"] == "failed" and row["note"].startswith("bfloat16 T 2048 ring: E: x; float32 T 1000 native")
