"""Bad pipeline settings: `handle run` exits 2 with one line per problem naming the key and what would be valid,
before anything starts (no run directory, no worker). One case per rule of issue 20; each starts from a preset
that passes (the last test) and changes one thing, whose every consequence is reported at once, structure first
(issue 29)."""

from __future__ import annotations

import pytest

from handle_cli.main import cli
from tests import test_cli_errors
from tests.test_cli_errors import PAIRS, Case, check_error_lines, make, preset

runner = test_cli_errors.runner
"""The error tests' fixture: in the test's directory, launching refused."""

PP = """[model]
n_layers = 2
d_model = 32
n_heads = 2
d_ff = 64
[training]
steps = 1
micro_batch_size = 4
grad_accum = 2
[launch]
nproc_per_node = 2
[parallel]
pp = 2
"""
"""2 layers on 2 stages, 8 samples a step in 2 micro-batches: valid as it is."""


def pp_case(id: str, sets: list[str], expect: list[str], body: str = PP, also: tuple[list[str], ...] = (),
            **files: str) -> Case:
    args = ["p.toml"] + [a for s in sets for a in ("--set", s)]
    return Case(id, preset(body, **files), args, expect, also=list(also))


CASES = [
    pp_case("world-not-divisible", ["parallel.pp=3"],
            ["p.toml:4: model.n_layers: 2 layers cannot fill 3 pipeline stages", "(valid parallel.pp: 1, 2)"],
            also=(["parallel.pp: tp x pp = 1 x 3 does not divide the world size 2", "valid pp: 1, 2"],
                  ["launch.nproc_per_node: strategy 'single' runs one model replica: world size 2 must equal"],
                  ["parallel.pp_microbatches: 2 micro-batches are fewer than the 3 stages 1f1b needs",
                   "(0 is training.grad_accum = 2; valid: 4, 8, e.g. --set parallel.pp_microbatches=4)"])),
    pp_case("pp-with-native-tp", ["parallel.tp=2", "parallel.tp_impl=native", "launch.nproc_per_node=4"],
            ["parallel.tp_impl: tensor parallelism inside pipeline stages is hand-written only",
             "set parallel.tp_impl = \"scratch\" (by hand) or \"auto\""]),
    pp_case("dp-world-not-divisible", ["parallel.tp=2", "parallel.tp_impl=scratch", "launch.nproc_per_node=6"],
            ["parallel.pp: tp x pp = 2 x 2 does not divide the world size 6", "valid pp: 1, 3"],
            also=(["launch.nproc_per_node: strategy 'single' runs one model replica: world size 6 must equal "
                   "parallel.tp x parallel.pp = 4"],)),
    pp_case("tied-zbv-with-dp", ["launch.nproc_per_node=4", "strategy.name=ddp", "parallel.pp_schedule=zbv",
                                 "parallel.pp_stages_per_rank=2", "model.n_layers=4", "model.tie_embeddings=true"],
            ["parallel.pp_schedule: zbv runs the first and the last stage on one rank", "(dp = 2)",
             "set model.tie_embeddings = false or use a looped schedule"]),
    pp_case("1f1b-too-few-microbatches", ["parallel.pp_schedule=1f1b", "parallel.pp_microbatches=1"],
            ["parallel.pp_microbatches: 1 micro-batches are fewer than the 2 stages 1f1b needs",
             "(valid: 2, 4, 8, e.g. --set parallel.pp_microbatches=2)"]),
    pp_case("microbatches-do-not-split-the-batch", ["parallel.pp_microbatches=3"],
            ["parallel.pp_microbatches: 3 does not divide", "micro_batch_size x grad_accum = 8",
             "valid: 2, 4, 8, e.g. --set parallel.pp_microbatches=2)"]),
    pp_case("pp-layers-do-not-add-up", ["parallel.pp_layers=[1, 2]"],
            ["parallel.pp_layers: [1, 2] must list 2 stages", "adding up to n_layers = 2"]),
    pp_case("pp-layers-wrong-length", ["parallel.pp_layers=[2]"],
            ["parallel.pp_layers: lists 1 stages", "pp_stages_per_rank = 2 layer counts (or [] to balance)"]),
    pp_case("fewer-layers-than-stages", ["model.n_layers=1"],
            ["model.n_layers: 1 layers cannot fill 2 pipeline stages", "every stage needs at least one"]),
    pp_case("scratch-native-only-schedule", ["parallel.pp_impl=scratch", "parallel.pp_schedule=zbv"],
            ["p.toml:14: parallel.pp_stages_per_rank: zbv runs several stages per rank", "(it is 1)"],
            also=(["parallel.pp_schedule: 'zbv' is native only", "scratch\" runs gpipe or 1f1b"],)),
    pp_case("interleaved-one-stage-per-rank", ["parallel.pp_schedule=interleaved-1f1b"],
            ["parallel.pp_stages_per_rank: interleaved-1f1b runs several stages per rank",
             "set pp_stages_per_rank >= 2 (it is 1)"]),
    pp_case("zbv-three-stages-per-rank", ["parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=3"],
            ["parallel.pp_stages_per_rank: zbv needs exactly 2 (it is 3)"]),
    pp_case("encoder-decoder", ["model.kind=encoder-decoder"],
            ["model.kind: 'encoder-decoder' has no pipeline split", "the decoder has one"],
            body=PP + '[data]\nname = "parallel"\npath = "pairs"\n', **PAIRS),
    pp_case("strategy-without-pipelines", ["strategy.name=scratch-fsdp"],
            ["strategy.name: 'scratch-fsdp' does not support parallel.pp = 2",
             "valid with pp > 1: ddp, fsdp, scratch-ddp, single"]),
    pp_case("zero1-with-pipelines", ["strategy.name=scratch-ddp", "strategy.shard_optimizer=true"],
            ["strategy.shard_optimizer: with parallel.pp > 1 is not supported", "set it to false, or use fsdp"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_pipeline_settings_stop_before_anything_starts(runner, tmp_path, case: Case) -> None:
    make(tmp_path, case)
    result = runner.invoke(cli, ["run", *case.args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    check_error_lines(result.exit_code, result.stdout, result.stderr, [case.expect, *case.also], tmp_path)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_base_preset_gets_as_far_as_the_launch(runner, tmp_path) -> None:
    """Each case above fails for its one change: the preset it starts from creates its run and reaches the
    launch (which the ``no_launch`` fixture refuses)."""
    make(tmp_path, pp_case("ok", [], []))
    result = runner.invoke(cli, ["run", "p.toml"])
    assert isinstance(result.exception, AssertionError) and "a run was launched" in str(result.exception)
    assert len(list((tmp_path / "out").iterdir())) == 1
