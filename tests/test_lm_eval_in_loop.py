"""``[eval]`` tasks scored during training (issue 50, done-when 3): one real ``handle run`` on 2 ranks (DDP, a tiny
2-layer decoder on the pydoc text, 128 positions, fp32, 2 steps, a checkpoint and an in-loop evaluation after each)
with the local tasks of tests/fixtures/eval_tasks (multiple choice, generation, perplexity; 4 documents each).

Each rank scores half the requests; the scores of step 1 equal a one-process ``handle eval --checkpoint 1`` of
the same run (in this process); the ``tasks`` events, TensorBoard, ``RUN/evals`` and ``handle runs`` carry them.
In this process, over the run's weights: the model is back in training mode and the random generators as they were
after an evaluation; a task that cannot be loaded, or that the model cannot score, is a warning event and the
others are still scored.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from handle_cli.main import cli
from tests.helpers import tiny_preset

lm_eval = pytest.importorskip("lm_eval", reason="needs the eval extra: pip install -e '.[eval]'")

pytestmark = pytest.mark.dist

TASKS_DIR = Path(__file__).parent / "fixtures" / "eval_tasks"
TASKS = ["handle_wikitext_cloze", "handle_seed_answers", "handle_wikitext_ppl"]
LIMIT = 4


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["kind"] == kind]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The 2-rank run (one torchrun launch)."""
    root = tmp_path_factory.mktemp("in_loop")
    preset = root / "in_loop.toml"
    preset.write_text(tiny_preset(root / "runs", steps=2, log_every=1).replace("seq_len = 32", "seq_len = 128")
                      .replace("checkpoint_every = 0", "checkpoint_every = 1")
                      + f"[eval]\ntasks = {json.dumps(TASKS)}\nevery = 1\nlimit = {LIMIT}\nbatch_size = 4\n"
                      f"include_paths = [\"{TASKS_DIR}\"]\n")
    out = subprocess.run([sys.executable, "-m", "handle_cli", "run", str(preset)], capture_output=True, text=True,
                         timeout=400, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (root / "stdout.txt").write_text(out.stdout)
    return Path(next(ln for ln in out.stdout.splitlines() if ln.startswith("run directory: ")).split(": ", 1)[1])


def test_each_rank_scores_half_and_the_scores_equal_handle_eval(run: Path) -> None:
    from tests.test_telemetry import tensorboard_scalars

    events = _events(run, "tasks")
    assert [e["step"] for e in events] == [1, 2]
    assert not [e for e in _events(run, "log") if e.get("level") == "warning" and "eval.tasks" in e["message"]]
    printed = (run.parent.parent / "stdout.txt").read_text()  # handle run prints each evaluation's scores
    cloze = events[1]["scores"]["handle_wikitext_cloze"]
    assert f"step 2: tasks handle_wikitext_cloze acc {cloze['acc']:.3f} acc_norm {cloze['acc_norm']:.3f} |" in printed
    # handle runs shows the newest evaluation: the in-loop one of step 2, its file tagged with the step
    listed = CliRunner().invoke(cli, ["runs", str(run.parent), "--json"])
    assert listed.exit_code == 0, listed.output
    shown = json.loads(listed.output)[0]["evals"]
    assert shown["step"] == 2 and "-step00000002-" in shown["file"] and shown["scores"] == events[1]["scores"]
    written = json.loads(Path(shown["file"]).read_text())
    assert written["handle"]["in_loop"] and written["n-samples"]["handle_wikitext_cloze"]["effective"] == LIMIT
    scalars = tensorboard_scalars(run)
    assert scalars["tasks/handle_wikitext_cloze/acc_norm"] == [
        (e["step"], pytest.approx(e["scores"]["handle_wikitext_cloze"]["acc_norm"])) for e in events]

    result = CliRunner().invoke(cli, ["eval", str(run), "--checkpoint", "1", "--tasks", ",".join(TASKS),
                                      "--include-path", str(TASKS_DIR), "--limit", str(LIMIT), "--batch-size", "4",
                                      "--json"])
    assert result.exit_code == 0, result.output
    one = json.loads(result.output)
    ours = events[0]
    for task, metrics in one["scores"].items():
        for metric, value in metrics.items():
            assert ours["scores"][task][metric] == pytest.approx(value, rel=1e-9), (task, metric)
    # every rank answered half the requests of each kind: documents r, r + 2, ... of every task
    total = one["handle"]["requests"]
    assert total == {"loglikelihood": LIMIT * 4, "generate_until": LIMIT, "loglikelihood_rolling": LIMIT}
    assert ours["requests"] == [{k: n // 2 for k, n in total.items()}] * 2, ours["requests"]


class _Events:
    def __init__(self):
        self.emitted = []

    def emit(self, kind: str, **fields) -> None:
        self.emitted.append({"kind": kind, **fields})


def test_a_failing_task_is_a_warning_and_the_others_are_scored(run: Path, tmp_path: Path) -> None:
    """In this process, over the run's final weights: a task whose data file went after the preset was
    validated is skipped with a warning naming it; a model too short for a task's requests is a warning; a model
    split over the ranks, or fewer documents than ranks, is one warning, and no evaluation after it."""
    from torch_handle.config.schema import EvalConfig
    from torch_handle.infer.generate import load_run
    from torch_handle.train.eval_tasks import InLoopTasks
    from torch_handle.train.strategy import DistContext

    tasks_dir = tmp_path / "tasks"
    shutil.copytree(TASKS_DIR, tasks_dir)
    loaded = load_run(run)
    model = loaded.model.train()

    def trainer(step: int):
        return types.SimpleNamespace(
            step=step, share=None, run_dir=tmp_path, events=_Events(), preset=loaded.preset,
            ctx=DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo"),
            data=types.SimpleNamespace(tokenizer_path=run / "tokenizer.json"),
            strategy=types.SimpleNamespace(unwrapped=lambda: model, local_shard=lambda p: p, train=model.train))

    tasks = InLoopTasks(EvalConfig(tasks=["handle_wikitext_cloze", "handle_wikitext_ppl"], limit=2,
                                   include_paths=[str(tasks_dir)]))
    first = trainer(1)
    rng = torch.get_rng_state(), random.getstate()
    assert tasks.run(first) is not None and model.training  # back in training mode
    # the harness seeds Python's, NumPy's and torch's generators: the training's streams are restored
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    (tasks_dir / "wikitext_cloze.jsonl").unlink()
    second = trainer(2)
    results = tasks.run(second)
    assert list(results["results"]) == ["handle_wikitext_ppl"]
    (warning,) = [e for e in second.events.emitted if e["kind"] == "log"]
    assert warning["level"] == "warning" and "handle_wikitext_cloze skipped at step 2" in warning["message"]
    assert [e["step"] for e in second.events.emitted if e["kind"] == "tasks"] == [2]
    model.args = dataclasses.replace(model.args, max_len=32)  # the cloze's 52-token continuations do not fit
    short = InLoopTasks(EvalConfig(tasks=["handle_wikitext_cloze"], limit=2, include_paths=[str(TASKS_DIR)]))
    third = trainer(3)
    assert short.run(third) is None and model.training
    (warning,) = [e for e in third.events.emitted if e["kind"] == "log"]
    assert warning["message"].startswith("eval.tasks at step 3: DataError: a continuation of"), warning
    shots = InLoopTasks(EvalConfig(tasks=["handle_wikitext_cloze"], limit=2, num_fewshot=1,
                                   include_paths=[str(TASKS_DIR)]))
    model.args = dataclasses.replace(model.args, max_len=128)
    assert shots.run(trainer(3))["n-shot"] == {"handle_wikitext_cloze": 1}  # the harness got num_fewshot
    crowded = trainer(4)  # 2 data-parallel ranks, 1 document a task: a rank would have none
    crowded.ctx = dataclasses.replace(crowded.ctx, world_size=2)
    few = InLoopTasks(EvalConfig(tasks=["handle_wikitext_cloze"], limit=1, include_paths=[str(TASKS_DIR)]))
    assert few.run(crowded) is None and "eval.limit 1 leaves some of the 2 ranks no document (use >= 2)" in \
        crowded.events.emitted[-1]["message"]
    split = trainer(4)
    split.share = object()  # a tp/pp/ep/cp share: the ranks hold parts of the model
    assert tasks.due(4, last=True) and tasks.run(split) is None and not tasks.due(5, last=True)
    (warning,) = [e for e in split.events.emitted if e["kind"] == "log"]
    assert warning["message"] == ("eval.tasks: not scored during training: each rank holds a part of the model "
                                  "(parallel layout) (score the final weights with handle eval RUN --tasks "
                                  "handle_wikitext_cloze,handle_wikitext_ppl)")


def _one_rank_fails(rank: int, tmp: Path) -> None:
    """On a gloo group of 2: HandleLM over the group, rank 1's share raises; what each rank raised goes to a file."""
    import torch.distributed as dist
    from tokenizers import Tokenizer

    from torch_handle.errors import DataError
    from torch_handle.infer.lm_eval_model import HandleLM
    from torch_handle.model.args import TransformerArgs
    from torch_handle.model.transformer import build_transformer

    tokenizer = Tokenizer.from_file((tmp / "tokenizer-path").read_text())
    model = build_transformer(TransformerArgs(vocab_size=tokenizer.get_vocab_size(), d_model=16, n_heads=2,
                                              n_layers=1, d_ff=32, max_len=32)).eval()
    lm = HandleLM(model, tokenizer, group=dist.group.WORLD)
    if rank == 1:
        def too_long(*args, **kwargs):
            raise DataError("a continuation of 52 tokens does not fit the model's 32 positions")

        lm._loglikelihood_tokens = too_long
    try:
        lm.loglikelihood([types.SimpleNamespace(args=("The cat", " sat"))])
        raised = "nothing"
    except DataError as e:
        raised = str(e)
    (tmp / f"raised{rank}").write_text(raised)


def test_an_error_on_one_rank_is_raised_on_every_rank(run: Path, tmp_path: Path) -> None:
    """A rank whose share of the requests fails (a continuation too long for the model) would leave the other ranks
    waiting in the harness's next collective: HandleLM over a group raises on every rank, naming the rank that
    failed and its error (2 gloo processes)."""
    from tests.helpers import run_on_gloo

    (tmp_path / "tokenizer-path").write_text(str(run / "tokenizer.json"))
    run_on_gloo(_one_rank_fails, tmp_path)
    assert (tmp_path / "raised1").read_text() == "a continuation of 52 tokens does not fit the model's 32 positions"
    assert (tmp_path / "raised0").read_text() == ("rank 1 of the evaluation failed: DataError: a continuation of 52 "
                                                  "tokens does not fit the model's 32 positions")
