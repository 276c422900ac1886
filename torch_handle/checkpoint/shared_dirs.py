"""Runs that span nodes, the workers' side: which ranks share a directory, and checkpoints written per directory.

Each node of a multi-node run (``launch.nnodes > 1``) runs its own ``handle run`` with its own run directory
path. Those paths may name one directory on a shared filesystem (NFS, Lustre, GPFS: the *shared* layout), one
directory per node on local disks (the *separate* layout), or a mix. Nothing in the preset says which, and a
path alone cannot tell: the workers find out at start by writing and looking for probe files
(:func:`directory_leaders`). Every directory then has a *leader*, the lowest global rank that sees it, which
does what one process per directory must do:

- builds the tokenizer cache (the cache directory is probed on its own: it may be shared when the run
  directories are not, or the other way round);
- creates and finalizes each checkpoint's temporary directory (every rank writes its own files into it);
- writes the final status into run.json when global rank 0 does not write that run.json (separate layout);
- reads the STOP file that its node's launcher creates on Ctrl-C.

Checkpoints in separate directories (:func:`copy_missing_files`, :func:`agree_on_checkpoint`): strategies write
some files on global rank 0 only (the model states, the LR schedule) that every rank reads back on a resume. Rank 0
sends the files of its temporary checkpoint directory that another directory lacks to that directory's leader
over the process group before the directories are finalized, so each directory holds a checkpoint that its own
ranks can load. A resume picks the newest step that verifies in every directory.

The launchers' side is :mod:`torch_handle.launch.multinode`.

No torch import at module level (the CLI imports this module). Every function here that takes ``gather`` is a
collective: every rank calls it, in the same order.
``gather(obj) -> list`` returns every rank's ``obj`` by rank (``torch.distributed.all_gather_object``;
:func:`gatherer` makes one from a DistContext).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch_handle.errors import CheckpointError

Gather = Callable[[Any], list[Any]]
PROBE_PREFIX = ".probe-"
"""Probe files (``<dir>/.probe-<random hex>``) live only during :func:`directory_leaders`."""
CHUNK_BYTES = 64 << 20
"""Bytes per message when :func:`copy_missing_files` sends a file (bounds the memory a transfer needs)."""


def gatherer(ctx: Any) -> Gather:
    """``gather`` for a :class:`~torch_handle.train.strategy.DistContext`: ``all_gather_object`` over the default process
    group (``[obj]`` without one)."""
    import torch.distributed as dist

    def gather(obj: Any) -> list[Any]:
        if not ctx.distributed:
            return [obj]
        out: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(out, obj)
        return out

    return gather


def directory_leaders(paths: Sequence[Path], rank: int, local_rank: int, gather: Gather) -> list[list[int]]:
    """For each of ``paths`` (the same logical directory on every rank, e.g. the run directory): for every rank,
    the lowest global rank that sees the same directory at that path. Collective.

    How: the first rank of each node (``local_rank == 0``; the ranks of one node see one filesystem) creates
    ``<path>/.probe-<random token>``; the tokens are gathered; each rank looks for every node's probe file in its own
    ``path``, and its leader is the lowest rank whose file it finds. Random tokens make stale files of a crashed
    run harmless. Costs two gathers and ``nnodes`` stat calls per rank and path.

    Returns:
        ``leaders[i][r]``: the leader of rank ``r`` for ``paths[i]``; ``leaders[i][r] == 0`` for every ``r`` on a
        shared filesystem or a single node.

    Raises:
        OSError: when a directory cannot be created or the probe file not written.
    """
    paths = [Path(p) for p in paths]
    token = uuid.uuid4().hex if local_rank == 0 else None
    mine: list[Path] = []
    if token is not None:
        for p in paths:
            p.mkdir(parents=True, exist_ok=True)
            probe = p / f"{PROBE_PREFIX}{token}"
            probe.write_text(f"{rank}\n", encoding="utf-8")
            mine.append(probe)
    tokens = gather(token)  # also the barrier: every probe file exists once this returns
    try:
        seen = []
        for p in paths:
            found = [r for r, t in enumerate(tokens) if t is not None and (p / f"{PROBE_PREFIX}{t}").exists()]
            seen.append(min(found) if found else rank)  # nothing found: this node's first rank failed to write
        everyone = gather(seen)  # also the barrier before the probe files go
    finally:
        for probe in mine:
            probe.unlink(missing_ok=True)
    return [[everyone[r][i] for r in range(len(everyone))] for i in range(len(paths))]


# ---------------------------------------------------------------------------------------------------------------
# checkpoints in separate run directories
# ---------------------------------------------------------------------------------------------------------------


def _files(directory: Path) -> dict[str, int]:
    """``{relative path: bytes}`` of the regular files under ``directory``."""
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(Path(directory).rglob("*"))
            if p.is_file()}


def copy_missing_files(directory: Path, rank: int, leaders: Sequence[int], gather: Gather, device: Any = "cpu",
                       chunk_bytes: int = CHUNK_BYTES) -> dict[int, int]:
    """Give every directory the files of rank 0's ``directory`` that it lacks. Collective.

    ``directory`` is the same relative place in every run directory (a checkpoint's temporary directory), after
    every rank wrote its files into it. Each leader of a directory that is not rank 0's (``leaders[r] != 0``)
    receives, from rank 0, the files of rank 0's ``directory`` that its own lacks (by relative path), in messages
    of ``chunk_bytes`` (``torch.distributed.send``/``recv`` of uint8 tensors on ``device``: the CPU with gloo, the
    rank's GPU with nccl). The other ranks wait. Nothing is sent when every rank shares rank 0's directory.

    Cost: the bytes of rank 0's directory that the other directory lacks, once per such directory, at every
    checkpoint: the files rank 0 alone writes (model states, LR schedule) and the shards that the ranks of rank
    0's node wrote.

    Returns:
        ``{leader rank: bytes sent}`` on rank 0, ``{leader rank: bytes received}`` on a receiving leader, ``{}``
        elsewhere.

    Raises:
        OSError: when a file cannot be read or written (the caller turns it into a CheckpointError).
    """
    directory = Path(directory)
    targets = sorted({leader for leader in leaders if leader != 0})
    if not targets:
        return {}
    import torch
    import torch.distributed as dist

    listing = gather(_files(directory) if rank == 0 else None)[0]
    missing = None
    if rank in targets:
        missing = [rel for rel in listing if not (directory / rel).exists()]
    wanted = gather(missing)  # per rank, the files it lacks
    moved: dict[int, int] = {}
    for target in targets:
        if rank not in (0, target):
            continue
        for rel in wanted[target]:
            size = listing[rel]
            path = directory / rel
            if rank == target:
                path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "rb" if rank == 0 else "wb") as f:
                for offset in range(0, size, chunk_bytes):
                    n = min(chunk_bytes, size - offset)
                    if rank == 0:
                        data = f.read(n)
                        if len(data) != n:
                            raise OSError(f"{path}: changed while it was being sent ({len(data)} of {n} bytes)")
                        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst=target)
                    else:
                        buf = torch.empty(n, dtype=torch.uint8, device=device)
                        dist.recv(buf, src=0)
                        f.write(buf.cpu().numpy().tobytes())
            moved[target] = moved.get(target, 0) + size
    return moved


def agree_on_checkpoint(root: Path, rank: int, leaders: Sequence[int], gather: Gather) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from: the newest step that verifies in every run directory. Collective.

    Each directory's leader lists the steps under its ``root`` (``<run dir>/checkpoints``); the steps every
    directory has are tried newest first, each leader verifying its own copy (manifest, sizes, SHA-256:
    :func:`torch_handle.checkpoint.store.verify`), until one verifies everywhere. With one directory this is
    :func:`torch_handle.checkpoint.store.newest_valid` on rank 0.

    Returns:
        ``(root/step-N or None, skipped)``: the path in this rank's own ``root``; ``skipped`` says, for every rank
        alike, why each newer step was passed over (``skipping <path>: <reason>``).
    """
    from torch_handle.checkpoint import store as ckpt
    root = Path(root)
    lead = leaders[rank] == rank
    steps = [int(p.name.split("-", 1)[1]) for p in ckpt.list_checkpoints(root)] if lead else None
    listed = gather(steps)
    dirs = {r: set(s) for r, s in enumerate(listed) if s is not None}
    everywhere = set.intersection(*dirs.values()) if dirs else set()
    skipped: list[str] = []
    for step in sorted(set.union(*dirs.values()) if dirs else set(), reverse=True):
        if step not in everywhere:
            lacking = sorted(r for r, s in dirs.items() if step not in s)
            skipped.append(f"skipping checkpoints/{ckpt.step_dir_name(step)}: not written in the run directory of "
                           f"rank {', '.join(map(str, lacking))} (a node stopped before it finished this checkpoint)")
            continue
        problem = None
        if lead:
            try:
                ckpt.verify(root / ckpt.step_dir_name(step))
            except CheckpointError as e:
                problem = f"skipping {e}" + ("" if rank == 0 else f" (the run directory of rank {rank})")
        problems = [m for m in gather(problem) if m]
        if not problems:
            return root / ckpt.step_dir_name(step), skipped
        skipped.extend(problems)
    return None, skipped
