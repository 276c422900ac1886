"""The encoder-decoder split over 2 tensor-parallel ranks (by hand and with DTensor, with and without sequence
parallelism, post-LN with fused QKV and tied embeddings, pre-LN with separate Q/K/V and an untied head) trains as one
process does: the losses of three AdamW steps within 1e-5 relative, every gradient (gathered) of step 1 within
1e-5, and the hand-written path's counted TP bytes equal to the analytic volume (the cross-attention's memory
gathered per layer).

Real gloo processes; a tiny model, fp32, dropout 0; source and target of different lengths, with padding; step 1's
lengths are odd (sequence parallelism pads them to a multiple of tp and cuts the logits back). Gradients are compared
at step 1 only: after an AdamW step the 1e-7 differences of the weights are no longer 1e-7 in every gradient.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torch_handle.model.args import TransformerArgs
from torch_handle.model.parallelize import parallelize_tensor, tensor_parallel_plan
from torch_handle.model.transformer import EncoderDecoder
from torch_handle.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from torch_handle.parallel.tensor.layers import all_reduce_sp_grads
from torch_handle.parallel.tensor.mappings import TPGroup, step_volume
from torch_handle.parallel.tensor.plan import unshard

from tests.helpers import parallel_corpus, run_here, run_on_gloo, tp_mesh

pytestmark = pytest.mark.dist

B, V, D_MODEL, N_LAYERS, PAD = 2, 32, 16, 2, 0
LENGTHS = [(7, 5), (8, 6), (6, 8)]  # (source, target) of each step; the first is padded to (8, 6) under SP
CASES = [(impl, sp, norm_first, fused) for impl in ("scratch", "native") for sp in (False, True)
         for norm_first, fused in ((False, True), (True, False))]
# Qwen 3-shaped stacks (grouped-query attention, q/k norm, head_dim 8, RMSNorm, RoPE, SwiGLU): the cross-attention's
# K, V of the memory through the fused projection of unequal parts, on DTensor's path the hand-written layer
CASES += [("native", True, True, True, "qwen3")]
QWEN3 = {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu", "n_kv_heads": 2, "bias": False, "qk_norm": True,
         "head_dim": 8, "scale_embeddings": False, "tie_embeddings": False}


def _args(norm_first: bool, fused: bool, shape: str = "paper") -> TransformerArgs:
    return TransformerArgs(**{"vocab_size": V, "d_model": D_MODEL, "n_heads": 4, "n_layers": N_LAYERS, "d_ff": 32,
                              "dropout": 0.0, "max_len": 8, "norm_first": norm_first, "fused_qkv": fused,
                              "tie_embeddings": fused, "pad_id": PAD, **(QWEN3 if shape == "qwen3" else {})})


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """src (B, S), tgt and labels (B, T): random tokens, the second sentence of each shorter (padded)."""
    S, T = LENGTHS[step]
    g = torch.Generator().manual_seed(step)
    src, tgt = torch.randint(1, V, (B, S), generator=g), torch.randint(1, V, (B, T), generator=g)
    labels = torch.randint(1, V, (B, T), generator=g)
    src[1, -2:] = PAD
    tgt[1, -3:] = PAD
    labels[1, -3:] = -100
    return src, tgt, labels


def _reference(args: TransformerArgs) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """(loss, gradients) of each step of the one-process model (the gradients of step 1 only)."""
    torch.manual_seed(0)
    model = EncoderDecoder(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(len(LENGTHS)):
        src, tgt, labels = _batch(step)
        loss = F.cross_entropy(model(src, tgt).flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()} if step == 0 else {}))
        optimizer.step()
        optimizer.zero_grad()
    return out


def _scratch_step(model, tp: TPGroup, sp: bool, batch, plan) -> tuple[float, dict[str, torch.Tensor]]:
    src, tgt, labels = batch
    loss, _ = vocab_parallel_cross_entropy(model(src, tgt), labels, tp)
    loss.backward()
    if sp:
        all_reduce_sp_grads(model, tp)
    return loss.item(), {n: unshard(n, p.grad, plan, tp) for n, p in model.named_parameters()}


def _native_step(model, tp: TPGroup, batch, plan) -> tuple[float, dict[str, torch.Tensor]]:
    from torch.distributed.tensor.parallel import loss_parallel

    src, tgt, labels = batch
    with loss_parallel():
        loss = F.cross_entropy(model(src, tgt).flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    all_reduce_sp_grads(model, tp)  # the q/k norms' partial sums (DTensor sums the rest)
    # plain tensors: replicated, or a fused QKV of unequal parts kept as hand-written slices
    return loss.item(), {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else unshard(n, p.grad, plan, tp)
                         for n, p in model.named_parameters()}


def _volume(sp: bool) -> dict[str, int]:
    """What step 2 (source 8, target 6) must move: the formula, fp32, plus under SP the one
    all-reduce of the LayerNorm and row-parallel-bias gradients (post-LN: 2 norms a layer and 2 row biases an
    encoder layer, 3 of each a decoder layer; each d_model wide, a norm two vectors)."""
    S, T = LENGTHS[1]
    sp_grads = N_LAYERS * (2 * 2 + 2 + 3 * 2 + 3) * D_MODEL
    return step_volume(n_layers=N_LAYERS, micro_batch_size=B, seq_len=T, src_len=S, d_model=D_MODEL,
                       sequence_parallel=sp, sp_grad_elements=sp_grads)


def _tensor_parallel(args: TransformerArgs, impl: str, sp: bool, tp: TPGroup, mesh
                     ) -> list[tuple[float, dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    model = EncoderDecoder(args)
    plan = tensor_parallel_plan(model)
    parallelize_tensor(model, impl, tp if impl == "scratch" else mesh, sequence_parallel=sp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(len(LENGTHS)):
        tp.stats.reset()
        batch = _batch(step)
        out.append(_scratch_step(model, tp, sp, batch, plan) if impl == "scratch"
                   else _native_step(model, tp, batch, plan))
        if impl == "scratch" and step == 1 and args.fused_qkv:
            want = _volume(sp)
            assert (tp.stats.calls, tp.stats.bytes) == (want["calls"], want["bytes"]), (sp, tp.stats.by_op)
        optimizer.step()
        optimizer.zero_grad()
    return out


def _cases(rank: int, tmp: Path) -> None:
    mesh, tp = tp_mesh()
    for impl, sp, norm_first, fused, *shape in CASES:
        case = f"{shape} {impl} sp={sp} norm_first={norm_first} fused_qkv={fused}"
        args = _args(norm_first, fused, *shape)
        for step, ((ref_loss, ref_grads), (loss, grads)) in enumerate(
                zip(_reference(args), _tensor_parallel(args, impl, sp, tp, mesh)), start=1):
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, step, loss, ref_loss)
            if step == 1:
                assert grads.keys() == ref_grads.keys(), case
            for name, ref in ref_grads.items():
                torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{case} step {step} {name}: {m}")


def test_encoder_decoder_split_two_ways_trains_as_one_process(tmp_path: Path) -> None:
    run_on_gloo(_cases, tmp_path)


# ---- a real run through `handle run`: translation batches of any length, on 2 ranks -------------------------------


def _steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] in ("step", "eval")]


def _run(preset: Path, name: str, *overrides: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "handle_cli", "run", str(preset), "--set", f"run.name={name}",
                           *overrides], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return _steps(Path(next(ln for ln in proc.stdout.splitlines() if ln.startswith("run directory: ")).split(": ", 1)[1]))


def test_handle_run_translates_with_tp_2_and_sequence_parallelism(tmp_path: Path) -> None:
    """A translation preset (sentence pairs of 3-6 words, each batch padded to its longest: odd lengths too) with
    `parallel.tp = 2` by hand with sequence parallelism trains and evaluates as one process does."""
    preset = tmp_path / "translate.toml"
    preset.write_text(f"""
[run]
output_dir = "{tmp_path / 'runs'}"
[model]
kind = "encoder-decoder"
d_model = 32
n_heads = 4
n_layers = 2
d_ff = 64
dropout = 0.0
[data]
name = "parallel"
path = "{parallel_corpus(tmp_path / 'pairs')}"
seq_len = 16
vocab_size = 300
[training]
steps = 10
micro_batch_size = 4
precision = "fp32"
eval_every = 5
eval_steps = 1
log_every = 1
checkpoint_every = 0
[strategy]
name = "single"
""")
    one = _steps(run_here(preset, ("--set", "run.name=one")))  # the one-process reference, in this process
    split = _run(preset, "tp", "--set", "launch.nproc_per_node=2", "--set", "parallel.tp=2",
                 "--set", "parallel.tp_impl=scratch", "--set", "parallel.sequence_parallel=true")
    assert [(e["kind"], e["step"]) for e in split] == [(e["kind"], e["step"]) for e in one]
    assert sum(e["kind"] == "eval" for e in one) >= 1 and len(one) >= 4
    for a, b in zip(one, split):
        key = "loss" if a["kind"] == "step" else "val_loss"
        assert abs(a[key] - b[key]) <= 1e-5 * a[key], (a["kind"], a["step"], a[key], b[key])
    assert all(e["layout"] == {"dp": 1, "tp": 2} and e["tp_comm_bytes"] > 0 for e in split if e["kind"] == "step")
