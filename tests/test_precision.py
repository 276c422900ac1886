"""The real CPU probe behind ``training.precision = "auto"``, in fresh interpreters (the ISA environment variables are
read when torch loads oneDNN): under ``ONEDNN_MAX_CPU_ISA=AVX2`` every x86 CPU emulates bf16, so auto must pick
fp32; on a CPU with AVX512-BF16 or AMX and no such variable, bf16. The resolver's logic is tests/unit/
test_precision_auto.py; the end-to-end run is in tests/test_telemetry.py."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from torch_handle.common.precision import ISA_ENV

X86 = platform.machine().lower() in ("x86_64", "amd64")
PROBE = ("import json; from torch_handle.launch import precision as p; probe = p.probe_cpu(refresh=True);"
         " r = p.resolve_cpu(probe); print(json.dumps({**probe, 'precision': r.precision, 'reason': r.reason}))")


def probe(tmp_path, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ISA_ENV}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         env={**base, "HANDLE_PEAK_CACHE": str(tmp_path / "peak.json"), **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), as torch sees it."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@pytest.mark.skipif(not X86, reason="ONEDNN_MAX_CPU_ISA=AVX2 is an x86 ISA")
def test_under_avx2_bf16_is_emulated_and_auto_picks_fp32(tmp_path):
    got = probe(tmp_path, ONEDNN_MAX_CPU_ISA="AVX2")
    assert got["precision"] == "fp32" and got["reason"].startswith("auto → fp32: bf16 matmul "), got
    assert got["ratio"] < 0.5 and "ONEDNN_MAX_CPU_ISA=AVX2" in got["key"], got
    assert got["seconds"] < 1.5, got  # PROBE_MAX_S bounds it, whatever else the machine runs


@pytest.mark.skipif(not X86 or not native_bf16(), reason="no AVX512-BF16/AMX: bf16 is emulated (or not x86)")
def test_with_native_bf16_and_no_isa_limit_auto_picks_bf16(tmp_path):
    got = probe(tmp_path)
    assert got["precision"] == "bf16" and got["ratio"] >= 1.25, got
    assert got["seconds"] < 1.0, got
