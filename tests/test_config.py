"""Presets: dataclass defaults, ``extends``, typed ``--set`` overrides, one-line errors, TOML round trips, and the
plugin registry's error boundary. No training and no workers: one ``handle presets show`` subprocess, and one
test imports torch (through ``torch_handle.data.datasets``) to compare the pre-flight's messages with the loaders'."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from torch_handle.config.loader import (
    CORE_TABLES,
    PLUGIN_TABLES,
    InvalidValue,
    LaunchConfig,
    PresetError,
    RunConfig,
    TrainingConfig,
    dump_preset,
    load_preset,
    preset_from_dict,
    preset_to_dict,
)
from torch_handle.config.overrides import parse_override
from torch_handle.errors import DataError
from torch_handle.hookspecs import hookimpl
from torch_handle.registry import PluginInfo, PluginRegistry, get_registry, load_registry

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted((REPO / "presets").glob("*.toml"))
NEEDS = {"translate": ["data.path=../shared/data/multi30k"], "translate-long": ["data.path=../shared/data/multi30k"]}
"""Overrides a shipped preset needs to validate (it documents them in its header)."""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def err(path, overrides=(), registry=None) -> PresetError:
    with pytest.raises(PresetError) as info:
        load_preset(path, overrides, registry)
    message = str(info.value)
    assert "\n" not in message, message
    return info.value


def same(a, b) -> bool:
    return dataclasses.replace(a, source="") == dataclasses.replace(b, source="")


# ----------------------------------------------------------------------------------------------------------------
# Dataclasses and defaults
# ----------------------------------------------------------------------------------------------------------------


def test_one_dataclass_per_table():
    assert set(CORE_TABLES) == {"run", "training", "parallel", "launch", "finetune", "eval"}
    assert set(PLUGIN_TABLES) == {"model", "data", "strategy", "profiler"}
    reg = get_registry()
    for cls in CORE_TABLES.values():
        assert dataclasses.is_dataclass(cls)
    for kind in PLUGIN_TABLES.values():
        assert reg.names(kind), kind
        for name in reg.names(kind):
            assert dataclasses.is_dataclass(reg.get(kind, name).config_cls)


def test_empty_preset_is_all_defaults(tmp_path):
    p = load_preset(write(tmp_path / "empty.toml", ""))
    assert p.run == RunConfig() and p.training == TrainingConfig() and p.launch == LaunchConfig()
    reg = get_registry()
    for table in ("model", "data", "strategy", "profiler"):
        section = getattr(p, table)
        assert section.options == reg.get(PLUGIN_TABLES[table], section.name).config_cls()
    assert (p.model.name, p.data.name, p.strategy.name, p.profiler.name) == ("transformer", "pydoc", "single", "none")
    assert p.world_size == 1


def test_preset_holds_only_what_differs(tmp_path):
    p = load_preset(write(tmp_path / "p.toml", "[training]\nsteps = 7\n"))
    assert p.training == dataclasses.replace(TrainingConfig(), steps=7)


def test_int_is_accepted_for_float_and_exponent_floats(tmp_path):
    p = load_preset(write(tmp_path / "p.toml", "[training]\nlr = 1\nweight_decay = 1e-3\n"))
    assert p.training.lr == 1.0 and isinstance(p.training.lr, float)
    assert p.training.weight_decay == pytest.approx(1e-3)


# ----------------------------------------------------------------------------------------------------------------
# extends
# ----------------------------------------------------------------------------------------------------------------


def test_extends_chain_of_shipped_presets():
    p = load_preset(REPO / "presets" / "zero3-offload.toml")
    assert p.run.name == "zero3-offload"
    assert p.strategy.name == "deepspeed"
    assert (p.strategy.options.zero_stage, p.strategy.options.offload_optimizer) == (3, "cpu")
    assert p.launch.nproc_per_node == 2  # from ddp.toml
    from torch_handle.config.loader import tomllib  # tomli on Python 3.10

    single = tomllib.loads((REPO / "presets" / "single.toml").read_text())  # the root of the chain
    assert p.model.options.d_model == single["model"]["d_model"]
    assert (p.training.steps, p.training.lr) == (single["training"]["steps"], single["training"]["lr"])


def test_extends_is_relative_to_the_file_not_the_cwd(tmp_path, monkeypatch):
    write(tmp_path / "base" / "base.toml", "[training]\nsteps = 11\nlr = 0.5\n")
    child = write(tmp_path / "exp" / "child.toml", 'extends = "../base/base.toml"\n[training]\nlr = 0.25\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    p = load_preset(child)
    assert (p.training.steps, p.training.lr) == (11, 0.25)


def test_extends_merges_nested_tables(tmp_path):
    write(tmp_path / "base.toml",
          '[strategy]\nname = "deepspeed"\n[strategy.ds_config]\na = 1\n[strategy.ds_config.b]\nc = 2\n')
    child = write(tmp_path / "child.toml", 'extends = "base.toml"\n[strategy.ds_config.b]\nd = 3\n')
    assert load_preset(child).strategy.options.ds_config == {"a": 1, "b": {"c": 2, "d": 3}}


def test_child_that_switches_plugin_drops_inherited_plugin_options(tmp_path):
    write(tmp_path / "base.toml", '[strategy]\nname = "ddp"\nbucket_cap_mb = 5.0\n')
    child = write(tmp_path / "child.toml", 'extends = "base.toml"\n[strategy]\nname = "fsdp"\n')
    p = load_preset(child)
    assert p.strategy.name == "fsdp"
    # same plugin: the options are inherited
    same_plugin = write(tmp_path / "same.toml", 'extends = "base.toml"\n[strategy]\nname = "ddp"\n')
    assert load_preset(same_plugin).strategy.options.bucket_cap_mb == 5.0


def test_extends_cycle_and_self_and_missing(tmp_path):
    a = write(tmp_path / "a.toml", 'extends = "b.toml"\n')
    write(tmp_path / "b.toml", '# b\nextends = "a.toml"\n')
    e = err(a)
    assert "extends cycle: a.toml -> b.toml -> a.toml" in str(e)
    assert str(e).startswith(f"{tmp_path / 'b.toml'}:2: extends:")
    me = write(tmp_path / "me.toml", 'extends = "me.toml"\n')
    assert "extends cycle: me.toml -> me.toml" in str(err(me))
    lost = (write(tmp_path / "lost.toml", '[run]\nname = "x"\n')
            and write(tmp_path / "lost.toml", 'extends = "gone.toml"\n'))
    e = err(lost)
    assert str(e).startswith(f"{lost}:1: extends:") and "'gone.toml' does not exist" in str(e)
    bad = write(tmp_path / "bad.toml", "extends = 3\n")
    assert "expected a file name, got 3" in str(err(bad))


# ----------------------------------------------------------------------------------------------------------------
# --set overrides
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, table, key, expected", [
    ("training.steps=50", "training", "steps", 50),
    ("training.lr=1e-3", "training", "lr", 1e-3),
    ("training.lr=2", "training", "lr", 2.0),
    ("training.lr=3.5E-4", "training", "lr", 3.5e-4),
    ("training.lr=.001", "training", "lr", 1e-3),
    ("training.lr=5.", "training", "lr", 5.0),
    ("model.norm_first=True", "model", "norm_first", True),
    ("model.norm_first=true", "model", "norm_first", True),
    ("model.tie_embeddings=false", "model", "tie_embeddings", False),
    ("training.schedule=linear", "training", "schedule", "linear"),
    ('training.schedule="constant"', "training", "schedule", "constant"),
    ("run.name=my-run_2", "run", "name", "my-run_2"),
    ("run.name=123", "run", "name", "123"),  # a string field keeps the text as written
    ("run.name=true", "run", "name", "true"),
    ("run.name=2024-01-01", "run", "name", "2024-01-01"),
    ("run.output_dir=/tmp/some where", "run", "output_dir", "/tmp/some where"),
    ("launch.rdzv_endpoint=node0:29400", "launch", "rdzv_endpoint", "node0:29400"),
    ("launch.rdzv_endpoint=10.0.0.1:29400", "launch", "rdzv_endpoint", "10.0.0.1:29400"),
    (" training.steps = 9 ", "training", "steps", 9),
])
def test_set_is_typed_by_the_field(tmp_path, override, table, key, expected):
    overrides = [override]
    if table == "launch":
        overrides = ["strategy.name=ddp", "launch.nnodes=2", "launch.node_rank=1", override]
    p = load_preset(write(tmp_path / "p.toml", ""), overrides)
    value = getattr(getattr(p, table), key) if table in CORE_TABLES else getattr(getattr(p, table).options, key)
    assert value == expected and type(value) is type(expected)


def test_set_plugin_name_and_nested_ds_config(tmp_path):
    p = load_preset(write(tmp_path / "p.toml", ""), ["strategy.name=deepspeed", "strategy.zero_stage=3",
                                                     "strategy.ds_config.x=1", "strategy.ds_config.a.b=on",
                                                     "strategy.offload_optimizer=cpu"])
    assert p.strategy.name == "deepspeed"
    assert p.strategy.options.zero_stage == 3 and p.strategy.options.offload_optimizer == "cpu"
    assert p.strategy.options.ds_config == {"x": 1, "a": {"b": "on"}}


def test_set_strategy_name_on_a_zero_preset_switches_cleanly():
    """`--set strategy.name=ddp` on zero2.toml: the DeepSpeed options zero2 sets do not leak into ddp."""
    p = load_preset(REPO / "presets" / "zero2.toml", ["strategy.name=ddp", "strategy.bucket_cap_mb=5"])
    assert p.strategy.name == "ddp" and p.strategy.options.bucket_cap_mb == 5.0
    # order of --set does not matter: the switch resets the table first
    q = load_preset(REPO / "presets" / "zero2.toml", ["strategy.bucket_cap_mb=5", "strategy.name=ddp"])
    assert same(p, q)
    # setting the same name keeps the file's options
    r = load_preset(REPO / "presets" / "zero3.toml", ["strategy.name=deepspeed"])
    assert r.strategy.options.zero_stage == 3


def test_set_beats_file_beats_parent(tmp_path):
    write(tmp_path / "base.toml", "[training]\nsteps = 1\nwarmup_steps = 1\ngrad_accum = 1\n")
    child = write(tmp_path / "child.toml", 'extends = "base.toml"\n[training]\nsteps = 2\nwarmup_steps = 2\n')
    p = load_preset(child, ["training.steps=3"])
    assert (p.training.steps, p.training.warmup_steps, p.training.grad_accum) == (3, 2, 1)


def test_parse_override():
    assert parse_override("a.b=1") == (["a", "b"], 1)
    assert parse_override("a.b.c=x y") == (["a", "b", "c"], "x y")
    assert parse_override("a.b=k=v") == (["a", "b"], "k=v")
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    for bad in ("a.b", "a=1", "=1", ".b=1", "a.=1", "a..b=1"):
        with pytest.raises(PresetError, match="expected TABLE.KEY=VALUE"):
            parse_override(bad)


# ----------------------------------------------------------------------------------------------------------------
# Errors: one line, file, line, table.key, what is valid
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, overrides, where, parts", [
    ("[training]\nsteps = 5\nstepz = 3\n", [], ":3: training.stepz:",
     ["unknown key", "did you mean 'steps'?", "valid:"]),
    ("[training]\nlr = 0.1\n", ["training.stpes=3"], " (--set): training.stpes:", ["did you mean 'steps'?"]),
    ("\n[trainig]\nsteps = 3\n", [], ":2: trainig:", ["unknown table", "did you mean 'training'?"]),
    ("", ["trainig.steps=3"], " (--set): trainig:", ["did you mean 'training'?"]),
    ("[model]\nnmae = 'x'\n", [], ":2: model.nmae:", ["did you mean 'name'?"]),
    ("[training]\nsteps = '5'\n", [], ":2: training.steps:", ["expected an integer, got '5'"]),
    ("[training]\nsteps = 5.0\n", [], ":2: training.steps:", ["expected an integer, got 5.0"]),
    ("[model]\nnorm_first = 1\n", [], ":2: model.norm_first:", ["expected true or false, got 1"]),
    ("[training]\nlr = 'fast'\n", [], ":2: training.lr:", ["expected a number"]),
    ("[training]\nlr = nan\n", [], ":2: training.lr:", ["not a finite number"]),
    ("[training]\nlr = inf\n", [], ":2: training.lr:", ["not a finite number"]),
    ("[training]\nsteps = -1\n", [], ":2: training.steps:", ["-1 must be >= 1"]),
    ("[training]\nlr = 0\n", [], ":2: training.lr:", ["must be > 0"]),
    ("[training]\nmin_lr_ratio = 1.5\n", [], ":2: training.min_lr_ratio:", ["must be <= 1.0"]),
    ("[training]\nschedule = 'step'\n", [], ":2: training.schedule:", ["'cosine', 'linear', 'constant'"]),
    ("[model]\ndropout = 1.5\n", [], ":2: model.dropout:", ["<= 0.9"]),
    ("[model]\nd_model = 100\nn_heads = 3\n", [], ":3: model.n_heads:", ["does not divide d_model=100"]),
    ("[strategy]\nname = 'deepspeed'\nzero_stage = 4\n", [], ":3: strategy.zero_stage:", ["<= 3"]),
    ("[strategy]\nname = 'deepspeed'\noffload_param = 'cpu'\n", [], ":3: strategy.offload_param:", ["zero_stage = 3"]),
    ("[strategy]\nname = 'deepspeed'\nzero_stage = 3\noffload_param = 'nvme'\n", [], ":1: strategy.nvme_path:",
     ["required for nvme"]),
    ("[strategy]\nname = 'deepspeed'\n\n[strategy.ds_config.fp16]\nenabled = true\n", [], ":4: strategy.ds_config:",
     ["fp16.enabled contradicts training.precision = 'auto' (set training.precision = 'fp16' instead)"]),
    ("[training]\nprecision = 'fp32'\n[strategy]\nname = 'deepspeed'\nds_config = { bf16 = { enabled = true } }\n", [],
     ":5: strategy.ds_config:", ["bf16.enabled contradicts training.precision = 'fp32'"]),
    ("[strategy]\nname = 'deepspeed'\n", ["strategy.ds_config.fp16=true"], " (--set): strategy.ds_config:",
     ["fp16 must be a table"]),
    ("[strategy]\nname = 'deepspeed'\nzero_stage = 1\n", ["strategy.ds_config.zero_optimization.stage=3"],
     " (--set): strategy.ds_config:", ["contradicts zero_stage = 1"]),
    ("[strategy]\nname = 'deepspeed'\nds_config.train_batch_size = 64\n", [], ":3: strategy.ds_config:",
     ["train_batch_size = 64 contradicts"]),
    ("[model]\nname = 'gpt'\n", [], ":2: model.name:", ["unknown model 'gpt' (available: hf, transformer)"]),
    ("[strategy]\nname = 'deepspeeed'\n", [], ":2: strategy.name:", ["did you mean 'deepspeed'?", "ddp, deepspeed"]),
    ("[model]\nname = 3\n", [], ":2: model.name:", ["expected a plugin name"]),
    ("model = 3\n", [], ":1: model:", ["expected a table"]),
    ("[launch]\nnproc_per_node = 2\n", [], ":2: launch.nproc_per_node:", ["strategy 'single' runs one process"]),
    ("[strategy]\nname = 'ddp'\n[launch]\nnnodes = 2\nnode_rank = 2\nrdzv_endpoint = 'h:1'\n", [],
     ":5: launch.node_rank:", ["2 must be below nnodes (2)"]),
    ("[strategy]\nname = 'ddp'\n[launch]\nnnodes = 2\n", [], ":3: launch.rdzv_endpoint:", ["required when nnodes > 1"]),
    ("[launch]\nrdzv_endpoint = 'node0'\n", [], ":2: launch.rdzv_endpoint:", ["must look like 'host:port'"]),
    ("[launch]\nrdzv_endpoint = 'node0:99999'\n", [], ":2: launch.rdzv_endpoint:", ["port 1-65535"]),
    ("[run]\nname = 'a/b'\n", [], ":2: run.name:", ["'a/b' must use only letters"]),
    ("[run]\nname = '.hidden'\n", [], ":2: run.name:", ["must not start with '.'"]),
    ("", ["run.name=a/b"], " (--set): run.name:", ["'a/b'"]),
    ("", ["training.lr=nan"], " (--set): training.lr:", ["not a finite number"]),
    ("", ["training.steps=1e3"], " (--set): training.steps:", ["expected an integer, got 1000.0"]),
    ("", ["model.norm_first=yes"], " (--set): model.norm_first:", ["expected true or false, got 'yes'"]),
    ("", ['training.steps="5"'], " (--set): training.steps:", ["expected an integer, got '5'"]),
    ("[data]\nname = 'text'\n", [], ":1: data.path:", ["is required"]),
    ("[model]\nkind = 'encoder-decoder'\n[data]\nname = 'parallel'\npath = 'x'\nsrc_lang = 'de'\n", [],
     ":3: data.tgt_lang:", ["must differ from src_lang"]),
    ("[data]\nname = 'parallel'\npath = 'x'\n", [], ": model.kind:",
     ["'decoder' cannot train on data 'parallel'", "use kind = 'encoder-decoder'"]),
    ("[model]\nkind = 'encoder-decoder'\n", [], ":2: model.kind:", ["use kind = 'decoder'"]),
    ("[training]\nsteps = 1\n", ["training.steps.x=1"], " (--set): training.steps.x:", ["is a value, not a table"]),
    ("[training]\nsteps = = 1\n", [], ":2: ", ["TOML syntax error", "(column 9)"]),
    ("[training]\nsteps = 1\n[training]\nlr = 1\n", [], ":3: ", ["TOML syntax error"]),
])
def test_errors_name_file_line_key_and_fix(tmp_path, body, overrides, where, parts):
    path = write(tmp_path / "p.toml", body)
    message = str(err(path, overrides))
    assert message.startswith(f"{path}{where}"), message
    for part in parts:
        assert part in message, (part, message)


def test_error_in_a_parent_names_the_parent_and_its_line(tmp_path):
    base = write(tmp_path / "base.toml", "# base\n[training]\nsteps = 5\nstepz = 3\n")
    child = write(tmp_path / "sub" / "child.toml", 'extends = "../base.toml"\n[training]\nlr = 0.1\n')
    assert str(err(child)).startswith(f"{base}:4: training.stepz: unknown key")
    # the child's own value is blamed on the child, even when the parent also sets it
    write(tmp_path / "base2.toml", "[training]\nsteps = 5\n")
    child2 = write(tmp_path / "child2.toml", 'extends = "base2.toml"\n\n[training]\nsteps = 0\n')
    assert str(err(child2)).startswith(f"{child2}:4: training.steps:")


def test_unknown_key_lists_valid_keys_of_the_selected_plugin(tmp_path):
    path = write(tmp_path / "p.toml", "[strategy]\nname = 'ddp'\nzero_stage = 2\n")
    message = str(err(path))
    assert "strategy.zero_stage: unknown key" in message
    assert ("valid: broadcast_buffers, bucket_cap_mb, find_unused_parameters, gradient_as_bucket_view, name"
            in message)


def test_missing_preset_file_and_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    message = str(err("no-such-preset"))
    assert message.startswith("no-such-preset: no such preset file") and "zero2" in message
    assert str(err(tmp_path / "x.toml")) == f"{tmp_path / 'x.toml'}: no such preset file"
    assert "not a preset file" in str(err(tmp_path))
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"# caf\xe9\n")
    assert "undecodable byte at offset 5" in str(err(bad))


def test_bare_preset_name_is_looked_up_in_presets(monkeypatch):
    monkeypatch.chdir(REPO)
    assert load_preset("zero2").run.name == "zero2"


# ----------------------------------------------------------------------------------------------------------------
# Round trips: `presets show` output loads back into an equal Preset
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_presets_show_round_trip_of_every_shipped_preset(tmp_path, monkeypatch, preset):
    from click.testing import CliRunner

    from handle_cli.main import cli

    monkeypatch.chdir(REPO)
    overrides = [*NEEDS.get(preset.stem, []), "training.lr=1e-3"]
    args = [a for o in overrides for a in ("--set", o)]
    result = CliRunner().invoke(cli, ["presets", "show", f"presets/{preset.name}", *args])
    assert result.exit_code == 0, result.stderr
    comment, _, text = result.stdout.partition("\n")
    original = load_preset(preset, overrides)
    assert comment.startswith("# training.precision: auto → ") and original.training.precision == "auto"
    assert text == dump_preset(original)
    again = load_preset(write(tmp_path / "shown.toml", text))
    assert same(again, original) and again.training.lr == 1e-3
    assert dump_preset(again) == text  # a fixed point
    assert preset_to_dict(again) == preset_to_dict(original)


def test_round_trip_of_awkward_values(tmp_path):
    overrides = ['run.name=x.y_z-1', 'run.output_dir=/tmp/a "quoted" dir', "strategy.name=deepspeed",
                 "strategy.ds_config.a.b=[1, 2]", "strategy.ds_config.c='s'", "profiler.name=torch",
                 "profiler.ranks=[0, 1]", "training.lr=1e-7", "training.grad_clip=0"]
    original = load_preset(write(tmp_path / "p.toml", ""), overrides)
    again = load_preset(write(tmp_path / "dumped.toml", dump_preset(original)))
    assert same(again, original)
    assert again.strategy.options.ds_config == {"a": {"b": [1, 2]}, "c": "s"}


def test_presets_show_cli_output_loads_back(tmp_path):
    out = subprocess.run([sys.executable, "-m", "handle_cli", "presets", "show", "presets/zero2.toml", "--set",
                          "training.lr=1e-3"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    again = load_preset(write(tmp_path / "shown.toml", out.stdout))
    expected = load_preset(REPO / "presets" / "zero2.toml", ["training.lr=1e-3"])
    assert same(again, expected) and again.training.lr == 1e-3


# ----------------------------------------------------------------------------------------------------------------
# Dataset pre-flight (torch-free checks that `handle run` does before launching)
# ----------------------------------------------------------------------------------------------------------------


def _data_options(tmp_path, overrides):
    return load_preset(write(tmp_path / "p.toml", ""), overrides)


def _preflight(preset):
    return get_registry().get("dataset", preset.data.name).preflight(preset.data.options)


def test_preflight_text(tmp_path):
    write(tmp_path / "corpus" / "a.txt", "hello world\n" * 20)
    write(tmp_path / "corpus" / ".hidden", "\xff")
    _preflight(_data_options(tmp_path, ["data.name=text", f"data.path={tmp_path / 'corpus'}", "data.seq_len=4"]))
    _preflight(_data_options(tmp_path, ["data.name=text", f"data.path={tmp_path}/corpus/*.txt", "data.seq_len=4",
                                        f"data.valid_path={tmp_path}/corpus/a.txt"]))
    (tmp_path / "corpus" / "b.txt").write_bytes(b"ok\n\xc3\x28 bad")
    with pytest.raises(DataError, match=r"b\.txt: not UTF-8 text \(undecodable byte at offset 3\)"):
        _preflight(_data_options(tmp_path, ["data.name=text", f"data.path={tmp_path / 'corpus'}"]))
    write(tmp_path / "blank.txt", " \n\n")
    with pytest.raises(DataError, match="empty corpus"):
        _preflight(_data_options(tmp_path, ["data.name=text", f"data.path={tmp_path / 'blank.txt'}"]))
    with pytest.raises(DataError, match="no files match"):
        _preflight(_data_options(tmp_path, ["data.name=text", f"data.path={tmp_path}/*.nothing"]))


def test_preflight_text_reads_only_a_head_of_huge_files(tmp_path, monkeypatch):
    import handle_plugins.datasets as ds

    monkeypatch.setattr(ds, "PREFLIGHT_BYTES", 10)
    (tmp_path / "big.txt").write_bytes(b"a" * (ds._HEAD_BYTES + 5) + b"\xff")
    _preflight(_data_options(tmp_path, ["data.name=text", f"data.path={tmp_path / 'big.txt'}"]))
    (tmp_path / "big.txt").write_bytes(b"\xe2\x82" + b"a" * 100)  # split multi-byte char at the head
    with pytest.raises(DataError, match="offset 0"):
        _preflight(_data_options(tmp_path, ["data.name=text", f"data.path={tmp_path / 'big.txt'}"]))


def _parallel(tmp_path, files):
    root = tmp_path / "pairs"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return _data_options(tmp_path, ["model.kind=encoder-decoder", "data.name=parallel", f"data.path={root}"])


GOOD_PAIRS = {"train.en": "a\nb\n", "train.de": "x\ny\n", "valid.en": "c\n", "valid.de": "z\n"}


def test_preflight_parallel(tmp_path):
    _preflight(_parallel(tmp_path, GOOD_PAIRS))
    with pytest.raises(DataError, match=r"train\.en has 2 lines but .*train\.de has 3"):
        _preflight(_parallel(tmp_path, {**GOOD_PAIRS, "train.de": "x\ny\nz"}))
    with pytest.raises(DataError, match=r"valid\.de: no such file"):
        (tmp_path / "pairs" / "valid.de").unlink()
        _preflight(_parallel(tmp_path, {k: v for k, v in GOOD_PAIRS.items() if k != "valid.de"}))
    with pytest.raises(DataError, match=r"valid\.en: not UTF-8 text \(undecodable byte at offset 2\)"):
        _preflight(_parallel(tmp_path, {**GOOD_PAIRS, "valid.en": b"c\n\x80\n"}))
    with pytest.raises(DataError, match=r"train\.en: empty corpus"):
        _preflight(_parallel(tmp_path, {**GOOD_PAIRS, "train.en": "", "train.de": ""}))


def test_preflight_messages_match_the_loaders(tmp_path):
    """The pre-flight and the loader that runs in the workers say the same thing about the same file."""
    from torch_handle.data import corpus as data
    (tmp_path / "bad.txt").write_bytes("héllo\n".encode() + b"\xfe")
    opts = _data_options(tmp_path, ["data.name=text", f"data.path={tmp_path / 'bad.txt'}"])
    with pytest.raises(DataError) as ours:
        _preflight(opts)
    with pytest.raises(DataError) as theirs:
        data.read_text(tmp_path / "bad.txt")
    assert str(ours.value) == str(theirs.value)
    p = _parallel(tmp_path, {**GOOD_PAIRS, "train.de": "x\r\ny\u2028z\n"})  # splitlines() semantics: 3 lines
    with pytest.raises(DataError) as ours:
        _preflight(p)
    with pytest.raises(DataError) as theirs:
        data.read_parallel(tmp_path / "pairs", "train", "en", "de")
    assert str(ours.value) == str(theirs.value)


# ----------------------------------------------------------------------------------------------------------------
# Plugin registry: error boundary
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class FancyConfig:
    depth: int = 1


def _build(*args, **kwargs):  # pragma: no cover - never called here
    raise AssertionError


class Misspelled:
    @hookimpl
    def handle_register_strategy(self, register):  # missing the final 's'
        register("fancy", FancyConfig, _build)


class Raises:
    @hookimpl
    def handle_register_strategies(self, register):
        register("fancy", FancyConfig, _build)
        raise RuntimeError("no GPU\nfound")


class RegistersBadConfig:
    @hookimpl
    def handle_register_models(self, register):
        register("weird", dict, _build)


class Duplicate:
    @hookimpl
    def handle_register_strategies(self, register):
        register("ddp", FancyConfig, _build)


class Good:
    @hookimpl
    def handle_register_strategies(self, register):
        register("fancy", FancyConfig, _build, "a fancy strategy")


def _info(name):
    return PluginInfo(name=name, distribution="test-dist", version="0", builtin=False)


def test_misspelled_hook_is_recorded_as_failed():
    reg = PluginRegistry()
    reg.add_plugin(Misspelled(), _info("misspelled"))
    info = reg.plugins["misspelled"]
    assert info.status == "failed"
    assert info.error.startswith("bad hook:") and "handle_register_strategy" in info.error
    assert "\n" not in info.error
    assert info.registered == {} and reg.names("strategy") == []
    assert not reg.pm.is_registered(Misspelled)


def test_hook_that_raises_is_failed_and_its_names_are_withdrawn():
    reg = load_registry()
    builtins = {k: reg.names(k) for k in ("model", "dataset", "strategy", "profiler")}
    reg.add_plugin(Raises(), _info("raiser"))
    info = reg.plugins["raiser"]
    assert info.status == "failed"
    assert info.error == "handle_register_strategies raised RuntimeError: no GPU found"
    assert "fancy" not in reg.names("strategy")
    assert {k: reg.names(k) for k in builtins} == builtins  # the others keep working


def test_preset_selecting_a_name_of_a_failed_plugin_names_plugin_and_cause(tmp_path):
    reg = load_registry()
    reg.add_plugin(Raises(), _info("raiser"))
    path = write(tmp_path / "p.toml", "[strategy]\nname = 'fancy'\n")
    message = str(err(path, registry=reg))
    assert message.startswith(f"{path}:2: strategy.name: strategy 'fancy' is provided by plugin 'raiser'")
    assert "failed to load: handle_register_strategies raised RuntimeError: no GPU found" in message
    # a name nobody registered: the failed plugins are mentioned next to what is available
    message = str(err(write(tmp_path / "q.toml", "[strategy]\nname = 'other'\n"), registry=reg))
    assert "unknown strategy 'other'" in message and "plugins that failed to load: raiser" in message


def test_plugin_named_like_the_preset_value_fails_at_import(tmp_path):
    reg = load_registry()
    info = _info("fancy")
    reg.plugins[info.name] = info
    reg._fail(info, None, "import failed: ModuleNotFoundError: No module named 'fancy_pkg'")
    message = str(err(write(tmp_path / "p.toml", "[strategy]\nname = 'fancy'\n"), registry=reg))
    assert "strategy plugin 'fancy' failed to load: import failed: ModuleNotFoundError" in message


def test_bad_registrations_fail_only_their_plugin():
    reg = load_registry()
    reg.add_plugin(RegistersBadConfig(), _info("bad-config"))
    assert reg.plugins["bad-config"].status == "failed"
    assert "config_cls must be a dataclass" in reg.plugins["bad-config"].error
    reg.add_plugin(Duplicate(), _info("dup"))
    assert reg.plugins["dup"].status == "failed"
    assert "'ddp' is already registered by plugin 'strategies'" in reg.plugins["dup"].error
    assert reg.get("strategy", "ddp").plugin == "strategies"
    reg.add_plugin(Good(), _info("good"))
    assert reg.plugins["good"].status == "loaded" and reg.plugins["good"].registered == {"strategy": ["fancy"]}
    preset = preset_from_dict({"strategy": {"name": "fancy", "depth": 3}}, reg)
    assert preset.strategy.options == FancyConfig(depth=3)


def test_check_preset_bug_in_a_plugin_is_one_line(tmp_path):
    def check(options, preset):
        raise KeyError("oops")

    class BuggyCheck:
        @hookimpl
        def handle_register_strategies(self, register):
            register("buggy", FancyConfig, _build, "", check)

    reg = load_registry()
    reg.add_plugin(BuggyCheck(), _info("buggy-plugin"))
    message = str(err(write(tmp_path / "p.toml", "[strategy]\nname = 'buggy'\n"), registry=reg))
    assert "strategy.name: the check of strategy 'buggy' (plugin 'buggy-plugin') failed: KeyError" in message


def test_invalid_value_carries_the_key():
    e = InvalidValue("steps", "must be positive")
    assert (e.key, e.message, str(e)) == ("steps", "must be positive", "steps: must be positive")


@pytest.mark.cuda
def test_nccl_needs_a_cuda_device_per_process(repo_root):
    torch = pytest.importorskip("torch")
    n = torch.cuda.device_count()
    with pytest.raises(PresetError, match=rf"launch.nproc_per_node: {n + 1} processes but {n} CUDA device"):
        load_preset(repo_root / "presets" / "ddp.toml", ["launch.backend=nccl", f"launch.nproc_per_node={n + 1}"])


def test_the_eval_table_names_an_unknown_task_a_missing_directory_and_a_bad_limit(tmp_path):
    """``[eval]`` (issue 50) is checked with the preset: task names against the include directories and the
    harness's own (the close names listed), each include directory, ``limit`` >= 1; a preset without tasks never
    imports the harness."""
    pytest.importorskip("lm_eval", reason="needs the eval extra")
    tasks = REPO / "tests" / "fixtures" / "eval_tasks"
    path = write(tmp_path / "p.toml", f'[eval]\ntasks = ["handle_wikitext_clze"]\ninclude_paths = ["{tasks}"]\n')
    assert str(err(path)) == (f"{path}:2: eval.tasks: unknown task 'handle_wikitext_clze' (close: "
                              "handle_wikitext_cloze, handle_wikitext_ppl, paloma_wikitext_103)")
    assert str(err(path, [f"eval.include_paths=['{tmp_path / 'none'}']", "eval.tasks=['arc_easy']"])) == (
        f"{path} (--set): eval.include_paths: {tmp_path / 'none'}: no such directory")
    assert "eval.limit: 0 must be >= 1" in str(err(path, ["eval.tasks=['handle_wikitext_cloze']", "eval.limit=0"]))
    p = load_preset(path, ["eval.tasks=['handle_wikitext_cloze', 'arc_easy']", "eval.every=5"])
    assert p.eval.tasks == ["handle_wikitext_cloze", "arc_easy"] and p.eval.every == 5 and p.eval.limit is None
