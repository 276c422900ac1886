"""Helpers shared by test modules."""

from __future__ import annotations

import os
import random
import uuid
from pathlib import Path
from typing import Any

import psutil


def tiny_preset(output_dir: str | Path, *, steps: int = 10, strategy: str = "ddp", log_every: int = 5) -> str:
    """A preset for real 2-process torchrun tests: a 2-layer d_model=64 Transformer on the embedded corpus,
    fp32 (so strategies can be compared exactly), no evals or checkpoints unless a test asks with --set."""
    return f"""
[run]
output_dir = "{output_dir}"
[model]
d_model = 64
n_heads = 4
n_layers = 2
d_ff = 128
[data]
seq_len = 32
vocab_size = 512
[training]
steps = {steps}
micro_batch_size = 4
precision = "fp32"
eval_every = 0
checkpoint_every = 0
log_every = {log_every}
[strategy]
name = "{strategy}"
[launch]
nproc_per_node = 2
"""


_WORDS = {"a": "ein", "dog": "Hund", "cat": "Katze", "runs": "läuft", "sleeps": "schläft", "big": "großer",
          "small": "kleiner", "red": "roter", "man": "Mann", "eats": "isst", "the": "der", "green": "grüner"}


def parallel_corpus(root: Path) -> Path:
    """A parallel corpus for ``[data] name = "parallel"`` in ``root``: train/valid/test .en/.de, word-by-word
    'translations' of random 3-6 word sentences (300/20/12 pairs; a 300-token vocabulary fills)."""
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 300), ("valid", 20), ("test", 12)):
        en = [" ".join(rng.choice(list(_WORDS)) for _ in range(rng.randint(3, 6))) for _ in range(n)]
        (root / f"{split}.en").write_text("\n".join(en) + "\n", encoding="utf-8")
        (root / f"{split}.de").write_text("\n".join(" ".join(_WORDS[w] for w in s.split()) for s in en) + "\n",
                                          encoding="utf-8")
    return root


def tagged_env(**extra: str) -> tuple[dict[str, str], str]:
    """An environment with a unique tag: every process started under it inherits it, so leftovers are found.
    ``HANDLE_LOAD_PLUGINS`` and the bench-comm corruption hook are dropped; ``extra`` is added."""
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("HANDLE_LOAD_PLUGINS", "HANDLE_BENCH_COMM_CORRUPT")}
    env.update(HANDLE_TEST_TAG=tag, **extra)
    return env, tag


def leftovers(tag: str) -> list[str]:
    """``pid: command`` of every process still alive that was started under ``tagged_env``'s ``tag``."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid != os.getpid() and p.environ().get("HANDLE_TEST_TAG") == tag:
                found.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])}")
        except (psutil.Error, OSError):
            continue
    return found


def assert_no_processes(run_dir: str | Path) -> None:
    """Fail naming the pids of any process whose command line names ``run_dir`` (a worker that outlived its run)."""
    left = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(run_dir) in " ".join(p.info["cmdline"] or []):
                left.append(p.pid)
        except psutil.Error:
            pass
    assert not left, f"processes outlived the run: {left}"


def find_worker(run_dir: str | Path, rank: int) -> psutil.Process | None:
    """The live training worker of ``run_dir`` with global rank ``rank`` (its torchrun agent left out), or None."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmdline = " ".join(p.info["cmdline"] or [])
            if ("torch_handle.train.worker" in cmdline and str(run_dir) in cmdline and "distributed.run" not in cmdline
                    and p.environ().get("RANK") == str(rank)):
                return p
        except psutil.Error:
            pass
    return None


def _gloo_rank(rank: int, body, world_size: int, tmp: str) -> None:
    import traceback

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'rendezvous'}", rank=rank,
                            world_size=world_size)
    try:
        body(rank, Path(tmp))
    except BaseException:
        (Path(tmp) / f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_on_gloo(body, tmp_path: Path, world_size: int = 2) -> None:
    """Run ``body(rank, tmp_path)`` (a module-level function: it is pickled) on ``world_size`` fresh processes in one
    gloo group, one thread each; a failure raises AssertionError with the failing ranks' own tracebacks."""
    import torch.multiprocessing as mp

    try:
        mp.spawn(_gloo_rank, args=(body, world_size, str(tmp_path)), nprocs=world_size, join=True)
    except Exception as e:
        raise AssertionError("\n".join(p.read_text() for p in sorted(tmp_path.glob("rank*.txt"))) or str(e)) from None


def tp_mesh(size: int = 2):
    """On a gloo group of ``size`` ranks (inside ``run_on_gloo``'s body): the one-dimensional "tp" ``DeviceMesh``
    over all of them and its :class:`~torch_handle.parallel.tensor.mappings.TPGroup`, (mesh, tp)."""
    from torch.distributed.device_mesh import init_device_mesh

    from torch_handle.parallel.tensor.mappings import TPGroup

    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    return mesh, TPGroup(mesh.get_group())


def worker_results(module: str, out: Path) -> list[dict]:
    """Run ``python -m module OUT`` (a 2-process worker such as tests/scratch_ddp_worker.py) from the repository
    root and return the per-rank results it wrote to ``out`` (JSON ``{"ranks": [...]}``)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", module, str(out)], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())["ranks"]


def handle_at_once(commands: dict[str, tuple[str, ...]], at_once: int, timeout: float = 400,
                   env: dict[str, str] | None = None) -> dict[str, tuple[int, str]]:
    """``handle ARGS...`` once per entry of ``commands`` (name -> ARGS), ``at_once`` at a time, under ``env``
    (default: this process's); name -> (exit code, its output: stdout and stderr)."""
    import subprocess
    import sys

    pending, running, done = list(commands.items()), {}, {}
    while pending or running:
        while pending and len(running) < at_once:
            name, args = pending.pop(0)
            running[name] = subprocess.Popen([sys.executable, "-m", "handle_cli", *args], stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True, env=env)
        name = next(iter(running))
        proc = running.pop(name)
        out, _ = proc.communicate(timeout=timeout)
        done[name] = (proc.returncode, out)
    return done


def train_here(preset: Any, run_dir: Path, ctx: Any, *, prepare: bool = True) -> str:
    """What a worker does with a loaded ``preset`` in ``run_dir``, in this process on ``ctx``'s (already
    initialised) group: build, resume if the run directory has a checkpoint, train, close. ``prepare``: prepare the
    data first, as the launcher does before the workers start. Returns the final status."""
    return trainer_here(preset, run_dir, ctx, prepare=prepare)[0]


def trainer_here(preset: Any, run_dir: Path, ctx: Any, *, prepare: bool = True) -> tuple[str, Any]:
    """:func:`train_here`, returning (the final status, the closed ``Trainer``)."""
    from torch_handle.launch.run import prepare_data
    from torch_handle.registry import get_registry
    from torch_handle.train.trainer import Trainer

    if prepare:
        prepare_data(preset)
    trainer = Trainer(preset, run_dir, ctx, get_registry())
    trainer.build()
    trainer.maybe_resume()
    status = trainer.train()
    trainer.close(status)
    return status, trainer


def run_here(preset: Path, args: tuple[str, ...]) -> Path:
    """``handle run PRESET ARGS`` (``--set`` pairs alone) of one process, trained in this process instead of
    launched (a launch's start-up, about 4 CPU seconds: the CLI's imports, torchrun's agent, the worker's): the
    launcher's checks, data and run directory (:func:`torch_handle.launch.run.prepare_run`), then what the worker
    does with ``preset.toml`` on a gloo group of world size 1 (:mod:`torch_handle.train.worker`), its log lines in
    ``logs/rank0.log``. Returns the run directory; fails unless the run finished."""
    import logging
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist

    from torch_handle.config.loader import load_preset
    from torch_handle.launch.run import prepare_run
    from torch_handle.train.strategy import DistContext

    assert all(a == "--set" for a in args[::2]) and len(args) % 2 == 0, args
    assert not dist.is_initialized(), "a process group is already up in this process"
    loaded, run_dir = prepare_run(str(preset), tuple(args[1::2]), None, None)
    assert loaded.world_size == 1, f"{run_dir}: {loaded.world_size} processes: launch it"
    handler, logger = logging.FileHandler(run_dir / "logs" / "rank0.log"), logging.getLogger("torch_handle")
    handler.setFormatter(logging.Formatter("%(asctime)s rank0 %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    store = Path(tempfile.mkdtemp(prefix="handle-store-"))
    dist.init_process_group("gloo", init_method=f"file://{store / 'store'}", rank=0, world_size=1)
    try:
        status = train_here(load_preset(run_dir / "preset.toml"), run_dir,
                            DistContext(0, 0, 1, torch.device("cpu"), "gloo"), prepare=False)  # prepare_run did
    finally:
        dist.destroy_process_group()
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()
        shutil.rmtree(store, ignore_errors=True)
    assert status == "finished", f"{run_dir}: {status}"
    return run_dir


def handle_runs(root: Path, runs: dict[str, tuple[str, ...]], common: tuple[str, ...], at_once: int,
                timeout: float = 400, env: dict[str, str] | None = None, here: tuple[str, ...] = ()
                ) -> dict[str, Path]:
    """``handle run`` of the 1-rank tiny preset (written to ``root``) once per entry of ``runs`` (name -> its
    ``--set`` arguments, after ``common``), ``at_once`` at a time (:func:`handle_at_once`); name -> run
    directory. A run that printed no run directory fails the calling fixture with its output's tail. The runs
    named in ``here`` (of one process: a reference) train in this process (:func:`run_here`), before the
    launches."""
    preset = root / "tiny.toml"
    preset.write_text(tiny_preset(root / "runs", strategy="single").replace("nproc_per_node = 2",
                                                                            "nproc_per_node = 1"))
    done = {name: run_here(preset, ("--set", f"run.name={name}", *common, *runs[name])) for name in here}
    commands = {name: ("run", str(preset), "--set", f"run.name={name}", *common, *overrides)
                for name, overrides in runs.items() if name not in here}
    for name, (_, out) in handle_at_once(commands, at_once, timeout, env).items():
        lines = [ln for ln in out.splitlines() if ln.startswith("run directory: ")]
        assert lines, f"{name}:\n{out[-3000:]}"
        done[name] = Path(lines[0].split(": ", 1)[1])
    return done
