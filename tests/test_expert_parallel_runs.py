"""Expert parallelism through `handle run`: ep = 2 on 2 processes (DDP, by hand), dp 2 × ep 2 on 4 (FSDP2: the
experts sharded over "edp", the dense part over "dp"; native) and pp 2 × ep 2 on 4 (DDP per stage in torch's 1F1B, by
hand) give the one-process losses and gradient norms within 1e-5 at every step and the same final weights (fp32,
dropless, aux and z losses on). Two resumes from step 2 continue the one-process losses and norms: the ep = 2 run's
checkpoint on tp = 2 (ep -> 1, and MoE layers replicated over the TP ranks), and the one-process run's on ep = 2 under
FSDP2 (the checkpoint cut into an EP run's experts).

A tiny MoE decoder (2 layers, both MoE: 4 SwiGLU experts, top-2; 4 steps of 8 sequences: micro-batches of 2, as
many per step on every layout, so the balancing loss sees the same micro-batches as the one-process run's).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import handle_at_once, handle_runs
from tests.whole_weights import assert_whole_weights

pytestmark = pytest.mark.dist

MOE = {"n_experts": 4, "top_k": 2, "moe_every": 1, "mlp": '"swiglu"', "d_ff_expert": 64, "router_aux_loss": 0.01,
       "router_z_loss": 0.001, "dropout": 0, "norm_first": "true"}
COMMON = (*(a for k, v in MOE.items() for a in ("--set", f"model.{k}={v}")), "--set", "training.steps=4",
          "--set", "training.log_every=1", "--set", "training.micro_batch_size=2",
          "--set", "training.checkpoint_every=2", "--set", "training.eval_steps=1")
EP2 = ("--set", "parallel.ep=2", "--set", "strategy.name=ddp")
RUNS = {
    "one": ("--set", "training.grad_accum=4"),
    "ep2-scratch": (*EP2, "--set", "launch.nproc_per_node=2", "--set", "training.grad_accum=2",
                    "--set", "parallel.ep_impl=scratch"),
    "dp2xep2-fsdp": (*EP2, "--set", "strategy.name=fsdp", "--set", "launch.nproc_per_node=4",
                     "--set", "training.grad_accum=1"),
    "pp2xep2": (*EP2, "--set", "launch.nproc_per_node=4", "--set", "training.grad_accum=2", "--set", "parallel.pp=2",
                "--set", "parallel.ep_impl=scratch"),
}
LABELS = {"ep2-scratch": "dp 1 × ep 2 (ddp; ep scratch)", "dp2xep2-fsdp": "dp 2 × ep 2 (fsdp; ep native)",
          "pp2xep2": "dp 1 × ep 2 × pp 2 (ddp; ep scratch; pp 1F1B native)"}


def _steps(run_dir: Path) -> dict[int, dict]:
    events = map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
    return {e["step"]: e for e in events if e["kind"] == "step"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Every run of :data:`RUNS`, two at a time, then the two resumes from step 2."""
    root = tmp_path_factory.mktemp("ep-runs")
    done = handle_runs(root, RUNS, COMMON, at_once=2, here=("one",))  # the reference in this process
    resumes = {"ep2-as-tp2": ("ep2-scratch", ("--set", "launch.nproc_per_node=2", "--set", "parallel.ep=1",
                                              "--set", "parallel.tp=2", "--set", "training.grad_accum=4")),
               "one-as-ep2-fsdp": ("one", ("--set", "launch.nproc_per_node=2", *EP2, "--set", "strategy.name=fsdp",
                                           "--set", "training.grad_accum=2", "--set", "parallel.ep_impl=scratch"))}
    commands = {}
    for name, (source, overrides) in resumes.items():
        stopped = root / name
        shutil.copytree(done[source], stopped)
        shutil.rmtree(stopped / "checkpoints" / "step-4")  # what a stop after step 2's checkpoint leaves
        (stopped / "events.jsonl").write_text("")
        commands[name] = ("run", "--resume", str(stopped), *overrides)
        done[name] = stopped
    for name, (code, out) in handle_at_once(commands, 2).items():
        assert code == 0, f"{name}:\n{out[-3000:]}"
    return done


@pytest.mark.parametrize("name", ["ep2-scratch", "dp2xep2-fsdp", "pp2xep2"])
def test_expert_parallel_layouts_train_as_one_process(runs, name) -> None:
    one, split = _steps(runs["one"]), _steps(runs[name])
    assert sorted(split) == sorted(one) == [1, 2, 3, 4]
    for step, ref in one.items():
        for key in ("loss", "grad_norm"):
            assert abs(split[step][key] - ref[key]) <= 1e-5 * abs(ref[key]), (name, step, key, split[step], ref)
        assert split[step]["layout"]["ep"] == 2
        # issue 31's invariant in every layout: each layer's tokens per expert add up to the step's tokens x top_k
        # (a pipeline stage's shape inference, a forward on uninitialised tensors, counted once into step 1: 3/2 of
        # it, and now and then NaN losses that dropped every step event)
        moe = split[step]["moe"]
        assert [sum(c) for c in moe["tokens_per_expert"]] == [split[step]["tokens"] * moe["top_k"]] * 2, (name, step)
    info = json.loads((runs[name] / "run.json").read_text())
    assert info["layout"]["label"] == LABELS[name]
    # the export gathers every rank's experts: the one-process model's tensors, (E, F, C) each. Within 1e-3, not
    # 1e-5: AdamW turns a gradient of rounding noise (a key bias: softmax ignores it) into steps of lr's size, while
    # an expert gathered in the wrong order would be off by the weights' own size (~0.1)
    want, got = load_file(runs["one"] / "model.safetensors"), load_file(runs[name] / "model.safetensors")
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-3, msg=lambda m: f"{name} {key}: {m}")


@pytest.mark.parametrize("name, layout", [("ep2-as-tp2", {"tp": 2}), ("one-as-ep2-fsdp", {"ep": 2})])
def test_checkpoints_resume_across_ep(runs, name, layout) -> None:
    """ep 2 -> 1 on tp 2 (whose steps check MoE under tensor parallelism too), and 1 -> ep 2 under FSDP2."""
    one, resumed = _steps(runs["one"]), _steps(runs[name])
    assert sorted(resumed) == [3, 4], name
    for step in (3, 4):
        for key in ("loss", "grad_norm"):
            assert abs(resumed[step][key] - one[step][key]) <= 1e-5 * abs(one[step][key]), (name, step, key)
        assert layout.items() <= resumed[step]["layout"].items(), resumed[step]["layout"]


@pytest.mark.parametrize("name", ["one", "ep2-scratch", "dp2xep2-fsdp", "pp2xep2"])
def test_every_expert_layout_hands_on_its_whole_model(runs, name: str) -> None:
    """model.safetensors has the one-process MoE model's every tensor (the experts gathered over "ep", every
    stage), handle generate loads it, and it equals the last checkpoint's consolidated state."""
    assert_whole_weights(runs[name])
