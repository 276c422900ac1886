"""Preference tuning (``[finetune] objective = "dpo"``, issue 47) in this process: LoRA on a Llama-shaped base
written by transformers, pairs from ../shared/data's Self-Instruct seed tasks (benchmarks/preference_pairs.py)
prepared with ``--preference``. At step 0 the policy is its reference (LoRA's B starts at zero): DPO's validation
loss is ln 2 with zero rewards. The final validation metrics equal a transformers + peft computation on the run's
exported adapters (the reference: the same model with its adapter disabled) and TRL's loss of those
log-probabilities."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[dev,hf]'")

from click.testing import CliRunner  # noqa: E402

from benchmarks.preference_pairs import seed_task_pairs  # noqa: E402
from handle_cli.main import cli  # noqa: E402
from tests.test_sft import DATA, write_base  # noqa: E402
from tests.unit.test_trainer_step import _events, _train, fake_peak, process_group  # noqa: E402,F401
from torch_handle.config.loader import dump_preset, load_preset  # noqa: E402
from torch_handle.data.chat.pairs import prepare_preference  # noqa: E402
from torch_handle.rundir import create_run_dir  # noqa: E402

SEQ = 96
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def write_pairs(root: Path, base: Path) -> Path:
    """The short pairs of the seed tasks (prompt and longer side under 200 characters: 34 of 175) prepared with
    ``--template chatml`` at ``root/pairs`` (a quarter held out)."""
    rows = [r for r in seed_task_pairs(DATA / "self-instruct" / "seed_tasks.jsonl")
            if len(r["prompt"]) + max(len(r["chosen"]), len(r["rejected"])) < 200]
    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    prepare_preference([str(path)], root / "pairs", tokenizer=base, template="chatml", valid_fraction=0.25,
                       max_len=SEQ)
    return root / "pairs"


DPO = ("finetune.objective=dpo", "finetune.method=lora", "finetune.rank=4", "finetune.alpha=8.0",
       'finetune.target_modules=["all"]', "finetune.preference.beta=0.5", f"data.seq_len={SEQ}", "training.lr=0.01")
"""The overrides that make tests/test_sft.py's preset a LoRA DPO one (sigmoid, beta 0.5)."""


def dpo_preset(root: Path, base: Path, data: Path, *, steps: int) -> Path:
    """tests/test_sft.py's preset (the base's shape, micro-batches of 2, grad_accum 2, fp32) on ``data``, written
    at ``root``; load it with :data:`DPO`."""
    from tests.test_sft import preset_file

    return preset_file(root, (base, data), micro_batch_size=2, grad_accum=2, steps=steps, eval_steps=2)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dpo")
    base = write_base(root / "base")
    return base, write_pairs(root, base)


def test_step_0_is_ln2_and_the_final_metrics_are_peft_and_trl(pairs, tmp_path, process_group):
    base, data = pairs
    preset = load_preset(dpo_preset(tmp_path, base, data, steps=4), DPO)
    run_dir = create_run_dir(tmp_path / "runs", "dpo", dump_preset(preset), {"status": "starting"})
    assert _train(preset, run_dir, process_group) == "finished"
    events = _events(run_dir)
    evals = [e for e in events if e["kind"] == "eval"]
    steps = [e for e in events if e["kind"] == "step"]
    assert evals[0]["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert evals[0]["rewards/margins"] == 0.0 and evals[0]["rewards/chosen"] == 0.0
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert all(set(METRICS) <= set(e) for e in steps + evals)
    assert steps[-1]["rewards/margins"] > 0, "chosen pulled above rejected"
    assert not [e for e in events if "policy still equals" in e.get("message", "")], "it trains: no warning"
    _metrics_are_peft(tmp_path, run_dir, data, evals[-1], beta=0.5, pairs_evaluated=4)
    refused = CliRunner().invoke(cli, ["eval", str(run_dir)])  # its validation split holds pairs: not a text loss
    assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1, refused.output
    assert "its eval events" in refused.output

    # the reference precomputed before step 1 (the run directory keeps it): the adapters-off run's losses
    preset = load_preset(dpo_preset(tmp_path, base, data, steps=4),
                         [*DPO, "finetune.preference.reference=precomputed"])
    run_dir = create_run_dir(tmp_path / "runs", "precomputed", dump_preset(preset), {"status": "starting"})
    assert _train(preset, run_dir, process_group) == "finished"
    again = [e for e in _events(run_dir) if e["kind"] in ("step", "eval")]
    assert [e.get("loss", e.get("val_loss")) for e in again] == pytest.approx(
        [e.get("loss", e.get("val_loss")) for e in events if e["kind"] in ("step", "eval")], abs=1e-6)
    table = torch.load(run_dir / "reference_logps.pt", weights_only=True)
    assert table["train"].shape[1] == 2 and (table["train"] < 0).all()


def test_a_full_fine_tune_takes_a_precomputed_reference(pairs, tmp_path, process_group):
    """method = "none": every weight trains, the reference (auto: precomputed) is the base's log-probabilities
    from before step 1, no second model."""
    base, data = pairs
    full = [*DPO, "finetune.method=none", "training.lr=0.001", "training.schedule=constant"]
    preset = load_preset(dpo_preset(tmp_path, base, data, steps=2), full)
    run_dir = create_run_dir(tmp_path / "runs", "full", dump_preset(preset), {"status": "starting"})
    assert _train(preset, run_dir, process_group) == "finished"
    steps = [e for e in _events(run_dir) if e["kind"] == "step"]
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(steps[1]["rewards/margins"]) > 0 and (run_dir / "reference_logps.pt").exists()

    # a resume reads the reference the run directory keeps (the model is no longer the reference): step 3 of the
    # resumed run is step 3 of an uninterrupted one
    longer = load_preset(dpo_preset(tmp_path, base, data, steps=3), full)
    assert _train(longer, run_dir, process_group) == "finished"
    straight = create_run_dir(tmp_path / "runs", "straight", dump_preset(longer), {"status": "starting"})
    assert _train(longer, straight, process_group) == "finished"
    resumed, uninterrupted = ([e["loss"] for e in _events(d) if e["kind"] == "step"] for d in (run_dir, straight))
    assert resumed[-1] == pytest.approx(uninterrupted[-1], abs=1e-6) and len(uninterrupted) == 3
    (run_dir / "reference_logps.pt").unlink()
    further = load_preset(dpo_preset(tmp_path, base, data, steps=4), full)
    with pytest.raises(RuntimeError, match="reference_logps.pt: missing, and the model is past step 0"):
        _train(further, run_dir, process_group)


def _metrics_are_peft(tmp_path: Path, run_dir: Path, data: Path, final: dict, *, beta: float,
                      pairs_evaluated: int) -> None:
    """The final validation metrics from transformers + peft on the run's exported adapters: the policy with the
    adapter, the reference with it disabled, each pair's rows run alone (no batch, no padding mask needed: the
    padding follows the tokens), log-probabilities summed over the completion's tokens."""
    import peft
    import torch.nn.functional as F

    from torch_handle.data.chat.pair_samples import PreferencePairs
    from torch_handle.data.shards import open_prepared
    from torch_handle.infer.adapter_export import export_run

    export_run(run_dir, tmp_path / "adapter")
    stored = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "adapter" / stored, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base.eval(), str(tmp_path / "adapter")).eval()
    prepared = open_prepared(data)
    valid = PreferencePairs(prepared.valid, SEQ, fill_id=prepared.eos_id)
    assert len(valid) >= pairs_evaluated

    def logps(ids, labels):  # (2, T) -> (2,)
        logits = model(input_ids=ids).logits.float()
        return -F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                reduction="none").view_as(labels).sum(1)

    policy, reference = [], []
    with torch.no_grad():
        for i in range(pairs_evaluated):
            item = valid[i]
            policy.append(logps(item["input_ids"], item["labels"]))
            with model.disable_adapter():
                reference.append(logps(item["input_ids"], item["labels"]))
    policy, reference = torch.stack(policy), torch.stack(reference)  # (pairs, 2): chosen, rejected
    rewards = beta * (policy - reference)
    margins = rewards[:, 0] - rewards[:, 1]
    expected = {"val_loss": float(-F.logsigmoid(margins).mean()), "rewards/chosen": float(rewards[:, 0].mean()),
                "rewards/rejected": float(rewards[:, 1].mean()),
                "rewards/accuracies": float((margins > 0).float().mean()), "rewards/margins": float(margins.mean()),
                "logps/chosen": float(policy[:, 0].mean()), "logps/rejected": float(policy[:, 1].mean())}
    for key, value in expected.items():
        assert final[key] == pytest.approx(value, abs=1e-4), key


STEPS = 6


@pytest.fixture(scope="module")
def run_losses(pairs, tmp_path_factory) -> dict[str, list[dict]]:
    """``handle run`` of the LoRA DPO preset on 1 process and under ddp on 2 (the same global batch: 2 pairs x
    grad_accum 2, and 2 pairs x 1 on each rank): name -> its step events."""
    from tests.helpers import handle_at_once

    base, data = pairs
    root = tmp_path_factory.mktemp("dpo-runs")
    preset = dpo_preset(root, base, data, steps=STEPS)
    runs = {"single": (1, "single", "lora"), "ddp": (2, "ddp", "lora")}
    commands = {name: ("run", str(preset), *[a for o in DPO for a in ("--set", o)], "--set", f"run.name={name}",
                       "--set", f"launch.nproc_per_node={n}", "--set", f"training.grad_accum={2 // n}",
                       "--set", f"strategy.name={strategy}", "--set", f"finetune.method={method}",
                       "--set", "training.eval_every=0")
                for name, (n, strategy, method) in runs.items()}
    out = {}
    for name, (code, text) in handle_at_once(commands, at_once=2).items():
        assert code == 0, f"{name}:\n{text[-3000:]}"
        run_dir = Path(next(ln for ln in text.splitlines() if ln.startswith("run directory: ")).split(": ", 1)[1])
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        out[name] = [e for e in events if e["kind"] == "step"]
    return out


def test_ddp_gives_the_single_process_losses_and_metrics(run_losses):
    single, ddp = run_losses["single"], run_losses["ddp"]
    assert len(single) == len(ddp) == STEPS
    assert [e["loss"] for e in ddp] == pytest.approx([e["loss"] for e in single], abs=1e-5)
    for key in METRICS:  # pair means over both ranks (all-reduced), as over the one process's micro-batches
        assert [e[key] for e in ddp] == pytest.approx([e[key] for e in single], abs=1e-4), key
    assert single[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert len({round(e["loss"], 4) for e in single}) == STEPS, "it trains"
    assert single[0]["trained_tokens"] == ddp[0]["trained_tokens"] > 0
    assert single[0]["tokens"] == 4 * 2 * SEQ, "positions computed: 4 pairs of 2 rows"


def test_qlora_dpo_starts_at_ln2_and_trains(pairs, tmp_path, process_group):
    """QLoRA: the reference is the NF4 base with the adapters off."""
    base, data = pairs
    preset = load_preset(dpo_preset(tmp_path, base, data, steps=3), [*DPO, "finetune.method=qlora",
                                                                      "training.eval_every=0"])
    run_dir = create_run_dir(tmp_path / "runs", "qlora", dump_preset(preset), {"status": "starting"})
    assert _train(preset, run_dir, process_group) == "finished"
    steps = [e for e in _events(run_dir) if e["kind"] == "step"]
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and steps[0]["rewards/margins"] == 0.0
    assert abs(steps[-1]["rewards/margins"]) > 1e-4 and steps[-1]["loss"] != pytest.approx(math.log(2), abs=1e-4)


def test_a_loss_stuck_at_ln2_says_why(pairs, tmp_path, process_group):
    """A learning rate too small to move the adapters: the margins stay 0 and the loss ln 2, and the run says so
    once, 3 steps past the warm-up (trl #1311, #1627)."""
    base, data = pairs
    preset = load_preset(dpo_preset(tmp_path, base, data, steps=5), [*DPO, "training.lr=1e-12",
                                                                      "training.eval_every=0"])
    run_dir = create_run_dir(tmp_path / "runs", "stuck", dump_preset(preset), {"status": "starting"})
    assert _train(preset, run_dir, process_group) == "finished"
    events = _events(run_dir)
    assert all(e["loss"] == pytest.approx(math.log(2), abs=1e-6) for e in events if e["kind"] == "step")
    warnings = [e["message"] for e in events if e["kind"] == "log" and "policy still equals its reference" in
                e.get("message", "")]
    assert len(warnings) == 1 and "training.lr = 1e-12" in warnings[0], warnings


def test_the_chunked_loss_path_gives_the_full_one(pairs, tmp_path, process_group):
    """``training.loss_impl = "chunked"``: the sequences' log-probabilities from the hidden states a chunk of tokens
    at a time (linear_cross_entropy.sequence_logps), the same DPO losses and metrics as from the logits."""
    base, data = pairs
    found = {}
    for impl in ("full", "chunked"):
        preset = load_preset(dpo_preset(tmp_path, base, data, steps=2), [*DPO, f"training.loss_impl={impl}"])
        run_dir = create_run_dir(tmp_path / "runs", impl, dump_preset(preset), {"status": "starting"})
        assert _train(preset, run_dir, process_group) == "finished"
        found[impl] = [e for e in _events(run_dir) if e["kind"] in ("step", "eval")]
    for key in ("loss", "val_loss", *METRICS):
        assert [e.get(key) for e in found["chunked"]] == pytest.approx([e.get(key) for e in found["full"]], rel=1e-6,
                                                                       abs=1e-5), key
