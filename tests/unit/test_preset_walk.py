"""The one validation walk of :mod:`torch_handle.config.problems`: every problem of a preset from one pass, in a
fixed order; ``load_preset`` raises them all, ``preset_problems`` returns them (structure first) without reading a
file twice, and a cross-table check runs whenever the values it reads are valid. In-process, no torch."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import pytest

import torch_handle.config.loader as config
from torch_handle.config.problems import Unavailable, _section, walk
from torch_handle.config.loader import deep_merge, load_preset, preset_from_dict, preset_problems
from torch_handle.errors import InvalidValue, PresetError, PresetErrors
from torch_handle.hookspecs import hookimpl
from torch_handle.registry import PluginInfo, PluginRegistry, load_registry

# Nine problems in eight tables; [data] has a key-level problem (seq_len) and breaks its check() (path is required
# for 'text'): the check() runs on the rest of the table and reports it too.
MANY = """\
[trainig]
steps = 3
[training]
stepz = 3
lr = -1
[model]
d_model = "wide"
[strategy]
name = "ddp"
zero_stage = 2
[launch]
nnodes = 0
[data]
name = "text"
seq_len = 0
[run]
name = "a/b"
"""
WALK_ORDER = ["trainig", "run.name", "training.stepz", "training.lr", "launch.nnodes", "model.d_model",
              "data.seq_len", "data.path", "strategy.zero_stage"]
"""Unknown tables, the core tables (run, training, launch), the plugin tables (model, data, strategy, profiler)."""
LISTED = [("trainig", 1), ("model.d_model", 7), ("launch.nnodes", 12), ("run.name", 17), ("data.path", 13),
          ("data.seq_len", 15), ("training.stepz", 4), ("training.lr", 5), ("strategy.zero_stage", 10)]
"""``handle validate``: structure first (the file's tables, the model, the layout, the details), then by
TABLE_ORDER, then by line (data.path is not in the file: the line of its table)."""


@dataclasses.dataclass
class DepthConfig:
    depth: int
    """Required (no default)."""

    def check(self) -> None:
        if self.depth > 5:
            raise InvalidValue("depth", f"{self.depth} is too deep")


CALLS: list[str] = []


def _cross(options: DepthConfig, preset) -> None:
    """A plain hook: raises its first problem."""
    CALLS.append(preset.source)
    if options.depth == 4:
        raise InvalidValue("training.steps", f"{preset.training.steps} steps are unlucky with depth 4")


def _two(options: DepthConfig, preset):
    """A generator hook: every problem it yields is reported, up to a value with a problem of its own."""
    if options.depth == 4:
        yield InvalidValue("depth", "4 is unlucky")
        yield InvalidValue("run.seed", f"{preset.run.seed} is unlucky with depth 4")


def _buggy_check(self) -> None:
    raise KeyError("oops")


BuggyConfig = dataclasses.make_dataclass("BuggyConfig", [("x", int, 1)], namespace={"check": _buggy_check})


class Plugin:
    @hookimpl
    def handle_register_strategies(self, register):
        register("deep", DepthConfig, lambda *a: None, "", _cross)

    @hookimpl
    def handle_register_profilers(self, register):
        register("deep", DepthConfig, lambda *a: None, "", (_cross, _two))  # two hooks, each run on its own
        register("buggy", BuggyConfig, lambda *a: None)


@pytest.fixture(scope="module")
def registry() -> PluginRegistry:
    reg = load_registry()
    reg.add_plugin(Plugin(), PluginInfo("walk-test", "walk-test-dist", "0", builtin=False))
    assert reg.plugins["walk-test"].status == "loaded", reg.plugins["walk-test"].error
    return reg


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def first_error(path: Path, registry: PluginRegistry, overrides=()) -> PresetError:
    with pytest.raises(PresetError) as info:
        load_preset(path, overrides, registry)
    return info.value


def test_one_walk_finds_every_problem_in_the_documented_order(registry):
    data = config.tomllib.loads(MANY)
    preset, problems = walk(data, registry, "<many>")
    assert preset is None
    assert [e.key for e in problems] == WALK_ORDER
    assert all(e.file is None for e in problems)
    # preset_from_dict is the same walk: it raises every problem, structure first, without a file
    with pytest.raises(PresetErrors) as info:
        preset_from_dict(data, registry)
    assert [e.key for e in info.value.problems] == [k for k, _ in LISTED[:4]] + ["data.seq_len", "data.path"] + \
        [k for k, _ in LISTED[6:]]  # no lines: the walk's order among equals
    assert info.value.key == LISTED[0][0] and info.value.file is None


def test_preset_problems_lists_them_structure_first(tmp_path, registry):
    path = write(tmp_path / "many.toml", MANY)
    preset, problems = preset_problems(path, registry=registry)
    assert preset is None
    assert [(e.key, e.line) for e in problems] == LISTED
    assert all(e.file == path for e in problems)
    text = {e.key: str(e) for e in problems}
    assert text["training.stepz"] == f"{path}:4: training.stepz: unknown key; did you mean 'steps'? (valid: " \
                                     f"{', '.join(sorted(f.name for f in dataclasses.fields(config.TrainingConfig)))})"
    assert text["run.name"].startswith(f"{path}:17: run.name: 'a/b' must use only letters")
    assert text["data.path"] == f"{path}:13: data.path: is required: a text file, a directory or a glob"


def test_load_preset_raises_every_problem_one_line_each(tmp_path, registry):
    path = write(tmp_path / "many.toml", MANY)
    _, problems = preset_problems(path, registry=registry)
    e = first_error(path, registry)
    assert isinstance(e, PresetErrors) and [str(p) for p in e.problems] == [str(p) for p in problems]
    assert str(e).splitlines() == [str(p) for p in problems]
    assert (e.key, e.line, e.file) == ("trainig", 1, path)  # read as one problem: the first
    # one problem is a plain PresetError, its line the same as handle validate's
    path = write(tmp_path / "one.toml", "[run]\nname = 'a/b'\n")
    e = first_error(path, registry)
    assert type(e) is PresetError
    assert str(e) == f"{path}:2: run.name: 'a/b' must use only letters, digits, '.', '_' and '-'"


def test_preset_problems_reads_each_file_once(tmp_path, registry, monkeypatch):
    base = write(tmp_path / "base.toml", "[training]\nsteps = 0\n")
    child = write(tmp_path / "child.toml", 'extends = "base.toml"\n[model]\nd_model = "wide"\n')
    reads: collections.Counter[Path] = collections.Counter()
    read_toml = config._read_toml

    def counting(path: Path):
        reads[Path(path).resolve()] += 1
        return read_toml(path)

    monkeypatch.setattr(config, "_read_toml", counting)
    preset, problems = preset_problems(child, ["training.lr=0"], registry)
    assert preset is None and [e.key for e in problems] == ["model.d_model", "training.steps", "training.lr"]
    assert [str(e).split(": ")[0] for e in problems] == [f"{child}:3", f"{base}:2", f"{child} (--set)"]
    assert reads == {base.resolve(): 1, child.resolve(): 1}
    reads.clear()
    preset, problems = preset_problems(child, ["training.steps=2", "model.d_model=64"], registry)
    assert problems == [] and preset is not None and preset.training.steps == 2
    assert reads == {base.resolve(): 1, child.resolve(): 1}


def test_a_problem_of_the_file_itself_is_reported_alone(tmp_path, registry):
    path = write(tmp_path / "p.toml", "[training]\nsteps = = 1\n[model]\nd_model = 'wide'\n")
    _, problems = preset_problems(path, registry=registry)
    assert [str(e) for e in problems] == [str(first_error(path, registry))]
    assert str(problems[0]).startswith(f"{path}:2: TOML syntax error")
    ok = write(tmp_path / "ok.toml", "[training]\nsteps = 0\n")
    _, problems = preset_problems(ok, ["training.steps"], registry)  # a malformed --set: nothing to validate
    assert [e.message for e in problems] == ["--set 'training.steps': expected TABLE.KEY=VALUE, for example "
                                             "training.steps=50"]


def test_a_cross_table_check_runs_whenever_what_it_reads_is_valid(tmp_path, registry):
    CALLS.clear()
    # the strategy's hook reads training.steps, which has a problem of its own: it ends there, quietly
    both = write(tmp_path / "both.toml", "[training]\nsteps = 0\n[strategy]\nname = 'deep'\ndepth = 4\n")
    _, problems = preset_problems(both, registry=registry)
    assert [str(e) for e in problems] == [f"{both}:2: training.steps: 0 must be >= 1"] and CALLS == [str(both)]
    # every hook of every plugin runs: the strategy's, then the profiler's two (its _cross finds what the
    # strategy's found: one line); the generator reports both of its problems
    cross = write(tmp_path / "cross.toml", "[strategy]\nname = 'deep'\ndepth = 4\n[profiler]\nname = 'deep'\n"
                                           "depth = 4\n")
    _, problems = preset_problems(cross, registry=registry)
    assert [str(e) for e in problems] == [f"{cross}: run.seed: 1234 is unlucky with depth 4",
                                          f"{cross}: training.steps: 200 steps are unlucky with depth 4",
                                          f"{cross}:6: profiler.depth: 4 is unlucky"]
    assert str(first_error(cross, registry)).splitlines() == [str(e) for e in problems]
    # a table with a problem still takes part with its other keys; a hook that reads a bad one ends there, the
    # hooks beside it still run, and what a generator yielded before stays
    mixed = write(tmp_path / "mixed.toml", "[run]\nseed = -1\n[training]\nsteps = 0\n[profiler]\nname = 'deep'\n"
                                           "depth = 4\n")
    _, problems = preset_problems(mixed, registry=registry)
    assert [e.key for e in problems] == ["run.seed", "training.steps", "profiler.depth"]
    assert "unlucky" not in str(problems[0]) + str(problems[1])
    good = write(tmp_path / "good.toml", "[strategy]\nname = 'deep'\ndepth = 3\n")
    assert load_preset(good, (), registry).strategy.options == DepthConfig(depth=3)


def test_a_value_with_a_problem_is_never_read_as_its_default(tmp_path):
    """What the cross-table checks read of a table with problems: its valid values and defaults; a bad value
    raises Unavailable, also through ``getattr(options, "steps", default)``."""
    options, problems = _section(config.TrainingConfig, "training", {"steps": "many", "lr": 0.5})
    assert [e.key for e in problems] == ["training.steps"]
    assert isinstance(options, config.TrainingConfig) and options.lr == 0.5 and options.micro_batch_size == 8
    with pytest.raises(Unavailable):
        getattr(options, "steps", 10)
    # the transformer's tensor-parallel check: the model's widths are checked although [data] has a problem
    path = write(tmp_path / "p.toml", "[data]\nseq_len = 'long'\n[parallel]\ntp = 2\ntp_impl = 'scratch'\n"
                                      "sequence_parallel = true\n[model]\nd_ff = 255\n[launch]\nnproc_per_node = 2\n")
    _, problems = preset_problems(path)
    assert [str(e) for e in problems] == [f"{path}:8: model.d_ff: 255 is not divisible by parallel.tp = 2",
                                          f"{path}:2: data.seq_len: expected an integer, got 'long'"]


def test_missing_keys_and_check_of_a_plugin_table(tmp_path, registry):
    path = write(tmp_path / "p.toml", "[strategy]\nname = 'deep'\n")
    _, problems = preset_problems(path, registry=registry)
    assert [str(e) for e in problems] == [f"{path}:1: strategy: missing required key(s): depth"]
    path = write(tmp_path / "p.toml", "[strategy]\nname = 'deep'\ndepth = 'x'\nwidth = 1\n")
    _, problems = preset_problems(path, registry=registry)
    assert [(e.key, e.line) for e in problems] == [("strategy.depth", 3), ("strategy.width", 4)]
    path = write(tmp_path / "p.toml", "[strategy]\nname = 'deep'\ndepth = 9\n")
    assert str(first_error(path, registry)) == f"{path}:3: strategy.depth: 9 is too deep"


def test_a_plugin_check_that_crashes_is_one_problem_and_hides_nothing(tmp_path, registry):
    path = write(tmp_path / "p.toml", "[run]\nname = 'a/b'\n[profiler]\nname = 'buggy'\n")
    assert first_error(path, registry).key == "run.name"
    _, problems = preset_problems(path, registry=registry)
    assert [str(e) for e in problems] == [f"{path}:2: run.name: 'a/b' must use only letters, digits, '.', '_' and '-'",
                                          f"{path}:4: profiler.name: the check of profiler 'buggy' (plugin "
                                          f"'walk-test') failed: KeyError: 'oops'"]


def test_deep_merge_is_a_new_mapping():
    base = {"a": 1, "t": {"x": 1, "n": {"p": [1]}}, "keep": {"k": 1}}
    over = {"a": 2, "t": {"n": {"q": 2}}, "new": {"z": [3]}}
    out = deep_merge(base, over)
    assert out == {"a": 2, "t": {"x": 1, "n": {"p": [1], "q": 2}}, "keep": {"k": 1}, "new": {"z": [3]}}
    out["t"]["n"]["p"].append(9)
    out["keep"]["k"] = 0
    out["new"]["z"].append(4)
    assert base == {"a": 1, "t": {"x": 1, "n": {"p": [1]}}, "keep": {"k": 1}}
    assert over == {"a": 2, "t": {"n": {"q": 2}}, "new": {"z": [3]}}
    assert deep_merge({"t": {"x": 1}}, {"t": 5}) == {"t": 5}
    assert deep_merge({"t": 5}, {"t": {"x": 1}}) == {"t": {"x": 1}}
