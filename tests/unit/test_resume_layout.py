"""Resume rules for ``[parallel]`` and for a finished run (issue 29, docs/resume.md#parallel-on-resume): checked
before anything is written, every problem at once. Run directories made by ``prepare_run`` (the real path of
``handle run``), their run.json settled by hand as a stopped or finished run leaves it; torchrun is never started
(``no_launch``)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from handle_cli.main import cli
from tests.helpers import tiny_preset
from torch_handle.checkpoint.resume import RESUME_PRESET
from torch_handle.config.loader import load_preset
from torch_handle.launch.run import prepare_run
from torch_handle.rundir import update_run_info

REPO = Path(__file__).resolve().parents[2]


def made_run(tmp_path: Path, preset: str | Path, sets: tuple[str, ...], status: str, step: int) -> Path:
    """A run directory of ``preset`` as ``handle run`` makes it, then left ``status`` at ``step`` with the
    checkpoint of that step (its directory and manifest: what the launcher reads of it)."""
    _, run = prepare_run(str(preset), ("training.precision=fp32", f"run.output_dir={tmp_path / 'runs'}", *sets),
                         None, None)
    update_run_info(run, status=status, step=step)
    (run / "checkpoints" / f"step-{step}").mkdir(parents=True)
    (run / "checkpoints" / f"step-{step}" / "manifest.json").write_text("{}")
    return run


def files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run.iterdir()) if p.is_file() and not p.name.startswith(".")}


def resume(run: Path, *sets: str):
    return CliRunner().invoke(cli, ["run", "--resume", str(run), *[a for s in sets for a in ("--set", s)]])


def test_a_tp_run_resumed_as_pp_trips_only_on_what_the_new_layout_needs(tmp_path, no_launch):
    """tp 2 with sequence parallelism, resumed as tp 1 x pp 2: sequence_parallel (meaningless with tp 1) goes, with
    a note; the micro-batches 1F1B needs are the one problem, with the --set that fixes it; then it starts."""
    run = made_run(tmp_path, REPO / "presets/tp.toml", (), "stopped", 100)
    before = files(run)
    result = resume(run, "parallel.tp=1", "parallel.pp=2")
    assert result.exit_code == 2 and result.stdout == "", result.output
    line = next(i for i, text in enumerate((run / "preset.toml").read_text().splitlines(), 1)
                if text.startswith("pp_microbatches"))
    assert result.stderr.splitlines() == [
        f"error: {run}/preset.toml:{line}: parallel.pp_microbatches: 1 micro-batches are fewer than the 2 stages 1f1b "
        f"needs (0 is training.grad_accum = 1; valid: 2, 4, 8, 16, e.g. --set parallel.pp_microbatches=2)"]
    assert files(run) == before  # nothing rewritten

    result = resume(run, "parallel.tp=1", "parallel.pp=2", "parallel.pp_microbatches=2")
    assert "a run was launched" in str(result.exception)
    assert result.stdout.splitlines()[:2] == [
        "note: parallel.sequence_parallel: true -> false (it splits the sequence over the TP group; the run had tp "
        "2, the resume has tp 1)",
        "note: the run's parallel.pp_impl = 'native' and parallel.pp_schedule = '1f1b' take effect (unused by its "
        "tp 2 x pp 1; --set them to choose)"]
    resumed = load_preset(run / RESUME_PRESET).parallel
    assert (resumed.tp, resumed.pp, resumed.pp_microbatches, resumed.sequence_parallel) == (1, 2, 2, False)
    assert (resumed.tp_impl, resumed.pp_impl) == ("scratch", "native")  # the run's, kept


def test_a_resume_keeps_every_parallel_key_it_does_not_set(tmp_path, no_launch):
    """A pp run (hand-written 1F1B, 4 micro-batches) resumed with more micro-batches: pp_impl and every other key
    stay the run's, and nothing is said about them; a pp_layers for the old stage count goes with a note."""
    run = made_run(tmp_path, REPO / "presets/pp.toml", ("parallel.pp_layers=[3, 1]",), "stopped", 100)
    result = resume(run, "parallel.pp_microbatches=8")
    assert "a run was launched" in str(result.exception) and "note:" not in result.stdout
    old, new = load_preset(run / "preset.toml").parallel, load_preset(run / RESUME_PRESET).parallel
    assert new.pp_impl == "scratch" and new.pp_microbatches == 8
    assert {**vars(old), "pp_microbatches": 8} == vars(new)

    result = resume(run, "parallel.pp=4", "launch.nproc_per_node=4")
    assert "a run was launched" in str(result.exception)
    assert "note: parallel.pp_layers: [3, 1] -> [] (it listed the run's 2 stages; the resume's 4 are balanced by " \
           "parallel.pp_split = 'layers')" in result.stdout.splitlines()
    assert load_preset(run / RESUME_PRESET).parallel.pp_layers == []


def test_a_finished_run_without_more_steps_is_refused_and_left_as_it_was(tmp_path, no_launch):
    preset = tmp_path / "tiny.toml"
    preset.write_text(tiny_preset(tmp_path / "runs"))
    run = made_run(tmp_path, preset, (), "finished", 10)
    before = files(run)
    assert {"preset.toml", "run.json"} <= set(before)
    for sets in ((), ("training.lr=0.01",), ("training.steps=10",)):
        result = resume(run, *sets)
        assert result.exit_code == 2 and result.stdout == "", result.output
        assert result.stderr.splitlines() == [
            f"error: {run}: nothing to train: the run finished at step 10 (training.steps = 10); to train further "
            f"add --set training.steps=M with M > 10"]
        assert files(run) == before
    # every problem of the resume at once: what may not change, the preset's, the steps
    result = resume(run, "model.d_model=32", "training.lr=0", "training.steps=8")
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        f"error: {run}: cannot change model.d_model on --resume (64 -> 32): the checkpoint's weights have the "
        f"model's shape",
        f"error: {run}/preset.toml (--set): training.lr: 0.0 must be > 0.0",
        f"error: {run}: nothing to train: the run finished at step 10 (training.steps = 8); to train further add "
        f"--set training.steps=M with M > 10"]
    assert files(run) == before
    result = resume(run, "training.steps=20")
    assert "a run was launched" in str(result.exception)
    assert json.loads((run / "run.json").read_text())["status"] == "running"


def test_a_finished_run_whose_last_checkpoint_is_gone_resumes_from_an_earlier_one(tmp_path, no_launch):
    """What the workers resume from decides: a finished run's copy without its step-10 checkpoint (as the
    cross-strategy tests make a stopped run) has steps 6-10 to train."""
    preset = tmp_path / "tiny.toml"
    preset.write_text(tiny_preset(tmp_path / "runs"))
    run = made_run(tmp_path, preset, (), "finished", 10)
    (run / "checkpoints" / "step-5").mkdir()
    (run / "checkpoints" / "step-5" / "manifest.json").write_text("{}")
    (run / "checkpoints" / "step-10" / "manifest.json").unlink()  # incomplete: not a checkpoint
    assert "a run was launched" in str(resume(run).exception)
