"""The training loop in this process: a gloo process group of world size 1, a tiny Transformer on real text,
two optimizer steps, then a resume. What a torchrun worker does, without starting one (about 2 s)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import train_here
from torch_handle.config.loader import dump_preset, load_preset
from torch_handle.data.corpus import pydoc_corpus
from torch_handle.plan.estimate import activation_bytes
from torch_handle.registry import get_registry
from torch_handle.rundir import STOP_FILE, create_run_dir, read_run_info
from torch_handle.train.strategy import DistContext

VOCAB = 300


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    dist.destroy_process_group()


def _preset(tmp_path: Path, steps: int, checkpointing: bool = False, model: str = ""):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("\n\n".join(pydoc_corpus())[:60_000], encoding="utf-8")
    text = f"""
[run]
output_dir = "{tmp_path / 'runs'}"
[model]
d_model = 32
n_heads = 2
n_layers = 1
d_ff = 64
dropout = 0.0
activation_checkpointing = {str(checkpointing).lower()}
{model}
[data]
name = "text"
path = "{corpus}"
seq_len = 16
vocab_size = {VOCAB}
[training]
steps = {steps}
micro_batch_size = 4
grad_accum = 2
precision = "fp32"
eval_every = 0
eval_steps = 2
log_every = 1
warmup_steps = 0
lr = 0.01
"""
    path = tmp_path / "p.toml"
    path.write_text(text, encoding="utf-8")
    return load_preset(path)


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


_train = train_here  # the modules that train in process import it from here


def test_one_step_writes_what_a_run_writes(tmp_path, process_group, caplog):
    preset = _preset(tmp_path, steps=2)
    run_dir = create_run_dir(tmp_path / "runs", "unit", dump_preset(preset), {"status": "starting"})

    with caplog.at_level(logging.INFO, logger="torch_handle"):
        assert _train(preset, run_dir, process_group) == "finished"
    # the dataset's description reaches the rank log
    assert any(r.getMessage().startswith(f"data {tmp_path / 'corpus.txt'}: ") for r in caplog.records)
    events = _events(run_dir)
    steps = [e for e in events if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [1, 2]
    # 2 micro-batches of 4 samples of 16 tokens, every token a label
    assert all(e["tokens"] == 2 * 4 * 16 for e in steps)
    # an untrained model predicts close to uniformly: cross-entropy near ln(vocab)
    first = steps[0]["loss"]
    assert abs(first - math.log(VOCAB)) < 1.0, first  # a sum instead of a mean, or a wrong label shift, is far off
    assert steps[0]["memory"][0]["param_bytes"] > 0 and steps[0]["grad_norm"] > 0
    assert steps[0]["step_time_s"] > 0 and steps[0]["tokens_per_s"] > 0
    # what autograd saved for the first micro-batch, measured once, and what `handle estimate` predicts for it
    measured = steps[0]["memory"][0]["activation_saved_bytes"]
    predicted = activation_bytes(preset, get_registry()).saved
    assert predicted > 0 and abs(measured - predicted) <= 0.10 * predicted, (measured, predicted)
    assert [e["step"] for e in events if e["kind"] == "eval"] == [0, 2]
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [2]
    assert (run_dir / "checkpoints" / "step-2" / "manifest.json").is_file()
    assert (run_dir / "model.safetensors").is_file() and (run_dir / "tokenizer.json").is_file()
    assert read_run_info(run_dir)["status"] == "finished"


def test_activation_bytes_with_checkpointing_match_the_estimate(tmp_path, process_group):
    plain = _preset(tmp_path, steps=1)
    preset = _preset(tmp_path, steps=1, checkpointing=True)
    run_dir = create_run_dir(tmp_path / "runs", "ckpt", dump_preset(preset), {"status": "starting"})
    assert _train(preset, run_dir, process_group) == "finished"
    step = next(e for e in _events(run_dir) if e["kind"] == "step")
    measured = step["memory"][0]["activation_saved_bytes"]
    predicted = activation_bytes(preset, get_registry()).saved
    assert abs(measured - predicted) <= 0.10 * predicted, (measured, predicted)
    assert measured < activation_bytes(plain, get_registry()).saved  # checkpointing keeps only block inputs


def test_stop_then_resume_gives_the_uninterrupted_losses(tmp_path, process_group):
    preset = _preset(tmp_path, steps=3)
    straight_dir = create_run_dir(tmp_path / "runs", "straight", dump_preset(preset), {"status": "starting"})
    assert _train(preset, straight_dir, process_group) == "finished"
    straight = [e["loss"] for e in _events(straight_dir) if e["kind"] == "step"]

    run_dir = create_run_dir(tmp_path / "runs", "stopped", dump_preset(preset), {"status": "starting"})
    (run_dir / STOP_FILE).touch()  # what the first Ctrl-C of `handle run` does: stop after this step
    assert _train(preset, run_dir, process_group) == "stopped"
    assert [e["step"] for e in _events(run_dir) if e["kind"] == "checkpoint"] == [1]
    (run_dir / STOP_FILE).unlink()
    assert _train(preset, run_dir, process_group) == "finished"
    resumed = [e for e in _events(run_dir) if e["kind"] == "step"]
    assert [e["step"] for e in resumed] == [1, 2, 3]
    assert [e["loss"] for e in resumed] == pytest.approx(straight, rel=1e-6, abs=0)
    assert straight[2] < straight[0]  # lr 0.01 without warm-up: it learns


def test_init_from_starts_a_new_run_but_not_its_resume(tmp_path, process_group):
    """A Llama-shaped run exported, then a run with ``init_from`` on the export: its step-0 evaluation is the
    exporter's last. With the directory gone, a new run is refused before it starts, while the resume of that run
    neither checks nor reads it (its checkpoint holds the weights). tests/test_hf_export.py: the same on real runs."""
    from torch_handle.errors import CheckpointError
    from torch_handle.infer.hf_export import export_hf
    from torch_handle.launch.run import check_inputs

    llama = 'norm = "rmsnorm"\nposition = "rope"\nmlp = "swiglu"\nnorm_first = true\nscale_embeddings = false\n'
    exporter = _preset(tmp_path, steps=2, model=llama)
    source = create_run_dir(tmp_path / "runs", "source", dump_preset(exporter), {"status": "starting"})
    assert _train(exporter, source, process_group) == "finished"
    export_hf(source, tmp_path / "hf")
    init = llama + f'init_from = "{tmp_path / "hf"}"'
    preset = _preset(tmp_path, steps=1, model=init)
    run_dir = create_run_dir(tmp_path / "runs", "init", dump_preset(preset), {"status": "starting"})
    assert _train(preset, run_dir, process_group) == "finished"
    evals = [e["val_loss"] for e in _events(source) if e["kind"] == "eval"]
    assert next(e for e in _events(run_dir) if e["kind"] == "eval")["val_loss"] == pytest.approx(evals[-1], abs=1e-6)
    assert abs(evals[0] - evals[-1]) > 1e-3  # a run that ignored init_from would start elsewhere

    (tmp_path / "hf").rename(tmp_path / "moved")
    with pytest.raises(CheckpointError, match=f"^model.init_from: {tmp_path / 'hf'}: no such directory"):
        check_inputs(preset)
    check_inputs(preset, resume=True)
    before = len(_events(run_dir))
    assert _train(_preset(tmp_path, steps=2, model=init), run_dir, process_group) == "finished"
    logs = [e["message"] for e in _events(run_dir)[before:] if e["kind"] == "log"]
    assert any(m.startswith("resumed from checkpoints/step-1") for m in logs)
    assert not any("init_from" in m for m in logs)


@pytest.fixture(autouse=True)
def fake_peak(tmp_path, monkeypatch):
    """A cached peak of 1 TFLOP/s for this process's device and threads (no measuring in a unit test: the
    Trainer's rank 0 would otherwise measure the real one, seconds, when the user cache lacks it)."""
    from torch_handle.observe import peak
    path = tmp_path / "peak.json"
    key = peak.device_key("cpu", torch.get_num_threads())
    path.write_text(json.dumps({key: {"device": "cpu", "fp32": 1e12, "bf16": 2e12, "fp16": 3e12}}))
    monkeypatch.setenv("HANDLE_PEAK_CACHE", str(path))
    return 1e12


def test_step_breakdown_tiles_the_step_and_mfu_uses_the_cached_peak(tmp_path, process_group, fake_peak):
    preset = _preset(tmp_path, steps=6)
    run_dir = create_run_dir(tmp_path / "runs", "parts", dump_preset(preset), {"status": "starting"})
    assert _train(preset, run_dir, process_group) == "finished"
    events = _events(run_dir)
    steps = [e for e in events if e["kind"] == "step"]
    parts = ("data_s", "forward_s", "backward_s", "sync_s", "optimizer_s")
    for e in steps:
        total = sum(e[k] for k in parts)
        assert all(e[k] >= 0 for k in parts) and e["forward_s"] > 0 and e["backward_s"] > 0
        # laps tile the step: only the few microseconds before the first and after the last lap are outside
        assert abs(total - e["step_time_s"]) <= 0.1 * e["step_time_s"], (total, e)
        assert e["mfu"] == pytest.approx(e["tflops"] * 1e12 / fake_peak)
        assert "ranks" not in e  # one rank: nothing to compare
    running = next(e for e in events if e["kind"] == "status" and e["status"] == "running")
    assert running["peak_flops"] == fake_peak and running["precision"] == "fp32"
    assert read_run_info(run_dir)["peak_flops"] == fake_peak
    assert any(e["kind"] == "log" and "peak 1.000 TFLOP/s (fp32 matmul, cached" in e["message"] for e in events)


def test_parse_test_delay():
    from torch_handle.common.testhooks import parse_test_delay

    assert parse_test_delay("1:0.05", 1) == 0.05
    assert parse_test_delay("1:0.05", 0) == 0.0
    assert parse_test_delay("", 0) == parse_test_delay("x:y", 0) == parse_test_delay("0:-1", 0) == 0.0


@pytest.mark.parametrize("broadcast", [False, True])
def test_ddp_broadcasts_buffers_only_when_asked(process_group, broadcast):
    """``strategy.broadcast_buffers`` (off by default: handle's buffers are constants or updated alike on every rank,
    so torch's default broadcast before every forward is a collective for nothing) reaches the DDP wrapper."""
    from handle_plugins.strategies import DDPConfig
    from handle_plugins.strategies.ddp import DDPStrategy
    from torch_handle.config.schema import TrainingConfig

    model = torch.nn.Linear(4, 4)
    model.register_buffer("table", torch.ones(4))
    strategy = DDPStrategy(DDPConfig(broadcast_buffers=broadcast), TrainingConfig(precision="fp32"), process_group,
                           model)
    assert strategy.model.broadcast_buffers is broadcast
    assert strategy.model.will_sync_module_buffers() is broadcast
