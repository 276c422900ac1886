"""The decoder split over 2 tensor-parallel ranks (by hand and with DTensor, with and without sequence parallelism,
post-LN and pre-LN, fused and separate QKV; and Llama- and Qwen 3-shaped: RMSNorm, RoPE, SwiGLU, grouped-query
attention, no biases, q/k norm, head_dim != d_model / n_heads) gives the one-process loss and every gradient
(gathered) within 1e-5, and so does the gradient norm the trainer clips by (``mesh_grad_norm``: each split gradient
counted over the TP group, each replicated one once).

Real gloo processes; a tiny model, fp32, dropout 0. Each rank also computes the one-process reference itself (the
same seed builds the same model everywhere), so the comparison needs no communication but the TP run's own.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torch_handle.model.args import TransformerArgs
from torch_handle.model.parallelize import parallelize_tensor, tensor_parallel_plan
from torch_handle.model.transformer import DecoderLM
from torch_handle.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from torch_handle.parallel.tensor.layers import all_reduce_sp_grads
from torch_handle.parallel.tensor.mappings import TPGroup, step_volume
from torch_handle.parallel.tensor.plan import unshard
from torch_handle.train.grad_norm import mesh_grad_norm

from tests.helpers import run_here, run_on_gloo, tiny_preset

pytestmark = pytest.mark.dist

B, T = 2, 8
# Llama's decoder (Touvron et al. 2023): 4 query heads sharing 2 key/value heads, so each rank holds 2 query heads
# and the 1 key/value head they read; Qwen 3's adds per-head q/k norms and a head width of its own (8, not 16 / 4).
LLAMA = {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu", "n_kv_heads": 2, "bias": False,
         "scale_embeddings": False, "norm_first": True, "tie_embeddings": False}
QWEN3 = {**LLAMA, "qk_norm": True, "head_dim": 8}
SHAPES = {"paper": {}, "llama": LLAMA, "qwen3": QWEN3}
CASES = [(impl, sp, "paper", norm_first, fused) for impl in ("scratch", "native") for sp in (False, True)
         for norm_first, fused in ((False, True), (True, False))]
CASES += [(impl, sp, shape, True, fused) for impl in ("scratch", "native")
          for sp, shape, fused in ((False, "llama", True), (True, "llama", False), (True, "qwen3", True))]
# training.loss_impl = "chunked" through the trainer's micro_batch_loss and the TP share: tied and untied, with and
# without sequence parallelism, both implementations (impl, sp, shape, norm_first, fused)
CHUNKED = [("native", False, "paper", False, True), ("scratch", True, "llama", True, False),
           ("native", True, "qwen3", True, True)]


def _args(norm_first: bool, fused: bool, shape: str = "paper") -> TransformerArgs:
    return TransformerArgs(**{"vocab_size": 32, "d_model": 16, "n_heads": 4, "n_layers": 2, "d_ff": 32,
                              "dropout": 0.0, "max_len": T, "norm_first": norm_first, "fused_qkv": fused,
                              "tie_embeddings": True, **SHAPES[shape]})


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 32, (B, T), generator=g)
    labels = torch.randint(0, 32, (B, T), generator=g)
    labels[0, :2] = -100
    return ids, labels


def _reference(args: TransformerArgs) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, gradients by name) of the one-process model."""
    torch.manual_seed(0)
    model = DecoderLM(args)
    ids, labels = _batch()
    loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _tensor_parallel(args: TransformerArgs, impl: str, sp: bool, tp: TPGroup, mesh, chunked: bool = False
                     ) -> tuple[float, dict[str, torch.Tensor], float]:
    """(loss, gathered gradients, gradient norm) of the model split over ``mesh``, a ("dp", "tp") mesh of dp 1;
    ``chunked``: the loss the trainer computes with ``training.loss_impl = "chunked"`` (``micro_batch_loss`` and
    the TP share, under its ``micro_batch`` context)."""
    torch.manual_seed(0)
    model = DecoderLM(args)
    plan = tensor_parallel_plan(model)
    parallelize_tensor(model, impl, tp if impl == "scratch" else mesh["tp"], sequence_parallel=sp)
    ids, labels = _batch()
    if chunked:
        from types import SimpleNamespace

        from torch_handle.train.loss import micro_batch_loss
        from torch_handle.train.shares.tensor import TensorParallel

        share = TensorParallel(SimpleNamespace(tp_impl=impl, sequence_parallel=sp), SimpleNamespace(tp_group=tp))
        strategy = SimpleNamespace(model=model, unwrapped=lambda: model, autocast=contextlib.nullcontext)
        with share.micro_batch():
            loss, _ = micro_batch_loss(strategy, {"input_ids": ids}, labels, "chunked", share=share)
            loss.backward()
    elif impl == "scratch":
        loss, _ = vocab_parallel_cross_entropy(model(ids), labels, tp)
        loss.backward()
    else:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
            loss.backward()
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    all_reduce_sp_grads(model, tp)  # the partial sums: under SP the norms' (by hand), the q/k norms' (always)
    norm = mesh_grad_norm(list(model.named_parameters()), mesh, plan)
    # DTensors carry their layout; plain tensors are the hand-written slices (on the native path: the fused QKV of
    # grouped-query attention) or replicated
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else unshard(n, p.grad, plan, tp)
             for n, p in model.named_parameters()}
    return loss.item(), grads, norm


def _cases(rank: int, tmp: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))  # mesh_grad_norm's: a dp and a tp axis
    tp = TPGroup(mesh["tp"].get_group())
    for impl, sp, shape, norm_first, fused, chunked in [(*c, False) for c in CASES] + [(*c, True) for c in CHUNKED]:
        case = f"{shape} {impl} sp={sp} norm_first={norm_first} fused_qkv={fused} chunked={chunked}"
        args = _args(norm_first, fused, shape)
        ref_loss, ref_grads = _reference(args)
        loss, grads, norm = _tensor_parallel(args, impl, sp, tp, mesh, chunked)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, loss, ref_loss)
        ref_norm = torch.stack([g.double().pow(2).sum() for g in ref_grads.values()]).sum().sqrt().item()
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (case, norm, ref_norm)
        assert grads.keys() == ref_grads.keys(), case
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {name}: {m}")


def test_decoder_split_two_ways_equals_one_process(tmp_path: Path) -> None:
    run_on_gloo(_cases, tmp_path)


# ---- real runs through `handle run`: the layout, the losses, the counted traffic, checkpoints ----------------------

TINY = ("--set", "model.dropout=0", "--set", "model.norm_first=true", "--set", "training.steps=10",
        "--set", "training.log_every=1", "--set", "training.grad_accum=2", "--set", "training.checkpoint_every=5")
TP2 = ("--set", "launch.nproc_per_node=2", "--set", "parallel.tp=2")


def _run(preset: Path, name: str, *overrides: str) -> Path:
    proc = subprocess.run([sys.executable, "-m", "handle_cli", "run", str(preset), "--set", f"run.name={name}",
                           *TINY, *overrides], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return Path(next(ln for ln in proc.stdout.splitlines() if ln.startswith("run directory: ")).split(": ", 1)[1])


def _steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == "step"]


def _losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in _steps(run_dir)}  # a step run twice keeps its last value


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The tiny decoder, fp32, dropout 0, 10 steps of 2 micro-batches, checkpoints at steps 5 and 10: one process,
    and tp = 2 by hand with sequence parallelism. Shared by the tests below (each run costs seconds)."""
    root = tmp_path_factory.mktemp("tp-runs")
    preset = root / "tiny.toml"
    preset.write_text(tiny_preset(root / "runs", strategy="single").replace("nproc_per_node = 2",
                                                                            "nproc_per_node = 1"))
    return {"preset": preset, "one": run_here(preset, ("--set", "run.name=one", *TINY)),  # in this process
            "scratch": _run(preset, "scratch", *TP2, "--set", "parallel.tp_impl=scratch",
                            "--set", "parallel.sequence_parallel=true")}


def _assert_same_training(one: list[dict], split: list[dict], name: str, layout: dict[str, int],
                          steps: range = range(1, 11)) -> None:
    one = [e for e in one if e["step"] in steps]
    assert [e["step"] for e in split] == list(steps), name
    for a, b in zip(one, split):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (name, a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (name, a["step"])
        assert b["tokens"] == a["tokens"] and b["layout"] == layout, name


def test_handle_run_with_tp_2_gives_the_one_process_losses(runs) -> None:
    """`parallel.tp = 2` on 2 ranks by hand with sequence parallelism trains as one process does, and its counted
    TP traffic is exactly the analytic volume of every step (DTensor's: the `as-tp` resume below)."""
    one, scratch = _steps(runs["one"]), _steps(runs["scratch"])
    _assert_same_training(one, scratch, "scratch", {"dp": 1, "tp": 2})
    d_model, n_layers = 64, 2
    sp_grads = n_layers * (2 * 2 * d_model + 2 * d_model) + 2 * d_model  # 2 LayerNorms + 2 row biases a layer, final
    want = step_volume(n_layers=n_layers, micro_batch_size=4, seq_len=32, d_model=d_model, grad_accum=2,
                       sequence_parallel=True, sp_grad_elements=sp_grads)
    assert [(e["tp_comm_calls"], e["tp_comm_bytes"]) for e in scratch] == [(want["calls"], want["bytes"])] * 10


def test_data_times_tensor_parallel_on_four_ranks(runs) -> None:
    """dp = 2 x tp = 2 on one ("dp", "tp") mesh (4 processes): `ddp` over the hand-written TP with sequence
    parallelism gives the one-process losses and gradient norms (same global batch of 8 sequences: 2 replicas x
    micro-batch 4, against 1 process x 2 micro-batches). `fsdp` over DTensor TP on the same mesh:
    tests/test_nd_parallel.py (its dp2xtp2-fsdp run, whose checkpoint also resumes under other layouts)."""
    mesh = ("--set", "launch.nproc_per_node=4", "--set", "parallel.tp=2", "--set", "training.grad_accum=1")
    split = _steps(_run(runs["preset"], "ddp-scratch", *mesh, "--set", "strategy.name=ddp",
                        "--set", "parallel.tp_impl=scratch", "--set", "parallel.sequence_parallel=true"))
    _assert_same_training(_steps(runs["one"]), split, "ddp-scratch", {"dp": 2, "tp": 2})


def _resume(run: Path, stopped: Path, *overrides: str) -> dict[int, float]:
    """Copy ``run`` without its last checkpoint (what a stop after step 5 leaves), resume it with ``overrides``."""
    shutil.copytree(run, stopped)
    shutil.rmtree(stopped / "checkpoints" / "step-10")
    proc = subprocess.run([sys.executable, "-m", "handle_cli", "run", "--resume", str(stopped), *overrides],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{stopped.name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return _losses(stopped)


def test_a_tp_checkpoint_resumes_as_single_and_fsdp_and_the_reverse(runs, tmp_path: Path) -> None:
    """A tp = 2 run's checkpoint is the one-process state in the portable form: resumed at step 5 as `single` on 1
    rank and as `fsdp` on 2, it continues the uninterrupted losses within 1e-4; and a `single` checkpoint resumed
    with tp = 2 (DTensor) does the same, its steps 6-10 training as one process does (losses within 1e-5, gradient
    norms within 1e-4; DTensor's collectives are not counted)."""
    split, one = runs["scratch"], runs["one"]
    layout = json.loads((split / "checkpoints" / "step-5" / "layout.json").read_text())
    assert layout["format"] == "dcp" and layout["tp"] == 2
    want_split, want_one = _losses(split), _losses(one)
    no_tp = ("--set", "parallel.tp=1", "--set", "parallel.sequence_parallel=false")
    cases = [(split, "as-single", (*no_tp, "--set", "launch.nproc_per_node=1"), want_split),
             # 2 data-parallel ranks with half the accumulation: the same global batch of 8 sequences
             (split, "as-fsdp", (*no_tp, "--set", "strategy.name=fsdp", "--set", "training.grad_accum=1"), want_split),
             (one, "as-tp", (*TP2, "--set", "parallel.tp_impl=native"), want_one)]
    for run, name, overrides, want in cases:
        got = _resume(run, tmp_path / name, *overrides)
        for step in range(6, 11):
            assert abs(got[step] - want[step]) <= 1e-4 * want[step], (name, step, got[step], want[step])
    native = _steps(tmp_path / "as-tp")[-5:]  # the steps after the resume
    _assert_same_training(_steps(one), native, "as-tp", {"dp": 1, "tp": 2}, range(6, 11))
    assert all("tp_comm_calls" not in e for e in native)
