"""``scratch-fsdp`` end to end: a real 2-rank torchrun ``handle run`` of the tiny preset (ZeRO-3, fp32, dropout 0,
checkpoints at steps 4 and 8), then the run as a stop after step 4 leaves it resumed on 1 rank as ``single``
with grad_accum 2 (the same global batch): the flat-sharded checkpoint is converted to the portable form and
steps 5-8 reproduce the uninterrupted losses within 1e-4 relative (measured: 4e-8).
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import tiny_preset
from tests.test_cross_resume import events, handle, losses, sets

pytestmark = pytest.mark.dist

STOP_AT, STEPS = 4, 8


def _estimated(preset) -> dict[str, int]:
    """``handle estimate``'s model-state bytes of rank 0 for the same preset and overrides."""
    from torch_handle.config.loader import load_preset
    from torch_handle.plan.estimate import estimate_preset
    from torch_handle.registry import get_registry

    registry = get_registry()
    (row,) = estimate_preset(load_preset(preset, ["model.dropout=0"], registry), registry, [2], rank=0)
    return {"param_bytes": row.param_bytes, "grad_bytes": row.grad_bytes, "optimizer_bytes": row.optimizer_bytes}


def test_a_scratch_fsdp_run_resumes_as_single(tmp_path):
    """Also: rank 0's model-state telemetry equals ``handle estimate``'s figures to the byte."""
    preset = tmp_path / "tiny.toml"
    preset.write_text(tiny_preset(tmp_path / "runs", steps=STEPS, strategy="scratch-fsdp", log_every=1))
    run = tmp_path / "zero3"
    handle("run", str(preset), "--run-dir", str(run), *sets("model.dropout=0", f"training.checkpoint_every={STOP_AT}"))
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished"
    step_event = [e for e in events(run, "step") if "memory" in e][-1]
    assert step_event["allgather_calls"] > 0 and step_event["reducescatter_calls"] > 0
    params = [m["param_bytes"] for m in step_event["memory"]]
    optimizer = [m["optimizer_bytes"] for m in step_event["memory"]]
    assert _estimated(preset) == {k: step_event["memory"][0][k] for k in ("param_bytes", "grad_bytes",
                                                                          "optimizer_bytes")}
    layout = json.loads((run / "checkpoints" / f"step-{STOP_AT}" / "layout.json").read_text())
    assert (layout["format"], layout["strategy"], layout["zero_stage"]) == ("flat-sharded", "scratch-fsdp", 3)

    stopped = tmp_path / "stopped"
    shutil.copytree(run, stopped)
    shutil.rmtree(stopped / "checkpoints" / f"step-{STEPS}")
    handle("run", "--resume", str(stopped), *sets("strategy.name=single", "launch.nproc_per_node=1",
                                                  "training.grad_accum=2"))
    straight, resumed = losses(run), losses(stopped)
    for step in range(STOP_AT + 1, STEPS + 1):
        assert abs(resumed[step] - straight[step]) <= 1e-4 * abs(straight[step]), (step, resumed, straight)
    single = [e for e in events(stopped, "step") if "memory" in e][-1]["memory"][0]
    assert 2 * params[0] == single["param_bytes"] and 2 * optimizer[0] <= single["optimizer_bytes"] + 64
