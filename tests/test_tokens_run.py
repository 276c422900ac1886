"""Real runs of the ``tokens`` dataset (plugins/tokens.py) on a mixture of three prepared sources (Tiny Shakespeare,
WikiText-2, Multi30k; weights 0.5/0.3/0.2): a 2-process DDP run stopped after step 4 and resumed on 1 process
continues the uninterrupted run's losses; the step events and the summary carry each source's tokens;
``handle eval --data`` scores a prepared directory; a resume whose data changed and an eval on another
tokenizer are refused in one line.

One uninterrupted 8-step run (checkpoints at 4 and 8) is shared by the tests (as tests/test_cross_resume.py):
a resume copies its directory without the step-8 checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import tiny_preset
from tests.prepared_data import prepare, shakespeare_docs, three_sources, tokenizer_file
from tests.test_cross_resume import events, handle, losses, sets

pytestmark = pytest.mark.dist

STOP_AT, STEPS = 4, 8
WEIGHTS = {"shakespeare": 0.5, "wiki": 0.3, "captions": 0.2}


def _preset(root: Path, dirs: dict[str, Path]) -> Path:
    text = tiny_preset(root / "runs", steps=STEPS, log_every=1).replace(
        "[data]\nseq_len = 32\nvocab_size = 512\n",
        '[data]\nname = "tokens"\nseq_len = 32\nsources = ['
        + ", ".join(f'{{path = "{dirs[n]}", weight = {w}}}' for n, w in WEIGHTS.items()) + "]\n")
    path = root / "mix.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def mix_run(tmp_path_factory) -> tuple[Path, dict[str, Path], str]:
    """The uninterrupted run: DDP on 2 ranks, fp32, dropout 0, checkpoints at steps 4 and 8."""
    root = tmp_path_factory.mktemp("tokens")
    dirs = three_sources(root / "data")
    run = root / "full"
    proc = handle("run", str(_preset(root, dirs)), "--run-dir", str(run), *sets(
        "model.dropout=0", f"training.checkpoint_every={STOP_AT}"))
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
    return run, dirs, proc.stdout


def test_a_stop_resumed_on_one_rank_continues_the_uninterrupted_losses(mix_run, tmp_path) -> None:
    full, _, _ = mix_run
    run = tmp_path / "stopped"
    shutil.copytree(full, run)
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS}")  # the run as a stop after step 4 leaves it
    handle("run", "--resume", str(run), *sets("strategy.name=single", "launch.nproc_per_node=1",
                                              "training.grad_accum=2"))
    assert json.loads((run / "run.json").read_text())["world_size"] == 1
    before, after = losses(full), losses(run)
    for step in range(STOP_AT + 1, STEPS + 1):
        assert abs(after[step] - before[step]) <= 1e-5 * abs(before[step]), (step, after[step], before[step])
    # the resumed steps drew the same sources (the telemetry is a function of the seed and the step)
    mix = {e["step"]: e["source_tokens"] for e in events(full, "step")}
    assert all(e["source_tokens"] == mix[e["step"]] for e in events(run, "step"))


def test_the_steps_and_the_summary_carry_each_sources_tokens(mix_run) -> None:
    full, _, stdout = mix_run
    steps = events(full, "step")
    totals = dict.fromkeys(WEIGHTS, 0)
    for e in steps:
        assert list(e["source_tokens"]) == list(WEIGHTS) and sum(e["source_tokens"].values()) == e["tokens"]
        for name, n in e["source_tokens"].items():
            totals[name] += n
    total = sum(totals.values())
    assert total == STEPS * 8 * 32  # 8 samples of 32 tokens a step
    line = next(x for x in stdout.splitlines() if x.strip().startswith("data mix"))
    assert line.split() == ["data", "mix", *(w for n, t in totals.items() for w in (n, f"{t / total:.1%}")),
                            f"({total:,}", "tokens)"]
    layout = json.loads((full / "checkpoints" / f"step-{STOP_AT}" / "layout.json").read_text())
    assert set(layout["data"]) == {"data_fingerprint", "tokenizer_sha256"}


def test_eval_data_reports_loss_perplexity_and_tokens(mix_run, tmp_path) -> None:
    full, dirs, _ = mix_run
    proc = handle("eval", str(full), "--data", str(dirs["wiki"]), "--json")
    result = json.loads(proc.stdout)
    meta = json.loads((dirs["wiki"] / "meta.json").read_text())
    windows = (meta["splits"]["valid"]["tokens"] - 1) // 32
    assert result["tokens"] == windows * 32 and result["data"] == str(dirs["wiki"]) and result["split"] == "valid"
    assert 0 < result["loss"] < 7 and abs(result["perplexity"] - 2.718281828 ** result["loss"]) < 0.01 * \
        result["perplexity"]
    text = handle("eval", str(full), "--data", str(dirs["wiki"])).stdout
    assert text.strip() == (f"{dirs['wiki']} (valid): loss {result['loss']:.4f}  perplexity "
                            f"{result['perplexity']:.2f}  ({result['tokens']} tokens)")


def _refused(*args: str) -> list[str]:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "handle_cli", *args], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.splitlines()


def test_eval_on_another_tokenizer_or_no_directory_is_refused_in_one_line(mix_run, tmp_path) -> None:
    full, _, _ = mix_run
    docs = shakespeare_docs()[:300]
    other = prepare(tmp_path / "other", docs, tokenizer_file(tmp_path / "tok.json", docs, 300))
    (line,) = _refused("eval", str(full), "--data", str(other))
    assert f"{other} was prepared with another tokenizer than the run's" in line
    (line,) = _refused("eval", str(full), "--data", str(tmp_path / "nope"))
    assert f"{tmp_path / 'nope'}: no such directory" in line


def test_a_resume_whose_data_changed_is_refused_before_anything_starts(mix_run, tmp_path) -> None:
    full, dirs, _ = mix_run
    run = tmp_path / "changed"
    shutil.copytree(full, run)
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS}")
    wiki = dirs["wiki"]
    saved = tmp_path / "wiki-saved"
    shutil.move(wiki, saved)
    try:
        prepare(wiki, shakespeare_docs()[:500], saved / "tokenizer.json")  # same tokenizer, other documents
        before = (run / "run.json").read_text()
        (line,) = _refused("run", "--resume", str(run))
        assert f"{run / 'checkpoints' / f'step-{STOP_AT}'}: the prepared data" in line and "changed" in line
        assert (run / "run.json").read_text() == before and not (run / "preset.resume.toml").exists()
    finally:
        shutil.rmtree(wiki, ignore_errors=True)
        shutil.move(saved, wiki)
