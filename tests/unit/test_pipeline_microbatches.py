"""The pipeline micro-batch counts the ``[parallel]`` checks accept: the "valid" list of the divisibility error
names only values that pass every micro-batch check (issue 29: ``pp_microbatches = 3`` listed 1, which 1F1B on 2
stages refuses, and "use >= 2" named 3, which does not split 8 samples)."""

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


@pytest.mark.parametrize("m, why", [(3, "3 does not divide the step's micro_batch_size x grad_accum = 8 samples"),
                                    (1, "1 micro-batches are fewer than the 2 stages 1f1b needs")])
def test_the_error_lists_only_values_every_check_accepts(m, why):
    """Both micro-batch errors (m does not split the batch; m too few for 1F1B) list the same values: those that
    pass both checks (issue 29: "use >= 2" named 3, which does not divide 8), and the --set of the smallest."""
    from torch_handle.config.loader import load_preset
    from torch_handle.errors import PresetError

    sets = ["parallel.pp=2", "parallel.pp_schedule=1f1b", f"parallel.pp_microbatches={m}", "training.grad_accum=1",
            "training.micro_batch_size=8"]
    with pytest.raises(PresetError) as e:
        load_preset("presets/ddp.toml", sets)
    assert e.value.key == "parallel.pp_microbatches"
    assert e.value.message.startswith(why), e.value.message
    assert e.value.message.endswith("valid: 2, 4, 8, e.g. --set parallel.pp_microbatches=2)"), e.value.message
    for ok in (2, 4, 8):
        load_preset("presets/ddp.toml", [*sets, f"parallel.pp_microbatches={ok}"])
