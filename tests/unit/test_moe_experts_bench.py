"""benchmarks/moe_experts.py (grouped against looped experts) runs and finds the two paths equal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_grouped_equals_looped_with_an_empty_expert():
    proc = subprocess.run([sys.executable, "benchmarks/moe_experts.py", "--smoke", "--json"], cwd=ROOT,
                          capture_output=True, text=True, check=True, timeout=120)
    rows = {r["dtype"]: r for r in json.loads(proc.stdout)}
    assert set(rows) == {"fp32", "bf16"}
    for r in rows.values():
        assert r["rows"] == r["tokens"] * r["top_k"] and r["empty_experts"] == 1
        assert r["grouped_ms"] > 0 and r["looped_ms"] > 0
    assert rows["fp32"]["max_rel_diff"] == 0.0  # the same products, summed in the same order
