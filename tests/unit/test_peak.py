"""The measured matmul peak behind MFU: measured, cached per device and thread count, never hard-coded."""

from __future__ import annotations

import json

import torch

from torch_handle.observe import peak
def test_measure_gives_positive_flops_per_dtype_quickly() -> None:
    result = peak.measure_peak("cpu", dtypes=("fp32", "bf16"), sizes=(64, 128), seconds_per_size=0.02)
    # any CPU multiplies 128x128 faster than 10 MFLOP/s in fp32 and 1 MFLOP/s in emulated bf16, even shared with
    # a dozen busy processes (the figure is wall-clock based: a busy machine lowers it, which the bound allows)
    assert result["fp32"] > 1e7 and result["bf16"] > 1e6


def test_a_second_call_reads_the_cache_and_the_key_holds_threads_and_torch(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HANDLE_PEAK_CACHE", str(tmp_path / "peak.json"))
    calls = []

    def fake_measure(device, dtypes=peak.DTYPES, **kw):
        calls.append(device)
        return {d: 1e12 for d in dtypes}

    monkeypatch.setattr(peak, "measure_peak", fake_measure)
    first = peak.peak_flops("cpu")
    second = peak.peak_flops("cpu")
    assert calls == ["cpu"] and not first["cached"] and second["cached"]
    assert f"x{torch.get_num_threads()} threads" in first["key"] and torch.__version__ in first["key"]
    assert peak.cached_peak("cpu", "bf16", torch.get_num_threads()) == 1e12
    assert peak.cached_peak("cpu", "bf16", torch.get_num_threads() + 7) is None  # another thread count: unknown
    stored = json.loads((tmp_path / "peak.json").read_text())
    assert list(stored) == [first["key"]]
    peak.peak_flops("cpu", refresh=True)
    assert len(calls) == 2


def test_measuring_leaves_the_global_rng_alone() -> None:
    """A worker measures its peak after seeding (on a cold cache only): the run must not depend on the cache."""
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    peak.measure_peak("cpu", dtypes=("fp32",), sizes=(32,), seconds_per_size=0.001)
    assert torch.equal(torch.rand(4), expected)


def test_the_mfu_peak_measures_only_the_run_s_precision_and_keeps_the_others(tmp_path, monkeypatch) -> None:
    """A cold cache on a CPU that emulates bf16: an fp32 run must not spend seconds measuring bf16 and fp16."""
    monkeypatch.setenv("HANDLE_PEAK_CACHE", str(tmp_path / "peak.json"))
    asked = []

    def fake_measure(device, dtypes=peak.DTYPES, **kw):
        asked.append(tuple(dtypes))
        return {d: {"fp32": 2e11, "bf16": 3e11, "fp16": 1e9}[d] for d in dtypes}

    monkeypatch.setattr(peak, "measure_peak", fake_measure)
    threads = torch.get_num_threads()
    assert peak.peak_for_mfu("cpu", "fp32", threads)[0] == 2e11
    assert peak.peak_for_mfu("cpu", "bf16", threads)[0] == 3e11
    assert peak.peak_for_mfu("cpu", "fp32", threads)[0] == 2e11  # cached: nothing measured again
    assert asked == [("fp32",), ("bf16",)]
    assert peak.peak_flops("cpu")["fp16"] == 1e9 and asked[-1] == ("fp16",)  # `handle env --peak`: the rest
