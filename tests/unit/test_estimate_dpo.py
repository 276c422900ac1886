"""``handle estimate`` of a DPO preset (``finetune.objective = "dpo"``, issue 47): a micro-batch of B pairs is one
forward of 2B rows of ``seq_len`` positions (chosen and rejected), priced as such; the reference's forward
(adapters off, under ``no_grad``, before the policy's) saves nothing. A real LoRA DPO micro-batch, policy and
reference forwards as :class:`~torch_handle.train.objectives.pairs.DirectPreference` runs them, saves the
estimate's bytes. In-process: a small tokenizer, 24 pairs built from Multi30k translations."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from handle_cli.main import cli
from tests.unit.test_estimate_sft import PRESET as SFT_PRESET
from tests.unit.test_estimate_sft import translations
from torch_handle.config.loader import load_preset
from torch_handle.data.chat.pair_samples import PreferencePairs
from torch_handle.data.chat.pairs import prepare_preference
from torch_handle.data.shards import open_prepared
from torch_handle.plan.estimate import estimate_preset
from torch_handle.plan.estimate_activations import saved_activation_bytes
from torch_handle.plan.estimate_model import build_model, model_build
from torch_handle.registry import get_registry
from torch_handle.train.objectives import objective_for

SEQ, PAIRS = 96, 2
PRESET = SFT_PRESET.replace('precision = "fp32"\n', 'precision = "fp32"\nloss_impl = "full"\n').replace(
    'objective = "sft"', 'method = "lora"\nrank = 4\ndropout = 0.0\ntarget_modules = ["all"]\nobjective = "dpo"')
"""The SFT estimate's tiny decoder, LoRA on every linear, micro_batch_size 2 (pairs)."""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dpo-estimate")
    en, de = translations(root)
    rows = root / "pairs.jsonl"  # chosen: the translation; rejected: the next sentence's
    rows.write_text("".join(json.dumps({"prompt": f"Translate to German: {e}", "chosen": d, "rejected": de[i - 1]})
                            + "\n" for i, (e, d) in enumerate(zip(en, de))), encoding="utf-8")
    prepare_preference([str(rows)], root / "data", tokenizer=root / "tokenizer.json", template="chatml",
                       valid_fraction=0.25, max_len=SEQ)
    (root / "dpo.toml").write_text(PRESET.format(data=root / "data", seq=SEQ), encoding="utf-8")
    return root


def test_the_estimate_prices_what_a_dpo_micro_batch_saves(prepared):
    """2B rows through the policy, then the reference (adapters off, no_grad): the bytes saved are the estimate's;
    an LM preset of the same B prices half the rows, and a precomputed reference (no forward) prices the same."""
    preset = load_preset(prepared / "dpo.toml")
    registry = get_registry()
    row = estimate_preset(preset, registry, [1])[0]
    data = open_prepared(prepared / "data")
    pairs = PreferencePairs(data.train, SEQ, fill_id=data.eos_id)
    items = [pairs[i] for i in range(PAIRS)]
    batch = {k: torch.stack([item[k] for item in items]) for k in items[0]}  # (B, 2, T)
    assert batch["input_ids"].shape == (PAIRS, 2, SEQ)
    torch.manual_seed(0)
    model = build_model(model_build(preset, registry)).train()
    objective = objective_for(preset)
    assert objective.reference == "adapters_off"
    strategy = SimpleNamespace(model=model, unwrapped=lambda: model,
                               autocast=lambda: torch.autocast("cpu", enabled=False))
    ctx = SimpleNamespace(tp_rank=0, cp_rank=0, cp_size=1)  # one process: no tp, no cp
    trainer = SimpleNamespace(strategy=strategy, loss_impl="full", ctx=ctx, share=None,
                              training=preset.training, aux_loss_scale=SimpleNamespace(probe=lambda loss: loss))

    def step():
        loss, counted = objective.forward_loss(trainer, dict(batch))
        assert int(counted) == PAIRS
        loss.backward()

    saved = saved_activation_bytes(step, model)
    # the estimate's loss is the token mean over the 2B rows; the pair loss adds its own (B,) tensors (the sigmoid
    # loss: 4 fp32 a pair, 32 bytes here), and the CPU's chunked per-row cross-entropy (kernels.token_cross_entropy)
    # its (2B·T,) bool mask of labelled positions and their count beside what F.cross_entropy saves; the estimate
    # leaves both out: ≤ 16 bytes a pair and 1 byte a position (+ 8) of 1.3 MB
    extra = 16 * PAIRS + 2 * PAIRS * SEQ + 8
    assert 0 <= saved - row.activation.saved <= extra, (row.activation.saved, saved)
    lm = estimate_preset(load_preset(prepared / "dpo.toml", ["finetune.objective=lm"]), registry, [1])[0]
    assert row.activation.saved > 1.9 * lm.activation.saved  # twice the rows (the lm row adds no pair tail)
    # two fp32 (2B·T, V) buffers beside the saved log-probabilities (full_loss_bytes)
    assert row.activation.logits == 2 * lm.activation.logits == 2 * 2 * PAIRS * SEQ * model.lm_head.weight.shape[0] * 4
    precomputed = estimate_preset(load_preset(prepared / "dpo.toml", ["finetune.preference.reference=precomputed"]),
                                  registry, [1])[0]
    assert precomputed.activation == row.activation


def test_the_cli_says_what_a_dpo_estimate_assumes(prepared):
    result = CliRunner().invoke(cli, ["estimate", str(prepared / "dpo.toml"), "--nproc", "1"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"dpo: each micro-batch is {PAIRS} pair(s), one forward of {2 * PAIRS} rows of {SEQ} positions" in text
    assert "reference (adapters_off)" in text
    result = CliRunner().invoke(cli, ["estimate", str(prepared / "dpo.toml"), "--nproc", "1", "--json"])
    assert result.exit_code == 0 and json.loads(result.output.splitlines()[0])["objective"] == "dpo"


def test_the_estimate_prices_each_reference(prepared):
    """A full fine-tune's ``copy`` holds the policy's parameters as the strategy shards them (whole on one process,
    half each under fsdp on 2) and nothing else; ``precomputed`` the table (16 bytes a pair of both splits);
    adapters off and a reference-free loss nothing. Each is part of the rank's device total."""
    registry = get_registry()
    full = ["finetune.method=none"]

    def row(*overrides: str, world: int = 1):
        return estimate_preset(load_preset(prepared / "dpo.toml", [*overrides]), registry, [world])[0]

    copy, precomputed = row(*full, "finetune.preference.reference=copy"), row(*full)
    data = open_prepared(prepared / "data")
    pairs = len(PreferencePairs(data.train, SEQ)) + len(PreferencePairs(data.valid, SEQ))
    assert precomputed.reference == "precomputed" and precomputed.reference_bytes == 16 * pairs > 0
    assert copy.reference == "copy" and copy.reference_bytes == copy.param_bytes > 1000 * pairs
    assert copy.device_bytes - precomputed.device_bytes == copy.param_bytes - 16 * pairs
    assert (copy.grad_bytes, copy.optimizer_bytes, copy.activation) == (precomputed.grad_bytes,
                                                                        precomputed.optimizer_bytes,
                                                                        precomputed.activation)
    sharded = row(*full, "finetune.preference.reference=copy", "strategy.name=fsdp", world=2)
    assert sharded.reference_bytes == sharded.param_bytes <= copy.param_bytes // 2 + 4096
    lora = row()
    assert (lora.reference, lora.reference_bytes) == ("adapters_off", 0)
    assert (row("finetune.preference.loss=simpo").reference_bytes, row(*full).as_dict()["reference"]) == (
        0, "precomputed")
    assert "reference" not in estimate_preset(load_preset(prepared / "dpo.toml", ["finetune.objective=lm"]),
                                              registry, [1])[0].as_dict()
    result = CliRunner().invoke(cli, ["estimate", str(prepared / "dpo.toml"), "--nproc", "1", "--set",
                                      "finetune.method=none", "--set", "finetune.preference.reference=copy"])
    assert result.exit_code == 0, result.output
    assert "the reference (copy) is a frozen copy of the model held as the strategy holds the policy's " \
           "parameters" in " ".join(result.output.split())


def test_the_estimate_prices_dpo_under_tp_and_pp(prepared):
    """tp 2: each TP rank holds half the vocabulary's logits of the micro-batch's 2B rows; pp 2: the last stage
    holds the logits of a pipeline micro-batch's rows, two per pair (the first stage none)."""
    registry = get_registry()

    def rows(*overrides: str):
        preset = load_preset(prepared / "dpo.toml", ["model.n_layers=2", "launch.nproc_per_node=2",
                                                     "strategy.name=ddp", *overrides])
        return estimate_preset(preset, registry, [2])

    whole, (tp,) = rows()[0], rows("parallel.tp=2")
    # 2B rows x SEQ x V/2 fp32, one buffer beside the saved softmax; two of 2B x SEQ x V on one process
    assert tp.activation.logits * 4 == whole.activation.logits > 0
    first, last = rows("parallel.pp=2", "training.grad_accum=2")  # m = 2 micro-batches of B pairs
    assert (first.activation.logits, last.activation.logits) == (0, whole.activation.logits)
