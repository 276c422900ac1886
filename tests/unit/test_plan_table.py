"""``handle plan``'s table (issue 38): the rank column and the layout are printed whole from row 10 on, on a
terminal as narrow as 100 columns (the other columns may shorten) and, piped, every column whole; ``--top N``
prints the N fastest, numbered as in the full table. In-process, no model: the rows are the planner's fields."""

from __future__ import annotations

import os
import re

from rich.console import Console

from handle_cli.plan_cmd import _report, plan_table


def _rows(n: int) -> list[dict]:
    return [{"label": f"dp {i} × tp 1 × pp 2 (ep 2), interleaved-1f1b v 2 m {i}", "strategy": "single",
             "tp_impl": "scratch", "micro_batch_size": 8, "grad_accum": 2, "largest_bytes": 100_000_000 + i,
             "largest_rank": 2, "predicted_tokens_per_s": 9000.0 - i, "step_s": 0.2, "pp": 2, "bubble": 0.06,
             "tp_bytes": 10_000_000, "tp_s": 0.014, "dp_bytes": 0, "dp_s": 0.0, "pp_bytes": 4_000_000, "pp_s": 0.009,
             "ep": 2, "ep_bytes": 2_000_000, "ep_s": 0.003} for i in range(1, n + 1)]


def _numbers(text: str) -> list[str]:
    return [m.group(1) for line in text.splitlines() if (m := re.match(r"│ +(\S+) │", line))]


def test_row_numbers_and_layouts_are_whole_on_a_narrow_terminal():
    """Too narrow for every column: the least needed ones are left out (and named), never a cell shortened."""
    rows = _rows(12)
    console = Console(width=10_000, record=True, file=open(os.devnull, "w"))
    console.print(plan_table(rows, width=100))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 100 and "…" not in text
    assert _numbers(text) == [str(i) for i in range(1, 13)]
    for r in rows:
        assert r["label"] in text
    assert "left out to fit 100 columns: EP comm, PP comm, DP comm, TP comm" in text


class _Made:
    def __init__(self, rows):
        self.rows = rows

    def as_dict(self):
        return {"nproc": 4, "nnodes": 1, "device_memory_bytes": 2**33, "layouts": self.rows, "dropped": [],
                "flops_per_token": 1e6, "peak": {"flops_per_s": 5e10, "source": "assumed"},
                "links": {"source": "assumed"}, "notes": []}


def test_top_prints_the_fastest_n_numbered_and_piped_output_keeps_every_column_whole(capsys):
    _report(_Made(_rows(14)), None, False, shown=11)
    out = capsys.readouterr().out
    assert _numbers(out) == [str(i) for i in range(1, 12)]
    assert "(the 11 fastest of 14 layouts; --top 14 or no --top for every one)" in out
    assert "…" not in out and "single, tp scratch" in out and "95.4 MiB (r2)" in out
