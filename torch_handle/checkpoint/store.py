"""Checkpoints: atomic step directories with a manifest, RNG capture, and loading that cannot run code.

Layout of ``checkpoints/step-<N>/``: whatever the strategy writes (its own format: DeepSpeed's
``save_checkpoint`` directory, ``model.pt``/``optim.pt`` for single/DDP, a DCP directory for FSDP2),
``layout.json`` (which strategy wrote it, on how many ranks: :data:`LAYOUT`), ``trainer-rank<R>.pt`` with the
step, the data position and the RNG states of rank R, and ``manifest.json`` (files, sizes, SHA-256, step),
written last. A resume under another strategy or world size converts the files to the portable form
(:mod:`torch_handle.checkpoint.convert`), next to them in ``portable/`` (not in the manifest). Every rank writes into ``.tmp-step-<N>/``; after a barrier rank 0 writes the manifest and renames
the directory into place, so a crash mid-save never leaves a directory that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torch_handle.common.names import step_of
from torch_handle.errors import CheckpointError
from torch_handle.parallel.tensor.random import get_rng_tracker, seed_tensor_parallel_rng

MANIFEST = "manifest.json"


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def tmp_dir_for(root: Path, step: int) -> Path:
    return Path(root) / f".tmp-{step_dir_name(step)}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def finalize(root: Path, step: int, keep_last: int | None) -> Path:
    """One rank per run directory (rank 0 on one node), after every rank wrote into the temporary directory:
    manifest, rename, then :func:`prune` to ``keep_last`` (None: no pruning; a multi-node run prunes only once
    every directory has the new checkpoint, so that a step common to all of them always remains)."""
    tmp = tmp_dir_for(root, step)
    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            files[str(p.relative_to(tmp))] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1), encoding="utf-8")
    final = Path(root) / step_dir_name(step)
    if final.exists():  # a restarted run reached the same step again: the new one wins
        shutil.rmtree(final)
    os.rename(tmp, final)
    if keep_last is not None:
        prune(root, keep_last)
    return final


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` step directories under ``root``."""
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(root: Path) -> list[Path]:
    """Step directories under ``root``, oldest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if (step := step_of(p.name)) is not None and p.is_dir()]
    return [p for _, p in sorted(found)]


def verify(path: Path, *, checksums: bool = True) -> None:
    """Check a checkpoint directory against its manifest.

    Raises:
        CheckpointError: naming the first missing, truncated or corrupt file.
    """
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise CheckpointError(f"{path}: no readable {MANIFEST} (incomplete checkpoint)") from None
    for rel, meta in manifest.get("files", {}).items():
        f = Path(path) / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: {rel} is missing")
        if f.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"{path}: {rel} has {f.stat().st_size} bytes, manifest says {meta['bytes']}")
        if checksums and _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{path}: {rel} does not match its checksum")


def newest_valid(root: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and a message for each newer one that was skipped."""
    skipped = []
    for path in reversed(list_checkpoints(root)):
        try:
            verify(path)
            return path, skipped
        except CheckpointError as e:
            skipped.append(f"skipping {e}")
    return None, skipped


def safe_load(path: Path, map_location: Any = "cpu") -> Any:
    """``torch.load(..., weights_only=True)``: tensors and plain containers only; a pickle that would run code
    is refused.

    Raises:
        CheckpointError: for a file that is not a safe checkpoint.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"(Unsupported global: GLOBAL [\w.]+|unsupported GLOBAL [\w.]+|Unsupported operand \S+)",
                          str(e))
        reason = found.group(1) if found else "unsafe pickle"
        raise CheckpointError(f"{path}: refused to load, it is not a plain-tensor checkpoint ({reason})") from None
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {str(e).splitlines()[0]})") from None


def verify_weights_only(paths: list[Path], allowed_globals: list[Any] = ()) -> None:
    """Check that pickle files written by another library (DeepSpeed) hold only tensors, plain containers and
    the ``allowed_globals`` data classes, before that library loads them with a full unpickler.

    Raises:
        CheckpointError: naming the file and the global it refused.
    """
    for path in paths:
        with torch.serialization.safe_globals(list(allowed_globals)):
            safe_load(path)


# ---------------------------------------------------------------------------------------------------------------
# RNG and data position: what makes a resumed run continue with the same batches and the same dropout masks.
# ---------------------------------------------------------------------------------------------------------------


def seed_everything(seed: int, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Seed every generator :func:`rng_state` captures: Python's, NumPy's and torch's with ``seed``, the
    tensor-parallel dropout stream with ``seed + 2718 + tp_rank``, one of ``tp_size``
    (:func:`~torch_handle.parallel.tensor.random.seed_tensor_parallel_rng`)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    seed_tensor_parallel_rng(seed, tp_rank, tp_size)


def rng_state() -> dict[str, Any]:
    """RNG states of torch (CPU and CUDA), Python and NumPy, and the tensor-parallel dropout stream
    (``"tracker"``: :meth:`~torch_handle.parallel.tensor.random.RNGTracker.get_states`), as weights_only-loadable
    values."""
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [py[0], torch.tensor(py[1], dtype=torch.int64), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "tracker": get_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(int(x) for x in internal.tolist()), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "tracker" in state:  # absent from checkpoints written before it: the stream goes on from its seed
        get_rng_tracker().set_states(state["tracker"])


@dataclass
class TrainerState:
    """Per-rank loop state saved with every checkpoint."""

    step: int
    epoch: int
    batch_in_epoch: int = 0
    """Micro-batches of this epoch consumed by this rank (informational since ``samples_in_epoch`` exists; the
    data position of checkpoints written before it)."""
    samples_in_epoch: int | None = None
    """Samples of this epoch's global order consumed by all ranks together (see
    :class:`torch_handle.data.datasets.GlobalBatchSampler`): the data position, independent of the world size. None in a
    checkpoint written before it existed."""

    def to_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "rng": rng_state()}
        if self.samples_in_epoch is not None:
            state["samples_in_epoch"] = self.samples_in_epoch
        return state


def trainer_state_path(ckpt_dir: Path, rank: int) -> Path:
    return Path(ckpt_dir) / f"trainer-rank{rank}.pt"


def save_trainer_state(ckpt_dir: Path, rank: int, state: TrainerState) -> None:
    torch.save(state.to_dict(), trainer_state_path(ckpt_dir, rank))


def own_rng_state(ckpt_dir: Path, rank: int, layout: dict[str, Any], tp: int) -> bool:
    """Whether ``rank`` resumes its own saved RNG states: it wrote a trainer state, under the same ``parallel.tp``
    (``layout["tp"]``, 1 when absent). Otherwise it must be seeded afresh, alike on the TP ranks of a replica:
    restoring states that two ranks wrote as data-parallel replicas would give one replica's TP ranks different
    replicated dropout masks."""
    return trainer_state_path(ckpt_dir, rank).is_file() and int(layout.get("tp", 1)) == tp


def load_trainer_state(ckpt_dir: Path, rank: int, *, restore_rng: bool = True) -> TrainerState:
    """Return the loop position saved by ``rank`` and (``restore_rng``) restore its RNG states in this process.

    Raises:
        CheckpointError: when the file is missing or unsafe.
    """
    data = safe_load(trainer_state_path(ckpt_dir, rank))
    if restore_rng:
        set_rng_state(data["rng"])
    samples = data.get("samples_in_epoch")
    return TrainerState(step=int(data["step"]), epoch=int(data["epoch"]), batch_in_epoch=int(data["batch_in_epoch"]),
                        samples_in_epoch=None if samples is None else int(samples))


# ---------------------------------------------------------------------------------------------------------------
# Layout: who wrote a checkpoint, so that a resume under other settings knows whether it can load it as it is.
# ---------------------------------------------------------------------------------------------------------------

LAYOUT = "layout.json"
"""Written by rank 0 into every checkpoint: ``format`` (``torch``: ``model.pt`` + ``optim.pt``; ``torch-sharded``:
``model.pt`` + ``optim-rank<R>.pt``; ``dcp``: ``dcp/`` + ``scheduler.pt``; ``deepspeed``: DeepSpeed's
``ds/`` directory), ``strategy``, ``world_size``, ``micro_batch_size``, ``grad_accum``, ``global_batch``,
``precision`` and the strategy's own layout keys (``zero_stage``, ...)."""


def save_layout(ckpt_dir: Path, layout: dict[str, Any]) -> None:
    (Path(ckpt_dir) / LAYOUT).write_text(json.dumps(layout, indent=1, sort_keys=True), encoding="utf-8")


def read_layout(ckpt_dir: Path) -> dict[str, Any]:
    """The checkpoint's layout: ``layout.json``, or for a checkpoint written before it existed what its files
    tell (``format`` and ``world_size``; the other keys absent).

    Raises:
        CheckpointError: when ``layout.json`` is unreadable, or no known format's files are there.
    """
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / LAYOUT
    if path.is_file():
        try:
            layout = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: unreadable ({e})") from None
        if not isinstance(layout, dict) or not isinstance(layout.get("format"), str):
            raise CheckpointError(f"{path}: no \"format\" key")
        return layout
    ranks = len(list(ckpt_dir.glob("trainer-rank*.pt")))
    if (ckpt_dir / "ds").is_dir():
        fmt = "deepspeed"
    elif (ckpt_dir / "dcp").is_dir():
        fmt = "dcp"
    elif list(ckpt_dir.glob("optim-rank*.pt")):
        fmt = "torch-sharded"
    elif (ckpt_dir / "optim.pt").is_file():
        fmt = "torch"
    else:
        raise CheckpointError(f"{ckpt_dir}: neither {LAYOUT} nor the files of a known checkpoint format")
    return {"format": fmt, "world_size": ranks or None}


# ---------------------------------------------------------------------------------------------------------------
# A checkpoint that cannot be written (disk full, directory unwritable): the previous one stays, the run fails.
# ---------------------------------------------------------------------------------------------------------------

FAULT_ENV = "HANDLE_TEST_CHECKPOINT_ENOSPC"
"""Test hook: ``HANDLE_TEST_CHECKPOINT_ENOSPC=N`` makes every rank's checkpoint write at step N raise
``OSError(ENOSPC)`` after its files are partly written (tests/test_resume_safety.py). Not for production use."""


def inject_fault(step: int, path: Path) -> None:
    """The :data:`FAULT_ENV` test hook (a no-op unless it is set to ``step``).

    Raises:
        OSError: ENOSPC for ``path`` when the hook names this step.
    """
    import errno

    if os.environ.get(FAULT_ENV, "").strip() == str(step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def is_write_failure(e: BaseException) -> bool:
    """An OSError, or torch's serializer failing to write a file (a RuntimeError that says so)."""
    return isinstance(e, OSError) or (isinstance(e, RuntimeError) and bool(
        re.search(r"failed writing file|file write failed|unexpected pos", str(e))))


def write_failure(root: Path, step: int, error: BaseException, *, clean_up: bool = True) -> CheckpointError:
    """Describe a failed checkpoint write in one line: the directory, the OS's reason and, when a previous
    checkpoint tells the size, the bytes needed and free (an estimate). ``clean_up`` (rank 0 only: another rank
    may still be writing into it) removes the half-written ``.tmp-step-<step>``; a leftover one is hidden and
    replaced by the next save at that step."""
    from torch_handle.common.units import fmt_bytes

    root = Path(root)
    if clean_up:
        shutil.rmtree(tmp_dir_for(root, step), ignore_errors=True)
    reason = (error.strerror if isinstance(error, OSError) and error.strerror else str(error).splitlines()[0])
    previous, _ = newest_valid(root) if root.is_dir() else (None, [])
    need = ""
    if previous is not None:
        try:
            files = json.loads((previous / MANIFEST).read_text(encoding="utf-8")).get("files", {})
            size = sum(int(f.get("bytes", 0)) for f in files.values())
            free = shutil.disk_usage(root).free
            need = f" (needs about {fmt_bytes(size)}, {fmt_bytes(free)} free)"
        except (OSError, ValueError, TypeError, AttributeError):
            need = ""
    kept = f"; {previous.name} is kept" if previous is not None else ""
    return CheckpointError(f"checkpoint at step {step} not written to {root}: {reason}{need}{kept}")
