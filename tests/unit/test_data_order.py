"""The training data order does not depend on the world size (torch_handle.data.datasets.GlobalBatchSampler): the samples
of optimizer step s are a function of the seed and s, however they are spread over ranks and micro-batches, and a
checkpoint's data position (samples consumed in the epoch) means the same on any world size."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from tests.unit.test_trainer_step import _events, _preset, _train, fake_peak  # noqa: F401 (fake_peak: autouse)
from torch_handle.data.datasets import GlobalBatchSampler
from torch_handle.train.strategy import DistContext


def chain(lists) -> list[int]:
    return list(itertools.chain.from_iterable(lists))


def steps(n: int, *, mb: int, accum: int, world: int, seed: int = 3, epochs: int = 2,
          start: tuple[int, int] = (0, 0)) -> list[list[int]]:
    """The samples of every optimizer step (all ranks and micro-batches together, sorted) for ``epochs`` epochs,
    starting at ``(epoch, samples consumed in it)``, consumed as the trainer consumes them: each rank iterates its
    sampler to the epoch's end and advances it once a step; what ``advance`` returns is checked to be exactly the
    step's micro-batches of all ranks."""
    samplers = [GlobalBatchSampler(n, micro_batch_size=mb, grad_accum=accum, world_size=world, rank=r, seed=seed)
                for r in range(world)]
    for s in samplers:
        s.load_state_dict({"epoch": start[0], "samples_in_epoch": start[1]})
    out: list[list[int]] = []
    for _ in range(epochs):
        epoch = samplers[0].epoch
        per_rank = []
        for s in samplers:
            batches = list(s)
            assert all(len(b) == mb for b in batches)
            # one rank's micro-batches, grouped by step
            per_rank.append([chain(batches[k:k + accum]) for k in range(0, len(batches), accum)])
        assert len({len(r) for r in per_rank}) == 1, "every rank must take the same number of steps"
        for group in zip(*per_rank):
            drawn = sorted(chain(group))
            assert all(sorted(s.advance().tolist()) == drawn for s in samplers), "advance returns the step's batch"
            out.append(drawn)
        assert all(s.state_dict() == {"epoch": epoch + 1, "samples_in_epoch": 0} for s in samplers)
    return out


def test_two_ranks_and_one_rank_with_doubled_accumulation_see_the_same_samples_per_step() -> None:
    n = 100  # 6 global batches of 16 per epoch, 4 samples dropped
    two_ranks = steps(n, mb=8, accum=1, world=2)
    assert two_ranks == steps(n, mb=8, accum=2, world=1)
    assert two_ranks == steps(n, mb=2, accum=2, world=4) == steps(n, mb=4, accum=4, world=1)
    assert len(two_ranks) == 12 and all(len(s) == 16 for s in two_ranks)
    assert len(set(chain(two_ranks[:6]))) == 96, "no sample twice in an epoch"
    assert two_ranks[:6] != two_ranks[6:], "every epoch has its own order"
    assert two_ranks != steps(n, mb=8, accum=1, world=2, seed=4), "the seed picks the order"


def test_within_a_step_rank_r_micro_batch_i_is_the_slice_at_r_times_accum_plus_i() -> None:
    n, mb, accum, world = 64, 4, 2, 2
    order = GlobalBatchSampler(n, micro_batch_size=mb, grad_accum=accum, world_size=world, seed=1).order(0)
    for rank in range(world):
        s = GlobalBatchSampler(n, micro_batch_size=mb, grad_accum=accum, world_size=world, rank=rank, seed=1)
        batches = list(s)
        assert len(batches) == len(s) == 4 * accum  # 64 // 16 steps of 2 micro-batches each
        for k in range(4):
            for i in range(accum):
                offset = k * 16 + (rank * accum + i) * mb
                assert batches[k * accum + i] == order[offset:offset + mb]


def test_a_resume_on_another_world_size_continues_the_same_global_batches() -> None:
    """Stopped after 3 steps of epoch 1 on 2 ranks (position: 48 samples), resumed on 1 rank with grad_accum 2:
    the same steps as the uninterrupted 2-rank run from there."""
    n = 100
    whole = steps(n, mb=8, accum=1, world=2, epochs=3)
    resumed = steps(n, mb=8, accum=2, world=1, epochs=2, start=(1, 3 * 16))
    assert resumed == whole[6 + 3:]


def test_a_changed_global_batch_continues_from_the_same_sample() -> None:
    """48 samples consumed with global batch 16; then global batch 8 starts at sample 48 of the epoch's order."""
    order = GlobalBatchSampler(100, micro_batch_size=8, grad_accum=1, world_size=2, seed=5).order(2)
    s = GlobalBatchSampler(100, micro_batch_size=4, grad_accum=1, world_size=2, rank=1, seed=5)
    s.load_state_dict({"epoch": 2, "samples_in_epoch": 48})
    batches = list(s)
    assert batches[0] == order[52:56] and len(batches) == (100 - 48) // 8
    assert next(iter(s)) == order[52:56], "drawing is not consuming: the position moves by advance() alone"
    assert s.advance().tolist() == order[48:56] and next(iter(s)) == order[60:64]
    s.load_state_dict({"epoch": 2, "samples_in_epoch": 96})  # fewer than one global batch left: the next epoch
    assert s.state_dict() == {"epoch": 3, "samples_in_epoch": 0}


def test_dataloader_workers_and_collate_get_the_sampler_batches() -> None:
    class Squares(Dataset):
        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": torch.tensor(i), "y": torch.tensor(i * i)}

    s = GlobalBatchSampler(40, micro_batch_size=4, grad_accum=2, world_size=2, rank=1, seed=0)
    loader = DataLoader(Squares(), batch_sampler=s, num_workers=2, persistent_workers=True)
    for epoch in (0, 1):
        s.load_state_dict({"epoch": epoch, "samples_in_epoch": 0})
        expected = list(s)
        s.load_state_dict({"epoch": epoch, "samples_in_epoch": 16})
        got = [b["x"].tolist() for b in loader]  # a persistent worker pool, reset every epoch
        assert got == expected[2:]  # one step of 2 x 4 x 2 = 16 samples: this rank's 2 micro-batches skipped
        assert all(b == [v * v for v in x] for b, x in zip([b["y"].tolist() for b in loader], expected[2:]))


@pytest.mark.parametrize("kwargs, message", [
    ({"micro_batch_size": 0}, "micro_batch_size must be at least 1"),
    ({"micro_batch_size": 4, "rank": 2, "world_size": 2}, r"rank must be in \[0, 2\)"),
    ({"micro_batch_size": 8, "grad_accum": 2, "world_size": 2}, "10 samples are too few for one global batch of 32"),
])
def test_bad_arguments_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        GlobalBatchSampler(10, **kwargs)


# -- through the Trainer (a world-1 process group in this process, as tests/unit/test_trainer_step.py) ------------


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    dist.destroy_process_group()


def test_a_resume_with_another_global_batch_continues_at_the_same_sample_with_a_warning(tmp_path, process_group):
    """Stopped after step 1 of micro-batch 4 x grad_accum 2 (8 samples), resumed with grad_accum 1: the first
    micro-batch is samples 8-11 of the epoch's order, and a warning event says the trajectory will differ."""
    from dataclasses import replace

    from torch_handle.config.loader import dump_preset
    from torch_handle.registry import get_registry
    from torch_handle.rundir import STOP_FILE, create_run_dir
    from torch_handle.train.trainer import Trainer
    from torch_handle.launch.run import prepare_data

    preset = _preset(tmp_path, steps=3)
    run_dir = create_run_dir(tmp_path / "runs", "gb", dump_preset(preset), {"status": "starting"})
    (run_dir / STOP_FILE).touch()
    assert _train(preset, run_dir, process_group) == "stopped"
    layout = json.loads((run_dir / "checkpoints" / "step-1" / "layout.json").read_text())
    assert (layout["global_batch"], layout["world_size"], layout["format"]) == (8, 1, "torch")
    (run_dir / STOP_FILE).unlink()

    changed = replace(preset, training=replace(preset.training, grad_accum=1))
    prepare_data(changed)  # what the launcher does before the workers start
    trainer = Trainer(changed, run_dir, process_group, get_registry())
    trainer.build()
    try:
        trainer.maybe_resume()
        assert (trainer.step, trainer.train_sampler.state_dict()) == (1, {"epoch": 0, "samples_in_epoch": 8})
        order = trainer.train_sampler.order(0)
        first = next(trainer.batches())["input_ids"]
        expected = torch.stack([trainer.data.train[i]["input_ids"] for i in order[8:12]])
        assert torch.equal(first, expected)
    finally:
        trainer.close("stopped")
    warnings = [e["message"] for e in _events(run_dir) if e["kind"] == "log" and e.get("level") == "warning"]
    assert any(m.startswith("global batch changed from 8 to 4 samples per step") and "trajectory will differ" in m
               for m in warnings), warnings
