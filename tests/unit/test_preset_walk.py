"""The one validation walk of :mod:`torch_handle.config.loader`: every problem of a preset from one pass, in a fixed
order; ``load_preset`` raises the first, ``preset_problems`` returns them all (sorted) without reading a file
twice, and the cross-table checks run only on valid tables. In-process, no torch."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import pytest

import torch_handle.config.loader as config
from torch_handle.config.loader import deep_merge, load_preset, preset_from_dict, preset_problems
from torch_handle.errors import InvalidValue, PresetError
from torch_handle.hookspecs import hookimpl
from torch_handle.registry import PluginInfo, PluginRegistry, load_registry

# Eight problems in eight tables; [data] also breaks its check() (path is required for 'text'), which is not
# reported because the table has a key-level problem.
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
              "data.seq_len", "strategy.zero_stage"]
"""Unknown tables, the core tables (run, training, launch), the plugin tables (model, data, strategy, profiler)."""
LISTED = [("trainig", 1), ("run.name", 17), ("model.d_model", 7), ("data.seq_len", 15), ("training.stepz", 4),
          ("training.lr", 5), ("strategy.zero_stage", 10), ("launch.nnodes", 12)]
"""``handle validate``: sorted by TABLE_ORDER (unknown tables first), then by line."""


@dataclasses.dataclass
class DepthConfig:
    depth: int
    """Required (no default)."""

    def check(self) -> None:
        if self.depth > 5:
            raise InvalidValue("depth", f"{self.depth} is too deep")


CALLS: list[str] = []


def _cross(options: DepthConfig, preset) -> None:
    CALLS.append(preset.source)
    if options.depth == 4:
        raise InvalidValue("training.steps", "4 is unlucky")


def _buggy_check(self) -> None:
    raise KeyError("oops")


BuggyConfig = dataclasses.make_dataclass("BuggyConfig", [("x", int, 1)], namespace={"check": _buggy_check})


class Plugin:
    @hookimpl
    def handle_register_strategies(self, register):
        register("deep", DepthConfig, lambda *a: None, "", _cross)

    @hookimpl
    def handle_register_profilers(self, register):
        register("deep", DepthConfig, lambda *a: None, "", _cross)
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
    preset, problems = config._walk(data, registry, "<many>")
    assert preset is None
    assert [e.key for e in problems] == WALK_ORDER
    assert all(e.file is None for e in problems)
    # preset_from_dict is the same walk: it raises the first problem, without a file
    with pytest.raises(PresetError) as info:
        preset_from_dict(data, registry)
    assert info.value.key == WALK_ORDER[0] and info.value.file is None


def test_preset_problems_lists_them_sorted_by_table_then_line(tmp_path, registry):
    path = write(tmp_path / "many.toml", MANY)
    preset, problems = preset_problems(path, registry=registry)
    assert preset is None
    assert [(e.key, e.line) for e in problems] == LISTED
    assert all(e.file == path for e in problems)
    text = {e.key: str(e) for e in problems}
    assert text["training.stepz"] == f"{path}:4: training.stepz: unknown key; did you mean 'steps'? (valid: " \
                                     f"{', '.join(sorted(f.name for f in dataclasses.fields(config.TrainingConfig)))})"
    assert text["run.name"].startswith(f"{path}:17: run.name: 'a/b' must use only letters")
    assert "data.path" not in text  # the check() of a table with a key-level problem does not run


def test_load_preset_raises_exactly_the_first_problem_of_the_walk(tmp_path, registry):
    path = write(tmp_path / "many.toml", MANY)
    _, problems = preset_problems(path, registry=registry)
    e = first_error(path, registry)
    assert e.key == WALK_ORDER[0]
    assert str(e) == next(str(p) for p in problems if p.key == e.key)
    # without the unknown table the first is the check() of [run], although [model] sorts before [training]
    path = write(tmp_path / "fewer.toml", MANY.replace("[trainig]\nsteps = 3\n", ""))
    assert str(first_error(path, registry)) == f"{path}:15: run.name: 'a/b' must use only letters, digits, '.', " \
                                               f"'_' and '-'"
    _, problems = preset_problems(path, registry=registry)
    assert [e.key for e in problems] == [k for k, _ in LISTED[1:]]


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


def test_cross_table_checks_run_only_when_every_table_is_valid(tmp_path, registry):
    CALLS.clear()
    both = write(tmp_path / "both.toml", "[training]\nsteps = 0\n[strategy]\nname = 'deep'\ndepth = 4\n")
    _, problems = preset_problems(both, registry=registry)
    assert [e.key for e in problems] == ["training.steps"] and CALLS == []
    assert first_error(both, registry).key == "training.steps"
    cross = write(tmp_path / "cross.toml", "[strategy]\nname = 'deep'\ndepth = 4\n[profiler]\nname = 'deep'\n"
                                           "depth = 4\n")
    _, problems = preset_problems(cross, registry=registry)
    # the first hook's problem is the only one: the profiler's hook does not run after the strategy's failed
    assert [str(e) for e in problems] == [f"{cross}: training.steps: 4 is unlucky"]
    assert str(first_error(cross, registry)) == str(problems[0])
    assert CALLS == [str(cross)] * 2  # preset_problems, then load_preset: the strategy's hook only
    good = write(tmp_path / "good.toml", "[strategy]\nname = 'deep'\ndepth = 3\n")
    assert load_preset(good, (), registry).strategy.options == DepthConfig(depth=3)


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
