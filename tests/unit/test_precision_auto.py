"""``training.precision = "auto"``: the resolver on a CPU (the probe faked) and on CUDA (the capability faked, no GPU
needed), its cache and key, and where the launcher applies it (new runs, resumes, nodes joining a shared run
directory, ranks of several nodes). The real probe runs in tests/test_precision.py."""

from __future__ import annotations

import json
import sys

import pytest

from torch_handle.common.precision import ISA_ENV
from torch_handle.config.loader import dump_preset, load_preset
from torch_handle.launch import precision as prec
from tests.helpers import tiny_preset



@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.toml"
    # the tests' tiny preset on 1 rank with the default precision (auto)
    text = tiny_preset(tmp_path / "runs", steps=4).replace('precision = "fp32"\n', "")
    path.write_text(text.replace("nproc_per_node = 2", "nproc_per_node = 1"))
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "peak.json"
    monkeypatch.setenv("HANDLE_PEAK_CACHE", str(path))
    for name in ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    return path


def fake_probe(monkeypatch, ratio: float) -> list[int]:
    """The CPU probe measures ``ratio`` (counted in the returned list); the device is the CPU."""
    calls: list[int] = []

    def measure(**kw):
        calls.append(1)
        return {"fp32": 1e11, "bf16": ratio * 1e11, "ratio": ratio, "seconds": 0.05}

    monkeypatch.setattr(prec, "measure_cpu_probe", measure)
    monkeypatch.setattr(prec, "target_device", lambda preset: "cpu")
    return calls


def test_the_default_is_auto_and_any_other_value_is_one_line_naming_the_valid_ones(tiny):
    from torch_handle.errors import PresetError

    assert load_preset(tiny).training.precision == "auto"
    with pytest.raises(PresetError) as e:
        load_preset(tiny, ["training.precision=fp8"])
    assert "training.precision" in str(e.value) and "auto" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("ratio, expected, reason", [
    (0.021, "fp32", "auto → fp32: bf16 matmul 0.021× fp32 on this CPU"),
    (1.1, "fp32", "auto → fp32: bf16 matmul 1.10× fp32 on this CPU"),  # no clear gain: fp32's accuracy
    (3.1, "bf16", "auto → bf16: bf16 matmul 3.10× fp32 on this CPU"),
])
def test_cpu_bf16_only_when_the_probe_finds_it_clearly_faster(tiny, cache, monkeypatch, ratio, expected, reason):
    fake_probe(monkeypatch, ratio)
    got = prec.resolve(load_preset(tiny))
    assert (got.precision, got.reason, got.ratio) == (expected, reason, ratio)


def test_an_explicit_precision_is_kept_and_the_probe_not_run(tiny, cache, monkeypatch):
    calls = fake_probe(monkeypatch, 0.02)
    got = prec.resolve(load_preset(tiny, ["training.precision=fp16"]))
    assert (got.precision, got.reason, calls) == ("fp16", "set in the preset", [])


@pytest.mark.parametrize("capability, strategy, sets, expected, why", [
    ((9, 0), "fsdp", (), "bf16", "auto → bf16: CUDA compute capability 9.0"),
    ((8, 0), "ddp", (), "bf16", "auto → bf16: CUDA compute capability 8.0"),
    ((8, 6), "deepspeed", (), "bf16", "auto → bf16: CUDA compute capability 8.6"),
    ((7, 5), "ddp", (), "fp16", "7.5 has no bf16 tensor cores; fp16 with loss scaling (ddp)"),
    ((7, 0), "single", ("launch.nproc_per_node=1",), "fp16", "fp16 with loss scaling (single)"),
    ((7, 0), "deepspeed", (), "fp16", "fp16 with loss scaling (deepspeed)"),
    ((7, 0), "scratch-fsdp", (), "fp16", "fp16 with loss scaling (scratch-fsdp)"),
    ((7, 0), "scratch-ddp", (), "fp16", "fp16 with loss scaling (scratch-ddp)"),
    ((7, 0), "fsdp", (), "fp32", "7.0 has no bf16 tensor cores and fsdp has no fp16 loss scaling"),
    ((7, 0), "ddp", ("parallel.pp=2", "training.grad_accum=2"), "fp32", "no bf16 tensor cores and parallel.pp > 1"),
])
def test_cuda_by_compute_capability_and_fp16_where_the_strategy_scales_the_loss(tiny, monkeypatch, capability,
                                                                                 strategy, sets, expected, why):
    import torch

    monkeypatch.setattr(prec, "target_device", lambda preset: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    # is_bf16_supported says True on a V100 (emulated): it must not be what decides
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
    preset = load_preset(tiny, [f"strategy.name={strategy}", "launch.nproc_per_node=2", *sets])
    got = prec.resolve(preset)
    assert got.precision == expected and why in got.reason and got.reason.startswith(f"auto → {expected}: ")


def test_the_lowest_capability_of_the_node_decides(tiny, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: [(9, 0), (7, 0)][i])
    assert prec.cuda_capability(load_preset(tiny, ["strategy.name=ddp", "launch.nproc_per_node=2"])) == (7, 0)


def test_the_backend_decides_the_device_without_torch_where_it_can(tiny, monkeypatch):
    monkeypatch.setattr(prec, "_cuda_possible", lambda: False)
    preset = load_preset(tiny)
    assert prec.target_device(preset) == "cpu" and preset.launch.backend == "auto"
    assert prec.target_device(load_preset(tiny, ["launch.backend=gloo"])) == "cpu"
    preset.launch.backend = "nccl"  # (the loader refuses nccl here: no GPU)
    assert prec.target_device(preset) == "cuda"


def test_the_probe_is_cached_under_a_key_with_the_isa_env_cpu_and_torch(cache, monkeypatch):
    import torch

    calls = fake_probe(monkeypatch, 2.0)
    first, second = prec.probe_cpu(), prec.probe_cpu()
    assert len(calls) == 1 and not first["cached"] and second["cached"] and second["ratio"] == 2.0
    assert torch.__version__ in first["key"] and "default ISA" in first["key"]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    emulated = prec.probe_cpu()
    assert len(calls) == 2 and not emulated["cached"] and "ONEDNN_MAX_CPU_ISA=AVX2" in emulated["key"]
    assert emulated["key"] != first["key"] and set(json.loads(cache.read_text())) == {first["key"], emulated["key"]}


def test_the_mfu_peak_key_changes_with_the_isa_env_too(monkeypatch):
    from torch_handle.observe.peak import device_key

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    plain = device_key("cpu", 1)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    avx2 = device_key("cpu", 1)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert len({plain, avx2, device_key("cpu", 1)}) == 3 and avx2.endswith("|ONEDNN_MAX_CPU_ISA=AVX2")
    assert plain.endswith("|default ISA")  # never the key of an entry written before the ISA was keyed


def test_a_new_run_gets_the_concrete_precision_and_the_reason(tiny, cache, monkeypatch, no_launch):
    from torch_handle.launch.run import prepare_run

    fake_probe(monkeypatch, 0.02)
    loaded, run_dir = prepare_run(str(tiny), ("launch.nproc_per_node=1",), None, None)
    info = json.loads((run_dir / "run.json").read_text())
    assert loaded.training.precision == "fp32" and 'precision = "fp32"' in (run_dir / "preset.toml").read_text()
    assert info["precision"] == "fp32"
    assert info["precision_reason"] == "auto → fp32: bf16 matmul 0.02× fp32 on this CPU"
    assert "precision_warning" not in info


def test_an_explicit_bf16_on_a_cpu_that_emulates_it_runs_with_one_warning(tiny, cache, monkeypatch, no_launch):
    from handle_cli.runner import precision_lines
    from torch_handle.launch.run import prepare_run

    fake_probe(monkeypatch, 0.03)
    loaded, run_dir = prepare_run(str(tiny), ("launch.nproc_per_node=1", "training.precision=bf16"), None, None)
    assert loaded.training.precision == "bf16"
    assert precision_lines(loaded, run_dir) == [
        "precision: bf16 (set in the preset)",
        'warning: training.precision = "bf16" on a CPU that emulates it: bf16 matmul 0.03× fp32 here '
        '(training.precision = "auto" or "fp32" would be faster)']
    fake_probe(monkeypatch, 2.5)
    prec.probe_cpu(refresh=True)
    _, fast = prepare_run(str(tiny), ("launch.nproc_per_node=1", "training.precision=bf16"), None, None)
    assert "precision_warning" not in json.loads((fast / "run.json").read_text())


def test_a_resume_keeps_the_runs_precision_and_auto_means_that_one(tiny, cache, monkeypatch, no_launch):
    from torch_handle.checkpoint.resume import RESUME_PRESET
    from torch_handle.errors import RunDirError
    from torch_handle.launch.run import prepare_run
    from torch_handle.rundir import update_run_info

    fake_probe(monkeypatch, 3.0)
    _, run_dir = prepare_run(str(tiny), ("launch.nproc_per_node=1",), None, None)
    update_run_info(run_dir, status="stopped")
    fake_probe(monkeypatch, 0.02)  # the machine changed since: the run keeps its bf16
    prec.probe_cpu(refresh=True)
    loaded, _ = prepare_run(None, ("training.precision=auto",), None, run_dir)
    assert loaded.training.precision == "bf16" and not (run_dir / RESUME_PRESET).exists()
    update_run_info(run_dir, status="stopped")
    with pytest.raises(RunDirError, match="cannot change training.precision on --resume"):
        prepare_run(None, ("training.precision=fp32",), None, run_dir)


NODES = ("launch.nnodes=2", "launch.rdzv_endpoint=127.0.0.1:29555", "launch.nproc_per_node=1")


def test_a_node_joining_a_shared_run_directory_takes_its_precision(tiny, cache, monkeypatch, no_launch):
    from torch_handle.launch.run import prepare_run

    run_dir = tiny.parent / "shared"
    fake_probe(monkeypatch, 3.0)
    _, made = prepare_run(str(tiny), (*NODES, "launch.node_rank=0"), run_dir, None)
    fake_probe(monkeypatch, 0.02)  # node 1 emulates bf16: alone it would pick fp32
    prec.probe_cpu(refresh=True)
    before = (run_dir / "preset.toml").read_text()
    joined, same = prepare_run(str(tiny), (*NODES, "launch.node_rank=1"), run_dir, None)
    assert same == made and joined.training.precision == "bf16" and 'precision = "bf16"' in before
    assert (run_dir / "preset.toml").read_text() == before


def test_ranks_of_several_nodes_take_rank_0s_precision(tiny, monkeypatch):
    import torch.distributed as dist

    from torch_handle.train.worker import agree_on_precision

    def broadcast(objects, src=0):
        assert src == 0
        objects[0] = "bf16"

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    one = load_preset(tiny, ["training.precision=fp32"])
    agree_on_precision(one)  # one node: nothing asked
    assert one.training.precision == "fp32"
    nodes = load_preset(tiny, ["training.precision=fp32", *NODES])
    agree_on_precision(nodes)
    assert nodes.training.precision == "bf16"


def test_presets_show_keeps_auto_and_says_what_it_resolves_to(tiny, cache, monkeypatch):
    from click.testing import CliRunner

    from handle_cli.main import cli

    fake_probe(monkeypatch, 0.02)
    result = CliRunner().invoke(cli, ["presets", "show", str(tiny)])
    assert result.exit_code == 0, result.output
    first, _, rest = result.stdout.partition("\n")
    assert first == "# training.precision: auto → fp32: bf16 matmul 0.02× fp32 on this CPU"
    assert rest == dump_preset(load_preset(tiny)) and 'precision = "auto"' in rest


def test_the_launcher_side_imports_no_torch_when_the_probe_is_cached(tiny, cache, monkeypatch):
    import subprocess

    fake_probe(monkeypatch, 2.0)
    prec.probe_cpu()
    code = ("import sys; from torch_handle.config.loader import load_preset; from torch_handle.launch import precision"
            " as p; p._cuda_possible = lambda: False; r = p.resolve(load_preset(sys.argv[1]));"
            " print(r.precision, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tiny)], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["bf16", "False"], out.stderr[-2000:]


def test_the_probe_restores_the_thread_count(monkeypatch):
    import torch

    before = torch.get_num_threads()
    seen = []
    real = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: (seen.append(torch.get_num_threads()), real(a, b))[1])
    out = prec.measure_cpu_probe(n=32, budget_s=0.0, max_s=0.5)
    assert set(seen) == {1} and torch.get_num_threads() == before
    assert out["fp32"] > 0 and out["bf16"] > 0 and out["ratio"] == out["bf16"] / out["fp32"]
