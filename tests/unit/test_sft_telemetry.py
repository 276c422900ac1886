"""An SFT run's step events (issue 46): ``tokens`` counts the positions computed, ``trained_tokens`` the labels
among them, with their share and rate; MFU counts what is computed; the TensorBoard and W&B sinks get the trained
share and rate. In-process, fakes for the strategy and the sinks' writers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from handle_plugins.sinks import TensorBoardSink
from handle_plugins.wandb_sink import WandbSink
from torch_handle.train.step_report import StepReport, window_tokens


class _Strategy:
    lr = 1e-3

    def step_stats(self):
        return {}


class _Timer:
    def read(self):
        return {}


def _report(tmp_path, window):
    ctx = SimpleNamespace(rank=0, world_size=2, distributed=False, is_main=True, device=torch.device("cpu"))
    return StepReport(ctx, _Strategy(), [], None, tmp_path, flops_per_token=1e6, peak_flops=1e9,
                      window_tokens=window)


def _record(report, trained):
    return report.record({"step": 1, "loss": 2.0, "tokens": trained}, grad_norm=1.0, seconds=0.5, log_memory=False,
                         grad_bytes=0, timer=_Timer(), activation_saved_bytes=None, routing={})


def test_window_tokens_are_the_samples_positions_of_packed_conversations_only():
    assert window_tokens(SimpleNamespace(sample_positions=256), 8) == 2048
    assert window_tokens(SimpleNamespace(seq_len=256), 8) is None  # token windows: every position a label


def test_an_sft_step_counts_the_positions_and_the_trained_tokens_apart(tmp_path):
    record = _record(_report(tmp_path, 2048), 512)
    assert record["tokens"] == 2048 and record["tokens_per_s"] == 4096  # what the model computed, per second
    assert record["trained_tokens"] == 512 and record["trained_tokens_per_s"] == 1024
    assert record["trained_share"] == 0.25
    assert record["mfu"] == pytest.approx(1e6 * 4096 / (1e9 * 2))  # MFU of the positions computed
    plain = _record(_report(tmp_path, None), 512)  # pretraining: every position a label
    assert plain["tokens"] == 512 and "trained_tokens" not in plain and "trained_share" not in plain


def test_the_sinks_get_the_trained_share_and_rate():
    event = {"kind": "step", "step": 3, "time": 1.0, "loss": 2.0, "tokens_per_s": 4096.0, "trained_share": 0.25,
             "trained_tokens_per_s": 1024.0, "trained_tokens": 512}
    written = {}
    writer = SimpleNamespace(add_scalar=lambda key, value, step, walltime: written.__setitem__(key, (step, value)))
    TensorBoardSink(writer).emit(event)
    assert written["train/trained_share"] == (3, 0.25) and written["train/trained_tokens_per_s"] == (3, 1024.0)
    logged = {}
    run = SimpleNamespace(log=lambda data, step: logged.update(data, step=step), summary={})
    WandbSink(run).emit(event)
    assert logged["train/trained_share"] == 0.25 and logged["train/trained_tokens_per_s"] == 1024.0
    assert logged["step"] == 3
