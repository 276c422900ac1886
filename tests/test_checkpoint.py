"""Checkpoint files: atomic step directories, manifests, corrupt-checkpoint fallback, RNG round trip, and
refusal of pickles that would run code."""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest
import torch

from torch_handle.checkpoint import store as ckpt
from torch_handle.errors import CheckpointError


def _write(root, step, payload=b"x" * 100):
    tmp = ckpt.tmp_dir_for(root, step)
    tmp.mkdir(parents=True)
    (tmp / "model.pt").write_bytes(payload)
    return ckpt.finalize(root, step, keep_last=3)


def test_finalize_writes_manifest_renames_and_prunes(tmp_path):
    for step in (10, 20, 30, 40):
        _write(tmp_path, step)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-20", "step-30", "step-40"]
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())
    ckpt.verify(tmp_path / "step-40")


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "missing_file"])
def test_newest_damaged_checkpoint_is_skipped_for_the_previous_good_one(tmp_path, damage):
    _write(tmp_path, 10)
    newest = _write(tmp_path, 20)
    f = newest / "model.pt"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:10])
    elif damage == "flip":
        f.write_bytes(b"y" + f.read_bytes()[1:])
    elif damage == "no_manifest":
        (newest / ckpt.MANIFEST).unlink()
    else:
        f.unlink()
    path, skipped = ckpt.newest_valid(tmp_path)
    assert path == tmp_path / "step-10"
    assert len(skipped) == 1 and "step-20" in skipped[0]


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "trainer-rank0.pt"
    with open(path, "wb") as f:
        pickle.dump({"step": 1, "evil": _Payload()}, f, protocol=2)
    with pytest.raises(CheckpointError, match="refused to load"):
        ckpt.safe_load(path)
    assert not (tmp_path / "PWNED").exists()


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = ckpt.TrainerState(step=5, epoch=1, batch_in_epoch=7)
    ckpt.save_trainer_state(tmp_path, 0, state)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    loaded = ckpt.load_trainer_state(tmp_path, 0)
    assert (loaded.step, loaded.epoch, loaded.batch_in_epoch) == (5, 1, 7)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected


def test_verify_weights_only_refuses_a_code_payload_in_a_library_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    torch.save({"w": torch.ones(2), "meta": {"step": 3}}, good)
    with open(bad, "wb") as f:
        pickle.dump([_Payload()], f, protocol=2)
    ckpt.verify_weights_only([good])
    with pytest.raises(CheckpointError, match=r"bad.pt: refused to load.*(?i:unsupported global)"):
        ckpt.verify_weights_only([good, bad])
    assert not (tmp_path / "PWNED").exists()
