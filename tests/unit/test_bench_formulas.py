"""The pure half of ``handle bench comm``: sizes, ops and nccl-tests' bandwidth formulas (no torch, no processes)."""

from __future__ import annotations

import math

import pytest

from torch_handle.common.units import size_label
from torch_handle.plan.bench_comm import (MAX_SIZE, OPS, algbw_gbps, bus_factor, busbw_gbps, check_size, element_count,
                                          parse_ops, parse_size, parse_sizes)


@pytest.mark.parametrize("op, n, factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75), ("all_reduce", 1, 0.0),
    ("all_gather", 2, 0.5), ("all_gather", 8, 0.875), ("reduce_scatter", 4, 0.75), ("reduce_scatter", 1, 0.0),
    ("broadcast", 2, 1.0), ("broadcast", 16, 1.0),
])
def test_bus_factor_is_nccl_tests(op, n, factor):
    """doc/PERFORMANCE.md: all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1."""
    assert bus_factor(op, n) == pytest.approx(factor)


def test_bandwidths():
    # 1 GB in 1 s is 1 GB/s (10^9 bytes, not GiB); 64 MiB in 41 ms
    assert algbw_gbps(10**9, 1e6) == pytest.approx(1.0)
    assert algbw_gbps(64 << 20, 41_000.0) == pytest.approx((64 << 20) / 0.041 / 1e9)
    assert busbw_gbps("all_reduce", 10**9, 1e6, 8) == pytest.approx(1.75)
    assert busbw_gbps("all_gather", 10**9, 5e5, 4) == pytest.approx(2 * 0.75)
    assert busbw_gbps("broadcast", 1024, 1.024, 2) == pytest.approx(1.0)
    for op in OPS:
        assert busbw_gbps(op, 4096, 10.0, 4) == pytest.approx(algbw_gbps(4096, 10.0) * bus_factor(op, 4))


def test_formula_errors():
    with pytest.raises(ValueError, match="unknown op"):
        bus_factor("all_to_all", 2)
    with pytest.raises(ValueError, match="world size"):
        bus_factor("all_reduce", 0)
    with pytest.raises(ValueError, match="positive"):
        algbw_gbps(1024, 0.0)


def test_parse_size_units():
    assert [parse_size(s) for s in ("1", "1K", "1k", "64M", "1G", "2KiB", "3MB", " 8 ")] == \
        [1, 1024, 1024, 64 << 20, 1 << 30, 2048, 3 * 10**6, 8]  # MB is decimal (issue 18: one convention)
    for bad in ("", "K", "1.5M", "-1K", "1T", "0", "1X"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError, match="maximum"):
        parse_size("17G")


def test_parse_sizes_range_list_and_errors():
    assert parse_sizes("1K:16K") == [1024, 2048, 4096, 8192, 16384]
    assert parse_sizes("1K:64M")[-1] == 64 << 20 and len(parse_sizes("1K:64M")) == 17
    assert parse_sizes("1K:10K") == [1024, 2048, 4096, 8192]  # MAX need not be on the ladder
    assert parse_sizes("1K:1M:4") == [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20]
    assert parse_sizes("4K,1K,4K,1M") == [4096, 1024, 1 << 20]
    assert parse_sizes("8") == [8]
    for bad, match in (("1M:1K", "larger than MAX"), ("1K:2K:1", "FACTOR"), ("1K:2K:x", "FACTOR"),
                       ("1K:2K:3:4", "MIN:MAX"), ("1K,,2K", "empty"),
                       (",".join(str(4 * i) for i in range(1, 66)), "at most 64")):
        with pytest.raises(ValueError, match=match):
            parse_sizes(bad)


def test_parse_ops():
    assert parse_ops("all") == list(OPS)
    assert parse_ops("broadcast, all_reduce,broadcast") == ["broadcast", "all_reduce"]
    with pytest.raises(ValueError, match="unknown op 'foo'"):
        parse_ops("all_reduce,foo")
    with pytest.raises(ValueError):
        parse_ops("")


def test_check_size_and_element_count():
    assert check_size(1024, "fp32", 2) is None
    assert "whole number of fp32" in check_size(5, "fp32", 2)
    assert check_size(6, "bf16", 2) is None and "one bf16 element per rank" in check_size(2, "bf16", 2)
    assert "one fp32 element per rank" in check_size(4, "fp32", 2)
    # all_gather/reduce_scatter: the total, split evenly (rounded down, as nccl-tests does)
    assert element_count("all_reduce", 1024, 4, 3) == 256
    assert element_count("all_gather", 1024, 4, 3) == 255
    assert element_count("reduce_scatter", 1024, 2, 2) == 512


def test_fmt_bytes():
    assert [size_label(n) for n in (1, 1000, 1024, 3 << 20, 1 << 30, 1536)] == ["1", "1000", "1K", "3M", "1G", "1536"]
    assert math.log2(MAX_SIZE) == 34
