"""``handle eval RUN --tasks T1,T2``: downstream tasks of EleutherAI's lm-evaluation-harness on a run
(``torch_handle.infer.downstream``). Click and the standard library at import; the harness inside the function.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path
from typing import Any

import click

from handle_cli.common import fail


def tasks_line(event: dict[str, Any]) -> str:
    """A ``tasks`` event (in-loop evaluation, ``[eval]``) as one console line: ``step 2: tasks cloze acc 0.250
    acc_norm 0.500 | answers exact_match,strip 0.000 (1.6 s)``; names and metrics cleaned of control characters."""
    from torch_handle.common.text import clean

    scores = event.get("scores") if isinstance(event.get("scores"), dict) else {}
    parts = [clean(str(task), 80) + "".join(f" {clean(str(m), 40)} {v:.3f}" for m, v in metrics.items()
                                            if isinstance(v, (int, float)) and not isinstance(v, bool))
             for task, metrics in scores.items() if isinstance(metrics, dict)]
    seconds = event.get("seconds")
    took = f" ({seconds:.1f} s)" if isinstance(seconds, (int, float)) else ""
    return f"step {event.get('step')}: tasks {' | '.join(parts) or '-'}{took}"


TASK_OPTIONS = ("num_fewshot", "limit", "batch_size", "include_paths", "log_samples")
"""The options that mean something only with --tasks."""


def check_task_options(tasks: str | None, given: dict[str, Any]) -> None:
    """One line, exit 2: a harness option without --tasks, or a --limit / --num-fewshot / --batch-size out of
    range (checked before anything is read)."""
    used = [k for k in TASK_OPTIONS if given.get(k) not in (None, (), False)]
    if tasks is None:
        if used:
            flag = "--" + used[0].replace("_", "-").replace("include-paths", "include-path")
            fail(f"{flag} needs --tasks (e.g. handle eval RUN --tasks hellaswag {flag} ...)")
        return
    if given.get("limit") is not None and given["limit"] <= 0:
        fail(f"--limit {given['limit']}: must be at least 1 (documents per task)")
    if given.get("num_fewshot") is not None and given["num_fewshot"] < 0:
        fail(f"--num-fewshot {given['num_fewshot']}: must be 0 or more")
    if given.get("batch_size") is not None and given["batch_size"] <= 0:
        fail(f"--batch-size {given['batch_size']}: must be at least 1")


def run_tasks(run_dir: Path, checkpoint: int | None, tasks: str, num_fewshot: int | None, limit: int | None,
              batch_size: int | None, include_paths: tuple[Path, ...], log_samples: bool, as_json: bool) -> None:
    """Resolve the tasks, open the run, evaluate, write ``RUN/evals/...json`` last, print the scores."""
    from handle_cli.runs_cmd import run_summary
    from torch_handle.infer import downstream
    from torch_handle.infer.generate import load_run

    try:
        import lm_eval  # noqa: F401
    except ImportError:
        fail("--tasks needs the eval extra (EleutherAI's lm-evaluation-harness): pip install 'torch-handle[eval]'")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    specs, manager = downstream.resolve_tasks(tasks.split(","), list(include_paths))
    loaded = load_run(run_dir, checkpoint)
    loaded.model.requires_grad_(False)  # inference only (not a global switch: tests run in-process)
    if loaded.kind != "decoder":
        fail(f"{run_dir}: --tasks scores decoder (language-model) runs, this is an {loaded.kind} run: the harness's "
             "requests need a decoder (handle eval RUN --split test gives BLEU and chrF)")
    step = checkpoint if checkpoint is not None else run_summary(run_dir)["step"]
    with contextlib.redirect_stderr(io.StringIO()):  # the harness's progress bars (errors are exceptions)
        results = downstream.evaluate_run(loaded, specs, manager, num_fewshot=num_fewshot, limit=limit,
                                          batch_size=batch_size or 16, step=step, log_samples=log_samples)
    path = downstream.write_results(run_dir, results)
    if as_json:
        click.echo(json.dumps({"file": str(path), "run": str(run_dir), "step": step,
                               "scores": downstream.scores(results), "handle": results["handle"]}, default=str))
        return
    where = f"step {step}" if step is not None else str(loaded.weights)
    click.echo(f"{run_dir} ({where}), lm-evaluation-harness:")
    for task, found in downstream.scores(results).items():
        metrics = results["results"][task]
        for key, value in found.items():
            metric, _, filt = key.partition(",")
            err = metrics.get(f"{metric}_stderr,{filt or 'none'}")
            err = f" ± {err:.4f}" if isinstance(err, (int, float)) else ""
            n = results.get("n-samples", {}).get(task, {}).get("effective", "?")
            click.echo(f"  {task:<28} {metric:<12} {value:.4f}{err}  ({n} documents)")
    h = results["handle"]
    count = ", ".join(f"{n} {kind}" for kind, n in h["requests"].items())
    click.echo(f"{count} requests in {h['seconds']:.1f} s; written: {path}")
