"""Supervised fine-tuning on conversations under real torchrun workers (issue 46, done-when 3): every
data-parallel strategy (ddp, fsdp, scratch-fsdp, DeepSpeed ZeRO-2/3) on 2 ranks gives the single-process losses
within 1e-5 (fp32, 10 steps, the same global batch of packed conversations, the loss the global batch's mean over
its trained tokens), each strategy once and each of the three methods (full, LoRA, QLoRA) among them. The single-process runs, one
a method, run in this process (:func:`single_runs`). tests/test_dpo.py runs the DPO matrix with the same helpers
(the matrix of both: docs/fine-tuning.md); tests/test_lora_strategies.py and tests/test_qlora_strategies.py run
LoRA and QLoRA under every strategy and layout on plain text, LoRA under ZeRO-3 and scratch-fsdp excepted: their
checks run here on the LoRA runs of this matrix (:func:`test_lora_under_a_sharding_strategy`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[dev,hf]'")

from tests.helpers import handle_at_once  # noqa: E402

pytestmark = pytest.mark.dist

STEPS = 10
STRATEGY = {"ddp": ("strategy.name=ddp",), "fsdp": ("strategy.name=fsdp",),
            "scratch-fsdp": ("strategy.name=scratch-fsdp",),
            "zero2": ("strategy.name=deepspeed", "strategy.zero_stage=2"),
            "zero3": ("strategy.name=deepspeed", "strategy.zero_stage=3")}
"""The data-parallel strategies: name -> ``--set`` overrides."""
METHOD = {"full": ("finetune.method=none",), "lora": ("finetune.method=lora",),
          "qlora": ("finetune.method=qlora",)}
"""The fine-tuning methods: name -> ``--set`` overrides (LoRA's rank and targets are the preset's)."""
SFT_RUNS = (("ddp", "qlora"), ("fsdp", "full"), ("scratch-fsdp", "lora"), ("zero2", "full"), ("zero3", "lora"))
"""(strategy, method) of the 2-rank SFT runs; tests/test_dpo.py's DPO_RUNS fills most of the other cells."""
SFT = ("finetune.rank=4", "finetune.alpha=8.0", 'finetune.target_modules=["all"]', "training.eval_every=0",
       "training.lr=0.01")


def launched(preset: Path, runs: tuple[tuple[str, str], ...], overrides: tuple[str, ...], root: Path,
             methods: dict[str, tuple[str, ...]] = METHOD) -> dict[tuple[str, str], Path]:
    """``handle run`` of ``preset`` with ``overrides`` on 2 processes, grad_accum 1 (the single process's grad_accum
    2 over the same samples), once per (strategy, method) of ``runs``, two runs at a time (a tiny run is mostly
    process start-up, which overlaps), each under an output directory and a cache of its own (nothing derived, a
    precomputed DPO reference say, read from another run): (strategy, method) -> its run directory. ``methods``:
    each method's overrides (:data:`METHOD`)."""
    from torch_handle.data.cache import CACHE_ENV

    env = {k: v for k, v in os.environ.items() if k != CACHE_ENV}
    env["TORCH_EXTENSIONS_DIR"] = str(root / "torch_extensions")
    commands = {(s, m): ("run", str(preset), *[a for o in (*overrides, f"run.name={s}-{m}", *STRATEGY[s], *methods[m],
                                                             f"run.output_dir={root / 'runs' / f'{s}-{m}'}",
                                                             "launch.nproc_per_node=2", "training.grad_accum=1")
                                                for a in ("--set", o)])
                for s, m in runs}
    out = {}
    for key, (code, text) in handle_at_once(commands, at_once=2, env=env).items():
        assert code == 0, f"{key}:\n{text[-3000:]}"
        out[key] = Path(next(ln for ln in text.splitlines() if ln.startswith("run directory: ")).split(": ", 1)[1])
    return out


def steps_of(run_dir: Path) -> list[dict]:
    """The step events of the run at ``run_dir``."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["kind"] == "step"]


def single_runs(preset: Path, overrides: tuple[str, ...], root: Path, methods: dict[str, tuple[str, ...]] = METHOD
                ) -> dict[tuple[str, str], Path]:
    """The single-process run of ``preset`` with ``overrides`` (grad_accum 2) once per method of ``methods`` (name ->
    its overrides: :data:`METHOD`), in this process (a gloo group of world size 1, as tests/unit/test_trainer_step.py
    trains): ("single", method) -> its run directory."""
    import torch
    import torch.distributed as dist

    from tests.unit.test_trainer_step import _train
    from torch_handle.config.loader import dump_preset, load_preset
    from torch_handle.rundir import create_run_dir
    from torch_handle.train.strategy import DistContext

    out = {}
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=0, world_size=1)
    try:
        for method, sets in methods.items():
            loaded = load_preset(preset, [*overrides, *sets, f"run.name=single-{method}",
                                          "strategy.name=single", "launch.nproc_per_node=1", "training.grad_accum=2"])
            run_dir = create_run_dir(root / "runs", f"single-{method}", dump_preset(loaded), {"status": "starting"})
            assert _train(loaded, run_dir, DistContext(0, 0, 1, torch.device("cpu"), "gloo")) == "finished"
            out[("single", method)] = run_dir
    finally:
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(strategy, method) -> the run directory of its 2-rank run, and ("single", method) -> the single process's."""
    from tests.test_sft import preset_file, write_base, write_conversations

    root = tmp_path_factory.mktemp("sft-strategies")
    base = write_base(root / "base")
    write_conversations(root, base)
    preset = preset_file(root, (base, root / "data"), micro_batch_size=2, grad_accum=2, steps=STEPS)
    return {**single_runs(preset, SFT, root), **launched(preset, SFT_RUNS, SFT, root)}


@pytest.fixture(scope="module")
def sft_steps(sft_runs) -> dict:
    """(strategy, method) -> the step events of its 2-rank run, and ("single", method) -> the single process's."""
    return {key: steps_of(run_dir) for key, run_dir in sft_runs.items()}


def assert_matrix(runs: tuple[tuple[str, str], ...]) -> None:
    """``runs`` (strategy, method) hold every strategy of :data:`STRATEGY` once, and each method of :data:`METHOD`
    (one launch a strategy: each costs about 9 CPU seconds of process start-up)."""
    assert sorted(s for s, _ in runs) == sorted(STRATEGY)
    assert {m for _, m in runs} == set(METHOD)


def assert_single_losses(steps: list[dict], single: list[dict]) -> None:
    """The step events ``steps`` of a 2-rank run: the single process's (``single``) losses within 1e-5, step for
    step, over the same trained tokens, and :data:`STEPS` of them."""
    assert len(single) == len(steps) == STEPS
    assert [e["loss"] for e in steps] == pytest.approx([e["loss"] for e in single], abs=1e-5)
    assert [e["trained_tokens"] for e in steps] == [e["trained_tokens"] for e in single]


def test_the_matrix_runs_every_strategy_and_each_method():
    assert_matrix(SFT_RUNS)


@pytest.mark.parametrize("run", SFT_RUNS, ids=[f"{s}-{m}" for s, m in SFT_RUNS])
def test_two_ranks_give_the_single_process_losses(sft_steps, run):
    single = sft_steps[("single", run[1])]
    assert_single_losses(sft_steps[run], single)
    assert single[0]["loss"] != pytest.approx(single[-1]["loss"], abs=1e-3)  # it trains


def test_the_methods_train_differently(sft_steps):
    """The single-process runs start from the same base (full and LoRA at the same loss, QLoRA's NF4 base off it)
    and part: each method is what its runs compare."""
    first = {m: sft_steps[("single", m)][0]["loss"] for m in METHOD}
    last = {m: sft_steps[("single", m)][-1]["loss"] for m in METHOD}
    assert first["full"] == pytest.approx(first["lora"], abs=1e-6) and abs(first["qlora"] - first["lora"]) > 1e-5
    assert abs(last["full"] - last["lora"]) > 1e-3, last


@pytest.mark.parametrize("strategy", ["zero3", "scratch-fsdp"])
def test_lora_under_a_sharding_strategy(sft_runs, strategy):
    """The LoRA runs under ZeRO-3 and scratch-fsdp are tests/test_lora_strategies.py's cells for those strategies
    (it runs the others): the whole model handed on, the adapters alone over the unchanged base, optimizer state for
    the rank's share of the adapters alone, and ``handle estimate`` to the byte (its :func:`assert_lora_run`)."""
    from tests.test_lora_strategies import assert_lora_run

    assert_lora_run(sft_runs[(strategy, "lora")], sft_runs[("single", "lora")], strategy)
