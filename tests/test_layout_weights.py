"""The final weights of a dp 2 × tp 2 × pp 2 run are whole: `handle run presets/3d.toml` (8 processes, tiny shapes,
2 steps) writes a ``model.safetensors`` with every tensor of the one-process model (every pipeline stage, each
gathered over its TP ranks), which `handle generate` loads, and which equals the last checkpoint's consolidated
state (tests/whole_weights.py). Before the run's parallel share was resolved in one place, the export gathered
over TP only and kept pipeline stage 0 (the embedding and half the layers).

The other layouts' runs are checked where their tests already run them: tests/test_nd_parallel.py (dp × pp under
ddp, fsdp and scratch-ddp, both pipeline implementations; tp × pp with sequence parallelism; dp × tp under fsdp
over DTensor TP; the one-process run), tests/test_expert_parallel_runs.py (ep by hand and native, dp × ep under
fsdp, pp × ep), tests/test_lora_strategies.py (LoRA under every strategy and split).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import handle_at_once
from tests.whole_weights import assert_whole_weights

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
TINY = ("model.d_model=32", "model.n_heads=2", "model.d_ff=64", "data.seq_len=16", "data.vocab_size=300",
        "training.steps=2", "training.micro_batch_size=4", "training.eval_steps=1", "training.eval_every=0",
        "training.checkpoint_every=0", "training.log_every=1", "training.precision=fp32")


@pytest.fixture(scope="module")
def run_3d(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layout-weights")
    args = ("run", str(ROOT / "presets" / "3d.toml"), "--run-dir", str(root / "3d"),
            *(a for s in (*TINY, f"run.output_dir={root}") for a in ("--set", s)))
    code, out = handle_at_once({"3d": args}, 1)["3d"]
    assert code == 0, out[-3000:]
    return root / "3d"


def test_a_dp2_tp2_pp2_run_hands_on_its_whole_model(run_3d: Path) -> None:
    assert_whole_weights(run_3d)
