"""Preference tuning (``[finetune] objective = "dpo"``, issue 47) in this process: LoRA on a Llama-shaped base
written by transformers, pairs from ../shared/data's Self-Instruct seed tasks (benchmarks/preference_pairs.py)
prepared with ``--preference``. At step 0 the policy is its reference (LoRA's B starts at zero): DPO's validation
loss is ln 2 with zero rewards. The final validation metrics equal a transformers + peft computation on the run's
exported adapters (the reference: the same model with its adapter disabled) and TRL's loss of those
log-probabilities. Under real torchrun workers (issue 47, done-when 3): every data-parallel strategy on 2 ranks gives
the single-process losses within 1e-5 and metrics within 1e-4 (fp32, 10 steps), full, LoRA and QLoRA among them
(:data:`DPO_RUNS`; tests/test_sft_strategies.py's helpers and SFT matrix), a sharded full fine-tune
precomputing the single process's reference table; the QLoRA run under scratch-fsdp also takes
tests/test_qlora_strategies.py's checks of that strategy."""

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


STEPS = 10
"""As tests/test_sft_strategies.py's (its assert_single_losses checks the count)."""
DPO_RUNS = (("ddp", "lora"), ("zero2", "lora"), ("fsdp", "full"), ("zero3", "full"), ("scratch-fsdp", "qlora"))
"""(strategy, method) of the 2-rank DPO runs (tests/test_sft_strategies.py's SFT_RUNS fill most other cells); a
full fine-tune's reference is precomputed (every rank runs the forwards of its share of the pairs, sharded)."""
FULL = ("training.lr=0.001", "finetune.preference.reference=precomputed")
"""A full fine-tune's learning rate (LoRA's 0.01 has it swing from a loss of 0.55 to 0.74 and back to 0.02 in 10
steps, the two ranks' last bits of difference growing to 5e-6) and its reference, precomputed (what auto means)."""


@pytest.fixture(scope="module")
def dpo_runs(pairs, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """``handle run`` of the DPO preset (full, LoRA or QLoRA) under each of :data:`DPO_RUNS` on 2 ranks, and in
    this process once per method (the same global batch: 2 pairs x grad_accum 2, and 2 pairs x 1 on each rank):
    (strategy, method) and ("single", method) -> its run directory."""
    from tests.test_sft_strategies import METHOD, launched, single_runs

    base, data = pairs
    root = tmp_path_factory.mktemp("dpo-runs")
    preset = dpo_preset(root, base, data, steps=STEPS)
    overrides, methods = (*DPO, "training.eval_every=0"), {**METHOD, "full": (*METHOD["full"], *FULL)}
    return {**single_runs(preset, overrides, root, methods), **launched(preset, DPO_RUNS, overrides, root, methods)}


def test_the_matrix_runs_every_strategy_and_each_method():
    from tests.test_sft_strategies import assert_matrix

    assert_matrix(DPO_RUNS)


@pytest.mark.dist
@pytest.mark.parametrize("run", DPO_RUNS, ids=[f"{s}-{m}" for s, m in DPO_RUNS])
def test_two_ranks_give_the_single_process_losses_and_metrics(dpo_runs, run):
    from tests.test_sft_strategies import assert_single_losses, steps_of

    single, steps = steps_of(dpo_runs[("single", run[1])]), steps_of(dpo_runs[run])
    assert_single_losses(steps, single)
    for key in METRICS:  # pair means over both ranks (all-reduced), as over the one process's micro-batches
        assert [e[key] for e in steps] == pytest.approx([e[key] for e in single], abs=1e-4), key
    assert single[0]["trained_tokens"] == steps[0]["trained_tokens"] > 0
    assert single[0]["tokens"] == 4 * 2 * SEQ, "positions computed: 4 pairs of 2 rows"
    # the evaluations at steps 0 and 10, over the same held-out pairs (the same trained tokens)
    single, evals = ([e for e in _events(dpo_runs[key]) if e["kind"] == "eval"] for key in (("single", run[1]), run))
    assert [(e["step"], e["tokens"]) for e in evals] == [(e["step"], e["tokens"]) for e in single]
    assert [e["step"] for e in single] == [0, STEPS]
    assert [e["val_loss"] for e in evals] == pytest.approx([e["val_loss"] for e in single], abs=1e-5)
    for key in METRICS:
        assert [e[key] for e in evals] == pytest.approx([e[key] for e in single], abs=1e-4), key


@pytest.mark.dist
@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_each_method_starts_at_ln2_and_trains(dpo_runs, method):
    """The policy is its reference at step 0 (LoRA's B at zero; QLoRA's reference the NF4 base with the adapters
    off; a full fine-tune's the base's log-probabilities precomputed before step 1), then the chosen rise above
    the rejected."""
    from tests.test_sft_strategies import steps_of

    single = steps_of(dpo_runs[("single", method)])
    assert single[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert single[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert len({round(e["loss"], 4) for e in single}) == STEPS, "it trains"
    assert single[-1]["rewards/margins"] > 0 and single[-1]["loss"] < math.log(2) - 1e-3


@pytest.mark.dist
def test_a_sharded_full_fine_tune_precomputes_the_single_process_reference(dpo_runs):
    """fsdp and ZeRO-3: each rank ran the reference forwards of every other pair on its shards (computed, not read
    from a cache), one all-reduce joined them: the table the single process computed, pair for pair."""
    want = torch.load(dpo_runs[("single", "full")] / "reference_logps.pt", weights_only=True)
    for strategy in ("fsdp", "zero3"):
        run_dir = dpo_runs[(strategy, "full")]
        logs = [json.loads(line).get("message", "") for line in (run_dir / "events.jsonl").read_text().splitlines()]
        assert any(m.startswith("finetune.preference.reference: precomputed before step 1") for m in logs), strategy
        got = torch.load(run_dir / "reference_logps.pt", weights_only=True)
        assert got.keys() == want.keys() == {"train", "valid"}
        for split in want:
            torch.testing.assert_close(got[split], want[split], rtol=0, atol=1e-4, msg=f"{strategy} {split}")


@pytest.mark.dist
def test_qlora_under_scratch_fsdp(dpo_runs, tmp_path):
    """The QLoRA run under scratch-fsdp is tests/test_qlora_strategies.py's cell for that strategy (it runs the
    others): each rank's chunk of the NF4 base unchanged, its memory ``handle estimate``'s to the byte, and its
    adapters exported as the single process's (its :func:`assert_qlora_run`)."""
    from tests.test_qlora_strategies import assert_qlora_run

    assert_qlora_run(dpo_runs[("scratch-fsdp", "qlora")], dpo_runs[("single", "qlora")], "scratch-fsdp", tmp_path)


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
    for key in ("loss", "val_loss", *METRICS):  # the metrics: sums of log-probabilities near -218 (and their
        # differences) summed in other chunks (e027df4), fp32's last bits (3e-5 in logps, 1.1e-5 in a reward): within
        # the 1e-4 of the ranks' comparison
        tolerance = 1e-4 if key in METRICS else 1e-5
        got, want = ([e.get(key) for e in found[impl]] for impl in ("chunked", "full"))
        assert got == pytest.approx(want, rel=1e-6, abs=tolerance), key
