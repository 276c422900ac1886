"""The probe behind ``training.precision = "auto"`` on this CPU, with and without ``ONEDNN_MAX_CPU_ISA=AVX2``
(which makes any x86 CPU emulate bf16): fp32 and bf16 GFLOP/s of one thread's 256x256 matmul, their ratio, the
probe's wall time and the precision auto picks. Each case is a fresh interpreter (oneDNN reads the variable when
torch loads it) measuring with a cache of its own.

    python benchmarks/precision_probe.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT

from torch_handle.common.precision import ISA_ENV

CODE = ("import json; from torch_handle.launch import precision as p; probe = p.probe_cpu(refresh=True);"
        " r = p.resolve_cpu(probe); print(json.dumps({**probe, 'precision': r.precision, 'reason': r.reason}))")
CASES = {"default": {}, "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}


def probe(extra: dict[str, str], cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ISA_ENV}
    env.update(HANDLE_PEAK_CACHE=str(cache), PYTHONPATH=str(ROOT), **extra)
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=300,
                         check=False)
    if out.returncode != 0:
        raise SystemExit(f"probe failed ({extra}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="probes per case (each in its own interpreter)")
    args = parser.parse_args()
    print(f"{'case':<26} {'fp32 GFLOP/s':>12} {'bf16 GFLOP/s':>12} {'bf16/fp32':>9} {'probe ms':>8}  auto")
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in CASES.items():
            for i in range(args.repeat):
                r = probe(extra, Path(tmp) / f"peak-{i}.json")
                print(f"{name:<26} {r['fp32'] / 1e9:>12.1f} {r['bf16'] / 1e9:>12.1f} {r['ratio']:>9.3f} "
                      f"{r['seconds'] * 1e3:>8.0f}  {r['precision']}")


if __name__ == "__main__":
    main()
