"""QLoRA under the sharding strategies and the pipeline: one module-scoped set of real 2-process torchrun runs (the
tiny Llama-shaped decoder of tests/test_lora_strategies.py, adapters on every linear, every block linear of the base
in NF4, fp32, dropout 0, 3 steps: the adapters' B leaves zero at step 1, so steps 2-3 compare adapted models)
against the single-process QLoRA run of the same preset in this process (grad_accum 2: the same samples per step).
fsdp (FSDP2) and DeepSpeed ZeRO-3 run dp 2 and shard every linear's ``weight_nf4`` (a frozen uint8 parameter) on
dim 0 (scratch-fsdp: tests/test_dpo.py's QLoRA runs under it, checked with this module's :func:`assert_qlora_run`);
ZeRO-2 runs dp 2 with the base whole; the pipeline runs pp 2, each stage its own layers' NF4. Each gives the single-process losses
within 1e-5; each rank's NF4 bytes hash, before the first step and after the last, to exactly its chunk of the
one-process base's bytes (unchanged, and sharded as torch.chunk cuts it); rank 0's model states equal
``handle estimate``'s to the byte, its NF4 base at most 0.55x the one-process base when sharded; every run's
adapters export (peft's format, and merged) as the one-process run's; and the fsdp run resumed from its step-2
checkpoint (the base quantised again and resharded) repeats step 3 exactly."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import handle_at_once
from tests.test_distributed import events, step_losses
from tests.test_lora_strategies import _preset_text, assert_exports_match, strategy_runs

pytestmark = pytest.mark.dist

STRATEGIES = {"fsdp": ["strategy.name=fsdp", "training.checkpoint_every=2"],
              "zero2": ["strategy.name=deepspeed", "strategy.zero_stage=2"],
              "zero3": ["strategy.name=deepspeed", "strategy.zero_stage=3"],
              "pp": ["parallel.pp=2", "parallel.pp_impl=scratch", "training.grad_accum=2"]}
SHARDED = ("fsdp", "scratch-fsdp", "zero3", "resumed")  # scratch-fsdp: assert_qlora_run's callers
"""The runs whose NF4 base is sharded ("resumed": the fsdp run resumed from its step-2 checkpoint)."""
STEPS = 3


@pytest.fixture(scope="module")
def qlora_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qlora")
    path = root / "qlora.toml"
    text = _preset_text(root / "runs").replace('method = "lora"', 'method = "qlora"')
    path.write_text(text.replace("steps = 4", f"steps = {STEPS}"))
    runs = strategy_runs(path, root, STRATEGIES)
    # the fsdp run again from its step-2 checkpoint: the base quantised again from the hash-checked one, resharded
    resumed = root / "resumed"
    shutil.copytree(runs["fsdp"], resumed)
    shutil.rmtree(resumed / "checkpoints" / f"step-{STEPS}")
    (code, out), = handle_at_once({"resumed": ("run", "--resume", str(resumed))}, at_once=1).values()
    assert code == 0, out[-3000:]
    return {**runs, "resumed": resumed}


@pytest.fixture(scope="module")
def base(qlora_runs) -> torch.nn.Module:
    """The one-process QLoRA model rebuilt from the single run (its base quantised again, hash-checked)."""
    from torch_handle.infer.generate import load_run

    return load_run(qlora_runs["single"]).model


def test_the_preset_is_qlora_for_steps(qlora_runs):
    reference = step_losses(qlora_runs["single"])
    assert sorted(reference) == list(range(1, STEPS + 1))
    text = (qlora_runs["fsdp"] / "preset.toml").read_text()
    assert 'method = "qlora"' in text and "dropout = 0.0" in text


def test_every_layout_gives_the_single_process_losses(qlora_runs):
    reference = step_losses(qlora_runs["single"])
    for name in STRATEGIES:
        losses = step_losses(qlora_runs[name])
        assert sorted(losses) == sorted(reference), name
        worst = max(abs(losses[s] - reference[s]) for s in reference)
        assert worst <= 1e-5, f"{name}: losses differ from the single process's by up to {worst:.2e}"


def test_a_resumed_sharded_run_continues_exactly(qlora_runs):
    """Resumed from step 2, the fsdp run's step 3 repeats the uninterrupted loss bit for bit."""
    steps = [e for e in events(qlora_runs["resumed"], "step")]
    assert [e["step"] for e in steps] == [1, 2, 3, 3]
    assert steps[-1]["loss"] == steps[2]["loss"] == step_losses(qlora_runs["fsdp"])[3]


def _digest(chunks: list[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in chunks:
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_each_rank_holds_its_chunk_of_the_nf4_base_unchanged(qlora_runs, base):
    """Every run's ranks hold their chunk of the one-process base's NF4 bytes, unchanged (:func:`assert_nf4_chunks`)."""
    for name, run in qlora_runs.items():
        assert_nf4_chunks(run, name, base)


def assert_nf4_chunks(run: Path, name: str, base: torch.nn.Module) -> None:
    """run.json's ``nf4_sha256`` of the run at ``run`` (``name``: "single", "pp", "zero2" or one of :data:`SHARDED`):
    per rank, the hash of its NF4 bytes before the first step and after the last. They are equal (training moved no
    code), and equal to the hash of that rank's chunk of the one-process ``base``'s ``weight_nf4`` tensors:
    torch.chunk(2)[rank] of each under the sharding strategies, the rank's own layer's under pp 2, the whole under
    ZeRO-2 and the single process."""
    from torch_handle.finetune.nf4 import nf4_storage

    storage = nf4_storage(base)
    hashes = json.loads((run / "run.json").read_text())["nf4_sha256"]
    assert hashes["start"] == hashes["end"], name
    if name == "single":
        want = [_digest(storage)]
    elif name == "pp":
        want = [_digest(nf4_storage(layer)) for layer in base.layers]
    elif name == "zero2":  # ZeRO-2 partitions the optimizer's (the adapters'), not the frozen parameters
        want = [_digest(storage)] * 2
    else:
        assert name in SHARDED, name
        want = [_digest([t.chunk(2)[rank] for t in storage]) for rank in range(2)]
    assert hashes["end"] == want, name


def test_rank_memory_is_the_estimate_to_the_byte(qlora_runs, base):
    """Every run's rank 0 against ``handle estimate`` of its preset (:func:`assert_nf4_estimate`)."""
    for name, run in qlora_runs.items():
        assert_nf4_estimate(run, name, base)


def assert_nf4_estimate(run: Path, name: str, base: torch.nn.Module) -> None:
    """``handle estimate`` of the run's own preset.toml, rank 0 (``name`` as :func:`assert_nf4_chunks`'s): trainable
    and frozen parameter bytes (the NF4 base among the frozen), gradients and optimizer state equal its memory
    telemetry exactly; its ``nf4_bytes`` equal what rank 0 stores (run.json's ``nf4_bytes``, per rank: its chunks of
    the one-process ``base``'s bytes), at most 0.55x the whole base when sharded."""
    from torch_handle.config.loader import load_preset
    from torch_handle.finetune.nf4 import nf4_storage
    from torch_handle.plan.estimate import estimate_preset
    from torch_handle.registry import get_registry

    registry = get_registry()
    whole = sum(t.numel() for t in nf4_storage(base))
    keys = ("trainable_param_bytes", "frozen_param_bytes", "grad_bytes", "optimizer_bytes")
    step = [e for e in events(run, "step") if "memory" in e][-1]
    world = 1 if name == "single" else 2
    rows = estimate_preset(load_preset(run / "preset.toml", [], registry), registry, [world], rank=0)
    for row in rows:
        estimated = {k: row.as_dict()[k] for k in keys}
        assert estimated == {k: step["memory"][row.rank][k] for k in keys}, (name, row.rank)
    held = json.loads((run / "run.json").read_text())["nf4_bytes"]  # what each rank stores
    if name in SHARDED:
        assert held == [sum(t.chunk(2)[rank].numel() for t in nf4_storage(base)) for rank in range(2)], name
        assert rows[0].nf4_layout == "sharded" and rows[0].nf4_bytes == held[0]
        assert rows[0].nf4_bytes == sum(t.chunk(2)[0].numel() for t in nf4_storage(base)) <= 0.55 * whole
    elif name == "pp":
        assert [r.nf4_bytes for r in rows] == held == [sum(t.numel() for t in nf4_storage(la))
                                                       for la in base.layers]
    else:
        assert rows[0].nf4_bytes == whole and held == [whole] * world


def assert_qlora_run(run: Path, single: Path, strategy: str, tmp_path: Path) -> None:
    """This module's checks of a 2-rank QLoRA run at ``run`` under a sharding ``strategy`` (scratch-fsdp:
    tests/test_dpo.py's run) against its single-process run ``single`` (the losses are the caller's): each rank's
    chunk of the NF4 base unchanged, rank 0's memory the estimate to the byte, and the adapters exported (peft's
    format, and merged) as the single process's."""
    from torch_handle.infer.generate import load_run

    base = load_run(single).model  # the one-process QLoRA model: its base quantised again, hash-checked
    assert_nf4_chunks(run, strategy, base)
    assert_nf4_estimate(run, strategy, base)
    assert_exports_match({"single": single, strategy: run}, strategy, tmp_path)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_layout_exports_the_one_process_adapters(qlora_runs, name, tmp_path):
    """The run's peft export (adapters alone) and merged export (the dequantised base with the adapters folded
    in) match the single process's."""
    assert_exports_match(qlora_runs, name, tmp_path)
