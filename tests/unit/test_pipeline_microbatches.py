"""The pipeline micro-batch counts the ``[parallel]`` checks accept: the "valid" list of the divisibility error
names only values that pass every micro-batch check (issue 29: ``pp_microbatches = 3`` listed 1, which 1F1B on 2
stages refuses)."""

from __future__ import annotations

import pytest

from torch_handle.config.layout import microbatch_problem, valid_microbatches


@pytest.mark.parametrize("schedule, pp, v, samples, expect", [
    ("1f1b", 2, 1, 8, [2, 4, 8]),
    ("gpipe", 2, 1, 8, [1, 2, 4, 8]),
    ("1f1b", 4, 1, 6, [6]),
    ("dualpipev", 2, 2, 8, [4, 8]),
    ("1f1b", 4, 1, 2, []),
])
def test_valid_microbatches(schedule, pp, v, samples, expect):
    assert valid_microbatches(schedule, pp, v, samples) == expect


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2),
                                         ("zbv", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_listed_values_are_exactly_those_every_check_accepts(schedule, v, pp):
    samples = 24
    listed = valid_microbatches(schedule, pp, v, samples)
    accepted = [m for m in range(1, 2 * samples) if samples % m == 0 and not microbatch_problem(schedule, pp, v, m)]
    assert listed == accepted and listed


def test_the_divisibility_error_lists_no_value_the_schedule_refuses():
    from torch_handle.config.loader import load_preset
    from torch_handle.errors import PresetError

    sets = ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=3", "training.grad_accum=1",
            "training.micro_batch_size=8"]
    with pytest.raises(PresetError) as e:
        load_preset("presets/ddp.toml", sets)
    assert e.value.key == "parallel.pp_microbatches"
    assert e.value.message.endswith("valid: 2, 4, 8)"), e.value.message
