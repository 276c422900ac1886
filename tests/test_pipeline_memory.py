"""Activation memory of a pipeline's first stage, measured against ``handle estimate`` (issue 20, "Done when" 5).

GPipe runs all m forwards before the first backward, so its first stage holds the activations of all m micro-batches
at once; 1F1B holds at most p of them (Narayanan et al. 2021, §2.2). Two gloo ranks (p = 2) run the decoder's two
stages through both schedules, m = 8, with the hand-written engine (``ScratchPipeline``) and torch's
(``TimedStage`` under ``ScheduleGPipe``/``Schedule1F1B``), counting the bytes autograd saves that are alive at once
(``peak_saved_bytes``: what a run's step event reports as ``pipeline.ranks[i].activation_peak_bytes``). The estimate
of the same preset must predict each within 10%.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from handle_cli.estimate_cmd import layout_overrides
from tests.helpers import run_on_gloo, tiny_preset
from torch_handle.config.loader import load_preset
from torch_handle.plan import estimate as E
from torch_handle.registry import get_registry

M, P, SAMPLES = 8, 2, 16  # micro-batches, stages, samples per step (2 per micro-batch)
SCHEDULES = ("gpipe", "1f1b")


def _preset(tmp_path: Path, schedule: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "tiny.toml"
    path.write_text(tiny_preset(tmp_path / "runs", strategy="single"))
    sets = ["parallel.pp=2", f"parallel.pp_schedule={schedule}", f"parallel.pp_microbatches={M}",
            "training.micro_batch_size=4", f"training.grad_accum={SAMPLES // 4}", "model.dropout=0"]
    return load_preset(path, layout_overrides(sets), get_registry())


def _measure(rank: int, tmp: Path) -> None:
    """On each of the two ranks: its stage's peak saved bytes under every (engine, schedule)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from torch_handle.model.pipeline import split_decoder
    from torch_handle.parallel.pipeline.p2p import StageLink
    from torch_handle.parallel.pipeline.scratch import ScratchPipeline
    from torch_handle.parallel.pipeline.timeline import Timeline
    from torch_handle.plan.estimate_model import build_model, model_build
    from torch_handle.plan.estimate_pipeline import _ranges
    from torch_handle.train.shares.pipeline_native import TimedStage

    preset = _preset(tmp / f"preset{rank}", "gpipe")
    build = model_build(preset, get_registry())
    torch.manual_seed(0)
    model = build_model(build)
    ranges = _ranges(build, model, P, preset)
    _, (stage,) = split_decoder(model, ranges, [rank])
    seq = preset.data.options.seq_len
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(4, build.vocab_size, (SAMPLES, seq), generator=generator)
    labels = torch.randint(4, build.vocab_size, (SAMPLES, seq), generator=generator)
    loss = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()) / M  # noqa: E731
    peaks = {}
    for schedule in SCHEDULES:
        timeline = Timeline("cpu")
        link = StageLink(None, [0, 1], rank, torch.device("cpu"), timeline)
        scratch = ScratchPipeline(stage, link, P, schedule, timeline)
        scratch.count_saved = True
        inputs = [{"input_ids": x} for x in ids.chunk(M)]
        scratch.step(inputs, lambda out, i: loss(out, labels.chunk(M)[i]))
        peaks[f"scratch {schedule}"] = scratch.peak_saved_bytes

        native = TimedStage(stage, rank, P, torch.device("cpu"), timeline=timeline)
        native.count_saved = True
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        cls(native, n_microbatches=M, loss_fn=loss, scale_grads=False).step(
            input_ids=ids, target=labels if rank == P - 1 else None)
        peaks[f"native {schedule}"] = native.peak_saved_bytes
        stage.zero_grad()
    (tmp / f"peaks{rank}.json").write_text(json.dumps(peaks))


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict[str, int]]:
    tmp = tmp_path_factory.mktemp("ppmem")
    run_on_gloo(_measure, tmp)
    return [json.loads((tmp / f"peaks{r}.json").read_text()) for r in range(P)]


def _estimated(tmp_path: Path, schedule: str) -> list[E.Estimate]:
    return E.estimate_preset(_preset(tmp_path, schedule), get_registry(), [P])


@pytest.mark.parametrize("impl", ["scratch", "native"])
def test_gpipe_first_stage_holds_more_than_1f1b_as_estimated(measured, tmp_path, impl):
    first = measured[0]
    gpipe, one_f_one_b = first[f"{impl} gpipe"], first[f"{impl} 1f1b"]
    assert gpipe > 3 * one_f_one_b  # m = 8 micro-batches alive against p = 2
    for schedule, got in (("gpipe", gpipe), ("1f1b", one_f_one_b)):
        rows = _estimated(tmp_path / schedule, schedule)
        row = next(r for r in rows if r.pp_rank == 0)
        assert row.pp_in_flight == [M if schedule == "gpipe" else P]
        assert row.as_dict()["activation_saved_bytes"] == pytest.approx(got, rel=0.10), (impl, schedule)


def test_the_last_stage_holds_m_under_gpipe_and_one_under_1f1b(measured, tmp_path):
    """The estimate of the last stage counts its loss's saved log-probabilities, which the engines' counters leave
    out (they count the stage's forward); its in-flight counts are checked against the measured ratio."""
    last = measured[P - 1]
    for impl in ("scratch", "native"):
        assert last[f"{impl} gpipe"] == M * last[f"{impl} 1f1b"]
    rows = {s: next(r for r in _estimated(tmp_path / s, s) if r.pp_rank == P - 1) for s in SCHEDULES}
    assert rows["gpipe"].pp_in_flight == [M] and rows["1f1b"].pp_in_flight == [1]


def test_the_table_has_a_stage_column(tmp_path):
    from click.testing import CliRunner

    from handle_cli.estimate_cmd import estimate

    path = tmp_path / "tiny.toml"
    path.write_text(tiny_preset(tmp_path / "runs", strategy="single"))
    result = CliRunner().invoke(estimate, [str(path), "--set", "parallel.pp=2", "--set", "parallel.pp_schedule=1f1b",
                                           "--set", "training.grad_accum=2", "--nproc", "1,2,4"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("layout "))
    assert lines[head].split()[:5] == ["layout", "world", "stage", "in", "flight"]
    assert [re.split(r"\s{2,}", line)[:4] for line in lines[head + 1:head + 3]] == [
        ["dp 1 × pp 2 (pp 1F1B native)", "2", "0", "2"], ["dp 1 × pp 2 (pp 1F1B native)", "2", "1", "1"]]
    result = CliRunner().invoke(estimate, [str(path), "--set", "parallel.pp=2", "--set", "training.grad_accum=2", "--nproc", "2",
                                           "--json"])
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [(r["pp_rank"], r["pp_stages"], r["dp"]) for r in rows] == [(0, [0], 1), (1, [1], 1)]
