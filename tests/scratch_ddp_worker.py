"""The 2-process half of tests/test_scratch_ddp.py: ``python -m tests.scratch_ddp_worker OUT.json`` spawns 2 ranks
(gloo, file store), runs every check once in that one process group and rank 0 writes the results as JSON:

- ``equivalence``: torch DDP + AdamW, then the 8 ``scratch-ddp`` variants (4 sync modes x shard_optimizer) on the
  same tiny Transformer and data, 10 optimizer steps of grad_accum 2; per variant the max abs parameter
  difference to DDP, whether it is bitwise equal, and the largest difference between the two ranks' replicas.
- ``memory``: optimizer_bytes per rank, unsharded and sharded.
- ``micro_batches``: all-reduce calls (counted by wrapping ``torch.distributed.all_reduce``) after each of 4
  micro-batches, per sync mode, and what ``step_stats`` reported.
- ``hooks``: all-reduce calls of a plain backward before and after ``close()``, and hooks left on parameters.
- ``resume``: the Trainer on 2 ranks with ZeRO-1: an uninterrupted run and a stop-file run resumed from its
  checkpoint (per-rank optimizer shards), their losses and the checkpoint's files.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WORLD = 2
MODES = ("naive", "flat", "overlap", "bucketed")
STEPS, ACCUM, MICRO_BATCH, SEQ, VOCAB = 10, 2, 4, 16, 64


def tiny_model() -> torch.nn.Module:
    from torch_handle.model.args import TransformerArgs
    from torch_handle.model.transformer import build_transformer

    torch.manual_seed(0)
    args = TransformerArgs(vocab_size=VOCAB, d_model=32, n_heads=2, n_layers=2, d_ff=64, dropout=0.0, pad_id=0,
                           max_len=SEQ, tie_embeddings=False, norm_first=True)
    return build_transformer(args, kind="decoder")


def training_config(grad_accum: int = ACCUM):
    from torch_handle.config.schema import TrainingConfig

    # clipping at 0.5 is active in most of the 10 steps (the gradient norm falls from about 1 to 0.5)
    return TrainingConfig(steps=STEPS, grad_accum=grad_accum, micro_batch_size=MICRO_BATCH, lr=1e-2, warmup_steps=2,
                          weight_decay=0.1, grad_clip=0.5, precision="fp32")


def batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` micro-batches of this rank: (input_ids, labels), each (MICRO_BATCH, SEQ), different on each rank."""
    g = torch.Generator().manual_seed(1234 + rank)
    out = []
    for _ in range(n):
        tokens = torch.randint(1, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def ctx_of(rank: int):
    from torch_handle.train.strategy import DistContext

    return DistContext(rank=rank, local_rank=rank, world_size=WORLD, device=torch.device("cpu"), backend="gloo")


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    from torch_handle.train.loss import loss_fn

    return loss_fn(model(input_ids=batch[0]), batch[1])[0]


def scratch(sync: str, shard: bool, grad_accum: int = ACCUM, bucket_mb: float = 0.01):
    from handle_plugins.strategies import ScratchDDPConfig
    from handle_plugins.strategies.scratch_ddp.strategy import ScratchDDPStrategy

    options = ScratchDDPConfig(sync=sync, bucket_mb=bucket_mb, shard_optimizer=shard)
    return ScratchDDPStrategy(options, training_config(grad_accum), ctx_of(dist.get_rank()), tiny_model())


def reference_ddp(rank: int) -> list[torch.Tensor]:
    """torch.nn.parallel.DistributedDataParallel + AdamW + the project's schedule and clipping, by hand."""
    import contextlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    from torch_handle.train.strategy import lr_lambda

    t = training_config()
    model = DDP(tiny_model())
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8,
                            weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t))
    data = batches(rank, STEPS * ACCUM)
    for step in range(STEPS):
        for i in range(ACCUM):
            with contextlib.nullcontext() if i == ACCUM - 1 else model.no_sync():
                (loss_of(model, data[step * ACCUM + i]) / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.module.parameters()]


def train_scratch(strategy, rank: int) -> None:
    """What the trainer does, ``STEPS`` times: accumulate, backward, step (grad norms kept in ``grad_norms``)."""
    strategy.grad_norms = []
    data = batches(rank, STEPS * ACCUM)
    for step in range(STEPS):
        for i in range(ACCUM):
            with strategy.accumulating(sync=i == ACCUM - 1):
                loss = loss_of(strategy.model, data[step * ACCUM + i])
            strategy.backward(loss)
        strategy.grad_norms.append(strategy.step())
        strategy.step_stats()


def replica_gap(params: list[torch.Tensor]) -> float:
    """Largest difference between this rank's parameters and rank 0's (0 when the replicas are identical)."""
    flat = torch.cat([p.flatten() for p in params])
    theirs = flat.clone()
    dist.broadcast(theirs, src=0)
    return float((flat - theirs).abs().max())


def check_equivalence(rank: int) -> dict[str, Any]:
    ref = reference_ddp(rank)
    out: dict[str, Any] = {}
    memory: dict[str, list[int]] = {}
    for shard in (False, True):
        for sync in MODES:
            strategy = scratch(sync, shard)
            train_scratch(strategy, rank)
            params = [p.detach() for p in strategy.model.parameters()]
            diffs = [float((a - b).abs().max()) for a, b in zip(params, ref)]
            name = f"{sync}{'+zero1' if shard else ''}"
            out[name] = {"max_abs_diff": max(diffs), "bitwise": all(torch.equal(a, b) for a, b in zip(params, ref)),
                         "replica_gap": replica_gap(params), "buckets": len(strategy.buckets),
                         "grad_norms": strategy.grad_norms, "moved": max(
                             float((a - b.detach()).abs().max()) for a, b in zip(params, tiny_model().parameters()))}
            if sync == "bucketed":
                memory["sharded" if shard else "unsharded"] = strategy.optimizer_bytes()
            strategy.close()
    return {"equivalence": out, "memory": memory}


class CountingAllReduce:
    """Wraps ``torch.distributed.all_reduce`` (what the strategy calls) and counts the calls."""

    def __init__(self):
        self.calls = 0
        self.original = dist.all_reduce

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.original(*args, **kwargs)

    def __enter__(self):
        dist.all_reduce = self
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.original


def check_micro_batches(rank: int) -> dict[str, Any]:
    """grad_accum 4: the all-reduce calls seen after each micro-batch's backward, per mode."""
    accum = 4
    data = batches(rank, accum)
    out = {}
    for sync in MODES:
        strategy = scratch(sync, shard=False, grad_accum=accum)
        calls = []
        with CountingAllReduce() as counter:
            for i in range(accum):
                with strategy.accumulating(sync=i == accum - 1):
                    loss = loss_of(strategy.model, data[i])
                strategy.backward(loss)
                calls.append(counter.calls)
        stats = strategy.step_stats()
        strategy.step()
        out[sync] = {"calls_after_each_micro_batch": calls, "step_stats": stats,
                     "params": len(strategy.params), "buckets": len(strategy.buckets),
                     "grad_bytes": sum(p.numel() * p.element_size() for p in strategy.params)}
        strategy.close()
    return out


def check_hooks(rank: int) -> dict[str, Any]:
    """A plain autograd backward (not strategy.backward) launches the hooks' all-reduces before close(), none
    after it."""
    data = batches(rank, 1)[0]
    out = {}
    for sync in ("overlap", "bucketed"):
        strategy = scratch(sync, shard=False, grad_accum=1)
        with CountingAllReduce() as before:
            loss_of(strategy.model, data).backward()
        strategy.sync_gradients()  # wait for what the hooks launched
        strategy.optimizer.zero_grad(set_to_none=True)
        hooks_before = len(strategy.synchronizer.hooks)
        strategy.close()
        strategy.close()  # idempotent
        with CountingAllReduce() as after:
            loss_of(strategy.model, data).backward()
        left = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in strategy.params)
        out[sync] = {"calls_before_close": before.calls, "calls_after_close": after.calls,
                     "hooks_before_close": hooks_before, "hooks_left_on_params": left}
    return out


RESUME_PRESET = """
[run]
output_dir = "{root}/runs"
[model]
d_model = 32
n_heads = 2
n_layers = 1
d_ff = 64
[data]
name = "text"
path = "{root}/corpus.txt"
seq_len = 16
vocab_size = 300
[training]
steps = 4
micro_batch_size = 4
grad_accum = 2
precision = "fp32"
eval_every = 0
eval_steps = 2
log_every = 1
warmup_steps = 0
lr = 0.01
[strategy]
name = "scratch-ddp"
shard_optimizer = true
[launch]
nproc_per_node = 2
"""


def check_resume(rank: int, root: Path) -> dict[str, Any]:
    """ZeRO-1 on 2 ranks through the Trainer: straight 4 steps; then a run stopped after step 1 (stop file, as
    the first Ctrl-C does) and resumed from its checkpoint."""
    from torch_handle.config.loader import dump_preset, load_preset
    from torch_handle.data.corpus import pydoc_corpus
    from torch_handle.registry import get_registry
    from torch_handle.rundir import STOP_FILE, create_run_dir
    from torch_handle.train.trainer import Trainer
    from torch_handle.launch.run import prepare_data

    if rank == 0:
        (root / "corpus.txt").write_text("\n\n".join(pydoc_corpus())[:60_000], encoding="utf-8")
        (root / "p.toml").write_text(RESUME_PRESET.format(root=root), encoding="utf-8")
    dist.barrier()
    preset = load_preset(root / "p.toml")
    ctx = ctx_of(rank)

    def new_run_dir(name: str) -> Path:
        found = [str(create_run_dir(root / "runs", name, dump_preset(preset), {"status": "starting"}))
                 if rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        return Path(found[0])

    hooks_after_close = []

    def train(run_dir: Path) -> str:
        prepare_data(preset)  # what the launcher does before the workers start
        trainer = Trainer(preset, run_dir, ctx, get_registry())
        trainer.build()
        trainer.maybe_resume()
        status = trainer.train()
        trainer.close(status)  # must close the strategy: no gradient hook left behind
        hooks_after_close.append(sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
                                     for p in trainer.strategy.params))
        return status

    def steps(run_dir: Path) -> list[dict]:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["kind"] == "step"]

    straight_dir = new_run_dir("straight")
    out: dict[str, Any] = {"straight_status": train(straight_dir)}
    run_dir = new_run_dir("stopped")
    if rank == 0:
        (run_dir / STOP_FILE).touch()
    dist.barrier()
    out["stopped_status"] = train(run_dir)
    dist.barrier()
    if rank == 0:
        (run_dir / STOP_FILE).unlink()
        out["checkpoint_files"] = sorted(p.name for p in (run_dir / "checkpoints" / "step-1").iterdir())
    out["resumed_status"] = train(run_dir)
    out["hooks_after_close"] = hooks_after_close
    if rank == 0:
        out["straight"] = {e["step"]: e["loss"] for e in steps(straight_dir)}
        resumed = {}
        for e in steps(run_dir):
            resumed[e["step"]] = e["loss"]  # the last occurrence of a step wins
        out["resumed"] = resumed
        out["step_event"] = steps(straight_dir)[-1]
    return out


def worker(rank: int, store: str, out_path: str, checks: Any = None) -> None:
    """Run ``checks(rank, store, out_path)`` (default :func:`run_checks`) and exit without C++ destructors."""
    code = 1
    try:
        (checks or run_checks)(rank, store, out_path)
        code = 0
    except BaseException:  # noqa: BLE001 - printed, and the exit code tells the parent
        traceback.print_exc()
    finally:
        # As torch_handle/train/worker.py does: skip C++ static destructors. After the Trainer has run in a 2-process
        # gloo group, one rank sometimes aborts at interpreter exit ("terminate called without an active
        # exception"; measured 2 of 6 exits, with torch DDP as well as scratch-ddp). Everything is written by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_checks(rank: int, store: str, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        results: dict[str, Any] = {}
        timings = {}
        for name, check in (("equivalence", check_equivalence), ("micro_batches", check_micro_batches),
                            ("hooks", check_hooks)):
            t0 = time.perf_counter()
            found = check(rank)
            results.update(found if name == "equivalence" else {name: found})
            timings[name] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            found = [tmp if rank == 0 else None]
            dist.broadcast_object_list(found, src=0)  # one shared directory (same machine)
            results["resume"] = check_resume(rank, Path(found[0]))
            dist.barrier()
        timings["resume"] = time.perf_counter() - t0
        results["timings_s"] = timings
        write_results(results, out_path)
    finally:
        dist.destroy_process_group()


def write_results(results: dict[str, Any], out_path: str) -> None:
    """Every rank's ``results``, gathered; rank 0 writes them to ``out_path`` as ``{"ranks": [...]}``."""
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps({"ranks": gathered}, indent=1, default=str), encoding="utf-8")


def main(out_path: str, checks: Any = None) -> None:
    """Spawn ``WORLD`` ranks running ``checks`` (a module-level function, default :func:`run_checks`)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(str(Path(tmp) / "store"), out_path, checks), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main(sys.argv[1])
