"""Expert parallelism's parts that need no process group: the checks before start (one line each, through `handle
validate`, exit 2), the EP ranks drawn from dp on the mesh, how views name the layout and its ranks, and the
source-major to expert-major permutation."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from handle_cli.main import cli
from torch_handle.common.run_layout import RunLayout
from torch_handle.parallel.expert.permute import inverse, source_to_expert_order
from torch_handle.common.parallel_dims import ParallelDims

MOE = '[model]\nn_experts = 4\ntop_k = 2\n'


@pytest.mark.parametrize("tables, message", [
    (MOE + "[parallel]\nep = 3\n[strategy]\nname = \"ddp\"\n[launch]\nnproc_per_node = 3\n",
     "parallel.ep = 3 does not divide model.n_experts = 4 (valid ep: 1)"),
    (MOE + "[parallel]\nep = 4\n[strategy]\nname = \"ddp\"\n[launch]\nnproc_per_node = 2\n",
     "parallel.ep = 4 does not divide the data-parallel degree 2 (world size / (tp x pp); EP ranks are drawn from "
     "the data-parallel ones) (valid ep: 1, 2)"),
    ("[parallel]\nep = 2\n[strategy]\nname = \"ddp\"\n[launch]\nnproc_per_node = 2\n",
     "parallel.ep = 2 splits the experts of mixture-of-experts layers, and the model has none"),
    (MOE + "[parallel]\nep = 2\n[strategy]\nname = \"deepspeed\"\n[launch]\nnproc_per_node = 2\n",
     "strategy 'deepspeed' does not support parallel.ep > 1 (valid with ep > 1: ddp, fsdp)"),
])
def test_bad_expert_layouts_are_one_line_before_anything_starts(tmp_path, monkeypatch, tables, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.toml").write_text(f'[run]\noutput_dir = "{tmp_path}/out"\n' + tables)
    result = CliRunner().invoke(cli, ["validate", "p.toml"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert message in lines[0] and "Traceback" not in result.stderr, lines[0]
    assert not (tmp_path / "out").exists()


def test_ep_ranks_are_consecutive_data_parallel_ranks():
    layout = ParallelDims(8, pp=2, ep=2)  # dp 4 per stage: 2 EP groups of 2
    assert (layout.dp, layout.edp) == (4, 2)
    assert [(layout.pp_rank(r), layout.edp_rank(r), layout.ep_rank(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert ParallelDims(4, ep=2).describe() == {"dp": 4, "tp": 1, "ep": 2}
    with pytest.raises(ValueError, match="ep = 3 must divide the data-parallel degree 4"):
        ParallelDims(4, ep=3)


def test_views_name_the_expert_layout_and_its_ranks():
    four = RunLayout.from_parts(4, "ddp", None, ep=2, ep_impl="native")
    assert four.label() == "dp 2 × ep 2 (ddp; ep native)"
    assert [four.rank_name(r) for r in range(4)] == ["rank 0 (dp0 ep0)", "rank 1 (dp0 ep1)", "rank 2 (dp1 ep0)",
                                                     "rank 3 (dp1 ep1)"]
    assert RunLayout.from_record(four.record()) == four
    two = RunLayout.from_parts(2, "ddp", None, ep=2, ep_impl="scratch")
    assert two.label() == "dp 1 × ep 2 (ddp; ep scratch)" and two.rank_name(1) == "rank 1 (ep1)"
    assert RunLayout.from_parts(4, "ddp", None, ep=3).ep == 1  # not a divisor of dp: not an EP layout
    assert RunLayout.from_parts(4, "ddp", None).matching({"dp": 4, "tp": 1, "ep": 2}).label() == "dp 2 × ep 2 (ddp)"


def test_received_rows_regroup_by_local_expert_and_back():
    # 3 source ranks, 2 local experts: rows arrive (s0 e0, s0 e1, s1 e0, s1 e1, s2 e0, s2 e1)
    counts = torch.tensor([[2, 1], [0, 3], [1, 0]])
    arrival = [(s, e) for s in range(3) for e in range(2) for _ in range(int(counts[s, e]))]
    index = source_to_expert_order(counts)
    assert [arrival[i] for i in index] == sorted(arrival, key=lambda se: (se[1], se[0]))
    x = torch.randn(len(arrival), 3)
    assert torch.equal(x[index][inverse(index)], x)
    assert source_to_expert_order(torch.zeros(2, 2, dtype=torch.long)).numel() == 0  # a rank that receives nothing
