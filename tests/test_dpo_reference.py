"""The reference of a DPO full fine-tune (issue 47), in this process on tests/test_dpo.py's base and pairs:
``reference = "copy"`` (a frozen copy of the model as built, held like the policy: torch_handle/train/objectives/
reference.py) gives the precomputed reference's losses, survives a resume as the base's copy (not the moved
policy's), and stays out of the optimizer; the precomputed table is cached under the data's and the base's hashes
(a second run reads it, other data or another base computes it again); layouts that cannot hold a copy are refused
at ``handle validate`` in one line."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[dev,hf]'")

from click.testing import CliRunner  # noqa: E402

from handle_cli.main import cli  # noqa: E402
from tests.helpers import trainer_here  # noqa: E402
from tests.test_dpo import DPO, SEQ, dpo_preset, pairs  # noqa: E402,F401
from tests.unit.test_trainer_step import _events, fake_peak, process_group  # noqa: E402,F401
from torch_handle.config.loader import dump_preset, load_preset  # noqa: E402
from torch_handle.data.cache import CACHE_ENV  # noqa: E402
from torch_handle.data.chat.pairs import prepare_preference  # noqa: E402
from torch_handle.rundir import create_run_dir  # noqa: E402
from torch_handle.train.objectives import reference  # noqa: E402
from torch_handle.train.trainer import Trainer  # noqa: E402

FULL = (*DPO, "finetune.method=none", "training.lr=0.001", "training.schedule=constant")
"""tests/test_dpo.py's full fine-tune: every weight trains, sigmoid DPO with beta 0.5."""


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own (the suite shares one across its runs: another test's table would be found)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _run(root: Path, pairs_: tuple[Path, Path], ctx, name: str, steps: int, *overrides: str,
         run_dir: Path | None = None) -> tuple[Path, Trainer]:
    """A full-fine-tune DPO run of ``steps`` in this process (resumed when ``run_dir`` is given): its directory and
    its trainer, closed."""
    base, data = pairs_
    preset = load_preset(dpo_preset(root, base, data, steps=steps), [*FULL, *overrides])
    run_dir = run_dir or create_run_dir(root / "runs", name, dump_preset(preset), {"status": "starting"})
    status, trainer = trainer_here(preset, run_dir, ctx)
    assert status == "finished"
    return run_dir, trainer


def _losses(run_dir: Path) -> dict[tuple[str, int], float]:
    """Every step's loss and eval's val_loss: (kind, step) -> loss."""
    return {(e["kind"], e["step"]): e.get("loss", e.get("val_loss")) for e in _events(run_dir)
            if e["kind"] in ("step", "eval")}


def test_the_copy_is_the_precomputed_reference_and_a_resume_rebuilds_it(pairs, tmp_path, process_group, fake_peak,
                                                                         cache):
    """Step 0 of the copy is ln 2; its 3 steps (2, then resumed for 1: the copy built again from the base, not from
    the moved policy) and evaluations give the precomputed reference's losses within 1e-6; the copy is frozen, in
    evaluation mode, not in the optimizer, and not in the run directory."""
    precomputed, _ = _run(tmp_path, pairs, process_group, "precomputed", 3, "finetune.preference.reference=precomputed")
    copy, _ = _run(tmp_path, pairs, process_group, "copy", 2, "finetune.preference.reference=copy")
    first = [e for e in _events(copy) if e["kind"] in ("step", "eval")]
    assert first[0]["val_loss"] == pytest.approx(math.log(2), abs=1e-6) and first[0]["rewards/margins"] == 0.0
    assert first[1]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(first[2]["rewards/margins"]) > 1e-4, "the policy moved away from its reference"
    _, trainer = _run(tmp_path, pairs, process_group, "copy", 3, "finetune.preference.reference=copy", run_dir=copy)
    resumed, straight = _losses(copy), _losses(precomputed)
    assert len(resumed) == 6 and len(straight) == 5 and set(straight) <= set(resumed)  # the copy also evaluated at 2
    assert [resumed[k] for k in straight] == pytest.approx(list(straight.values()), abs=1e-6)
    assert not (copy / "reference_logps.pt").exists()

    held = trainer.objective.copy.model
    assert not held.training and not any(p.requires_grad for p in held.parameters())
    optimized = {id(p) for group in trainer.strategy.optimizer.param_groups for p in group["params"]}
    assert optimized and not optimized & {id(p) for p in held.parameters()}
    policy = trainer.strategy.unwrapped()
    base = dict(held.named_parameters())
    assert set(base) == {n for n, _ in policy.named_parameters()}
    moved = [n for n, p in policy.named_parameters() if not torch.equal(p, base[n])]
    assert moved, "the resumed policy has moved; the copy is the base's"
    assert trainer.objective.copy.nbytes() == sum(p.numel() * 4 for p in policy.parameters())
    built = [e["message"] for e in _events(copy) if "a frozen copy of the model as built" in e.get("message", "")]
    assert len(built) == 2 and f"{trainer.objective.copy.nbytes():,} bytes on rank 0" in built[-1], built


def test_the_precomputed_reference_is_cached_under_the_data_and_the_base(pairs, tmp_path, process_group, fake_peak,
                                                                         cache):
    """A second run on the same data and base reads the table (not computed again: the process's counters) and
    gets the same losses; other data, or a base with one weight changed, computes its own."""
    counts = dict(reference.COUNTS)
    first, _ = _run(tmp_path, pairs, process_group, "first", 1)  # auto: precomputed
    assert reference.COUNTS == {**counts, "computed": counts["computed"] + 1}
    second, _ = _run(tmp_path, pairs, process_group, "second", 1)
    assert reference.COUNTS == {"computed": counts["computed"] + 1, "cached": counts["cached"] + 1}
    assert _losses(second) == _losses(first)
    tables = [torch.load(d / "reference_logps.pt", weights_only=True) for d in (first, second)]
    assert all(torch.equal(tables[0][k], tables[1][k]) for k in ("train", "valid"))
    assert any("read from" in e.get("message", "") for e in _events(second) if e["kind"] == "log")

    base, data = pairs
    rows = (data.parent / "pairs.jsonl").read_text(encoding="utf-8").splitlines()[:-1]  # one pair fewer
    (tmp_path / "fewer.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    prepare_preference([str(tmp_path / "fewer.jsonl")], tmp_path / "fewer", tokenizer=base, template="chatml",
                       valid_fraction=0.25, max_len=SEQ)
    _run(tmp_path, (base, tmp_path / "fewer"), process_group, "other-data", 1)
    assert reference.COUNTS["computed"] == counts["computed"] + 2

    other = tmp_path / "other-base"
    shutil.copytree(base, other)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(other / "model.safetensors"))
    name = min(weights)
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    moved, _ = _run(tmp_path, (other, data), process_group, "other-base", 1)
    assert reference.COUNTS["computed"] == counts["computed"] + 3
    assert reference.COUNTS["cached"] == counts["cached"] + 1
    assert len(list((cache / reference.REFERENCE_CACHE).glob("*.pt"))) == 3
    assert not torch.equal(torch.load(moved / "reference_logps.pt", weights_only=True)["train"], tables[0]["train"])


@pytest.mark.parametrize("overrides, says", [
    ([], None),
    (["finetune.method=lora"], "finetune.preference.reference: 'copy' is a full fine-tune's (method = 'none')"),
    (["strategy.name=scratch-fsdp", "launch.nproc_per_node=2", "training.grad_accum=1"],
     "finetune.preference.reference = 'copy' under strategy 'scratch-fsdp': not sharded as that strategy shards"),
    (["strategy.name=deepspeed", "strategy.zero_stage=3", "launch.nproc_per_node=2", "training.grad_accum=1"],
     "under strategy 'deepspeed' with zero_stage 3"),
    (["finetune.preference.loss=simpo"], "'copy': loss 'simpo' is reference-free"),
    (["parallel.tp=2", "launch.nproc_per_node=2", "training.grad_accum=1"],
     "finetune.preference.reference = 'copy' is not split over parallel.tp > 1 (valid: reference = 'precomputed'"),
])
def test_a_copy_the_layout_cannot_hold_is_one_line(pairs, tmp_path, overrides, says):
    base, data = pairs
    path = dpo_preset(tmp_path, base, data, steps=1)
    sets = [a for o in (*FULL, "finetune.preference.reference=copy", *overrides) for a in ("--set", o)]
    result = CliRunner().invoke(cli, ["validate", str(path), *sets])
    if says is None:  # a full fine-tune on one process
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines
