"""``handle estimate`` (torch_handle.plan.estimate) against what really happens.

- Model states: the formulas reproduce the measured telemetry of the tiny model to the byte (``MEASURED``, fast);
  real 2-rank runs of the shipped strategies (fp32 and bf16) agree with the estimate of the same preset within 5%
  (tests/test_distributed.py, on that module's runs).
- Activations: the fake-tensor figure against the same counter on a real forward/backward (fp32, bf16 autocast,
  bf16 weights; with and without activation checkpointing) within 10%.
- The command: speed (shipped preset < 10 s, a 1B-parameter variant < 30 s without allocating), JSON, bad input.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import tiny_preset
from torch_handle.common.units import parse_bytes
from torch_handle.plan import estimate as E
from torch_handle.plan import estimate_activations as A
from torch_handle.plan.estimate_model import ModelBuild, ModelShape
ROOT = Path(__file__).resolve().parents[1]
HANDLE = [sys.executable, "-m", "handle_cli"]
VARIANTS = {v.label: v for v in E.COMPARE_VARIANTS}


def tiny_shape() -> ModelShape:
    """The model of benchmarks/zero_memory.py (132,864 parameters in 27 tensors), on the meta device."""
    import torch

    from torch_handle.model.args import TransformerArgs
    from torch_handle.model.transformer import build_transformer

    args = TransformerArgs(vocab_size=512, pad_id=0, max_len=32, d_model=64, n_heads=4, n_layers=2, d_ff=256,
                           norm_first=True)
    with torch.device("meta"):
        return ModelShape.of(build_transformer(args))


# ---------------------------------------------------------------------------------------------------------------
# model states
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision,label", [(p, label) for p, d in E.MEASURED.items() for label in d])
def test_formulas_reproduce_the_measured_bytes(precision, label):
    shape = tiny_shape()
    assert (shape.n_params, shape.n_tensors) == (132_864, 27)
    s = E.model_state_bytes(shape, VARIANTS[label], precision, world=2, rank=0)
    assert (s.param, s.grad, s.optimizer) == E.MEASURED[precision][label]


def test_rank_dependent_terms_and_offload_split():
    shape = tiny_shape()
    # measured on rank 1: ZeRO-1 fp32 gradients (the boundary parameter's other part), ZeRO-1 greedy shard
    assert E.model_state_bytes(shape, VARIANTS["zero1"], "fp32", 2, 1).grad == 266_752
    assert E.model_state_bytes(shape, VARIANTS["scratch-ddp+zero1"], "fp32", 2, 1).optimizer == 531_512
    off = E.model_state_bytes(shape, VARIANTS["zero3+offload+param"], "bf16", 2, 0)
    assert off.host == off.param + off.optimizer + 4 * 66_432  # parameters, optimizer, fp32 gradient partition
    with pytest.raises(ValueError, match="one process"):
        E.model_state_bytes(shape, VARIANTS["single"], "fp32", 2)


def test_sizes_parse():
    assert parse_bytes("80GiB") == 80 * 1024**3
    assert parse_bytes("24GB") == 24 * 10**9
    assert parse_bytes("1048576") == 2**20
    for bad in ("", "12XB", "-1GB", "GB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


# ---------------------------------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------------------------------


def _factory(options, vocab_size, pad_id, max_len):
    from torch_handle.model.transformer import build_transformer

    return build_transformer(dataclasses.replace(options, vocab_size=vocab_size, pad_id=pad_id, max_len=max_len))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("precision,mode", [("fp32", "fp32"), ("bf16", "autocast"), ("bf16", "cast")])
def test_fake_activations_match_a_real_forward_backward(precision, mode, checkpointing):
    import torch
    import torch.nn.functional as F

    from torch_handle.model.args import TransformerArgs

    batch, seq, vocab = 4, 48, 300
    args = TransformerArgs(vocab_size=vocab, pad_id=0, max_len=seq, d_model=64, n_heads=4, n_layers=3, d_ff=160,
                           norm_first=True, activation_checkpointing=checkpointing)
    fake = A.fake_activations(ModelBuild(_factory, args, vocab, 0, seq, "lm"), batch, seq, precision, mode,
                              checkpointing)
    torch.manual_seed(0)
    model = _factory(args, vocab, 0, seq).train()
    if mode == "cast":
        model.to(torch.bfloat16)
    ids, labels = torch.randint(4, vocab, (batch, seq)), torch.randint(4, vocab, (batch, seq))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            logits = model(ids)
        F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()

    real = A.saved_activation_bytes(step, model)
    assert abs(fake.saved - real) <= 0.10 * real, (fake, real)
    assert model.layers[0].ff.linear1.weight.grad is not None  # the counter changed nothing: backward ran
    assert fake.logits == 2 * batch * seq * vocab * 4  # the logits, then their and the log-probs' gradients
    if checkpointing:
        # the recomputed block is one block's saved tensors, measured on the real model without checkpointing
        model.args = dataclasses.replace(args, activation_checkpointing=False)
        model.zero_grad()
        plain = A.saved_activation_bytes(step, model)
        inputs = len(model.blocks()) * batch * seq * 64 * (2 if mode == "cast" else 4)
        assert fake.recompute > 0 and fake.saved < plain
        assert abs((plain - real + inputs) / len(model.blocks()) - fake.recompute) <= 0.10 * fake.recompute
    else:
        assert fake.recompute == 0


def test_tensor_parallel_activations_follow_korthikanti():
    """One layer's activations on one TP rank, measured on the split model (the recomputed block of a checkpointed
    model), against Korthikanti et al. 2022 Table 2. Without sequence parallelism the measured figure is the same
    multiple of sbh(10 + 24/t + 5as/(ht)) for every t (this model saves somewhat more than Megatron-LM's count,
    alike at every t). With it, what leaves the replicated region shrinks as (1 - 1/t), as sbh·10·(1 - 1/t)
    does; the column-parallel linears' gathered inputs stay whole here. The logits buffer is (b, s, V/t) fp32
    (two at t = 1: ``full_loss_bytes``)."""
    from torch_handle.model.args import TransformerArgs

    batch, seq, vocab, h, heads = 2, 64, 256, 128, 4
    args = TransformerArgs(vocab_size=vocab, pad_id=0, max_len=seq, d_model=h, n_heads=heads, n_layers=2,
                           d_ff=4 * h, dropout=0.1, mlp="gelu", activation_checkpointing=True)

    def layer(tp: int, sp: bool) -> A.ActivationBytes:
        return A.fake_activations(ModelBuild(_factory, args, vocab, 0, seq, "lm", tp, sp), batch, seq, "bf16",
                                  "cast", True)

    plain = {t: layer(t, False) for t in (1, 2, 4)}
    ratios = [plain[t].recompute / A.korthikanti_layer_bytes(seq, batch, h, heads, t) for t in (1, 2, 4)]
    assert max(ratios) / min(ratios) < 1.02, ratios
    sp = {t: layer(t, True) for t in (2, 4)}
    saved_by_sp = {t: plain[t].recompute - sp[t].recompute for t in (2, 4)}
    assert all(v > 0 for v in saved_by_sp.values())
    assert abs(saved_by_sp[4] / saved_by_sp[2] - 1.5) < 0.03, saved_by_sp  # (1 - 1/4) / (1 - 1/2)
    assert plain[1].logits == 2 * batch * seq * vocab * 4  # F.cross_entropy's two gradients beside the log-probs
    assert all(plain[t].logits == batch * seq * vocab // t * 4 for t in (2, 4))  # one beside the saved softmax
    assert plain[2].saved < plain[1].saved and sp[2].saved < plain[2].saved


TP_CASES = [(impl, sp) for impl in ("scratch", "native") for sp in (False, True)]


def _tp_worker(rank: int, init: str, out: str) -> None:
    """Rank ``rank`` of 2 gloo processes: the decoder split both ways, with and without sequence parallelism; rank
    0 writes, per case, the elements of its parameter shards and the bytes autograd saved (the telemetry's
    counter) for one micro-batch's forward, loss and backward."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from torch_handle.model.parallelize import parallelize_tensor
    from torch_handle.model.transformer import DecoderLM
    from torch_handle.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
    from torch_handle.parallel.tensor.mappings import TPGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        tp = TPGroup(mesh.get_group())
        ids, labels = torch.randint(4, 512, (4, 64)), torch.randint(4, 512, (4, 64))
        results = {}
        for impl, sp in TP_CASES:
            torch.manual_seed(0)
            model = DecoderLM(_tp_args()).train()
            parallelize_tensor(model, impl, tp if impl == "scratch" else mesh, sequence_parallel=sp)

            def step():
                if impl == "scratch":
                    vocab_parallel_cross_entropy(model(ids), labels, tp)[0].backward()
                else:
                    with loss_parallel():
                        F.cross_entropy(model(ids).flatten(0, 1), labels.flatten()).backward()

            saved = A.saved_activation_bytes(step, model)
            local = sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())
            results[f"{impl} {sp}"] = (local, saved)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _tp_args():
    from torch_handle.model.args import TransformerArgs

    return TransformerArgs(vocab_size=512, pad_id=0, max_len=64, d_model=128, n_heads=4, n_layers=2, d_ff=512,
                           dropout=0.1, norm_first=True)


@pytest.mark.dist
def test_tp_estimate_matches_real_split_models(tmp_path):
    """Real 2-rank TP models (by hand and DTensor, SP off and on): rank 0's parameter shards hold what the estimate
    counts, and the telemetry's saved-activation counter agrees with the estimate's fake-tensor figure within 1%
    (by hand: to the byte; DTensor keeps a few small tensors of its own)."""
    import torch
    import torch.multiprocessing as mp

    from torch_handle.plan.estimate_model import build_model

    out = tmp_path / "results.json"
    mp.spawn(_tp_worker, args=(f"file://{tmp_path / 'rendezvous'}", str(out)), nprocs=2, join=True)
    real = json.loads(out.read_text())
    for impl, sp in TP_CASES:
        build = ModelBuild(_factory, _tp_args(), 512, 0, 64, "lm", 2, sp)
        fake = A.fake_activations(build, 4, 64, "fp32", "fp32", False)
        local, saved = real[f"{impl} {sp}"]
        with torch.device("meta"):
            assert ModelShape.of(build_model(build)).n_params == local, (impl, sp)
        assert abs(fake.saved - saved) <= 0.01 * saved, (impl, sp, fake.saved, saved)


def _tiny_tp(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    preset = tmp_path / "tiny.toml"
    preset.write_text(tiny_preset(tmp_path / "runs", strategy="single"))
    proc, _, _ = _estimate(str(preset), "--set", "parallel.tp=2", *args)
    return proc


def test_the_command_shows_the_tp_layout_and_per_rank_figures(tmp_path):
    proc = _tiny_tp(tmp_path, "--set", "parallel.sequence_parallel=true", "--nproc", "1,2,4", "--json")
    assert proc.returncode == 0, proc.stderr
    (row,) = [json.loads(line) for line in proc.stdout.splitlines()]  # single: dp = 1, world 2 only
    assert (row["world_size"], row["dp"], row["tp"], row["sequence_parallel"]) == (2, 1, 2, True)
    assert row["param_bytes"] == 4 * row["tp_shard_params"] and row["tp_shard_params"] < row["params"] / 1.9
    text = _tiny_tp(tmp_path, "--compare", "--nproc", "2").stdout
    assert "tp = 2" in text and "left out: " in text
    # each strategy's row names its layout and the TP implementation that strategy runs (tp_impl = "auto")
    rows = {line.split()[0]: " ".join(line.split()[1:9]) for line in text.splitlines()
            if line.split()[:1] in (["single"], ["ddp"], ["fsdp"])}
    assert rows == {"single": "dp 1 × tp 2 (tp native) 2", "ddp": "dp 1 × tp 2 (tp scratch) 2",
                    "fsdp": "dp 1 × tp 2 (tp native) 2"}
    assert "\nlayout: dp 1 × tp 2 (tp native) at the preset's world size 2; each row's rank is a global rank" in text
    bad = _tiny_tp(tmp_path, "--nproc", "4")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "runs one replica of parallel.tp = 2" in bad.stderr


def test_json_names_the_activation_parts_as_the_memory_telemetry_does():
    """``activation_bytes`` is the total; its ``activation_saved_bytes`` is what a run's memory telemetry reports
    under the same name (the trainer measures only that part)."""
    from torch_handle.observe.fields import ACTIVATION_BYTES, ACTIVATION_PARTS, ACTIVATION_SAVED_BYTES

    row = E.Estimate("ddp", 2, 0, "fp32", 10, 40, 40, 80, A.ActivationBytes(saved=100, logits=30, recompute=7), 297,
                     0, options={"zero_stage": 0})
    d = row.as_dict()
    assert d[ACTIVATION_BYTES] == row.activation_bytes == 137 == sum(d[k] for k in ACTIVATION_PARTS)
    assert d[ACTIVATION_SAVED_BYTES] == 100 and d["activation_logits_bytes"] == 30
    assert d["activation_recompute_bytes"] == 7
    assert json.loads(json.dumps(d))["options"] == {"zero_stage": 0} and "activation" not in d


# ---------------------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------------------


def test_rows_name_the_layout_as_every_view_does(tmp_path):
    """A ddp preset with tp = 2: at world size 2 one replica of 2 TP ranks runs no DDP, and its row says so."""
    from click.testing import CliRunner

    from handle_cli.estimate_cmd import estimate

    preset = tmp_path / "tiny.toml"
    preset.write_text(tiny_preset(tmp_path / "runs", strategy="ddp"))
    args = [str(preset), "--set", "parallel.tp=2", "--nproc", "2,4"]
    result = CliRunner().invoke(estimate, args)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("layout "))
    assert [line[:31].rstrip() for line in lines[head:head + 3]] == [
        "layout", "dp 1 × tp 2 (tp scratch)", "dp 2 × tp 2 (ddp; tp scratch)"]
    assert "(scratch, sequence parallelism off; auto → scratch: ddp does not wrap DTensor parameters" in result.stdout
    result = CliRunner().invoke(estimate, [*args, "--json"])
    assert [json.loads(line)["layout"] for line in result.stdout.splitlines()] == [
        "dp 1 × tp 2 (tp scratch)", "dp 2 × tp 2 (ddp; tp scratch)"]


def _estimate(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float, int]:
    """Run ``handle estimate ARGS``: (result, CPU seconds of the child, peak RSS of the child in bytes).

    CPU time (user + system), not wall time: other load on the machine does not inflate it, so the bounds below
    test what ``estimate`` does (no real allocation, no model run), not how busy the machine is."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([*HANDLE, "estimate", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "HANDLE_LOAD_PLUGINS": ""}, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return proc, seconds, max(after.ru_maxrss, before.ru_maxrss) * 1024


def test_shipped_preset_in_under_10_cpu_seconds():
    proc, seconds, _ = _estimate("presets/zero2.toml", "--nproc", "1,2,4,8", "--device-memory", "80GiB")
    assert proc.returncode == 0, proc.stderr
    assert seconds < 10, seconds
    out = proc.stdout
    assert "4,208,128 parameters" in out
    lines = [ln.split() for ln in out.splitlines() if "(deepspeed ZeRO-2) " in ln]  # the layout, as runs name it
    assert [ln[:4] for ln in lines] == [["1", "rank", "(deepspeed", "ZeRO-2)"], ["dp", "2", "(deepspeed", "ZeRO-2)"],
                                        ["dp", "4", "(deepspeed", "ZeRO-2)"], ["dp", "8", "(deepspeed", "ZeRO-2)"]]
    assert [ln[4] for ln in lines] == ["1", "2", "4", "8"]
    assert "smallest world size that fits in 80.00 GiB: zero2 1" in out
    prose = " ".join(out.split())  # the note is wrapped to the terminal
    assert "not included: allocator fragmentation" in prose and "communication buffers" in prose


def test_one_billion_parameters_in_under_30_cpu_seconds_without_allocating():
    sets = ["model.d_model=2048", "model.n_heads=16", "model.n_layers=20", "model.d_ff=8192"]
    args = [x for s in sets for x in ("--set", s)]
    proc, seconds, peak_rss = _estimate("presets/zero3.toml", *args, "--compare", "--nproc", "1,8", "--json")
    assert proc.returncode == 0, proc.stderr
    assert seconds < 30, seconds
    assert peak_rss < 2 * 1024**3, peak_rss  # fp32 weights alone would be 4 GB
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert rows[0]["params"] > 1_000_000_000
    assert {r["strategy"] for r in rows} == set(VARIANTS)
    assert all({"world_size", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "device_bytes",
                "host_bytes"} <= r.keys() for r in rows)
    by = {(r["strategy"], r["world_size"]): r for r in rows}
    assert by[("zero3", 8)]["device_bytes"] < by[("zero2", 8)]["device_bytes"] < by[("ddp", 8)]["device_bytes"]
    assert by[("zero3+offload", 8)]["host_bytes"] > 0 and by[("zero3", 8)]["host_bytes"] == 0


@pytest.mark.parametrize("args,expect", [
    (["presets/zero2.toml", "--nproc", "0,2"], "--nproc: '0'"),
    (["presets/zero2.toml", "--device-memory", "lots"], "--device-memory: 'lots' is not a size"),
    (["presets/zero2.toml", "--set", "model.d_mode=3"], "model.d_mode: unknown key"),
    (["presets/nope.toml"], "nope.toml"),
    (["presets/single.toml", "--nproc", "2"], "runs one process"),
])
def test_bad_input_exits_2_with_one_line(args, expect):
    proc, _, _ = _estimate(*args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and expect in proc.stderr, proc.stderr
    assert proc.stdout == ""
