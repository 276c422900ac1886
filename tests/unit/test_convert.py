"""Checkpoint conversion to the portable form (torch_handle.checkpoint.convert), in process: a ``torch`` checkpoint (single/ddp)
and a ``torch-sharded`` one (scratch-ddp's ZeRO-1) become name-keyed DCP, and loading that into another strategy
restores weights, Adam moments and step, and the LR schedule exactly: the next step is bitwise the same. The
DeepSpeed and FSDP2 paths need process groups: tests/test_cross_resume.py."""

from __future__ import annotations

import json

import pytest
import torch
from handle_plugins.strategies import ScratchDDPConfig
from handle_plugins.strategies.scratch_ddp.strategy import ScratchDDPStrategy
from torch import nn

from torch_handle.checkpoint import convert
from torch_handle.errors import CheckpointError
from torch_handle.config.schema import TrainingConfig
from torch_handle.train.strategy import DistContext, Strategy

CTX = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
TRAINING = TrainingConfig(steps=10, warmup_steps=2, lr=0.01)


class Tiny(nn.Module):
    """Tied input/output embedding (one parameter, two names) and a buffer, like the project's models."""

    def __init__(self, dim: int = 4, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(10, dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.rand(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(self.embed(x))) * self.scale)


def train(strategy: Strategy, steps: int, first: int = 0) -> None:
    for s in range(first, first + steps):
        x = torch.arange(10).roll(s)
        strategy.backward(strategy.model(x).square().mean())
        strategy.step()


def scratch(sharded: bool, model: nn.Module) -> ScratchDDPStrategy:
    return ScratchDDPStrategy(ScratchDDPConfig(sync="naive", shard_optimizer=sharded), TRAINING, CTX, model)


def optimizer_state(strategy: Strategy) -> dict[str, dict[str, torch.Tensor]]:
    names = {p: n for n, p in strategy.unwrapped().named_parameters()}
    params = [p for g in strategy.optimizer.param_groups for p in g["params"]]
    return {names[p]: strategy.optimizer.state[p] for p in params if p in strategy.optimizer.state}


def assert_same(a: Strategy, b: Strategy) -> None:
    assert a.unwrapped().state_dict().keys() == b.unwrapped().state_dict().keys()
    for (name, x), y in zip(a.unwrapped().state_dict().items(), b.unwrapped().state_dict().values()):
        assert torch.equal(x, y), name
    sa, sb = optimizer_state(a), optimizer_state(b)
    assert sa.keys() == sb.keys() and len(sa) == 3  # embed (tied with head), proj weight and bias
    for name in sa:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[name][key], sb[name][key]), (name, key)
    assert a.lr == b.lr and a.scheduler.last_epoch == b.scheduler.last_epoch


@pytest.mark.parametrize("source, target", [("base", "base"), ("base", "sharded"), ("sharded", "base"),
                                            ("sharded", "unsharded")])
def test_conversion_restores_the_state_exactly_and_the_next_step_matches(tmp_path, source, target) -> None:
    build = {"base": lambda m: Strategy(None, TRAINING, CTX, m), "sharded": lambda m: scratch(True, m),
             "unsharded": lambda m: scratch(False, m)}
    a = build[source](Tiny(seed=0))
    train(a, 3)
    a.save(tmp_path)
    layout = {"format": "torch-sharded" if source == "sharded" else "torch", "strategy": "x", "world_size": 1}
    if source == "sharded":
        assert json.dumps(torch.load(tmp_path / "optim-rank0.pt")["owned"]) == "[0, 1, 2]"
    names = [n for n, _ in a.unwrapped().named_parameters()]
    done = convert.ensure_portable(tmp_path, layout, names)
    assert not done["cached"] and done["bytes"] > 0 and (tmp_path / "portable" / "dcp" / ".metadata").is_file()
    assert convert.ensure_portable(tmp_path, layout, names)["cached"]  # a second resume reuses it

    b = build[target](Tiny(seed=1))  # other initial weights: the load must replace all of them
    b.load_portable(convert.portable_dir(tmp_path, layout))
    assert_same(a, b)
    train(a, 2, first=3)
    train(b, 2, first=3)
    assert_same(a, b)


def test_a_portable_form_that_does_not_fit_the_model_is_one_line(tmp_path) -> None:
    a = Strategy(None, TRAINING, CTX, Tiny())
    train(a, 1)
    a.save(tmp_path)
    layout = {"format": "torch"}
    convert.ensure_portable(tmp_path, layout, [n for n, _ in a.unwrapped().named_parameters()])
    wider = Strategy(None, TRAINING, CTX, Tiny(dim=6))
    with pytest.raises(CheckpointError, match=r"portable: does not fit this model and optimizer") as e:
        wider.load_portable(tmp_path / "portable")
    assert "\n" not in str(e.value)
    (tmp_path / "other").mkdir()
    for f in ("model.pt", "optim.pt"):
        (tmp_path / "other" / f).write_bytes((tmp_path / f).read_bytes())
    with pytest.raises(CheckpointError, match=r"optim.pt: 3 parameters, the model has 1"):
        convert.ensure_portable(tmp_path / "other", layout, ["only"])
    assert not list((tmp_path / "other").glob(".portable-*")), "a failed conversion leaves nothing behind"
    with pytest.raises(CheckpointError, match=r"cannot convert a checkpoint of format 'zip'"):
        convert.ensure_portable(tmp_path, {"format": "zip"}, [])


def test_a_resume_that_changes_the_peak_lr_uses_it_and_an_unchanged_one_keeps_the_loaded_lr(tmp_path) -> None:
    """``Strategy.apply_schedule``: the checkpoint's scheduler state holds the old peak lr; after a resume with
    another ``training.lr`` the optimizer steps with the new peak at the checkpoint's point of the schedule."""
    from dataclasses import replace

    from torch_handle.train.strategy import lr_lambda

    a = Strategy(None, TRAINING, CTX, Tiny())
    train(a, 4)
    a.save(tmp_path)
    same = Strategy(None, TRAINING, CTX, Tiny())
    same.load(tmp_path)
    loaded = [g["lr"] for g in same.optimizer.param_groups]
    same.apply_schedule()
    assert [g["lr"] for g in same.optimizer.param_groups] == loaded == [a.lr]  # bit for bit

    doubled = replace(TRAINING, lr=2 * TRAINING.lr)
    b = Strategy(None, doubled, CTX, Tiny())
    b.load(tmp_path)
    assert b.lr == a.lr  # what load alone gives: the checkpoint's peak
    b.apply_schedule()
    assert b.lr == pytest.approx(doubled.lr * lr_lambda(doubled)(4), rel=1e-12) and b.lr == pytest.approx(2 * a.lr)
    train(b, 1, first=4)
    assert b.scheduler.get_last_lr()[0] == pytest.approx(doubled.lr * lr_lambda(doubled)(5), rel=1e-12)
