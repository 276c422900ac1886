"""``scratch-ddp``'s pieces in one process without a process group: the options pick the synchronizer, and without
a group nothing is communicated. The collectives themselves are tested against torch DDP in
tests/test_scratch_ddp.py (real processes)."""

from __future__ import annotations

import typing

import pytest
import torch
from handle_plugins.strategies import ScratchDDPConfig, build_scratch_ddp
from handle_plugins.strategies.scratch_ddp.bucketed import BucketedSync
from handle_plugins.strategies.scratch_ddp.flat import FlatSync
from handle_plugins.strategies.scratch_ddp.naive import NaiveSync
from handle_plugins.strategies.scratch_ddp.overlap import OverlapSync

from torch_handle.config.schema import TrainingConfig
from torch_handle.train.strategy import DistContext

CTX = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
SYNC_VALUES = typing.get_args(typing.get_type_hints(ScratchDDPConfig)["sync"])


@pytest.mark.parametrize("sync", SYNC_VALUES)
def test_each_sync_option_builds_its_synchronizer_and_nothing_is_sent_without_a_group(sync):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    strategy = build_scratch_ddp(ScratchDDPConfig(sync=sync), TrainingConfig(steps=1, grad_accum=1), CTX, model)
    expected = {"naive": NaiveSync, "flat": FlatSync, "overlap": OverlapSync, "bucketed": BucketedSync}[sync]
    assert type(strategy.synchronizer) is expected
    assert len(strategy.synchronizer.hooks) == (4 if sync in ("overlap", "bucketed") else 0)
    strategy.backward(model(torch.ones(5, 4)).square().sum())
    local = [p.grad.clone() for p in model.parameters()]
    strategy.sync_gradients()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), local))
    assert strategy.step_stats() == {"comm_s": 0.0, "allreduce_calls": 0, "allreduce_bytes": 0}
    strategy.close()
    assert strategy.synchronizer.hooks == []
