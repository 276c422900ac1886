"""torch_handle.common: one units convention, one atomic write, one precision map, one test-hook parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torch_handle.common import fsio
from torch_handle.common.precision import ELEMENT_BYTES, PRECISIONS, torch_dtype
from torch_handle.common.units import fmt_bytes, parse_bytes, size_label
from torch_handle.plan.bench_comm import parse_size


def test_gb_is_decimal_and_gib_binary_in_every_parser():
    for parse in (parse_bytes, parse_size):
        assert parse("1GB") == parse("1gb") == 10**9
        assert parse("1GiB") == parse("1G") == parse("1g") == 2**30
        assert parse("3MB") == 3 * 10**6 and parse("3MiB") == parse("3M") == 3 << 20
        assert parse("2kB") == parse("2KB") == 2000 and parse("2KiB") == parse("2K") == 2048
        assert parse("4096") == parse("4096B") == parse(" 4096 ") == 4096
    assert parse_bytes("1.5GiB") == 3 << 29 and parse_bytes("1e9") == 10**9
    for bad in ("", "K", "1X", "12XB", "-1GB", "0", "0.1"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    for bad in ("1.5M", "1e6"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_bytes(bad, whole=True)


def test_fmt_bytes_both_precisions():
    assert [fmt_bytes(n) for n in (None, 0, 300, 1536, 38_377_881, 3 << 40)] == \
        ["-", "0 B", "300 B", "1.5 KiB", "36.6 MiB", "3.0 TiB"]
    assert [fmt_bytes(n, precise=True) for n in (300, 1536, 8_420_000, 108_003_328, 80 << 30, 1000 << 20)] == \
        ["300 B", "1.50 KiB", "8.03 MiB", "103 MiB", "80.00 GiB", "1000 MiB"]


def test_size_label_reads_back():
    for n in (1, 1000, 1024, 3 << 20, 1 << 30, 1536):
        assert parse_size(size_label(n)) == n


def test_precisions():
    import torch

    assert PRECISIONS == ("fp32", "bf16", "fp16") and set(ELEMENT_BYTES) == set(PRECISIONS)
    for name in PRECISIONS:
        assert torch.empty(0, dtype=torch_dtype(name)).element_size() == ELEMENT_BYTES[name]
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        torch_dtype("fp8")


def test_common_imports_no_torch():
    code = ("import sys, torch_handle.common.units, torch_handle.common.fsio, torch_handle.common.precision, "
            "torch_handle.common.text, torch_handle.common.testhooks; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_atomic_writes(tmp_path):
    target = tmp_path / "run.json"
    fsio.write_json_atomic(target, {"a": 1})
    assert target.read_text() == '{\n  "a": 1\n}\n'
    fsio.write_json_atomic(target, {"b": 2}, indent=None)
    assert json.loads(target.read_text()) == {"b": 2} and target.read_text().count("\n") == 1
    with pytest.raises(TypeError):
        fsio.write_json_atomic(target, {"c": object()})
    with pytest.raises(RuntimeError):
        with fsio.replacing(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("the writer failed")
    assert json.loads(target.read_text()) == {"b": 2}  # untouched, and no temporary file left behind
    assert os.listdir(tmp_path) == ["run.json"]
    assert fsio.temporary_path(target).name.startswith(".run.json.")
