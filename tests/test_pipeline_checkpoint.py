"""A pipeline run's checkpoints hold every stage (torchtitan #474 saved only half): a pp = 2 checkpoint resumes as
`single` on one rank, and that run's own `single` checkpoint resumes as pp = 2, each continuing the uninterrupted
losses within 1e-4; the portable form and the exported model.safetensors carry the one-process names.

One chain of real `handle run` processes (tiny decoder, fp32, dropout 0, 6 steps, checkpoints every 2 steps):
pp = 2 (hand-written 1F1B, m = 4) -> resumed at step 2 as `single` -> its step-4 checkpoint resumed with pp = 2
(torch's 1F1B).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_preset
from torch_handle.checkpoint.convert import read_portable
from torch_handle.infer.generate import load_run

pytestmark = pytest.mark.dist

TINY = ("--set", "model.dropout=0", "--set", "model.norm_first=true", "--set", "training.steps=6",
        "--set", "training.log_every=1", "--set", "training.grad_accum=2", "--set", "training.checkpoint_every=2",
        "--set", "training.keep_last=3")
PP2 = ("--set", "launch.nproc_per_node=2", "--set", "parallel.pp=2", "--set", "parallel.pp_schedule=1f1b",
       "--set", "parallel.pp_microbatches=4")


def _handle(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "handle_cli", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> loss (a step run again after a resume keeps its last value)."""
    events = map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
    return {e["step"]: e["loss"] for e in events if e["kind"] == "step"}


def _resume(run: Path, stopped: Path, at: int, *overrides: str) -> Path:
    """Copy ``run`` with no checkpoint after step ``at`` (what a stop there leaves), resume it with ``overrides``."""
    shutil.copytree(run, stopped)
    for ckpt in (stopped / "checkpoints").iterdir():
        if int(ckpt.name.split("-")[1]) > at:
            shutil.rmtree(ckpt)
    _handle("run", "--resume", str(stopped), *overrides)
    return stopped


def _assert_continues(got: dict[int, float], want: dict[int, float], steps: range, name: str) -> None:
    for step in steps:
        assert abs(got[step] - want[step]) <= 1e-4 * want[step], (name, step, got[step], want[step])


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pp-ckpt")
    preset = root / "tiny.toml"
    preset.write_text(tiny_preset(root / "runs", strategy="single").replace("nproc_per_node = 2",
                                                                            "nproc_per_node = 1"))
    out = _handle("run", str(preset), "--set", "run.name=pp", *TINY, *PP2, "--set", "parallel.pp_impl=scratch")
    return Path(next(ln for ln in out.splitlines() if ln.startswith("run directory: ")).split(": ", 1)[1])


def test_a_pp_checkpoint_resumes_as_single_and_a_single_one_as_pp(pipeline_run: Path, tmp_path: Path) -> None:
    want = _losses(pipeline_run)
    assert sorted(want) == [1, 2, 3, 4, 5, 6]
    layout = json.loads((pipeline_run / "checkpoints" / "step-2" / "layout.json").read_text())
    assert layout["format"] == "dcp" and layout["pp"] == 2 and layout["world_size"] == 2

    single = _resume(pipeline_run, tmp_path / "as-single", 2, "--set", "parallel.pp=1",
                     "--set", "launch.nproc_per_node=1")
    _assert_continues(_losses(single), want, range(3, 7), "pp -> single")
    layout = json.loads((single / "checkpoints" / "step-4" / "layout.json").read_text())
    assert layout["format"] == "torch" and layout["world_size"] == 1 and "pp" not in layout

    back = _resume(single, tmp_path / "back-to-pp", 4, *PP2, "--set", "parallel.pp_impl=native")
    _assert_continues(_losses(back), want, range(5, 7), "single -> pp")
    layout = json.loads((back / "checkpoints" / "step-6" / "layout.json").read_text())
    assert layout["pp"] == 2 and layout["pp_impl"] == "native"


def test_the_portable_form_and_the_export_hold_every_stage(pipeline_run: Path) -> None:
    """Each stage's parameters under their one-process names: the checkpoint's and model.safetensors' keys are
    the one-process model's, and both load into it strictly (as `handle generate` does)."""
    weights, state, _ = read_portable(pipeline_run / "checkpoints" / "step-2")
    final = load_run(pipeline_run)
    one_process = final.model.state_dict()
    assert weights.keys() == one_process.keys()
    assert {n for n, _ in final.model.named_parameters()} == state.keys()  # tied lm_head.weight once
    assert any(k.startswith("layers.0.") for k in weights) and any(k.startswith("layers.1.") for k in weights)
    assert "embed.weight" in weights and "final_norm.weight" in weights
    step2 = load_run(pipeline_run, checkpoint=2).model.state_dict()
    assert all(torch.equal(step2[k], weights[k].float()) for k in weights)
    assert not all(torch.equal(step2[k], one_process[k]) for k in weights if k.startswith("layers.1."))
