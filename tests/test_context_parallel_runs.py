"""Context parallelism through `handle run` (issue 48): a tiny Llama-shaped decoder (RMSNorm, RoPE, SwiGLU, 4 query
heads on 2 key/value heads) on packed documents with document masks, fp32, 10 steps of 8 sequences of 32 tokens.
tp 2 × cp 2 by ring (hand-written TP with sequence parallelism, DDP; 4 processes), cp 4 by ring (DeepSpeed ZeRO-2
and the chunked loss, each rank's T/cp tokens projected a chunk at a time; 4 processes: K/V blocks three hops round
the ring), dp 2 × cp 2 by Ulysses (FSDP2 sharding over the 4 dp × cp
ranks), tp 2 × cp 2 by all-gather under DTensor's TP with sequence parallelism (FSDP2; the TP share's
``loss_parallel()`` entered by the cp share) and pp 2 × cp 2 by all-gather (the hand-written 1F1B, each stage on its T/cp tokens; the hand-written DDP,
which syncs each stage's gradients once a step over the cp ranks: tests/test_nd_parallel.py's hand-written DDP under
a pipeline) give the one-process losses and gradient norms within 1e-5 at every step (and the validation losses); the
tp 2 × cp 2 run's step-5 checkpoint resumed at tp 1, cp 1, dp 2 (DDP on 2 processes, grad_accum 1: the same global
batch) and the cp 4 run's (ZeRO-2) resumed by one process continue them. The all-gather attention runs end to end
under SFT and DPO with LoRA (tests/test_objectives_split.py).

The corpus is 240 text files of 2-30 words, one document each, so nearly every 32-token window holds several
documents (the mask changes the loss: without it the first step's is 6.68, with it 6.57), and a shard's tokens come
from several documents' head and tail chunks. Seven launches (the one-process reference in this process),
module-scoped; the bad-input lines are
tests/unit/test_context_parallel_config.py, the attentions alone tests/test_context_parallel.py.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import handle_at_once, handle_runs

pytestmark = pytest.mark.dist

LLAMA = {"norm": '"rmsnorm"', "position": '"rope"', "mlp": '"swiglu"', "n_kv_heads": 2, "bias": "false",
         "norm_first": "true", "dropout": 0}
WORDS = ("the", "a", "dog", "cat", "runs", "sleeps", "big", "small", "red", "man", "eats", "green", "house", "tree",
         "river", "stone", "light", "dark")
RUNS = {
    "one": (),
    "tp2xcp2-ring": ("--set", "launch.nproc_per_node=4", "--set", "strategy.name=ddp", "--set", "parallel.cp=2",
                     "--set", "parallel.cp_impl=ring", "--set", "parallel.tp=2", "--set", "parallel.tp_impl=scratch",
                     "--set", "parallel.sequence_parallel=true", "--set", "training.checkpoint_every=5"),
    "cp4-ring-zero2": ("--set", "launch.nproc_per_node=4", "--set", "strategy.name=deepspeed", "--set",
                       "strategy.zero_stage=2", "--set", "parallel.cp=4", "--set", "parallel.cp_impl=ring",
                       "--set", "training.checkpoint_every=5", "--set", "training.loss_impl=chunked"),
    "dp2xcp2-ulysses": ("--set", "launch.nproc_per_node=4", "--set", "strategy.name=fsdp", "--set", "parallel.cp=2",
                        "--set", "parallel.cp_impl=ulysses", "--set", "training.grad_accum=1"),
    "tp2xcp2-dtensor": ("--set", "launch.nproc_per_node=4", "--set", "strategy.name=fsdp", "--set", "parallel.cp=2",
                        "--set", "parallel.cp_impl=allgather", "--set", "parallel.tp=2", "--set",
                        "parallel.tp_impl=native", "--set", "parallel.sequence_parallel=true"),
    "pp2xcp2-allgather": ("--set", "launch.nproc_per_node=4", "--set", "strategy.name=scratch-ddp", "--set", "parallel.pp=2",
                          "--set", "parallel.pp_impl=scratch", "--set", "parallel.cp=2",
                          "--set", "parallel.cp_impl=allgather"),
}
LABELS = {"tp2xcp2-ring": "dp 1 × cp 2 × tp 2 (cp ring; tp scratch + sp)",
          "cp4-ring-zero2": "dp 1 × cp 4 (deepspeed ZeRO-2; cp ring)",
          "dp2xcp2-ulysses": "dp 2 × cp 2 (fsdp; cp ulysses)",
          "tp2xcp2-dtensor": "dp 1 × cp 2 × tp 2 (cp allgather; tp native + sp)",
          "pp2xcp2-allgather": "dp 1 × cp 2 × pp 2 (cp allgather; pp 1F1B scratch)"}


def _documents(root: Path) -> Path:
    rng = random.Random(0)
    root.mkdir()
    for i in range(240):
        (root / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30))) + ".\n")
    return root


def _events(run_dir: Path, kind: str) -> dict[int, dict]:
    events = map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
    return {e["step"]: e for e in events if e["kind"] == kind}


def _steps(run_dir: Path) -> dict[int, dict]:
    return _events(run_dir, "step")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Every run of :data:`RUNS`, two at a time, then the step-5 checkpoints of the tp 2 × cp 2 run resumed at cp 1,
    dp 2 and of the cp 4 run by one process, side by side."""
    root = tmp_path_factory.mktemp("cp-runs")
    common = (*(a for k, v in LLAMA.items() for a in ("--set", f"model.{k}={v}")),
              "--set", "model.n_layers=2", "--set", "data.name=text", "--set", f"data.path={_documents(root / 'docs')}",
              "--set", "data.vocab_size=300", "--set", "data.document_mask=true", "--set", "training.grad_accum=2",
              "--set", "training.log_every=1")
    done = handle_runs(root, RUNS, common, at_once=2, here=("one",))  # the reference in this process
    resumes = {"cp2-at-dp2": ("tp2xcp2-ring", "parallel.tp=1", "parallel.sequence_parallel=false",
                              "strategy.name=ddp", "launch.nproc_per_node=2", "training.grad_accum=1"),
               "cp4-at-one": ("cp4-ring-zero2", "strategy.name=single", "launch.nproc_per_node=1")}
    for name, (source, *_) in resumes.items():
        shutil.copytree(done[source], root / name)
        shutil.rmtree(root / name / "checkpoints" / "step-10")  # what a stop after step 5's checkpoint leaves
        (root / name / "events.jsonl").write_text("")
    resumed = handle_at_once({name: ("run", "--resume", str(root / name), "--set", "parallel.cp=1",
                                     *(a for o in overrides for a in ("--set", o)))
                              for name, (_, *overrides) in resumes.items()}, 2)
    for name, (code, out) in resumed.items():
        assert code == 0, f"{name}:\n{out[-3000:]}"
    return {**done, **{name: root / name for name in resumes}}


def _assert_steps_equal(one: dict[int, dict], split: dict[int, dict], steps: list[int], name: str) -> None:
    assert sorted(split) == steps, (name, sorted(split))
    for step in steps:
        for key in ("loss", "grad_norm"):
            want, got = one[step][key], split[step][key]
            assert abs(got - want) <= 1e-5 * abs(want), (name, step, key, got, want)


@pytest.mark.parametrize("name", ["tp2xcp2-ring", "cp4-ring-zero2", "dp2xcp2-ulysses", "tp2xcp2-dtensor",
                                  "pp2xcp2-allgather"])
def test_context_parallel_layouts_train_as_one_process(runs, name) -> None:
    one, split = _steps(runs["one"]), _steps(runs[name])
    _assert_steps_equal(one, split, list(range(1, 11)), name)
    for event in split.values():
        assert event["layout"]["cp"] == (4 if name == "cp4-ring-zero2" else 2)
        assert event["tokens"] == one[event["step"]]["tokens"]
        assert ("tp_comm_calls" in event) == (name == "tp2xcp2-ring")  # the TP share's traffic, through cp's
        assert event["cp_comm_bytes"] > 0 and event["comm"]["cp"] == event["cp_comm_s"] > 0, event
        if name == "cp4-ring-zero2":  # per layer and micro-batch, the ring's passes: cp - 1 of K/V forward, cp - 1
            assert event["cp_comm_calls"] == (3 * 4 - 2) * 2 * 2  # again and cp of dK/dV backward; 2 layers, 2 each
        # head-tail per document: every rank attends as many query-key pairs, to the pool's few tokens
        assert 1.0 <= event["cp_imbalance"] <= 1.05, event
    assert json.loads((runs[name] / "run.json").read_text())["layout"]["label"] == LABELS[name]
    # evaluation (steps 0 and 10) goes through the same sharded forward and loss; the 4 validation windows fill
    # no micro-batch of 4 on each of dp 2 replicas, so dp 2 has no validation loss to compare
    want, got = _events(runs["one"], "eval"), _events(runs[name], "eval")
    assert sorted(got) == sorted(want) == [0, 10]
    for step, event in want.items() if split[1]["layout"]["dp"] == 1 else ():
        assert abs(got[step]["val_loss"] - event["val_loss"]) <= 1e-5 * event["val_loss"], (name, step)


def test_a_stage_syncs_its_gradients_once_a_step(runs) -> None:
    """The hand-written DDP under a pipeline (pp 2 × cp 2) all-reduces rank 0's stage (its first layer and the
    embedding) once a step in its one bucket over the cp ranks: exactly the stage's parameter bytes, not once per
    micro-batch (picotron #5). Its final weights are the whole model (tests/whole_weights.py), and ``handle
    estimate``'s every-rank memory is every rank's telemetry (tests/test_nd_parallel.py's check of its layouts)."""
    from tests.test_nd_parallel import _disagreements
    from tests.whole_weights import assert_whole_weights
    from torch_handle.config.loader import load_preset
    from torch_handle.plan import estimate_layout
    from torch_handle.registry import get_registry

    weights = load_file(runs["one"] / "model.safetensors")  # the one-process model's tensors
    stage0 = sum(t.numel() for k, t in weights.items() if k == "embed.weight" or k.startswith("layers.0."))
    assert stage0 > weights["embed.weight"].numel(), sorted(weights)
    for e in _steps(runs["pp2xcp2-allgather"]).values():
        assert (e["allreduce_calls"], e["allreduce_bytes"]) == (1, 4 * stage0), (e["step"], stage0)
    assert_whole_weights(runs["pp2xcp2-allgather"])
    registry = get_registry()
    preset = load_preset(runs["pp2xcp2-allgather"] / "preset.toml", [], registry)
    step = [e for e in _steps(runs["pp2xcp2-allgather"]).values() if e.get("memory")][-1]
    bad = _disagreements(estimate_layout.estimate_layout(preset, registry, every_rank=True), step)
    assert not bad, "\n".join(bad)


def test_final_weights_are_the_one_process_model(runs) -> None:
    want, got = load_file(runs["one"] / "model.safetensors"), load_file(runs["tp2xcp2-ring"] / "model.safetensors")
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-4, msg=lambda m, key=key: f"{key}: {m}")


def test_a_cp2_checkpoint_resumes_at_cp1_dp2(runs) -> None:
    layout = json.loads((runs["cp2-at-dp2"] / "checkpoints" / "step-5" / "layout.json").read_text())
    assert (layout["cp"], layout["cp_impl"], layout["tp"], layout["world_size"]) == (2, "ring", 2, 4)
    resumed = json.loads((runs["cp2-at-dp2"] / "run.json").read_text())["layout"]
    assert (resumed["dp"], resumed["cp"], resumed["tp"], resumed["world_size"]) == (2, 1, 1, 2)
    _assert_steps_equal(_steps(runs["one"]), _steps(runs["cp2-at-dp2"]), list(range(6, 11)), "cp2-at-dp2")


def test_a_cp4_zero2_checkpoint_resumes_in_one_process(runs) -> None:
    layout = json.loads((runs["cp4-at-one"] / "checkpoints" / "step-5" / "layout.json").read_text())
    assert (layout["cp"], layout["cp_impl"], layout["world_size"]) == (4, "ring", 4)
    resumed = json.loads((runs["cp4-at-one"] / "run.json").read_text())["layout"]
    assert (resumed["cp"], resumed["world_size"]) == (1, 1)
    _assert_steps_equal(_steps(runs["one"]), _steps(runs["cp4-at-one"]), list(range(6, 11)), "cp4-at-one")
