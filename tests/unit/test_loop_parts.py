"""The small parts of the training loop, in process: the LR schedule, storage-honest byte counts, the resumable
sampler. Each test would fail if its part were broken (checked against hand-computed values, not against the
code's own output)."""

from __future__ import annotations


import pytest
import torch

from torch_handle.data.datasets import ResumableDistributedSampler
from torch_handle.config.schema import TrainingConfig
from torch_handle.train.strategy import lr_lambda, optimizer_state_tensors, tensor_bytes


# -- learning-rate schedule ------------------------------------------------------------------------------------


def test_warmup_is_linear_and_reaches_the_peak_after_warmup_steps() -> None:
    f = lr_lambda(TrainingConfig(steps=100, warmup_steps=4, schedule="constant"))
    assert [f(s) for s in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])


def test_cosine_decays_to_min_lr_ratio_at_the_last_step() -> None:
    t = TrainingConfig(steps=110, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    f = lr_lambda(t)
    assert f(10) == pytest.approx(1.0)
    # half-way through the decay the cosine is at 0.5: floor + (1 - floor) / 2
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(110) == pytest.approx(0.1)
    assert f(500) == pytest.approx(0.1)  # past the end it stays at the floor
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:])), "cosine decay must be monotone"


def test_linear_schedule_is_a_straight_line_to_the_floor() -> None:
    f = lr_lambda(TrainingConfig(steps=20, warmup_steps=0, schedule="linear", min_lr_ratio=0.0))
    assert [f(s) for s in (0, 5, 10, 20)] == pytest.approx([1.0, 0.75, 0.5, 0.0])


def test_schedule_drives_a_real_optimizer() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(TrainingConfig(steps=10, warmup_steps=1,
                                                                            schedule="constant")))
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.25, 0.5, 0.5])


# -- tensor_bytes ----------------------------------------------------------------------------------------------


def test_views_of_one_buffer_count_once() -> None:
    flat = torch.zeros(100, dtype=torch.float32)
    views = [flat[:40], flat[40:], flat.view(10, 10)]
    assert tensor_bytes(views) == 400


def test_distinct_tensors_add_up_and_none_or_empty_count_nothing() -> None:
    a, b = torch.zeros(10, dtype=torch.float32), torch.zeros(10, dtype=torch.bfloat16)
    assert tensor_bytes([a, b, None, torch.empty(0)]) == 40 + 20


def test_optimizer_state_of_adamw_is_two_moments_per_parameter() -> None:
    model = torch.nn.Linear(8, 4)  # 32 + 4 parameters
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    moments = tensor_bytes(t for t in optimizer_state_tensors(opt) if t.numel() > 1)
    assert moments == 2 * 36 * 4


# -- the resumable sampler -------------------------------------------------------------------------------------


def _order(sampler: ResumableDistributedSampler, epoch: int, skip: int = 0) -> list[int]:
    sampler.set_epoch(epoch)
    sampler.skip(skip)
    return list(iter(sampler))


@pytest.mark.parametrize("rank", [0, 1])
def test_skip_resumes_exactly_where_an_uninterrupted_epoch_would_be(rank: int) -> None:
    data = list(range(50))
    whole = _order(ResumableDistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=7), epoch=3)
    resumed = _order(ResumableDistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=7), epoch=3,
                     skip=10)
    assert resumed == whole[10:]
    assert len(whole) == 25


def test_skip_applies_to_one_epoch_only_and_ranks_are_disjoint() -> None:
    data = list(range(40))
    s0 = ResumableDistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=1)
    s1 = ResumableDistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=1)
    assert len(_order(s0, 0, skip=5)) == 15
    assert len(_order(s0, 1)) == 20  # the next epoch is whole again
    e0, e1 = _order(s0, 2), _order(s1, 2)
    assert not set(e0) & set(e1) and sorted(e0 + e1) == data
    assert _order(s0, 2) != _order(s0, 3), "set_epoch must reshuffle"


def test_seed_changes_the_order() -> None:
    data = list(range(64))
    a = _order(ResumableDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=1), 0)
    b = _order(ResumableDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=2), 0)
    assert a != b and sorted(a) == sorted(b) == data
