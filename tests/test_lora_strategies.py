"""LoRA under the strategies and layouts: one module-scoped set of real 2-process torchrun runs (tiny Llama-shaped
decoder, adapters on every linear, fp32, dropout 0, 4 steps: the adapters' B leaves zero at step 1, so steps 2-4
compare adapted models) against the single-process run of the same preset in this process (grad_accum 2: the same
samples per step). The data-parallel strategies (fsdp, scratch-ddp's ZeRO-1) run dp 2 (LoRA under ddp and ZeRO-2:
the SFT and DPO matrices of tests/test_sft_strategies.py and tests/test_dpo.py; under ZeRO-3 and scratch-fsdp: the
SFT matrix's LoRA runs, which tests/test_sft_strategies.py checks with this module's assertions, :func:`assert_lora_run`);
tensor parallelism (hand-written and DTensor) and the pipeline run dp 1 with grad_accum 2. Each gives the
single-process losses within 1e-5, leaves every frozen base weight bitwise as it started (the final weights are
the adapters; the base is rebuilt from the seed and compared), holds optimizer state for the adapters alone (per
rank exactly what the accounting of the trainable parameters says for its strategy and split), and exports
(peft's format, and merged) the one-process files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.test_distributed import events, step_losses
from tests.helpers import handle_at_once, tiny_preset

pytestmark = pytest.mark.dist

LLAMA = """
[model]
d_model = 64
n_heads = 4
n_layers = 2
d_ff = 128
dropout = 0.0
norm = "rmsnorm"
position = "rope"
mlp = "swiglu"
bias = false
scale_embeddings = false
norm_first = true
[finetune]
method = "lora"
rank = 4
alpha = 8.0
target_modules = ["all"]
"""
STRATEGIES = {"fsdp": ["strategy.name=fsdp"],
              "scratch-zero1": ["strategy.name=scratch-ddp", "strategy.shard_optimizer=true"],
              "tp-scratch": ["parallel.tp=2", "parallel.tp_impl=scratch", "training.grad_accum=2"],
              "tp-native": ["parallel.tp=2", "parallel.tp_impl=native", "strategy.name=fsdp", "training.grad_accum=2"],
              "pp": ["parallel.pp=2", "parallel.pp_impl=scratch", "training.grad_accum=2"]}
STEPS = 4
COLUMN_PARALLEL, ROW_PARALLEL = (".qkv_proj.", ".gate_proj.", ".up_proj."), (".out_proj.", ".down_proj.")


def _preset_text(output_dir: Path) -> str:
    text = tiny_preset(output_dir, steps=STEPS)
    text = text.replace("[model]\nd_model = 64\nn_heads = 4\nn_layers = 2\nd_ff = 128\n", LLAMA)
    return text.replace("log_every = 5", "log_every = 10\neval_steps = 1\nlr = 0.01")


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    path = root / "lora.toml"
    path.write_text(_preset_text(root / "runs"))
    return strategy_runs(path, root, STRATEGIES)


def strategy_runs(path: Path, root: Path, strategies: dict[str, list[str]]) -> dict[str, Path]:
    """``handle run`` of the preset at ``path`` once per entry of ``strategies`` (name -> its ``--set``
    overrides), and the single-process reference (:func:`_single`) as ``"single"``: name -> run directory."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions")}
    # two at a time: a tiny 2-process run is mostly process start-up (imports, rendezvous), which overlaps
    commands = {name: ("run", str(path), *[x for s in [f"run.name={name}", *sets] for x in ("--set", s)])
                for name, sets in strategies.items()}
    runs = {}
    for name, (code, out) in handle_at_once(commands, at_once=2, env=env).items():
        assert code == 0, f"{name}:\n{out[-3000:]}"
        runs[name] = Path(next(ln for ln in out.splitlines() if ln.startswith("run directory: ")).split(": ", 1)[1])
    runs["single"] = _single(path, root)
    return runs


def _single(path: Path, root: Path) -> Path:
    """The reference: the same preset on one process (this one), micro-batches of 4 accumulated twice."""
    from torch_handle.config.loader import dump_preset, load_preset
    from torch_handle.registry import get_registry
    from torch_handle.rundir import create_run_dir
    from torch_handle.train.strategy import DistContext
    from torch_handle.train.trainer import Trainer
    from torch_handle.launch.run import prepare_data

    preset = load_preset(path, overrides=["strategy.name=single", "launch.nproc_per_node=1",
                                          "training.grad_accum=2", "run.name=single"])
    run_dir = create_run_dir(root / "runs", "single", dump_preset(preset), {"status": "starting"})
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=0, world_size=1)
    try:
        prepare_data(preset)  # what the launcher does before the workers start
        trainer = Trainer(preset, run_dir, DistContext(0, 0, 1, torch.device("cpu"), "gloo"), get_registry())
        trainer.build()
        status = trainer.train()
        trainer.close(status)
    finally:
        dist.destroy_process_group()
    return run_dir


def test_every_strategy_gives_the_single_process_losses(lora_runs):
    reference = step_losses(lora_runs["single"])
    assert sorted(reference) == list(range(1, STEPS + 1))
    for name in STRATEGIES:
        losses = step_losses(lora_runs[name])
        worst = max(abs(losses[s] - reference[s]) for s in reference)
        assert worst <= 1e-5, f"{name}: losses differ from the single process's by up to {worst:.2e}"


@pytest.mark.parametrize("name", ["single", *STRATEGIES])
def test_every_layout_hands_on_its_whole_model(lora_runs, name) -> None:
    """model.safetensors has the one-process tensors (base and adapters), handle generate loads it, and it equals
    the last checkpoint's consolidated state (tests/whole_weights.py)."""
    from tests.whole_weights import assert_whole_weights

    assert_whole_weights(lora_runs[name])


def test_the_base_stays_bitwise_as_it_started(lora_runs):
    """Every run's final weights hold the adapters and the base's hash; the base rebuilt from the seed (what every
    rank froze) has that hash, and the adapters' own B moved away from zero."""
    assert len({base_hash(run_dir) for run_dir in lora_runs.values()}) == 1


def base_hash(run_dir: Path) -> bytes:
    """The run's final weights hold the adapters alone (and the base's hash), the adapters' B moved away from
    zero, and the base rebuilt as the run's ranks froze it (from the seed, or ``model.init_from``) has that hash:
    the hash."""
    from safetensors.torch import load_file

    from torch_handle.finetune.lora import BASE_HASH_BUFFER
    from torch_handle.infer.generate import load_run

    state = load_file(str(run_dir / "model.safetensors"))
    assert all(".lora_" in k for k in state if k != BASE_HASH_BUFFER), run_dir
    assert any(k.endswith("lora_B.default.weight") and t.abs().sum() > 0 for k, t in state.items()), run_dir
    load_run(run_dir)  # rebuilds the base and checks it against the hash: raises if it differs
    return bytes(state[BASE_HASH_BUFFER].tolist())


def test_optimizer_bytes_are_the_adapters_alone(lora_runs):
    """AdamW: exp_avg and exp_avg_sq (8 bytes per trainable parameter) and a 4-byte step per tensor; FSDP2 and
    ZeRO-1 shard the 8 bytes (:func:`assert_sharded_optimizer_bytes`); tp 2 halves the split adapters, pp 2 keeps
    each stage's own. Nothing for the frozen base (13x the adapters here)."""
    adapters = list(_adapters(lora_runs["single"]).values())
    n, tensors = sum(t.numel() for t in adapters), len(adapters)
    memory = {name: last_memory(run) for name, run in lora_runs.items()}
    assert memory["single"][0]["optimizer_bytes"] == 8 * n + 4 * tensors
    assert_sharded_optimizer_bytes(lora_runs["fsdp"], "fsdp", lora_runs["single"])
    owned = [m["optimizer_bytes"] for m in memory["scratch-zero1"]]  # ZeRO-1: whole tensors, balanced by size
    assert sum(owned) == 8 * n + 4 * tensors and max(owned) <= 0.55 * sum(owned), owned
    # tp 2: B of a column-parallel linear and A of a row-parallel one split in half, the other adapter whole
    split = sum(t.numel() for k, t in _adapters(lora_runs["single"]).items()
                if (".lora_B." in k and any(c in k for c in COLUMN_PARALLEL))
                or (".lora_A." in k and any(r in k for r in ROW_PARALLEL)))
    assert 0 < split < n
    for name in ("tp-scratch", "tp-native"):
        assert [m["optimizer_bytes"] for m in memory[name]] == [8 * (n - split // 2) + 4 * tensors] * 2, name
    # pp 2: each stage steps its own layer's adapters (the embedding and the head, on the two ends, have none)
    assert [m["optimizer_bytes"] for m in memory["pp"]] == [(8 * n + 4 * tensors) // 2] * 2


def last_memory(run_dir: Path) -> list[dict]:
    """Every rank's memory telemetry at the run's last memory-logging step."""
    return [e for e in events(run_dir, "step") if "memory" in e][-1]["memory"]


def assert_sharded_optimizer_bytes(run_dir: Path, strategy: str, single: Path) -> None:
    """The 2-rank run at ``run_dir`` under ``strategy`` (fsdp, scratch-fsdp or zero3) holds optimizer state for its
    share of the adapters of the single-process run at ``single`` alone: DeepSpeed ZeRO-3 half of its 12 bytes per
    adapter parameter (its fp32 master copy beside AdamW's moments) and one 4-byte step; FSDP2 and scratch-fsdp (per
    parameter) half of each tensor's 8 bytes of moments (the widths are even) and every step counter."""
    adapters = list(_adapters(single).values())
    n, tensors = sum(t.numel() for t in adapters), len(adapters)
    want = {"zero3": 12 * n // 2 + 4, "fsdp": 8 * n // 2 + 4 * tensors, "scratch-fsdp": 8 * n // 2 + 4 * tensors}
    assert [m["optimizer_bytes"] for m in last_memory(run_dir)] == [want[strategy]] * 2, strategy
    if strategy == "zero3":
        info = json.loads((run_dir / "run.json").read_text())
        assert info["zero_stage"] == 3 and info["world_size"] == 2


def _adapters(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from torch_handle.finetune.lora import BASE_HASH_BUFFER

    return {k: t for k, t in load_file(str(run_dir / "model.safetensors")).items() if k != BASE_HASH_BUFFER}


@pytest.mark.parametrize("name", ["tp-scratch", "tp-native", "pp"])
def test_a_split_run_exports_the_one_process_files(lora_runs, name, tmp_path):
    """The split run's final weights are the one-process adapters (gathered over the TP ranks / joined from the
    stages, under the one-process names): its peft export and its merged export match the single process's."""
    assert_exports_match(lora_runs, name, tmp_path)


def assert_exports_match(runs: dict[str, Path], name: str, tmp_path: Path) -> None:
    """Run ``name``'s peft export and merged export equal the single run's, file for file and tensor for
    tensor."""
    from safetensors.torch import load_file

    from torch_handle.infer.adapter_export import export_run

    for merge in (False, True):
        files = {}
        for run in ("single", name):
            out = tmp_path / f"{run}-{merge}"
            export_run(runs[run], out, merge=merge)
            files[run] = {f.name: f for f in out.iterdir()}
        assert files["single"].keys() == files[name].keys()
        tensors = [f for f in files["single"] if f.endswith(".safetensors")]
        assert tensors, files["single"]
        for file in tensors:
            want, got = load_file(str(files["single"][file])), load_file(str(files[name][file]))
            assert want.keys() == got.keys(), (name, file)
            assert any("lora_B" in k for k in want) != merge, file  # merged: no adapters left; peft: adapters
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6, msg=f"{name} {file} {key}")


def test_the_estimate_is_the_telemetry_to_the_byte(lora_runs):
    """``handle estimate`` of each run's own preset.toml is its rank 0's telemetry to the byte
    (:func:`assert_estimate_is_telemetry`): one process (the base whole), FSDP2 (the base sharded like any
    parameter), tp 2 (base and adapters split by the plan), pp 2 (each stage's own layers, the tied embedding on
    both ends)."""
    for name in ("single", "fsdp", "tp-scratch", "tp-native", "pp"):
        assert_estimate_is_telemetry(lora_runs[name], 1 if name == "single" else 2, stages=2 if name == "pp" else 1)


def assert_estimate_is_telemetry(run: Path, world_size: int, stages: int = 1) -> None:
    """``handle estimate`` of the LoRA run's own preset.toml on ``world_size`` ranks: rank 0's trainable and frozen
    parameter bytes, gradients and optimizer state equal its memory telemetry exactly (ZeRO-3: the base sharded
    like any parameter; scratch-fsdp: each rank's rows of every frozen tensor), one row per pipeline stage
    (``stages``), and its FLOPs per token are what the run's tflops counts (LoRA's: 4 per frozen matmul weight)."""
    from torch_handle.config.loader import load_preset
    from torch_handle.plan.estimate import estimate_preset
    from torch_handle.registry import get_registry

    registry = get_registry()
    keys = ("trainable_param_bytes", "frozen_param_bytes", "grad_bytes", "optimizer_bytes")
    step = [e for e in events(run, "step") if "memory" in e][-1]
    rows = estimate_preset(load_preset(run / "preset.toml", [], registry), registry, [world_size], rank=0)
    assert len(rows) == stages, run
    for row in rows:
        estimated = {k: row.as_dict()[k] for k in keys}
        assert estimated == {k: step["memory"][row.rank][k] for k in keys}, (run, row.rank)
        assert 0 < estimated["trainable_param_bytes"] < estimated["frozen_param_bytes"] / 5, run
        assert row.finetune["flops_per_token"] == pytest.approx(step["tflops"] * 1e12 / step["tokens_per_s"],
                                                                rel=1e-9), run


def assert_lora_run(run: Path, single: Path, strategy: str) -> None:
    """This module's checks of a 2-rank LoRA run at ``run`` under a sharding ``strategy`` (zero3 or scratch-fsdp:
    tests/test_sft_strategies.py's runs) against its single-process run ``single`` (the losses are the caller's):
    the whole model handed on, the adapters alone in the final weights over the unchanged base, optimizer state
    for its share of the adapters alone, and the estimate to the byte."""
    from tests.whole_weights import assert_whole_weights

    assert_whole_weights(run)
    assert base_hash(run) == base_hash(single)
    assert_sharded_optimizer_bytes(run, strategy, single)
    assert_estimate_is_telemetry(run, 2)
