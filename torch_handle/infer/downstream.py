"""Downstream evaluation of a run with EleutherAI's lm-evaluation-harness (``handle eval RUN --tasks ...``).

- :func:`resolve_tasks`: task names -> what ``lm_eval.simple_evaluate`` takes. Tasks of ``--include-path``
  directories are read first (their YAML with its ``include``s, relative ``data_files`` resolved against the
  YAML's directory and checked to exist); only a name they lack brings in the harness's own index of ~14,000
  tasks (seconds). An unknown name is one line with the close names.
- :func:`evaluate_run`: a loaded run's ``DecoderLM`` through :class:`~torch_handle.infer.lm_eval_model.HandleLM`,
  offline (``HF_DATASETS_OFFLINE``, ``HF_HUB_OFFLINE``: nothing is downloaded; a task whose data is not local
  is one line naming it), returning the harness's results with a ``handle`` record (run, weights, step, version).
- :func:`write_results`, :func:`latest_results`: ``RUN/evals/<UTC time>-<tasks>.json`` (the harness's JSON, written
  whole or not at all) and the newest one's scores, which ``handle runs`` shows.

Every problem a user can fix raises one of ``torch_handle.errors.USER_ERRORS`` (one line).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from torch_handle.errors import DataError, RunDirError

EVALS_DIR = "evals"
OFFLINE_ENV = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TQDM_DISABLE")
"""Set to 1 while the harness runs: nothing from the Hub, and no progress bars (the harness draws several)."""
NOT_METRICS = ("sample_len", "sample_count")
"""Numbers in a task's results that are not scores."""
_NAME_LINE = re.compile(r"""^\s*-?\s*["']?(?:task|group|tag)["']?:\s*(.+?)\s*$""", re.M)


def builtin_task_names() -> set[str]:
    """The task, group and tag names the harness's own YAML files declare: a text scan of ``lm_eval/tasks`` (about
    1 s) instead of the harness's index (about 20 s); it finds all but the few names its Python builds."""
    import lm_eval.tasks

    names: set[str] = set()
    for path in Path(lm_eval.tasks.__file__).parent.rglob("*.yaml"):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for match in _NAME_LINE.finditer(text):
            value = match.group(1).strip("'\"")
            if value and value[0] not in "[!{-|>":
                names.add(value)
    return names


def _local_config(yaml_path: Path, name: str) -> dict[str, Any]:
    """A local task's YAML as one config (``include``s merged), its relative ``dataset_kwargs.data_files`` made
    absolute against the YAML's directory (the harness reads them against the working directory).

    Raises:
        DataError: a data file that does not exist."""
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(yaml_path, resolve_func=True)
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if files is None:
        return config

    def fix(value):
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v) for v in value]
        path = Path(value)
        if not path.is_absolute() and (yaml_path.parent / path).exists():
            path = yaml_path.parent / path
        if "://" not in str(value) and not any(c in str(path) for c in "*?[") and not path.exists():
            raise DataError(f"task {name}: data file {value} not found (relative to {yaml_path.parent} or the working "
                            "directory; tasks are read offline)")
        return str(path)

    config["dataset_kwargs"] = {**config["dataset_kwargs"], "data_files": fix(files)}
    return config


def resolve_tasks(names: list[str], include_paths: list[Path] = (), *, names_only: bool = False
                  ) -> tuple[list[Any], Any]:
    """Task names -> (specs for ``simple_evaluate``: a config dict for each local task, the name otherwise; the
    ``TaskManager`` that knows them). ``names_only``: check the names and the local tasks' data files and return
    ``(specs, None)`` without building the harness's index of its own tasks (about 20 s; a preset's validation).

    Raises:
        DataError: no names, a missing include directory, an unknown name (with up to 5 close names among the
            local and the harness's tasks), or a local task's missing data file.
    """
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import Kind

    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise DataError("--tasks: no task named (e.g. --tasks hellaswag,arc_easy)")
    paths = [Path(p) for p in include_paths]
    for path in paths:
        if not path.is_dir():
            raise DataError(f"--include-path {path}: no such directory")
    local = TaskManager(include_path=[str(p) for p in paths], include_defaults=False) if paths else None
    known = set(local.all_tasks) if local else set()
    others = [n for n in names if n not in known]
    if others:
        builtin = builtin_task_names()
        unknown = [n for n in others if n not in builtin]
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(known | builtin), n=5, cutoff=0.6)
            hint = (f" (close: {', '.join(close)})" if close
                    else " (lm_eval --tasks list names the harness's; local tasks need --include-path DIR)")
            raise DataError(f"unknown task {unknown[0]!r}{hint}")
        manager = None if names_only else TaskManager(include_path=[str(p) for p in paths] or None)
    else:
        manager = None if names_only else local
    specs: list[Any] = []
    for name in names:
        entry = local.task_index.get(name) if local else None
        if entry is not None and entry.kind == Kind.TASK and entry.yaml_path is not None:
            specs.append(_local_config(Path(entry.yaml_path), name))
        else:
            specs.append(name)
    return specs, manager


@contextlib.contextmanager
def offline():
    """No Hugging Face Hub access inside: the offline switches (:data:`OFFLINE_ENV`) set in the environment and
    in the already imported ``datasets`` / ``huggingface_hub`` (they read the environment once, at import), and
    datasets' progress bars off; all restored after."""
    import importlib

    saved = {k: os.environ.get(k) for k in OFFLINE_ENV}
    os.environ.update({k: "1" for k in OFFLINE_ENV})
    patched = []
    for module, attr in (("datasets.config", "HF_DATASETS_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
                         ("huggingface_hub.constants", "HF_HUB_OFFLINE")):
        with contextlib.suppress(ImportError):
            mod = importlib.import_module(module)
            if hasattr(mod, attr):
                patched.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, True)
    bars = None
    with contextlib.suppress(ImportError):
        from datasets.utils import logging as datasets_logging

        bars = datasets_logging.is_progress_bar_enabled()
        datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            datasets_logging.enable_progress_bar()
        for mod, attr, value in patched:
            setattr(mod, attr, value)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_tasks(specs: list[Any], manager: Any) -> dict[str, Any]:
    """The harness's task objects of ``specs`` (their data read now, offline).

    Raises:
        DataError: a task that cannot be built offline: its data not on this machine, or its YAML refused by
            the harness (named, with the harness's reason)."""
    from lm_eval.tasks import get_task_dict

    tasks: dict[str, Any] = {}
    with offline():
        for spec in specs:
            name = spec["task"] if isinstance(spec, dict) else spec
            try:
                tasks.update(get_task_dict([spec], manager))
            except Exception as e:  # noqa: BLE001 - datasets and the hub raise many types
                reason = " ".join(str(e).split())[:300] or type(e).__name__
                raise DataError(f"task {name}: cannot be loaded offline ({reason})") from None
    return tasks


def handle_version() -> str:
    import importlib.metadata as md

    try:
        return md.version("torch-handle")
    except md.PackageNotFoundError:
        return "unknown"


def evaluate_run(loaded: Any, specs: list[Any], manager: Any, *, num_fewshot: int | None = None,
                 limit: int | None = None, batch_size: int = 16, step: int | None = None,
                 log_samples: bool = False, tasks: dict[str, Any] | None = None, lm: Any = None
                 ) -> dict[str, Any] | None:
    """Run the harness on a loaded decoder run (``torch_handle.infer.generate.load_run``, or the model a trainer
    holds: :mod:`torch_handle.train.eval_tasks`).

    ``tasks``: the task objects when :func:`load_tasks` has already built them. ``lm``: the
    :class:`~torch_handle.infer.lm_eval_model.HandleLM` to score with (default: one over ``loaded.model``); one over
    a process group splits the documents among its ranks: every rank calls this, and only the group's rank 0 gets
    the results (the others None).

    Returns:
        ``lm_eval.simple_evaluate``'s results (``results``: per task ``acc,none``, ``acc_norm,none``,
        ``exact_match,...`` and their ``_stderr``; ``configs``, ``versions``, ``n-shot``, ``n-samples``, and
        ``samples`` with ``log_samples``) plus ``handle``: ``run``, ``weights``, ``step``, ``version``, ``tasks``,
        ``num_fewshot``, ``limit``, ``batch_size``, ``seconds``, ``requests`` (one count per request type).

    Raises:
        RunDirError: a run the harness cannot score (an encoder-decoder: its requests are a decoder's).
        DataError: as :func:`load_tasks`.
    """
    import lm_eval

    from torch_handle.infer.lm_eval_model import HandleLM

    if loaded.kind != "decoder":
        raise RunDirError(f"{loaded.run_dir}: the harness scores decoder (language-model) runs; this is an "
                          f"{loaded.kind} run (use handle eval --split test for BLEU/chrF)")
    started = time.perf_counter()
    tasks = tasks if tasks is not None else load_tasks(specs, manager)
    lm = lm if lm is not None else HandleLM(loaded.model, loaded.tokenizer, batch_size=batch_size)
    with offline():
        results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks.values()), num_fewshot=num_fewshot,
                                          limit=limit, task_manager=manager, log_samples=log_samples)
    if results is None:  # not the group's rank 0: the scores are computed there
        return None
    results["handle"] = {"run": str(loaded.run_dir), "weights": str(loaded.weights), "step": step,
                         "version": handle_version(), "tasks": list(tasks), "num_fewshot": num_fewshot,
                         "limit": limit, "batch_size": batch_size,
                         "seconds": round(time.perf_counter() - started, 3), "requests": lm.counts}
    return results


def scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """task -> metric -> value of the harness's ``results`` (``acc,none`` -> ``acc``; stderr and aliases left out)."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (results.get("results") or {}).items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if (metric.endswith("_stderr") or metric in NOT_METRICS or not isinstance(value, (int, float))
                    or isinstance(value, bool)):
                continue
            name = metric if filt in ("", "none") else f"{metric},{filt}"
            out.setdefault(task, {})[name] = value
    return out


def write_results(run_dir: Path, results: dict[str, Any]) -> Path:
    """Write ``results`` to ``RUN/evals/<UTC time>-<tasks>.json`` (``<UTC time>-step<8 digits>-<tasks>.json`` for
    an in-loop evaluation: two in one second stay apart) through a temporary file: whole or absent;
    ``samples``, when there, go to ``...-samples.jsonl`` beside it (one request a line: the document, the
    arguments, the model's responses). Returns the JSON's path."""
    from lm_eval.utils import handle_non_serializable

    out = Path(run_dir) / EVALS_DIR
    out.mkdir(exist_ok=True)
    tasks = "+".join(results.get("handle", {}).get("tasks", []))[:80] or "tasks"
    step = results["handle"].get("step") if results.get("handle", {}).get("in_loop") else None
    when = time.strftime('%Y%m%dT%H%M%S', time.gmtime()) + (f"-step{step:08d}" if step is not None else "")
    stem = f"{when}-{re.sub(r'[^A-Za-z0-9_.+-]', '_', tasks)}"
    samples = results.pop("samples", None)
    if samples is not None:
        lines = [json.dumps({"task": task, **s}, default=handle_non_serializable)
                 for task, rows in samples.items() for s in rows]
        _atomic_write(out / f"{stem}-samples.jsonl", "\n".join(lines) + "\n")
        results["handle"]["samples_file"] = f"{stem}-samples.jsonl"
    path = out / f"{stem}.json"
    _atomic_write(path, json.dumps(results, indent=1, default=handle_non_serializable) + "\n")
    return path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def latest_results(run_dir: Path) -> dict[str, Any] | None:
    """The newest ``RUN/evals/*.json``: ``{"file", "step", "scores"}`` (:func:`scores`), None without one or when
    it cannot be read."""
    files = sorted(p for p in (Path(run_dir) / EVALS_DIR).glob("*.json")) if (Path(run_dir) / EVALS_DIR).is_dir() \
        else []
    for path in reversed(files):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        return {"file": str(path), "step": (data.get("handle") or {}).get("step"), "scores": scores(data)}
    return None
