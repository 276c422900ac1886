"""The 2-process half of tests/test_scratch_fsdp.py: ``python -m tests.scratch_fsdp_worker OUT.json`` spawns 2 gloo
ranks, runs every check once in that process group and rank 0 writes the results as JSON:

- ``equivalence``: torch DDP + AdamW, then scratch-fsdp ZeRO-2, ZeRO-3, ZeRO-3 without reshard_after_forward and
  ZeRO-3 with prefetch, on the tiny Transformer of tests/scratch_ddp_worker.py and on a model that is not handle's
  (embedding, LayerNorm, Linears: :class:`Small`), the Transformer with frozen parameters (:func:`frozen_tiny`)
  and a module with a bf16 frozen weight (:class:`Mixed`), 10 optimizer steps of grad_accum 2; per variant the
  max abs parameter difference to DDP (clipping off), and with clipping at 0.5 active.
- ``memory``: per rank, AdamW state and master elements, parameter bytes between steps, and one process's.
- ``bf16``: ZeRO-2 and ZeRO-3 with bf16 compute, 3 steps, against one process that casts its weights the same way.
- ``checkpoint``: save, convert, load natively and through the portable form, and the reverse from torch's; a
  model with frozen parameters through the portable form.
- ``grad_shards``: after one step's backward, each trainable parameter's gradient shard against DDP's gradient.
- ``comm``: one step's ``step_stats`` per variant, and the number of units.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests import scratch_ddp_worker
from tests.scratch_ddp_worker import ACCUM, STEPS, VOCAB, batches, ctx_of, loss_of, tiny_model, training_config

WORLD = 2
VARIANTS = {"zero2": dict(zero_stage=2), "zero3": dict(zero_stage=3),
            "zero3-keep": dict(zero_stage=3, reshard_after_forward=False),
            "zero3-prefetch": dict(zero_stage=3, prefetch=True)}


class Small(torch.nn.Module):
    """Not a BlockModel: units are found (every module with parameters of its own)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 24)
        self.norm = torch.nn.LayerNorm(24)
        self.up = torch.nn.Linear(24, 48)
        self.down = torch.nn.Linear(48, 24)
        self.out = torch.nn.Linear(24, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(input_ids))
        return self.out(h + self.down(torch.nn.functional.gelu(self.up(h))))


FROZEN = ("embed.", "self_attn_norm.", "qkv_proj.", "linear1.")


def frozen_tiny() -> torch.nn.Module:
    """The tiny Transformer with the embedding, each block's first norm and half its linears frozen: the first op
    of every block reads only frozen weights, so its backward (the input's gradient) may run after the block's
    last trainable gradient is in (what a LoRA model does)."""
    model = tiny_model()
    for name, p in model.named_parameters():
        if any(part in name for part in FROZEN):
            p.requires_grad_(False)
    return model


class Adapter(torch.nn.Module):
    """A bf16 frozen weight beside fp32 trainable low-rank factors (LoRA-like), 25 output rows: an odd dim 0, so
    each rank's chunk of the weight and of ``b`` is padded on 2 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(25, 24).to(torch.bfloat16), requires_grad=False)
        self.a = torch.nn.Parameter(torch.randn(3, 24) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(25, 3) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = torch.nn.functional.linear(x.to(torch.bfloat16), self.weight).float()
        return base + torch.nn.functional.linear(torch.nn.functional.linear(x, self.a), self.b)


class Mixed(torch.nn.Module):
    """Units found per module; ``adapter`` is one unit of two dtypes (two all-gathers)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 24)
        self.adapter = Adapter()
        self.out = torch.nn.Linear(25, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.gelu(self.adapter(self.embed(input_ids))))


MODELS = {"transformer": tiny_model, "small": Small, "frozen": frozen_tiny, "mixed": Mixed}


def config(clip: float):
    import dataclasses

    return dataclasses.replace(training_config(), grad_clip=clip)


def ddp(make, clip: float) -> tuple[Any, Any, Any]:
    """torch DDP around ``make()``, the project's AdamW and LR schedule: ``(model, optimizer, scheduler)``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torch_handle.train.strategy import lr_lambda

    t = config(clip)
    model = DDP(make())
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8,
                            weight_decay=t.weight_decay)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t))


def ddp_train(reference: tuple[Any, Any, Any], rank: int, clip: float, steps: int = STEPS) -> list[float]:
    """``steps`` optimizer steps as tests/scratch_ddp_worker.py's reference takes them; the gradient norms."""
    model, opt, sched = reference
    data = batches(rank, steps * ACCUM)
    norms = []
    for step in range(steps):
        for i in range(ACCUM):
            with contextlib.nullcontext() if i == ACCUM - 1 else model.no_sync():
                (loss_of(model, data[step * ACCUM + i]) / ACCUM).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return norms


def reference_ddp(rank: int, make, clip: float) -> tuple[list[torch.Tensor], list[float]]:
    """torch DDP's parameters after ``STEPS`` steps, and its gradient norms."""
    reference = ddp(make, clip)
    norms = ddp_train(reference, rank, clip)
    return [p.detach().clone() for p in reference[0].module.parameters()], norms


def scratch(make, clip: float, **options):
    from handle_plugins.strategies import ScratchFSDPConfig
    from handle_plugins.strategies.scratch_fsdp.strategy import ScratchFSDPStrategy

    return ScratchFSDPStrategy(ScratchFSDPConfig(**options), config(clip), ctx_of(dist.get_rank()), make())


def train(strategy, rank: int, steps: int = STEPS) -> list[dict[str, Any]]:
    """The trainer's calls, ``steps`` times; each step's ``step_stats`` with the memory figures after it."""
    data = batches(rank, steps * ACCUM)
    stats = []
    for step in range(steps):
        for i in range(ACCUM):
            with strategy.accumulating(sync=i == ACCUM - 1), strategy.autocast():
                loss = loss_of(strategy.model, data[step * ACCUM + i])
            strategy.backward(loss)
        norm = strategy.step()
        stats.append({**strategy.step_stats(), "grad_norm": norm, "param_bytes": strategy.param_bytes(),
                      "optimizer_bytes": strategy.optimizer_bytes()})
    return stats


def check_equivalence(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model_name, make in MODELS.items():
        for clip in (0.0, 0.5) if model_name == "transformer" else (0.0,):
            ref, ref_norms = reference_ddp(rank, make, clip)
            for variant, options in VARIANTS.items():
                if (clip or model_name != "transformer") and variant not in ("zero2", "zero3"):
                    continue
                strategy = scratch(make, clip, **options)
                stats = train(strategy, rank)
                weights = strategy.full_state_dict()
                found = {}
                if rank == 0:
                    names = [n for n, _ in strategy.model.named_parameters()]
                    diffs = [float((weights[n] - r).abs().max()) for n, r in zip(names, ref)]
                    initial = dict(make().named_parameters())
                    change = {n: float((weights[n].float() - p.detach().float()).abs().max())
                              for n, p in initial.items()}
                    frozen = [n for n, p in initial.items() if not p.requires_grad]
                    found = {"max_abs_diff": max(diffs), "units": len(strategy.units),
                             "moved": max(v for n, v in change.items() if n not in frozen),
                             "frozen": frozen, "frozen_max_change": max((change[n] for n in frozen), default=0.0),
                             "frozen_dtypes": sorted({str(weights[n].dtype) for n in frozen}),
                             "optimizer_states": len(strategy.optimizer.state),
                             "state_is_trainable_shards": all(
                                 s in set(strategy.trainable_shards()) for s in strategy.optimizer.state),
                             "trainable": sum(p.requires_grad for p in initial.values()),
                             "gather_dtypes": [sorted(str(d) for d in u.groups) for u in strategy.units],
                             "grad_norms": [s["grad_norm"] for s in stats], "ddp_grad_norms": ref_norms,
                             "unit_names": [u.name for u in strategy.units], "last_step": stats[-1]}
                out[f"{model_name}/{variant}/clip{clip}"] = found
                strategy.close()
    return out


def check_grad_shards(rank: int) -> dict[str, Any]:
    """One step's backward (grad_accum 2) under torch DDP and under ZeRO-3 on the same data: per model, on every
    rank, each trainable parameter's ``shard.grad`` against its rows of DDP's full gradient (``torch.chunk`` on dim
    0), and the frozen ones' gradients (there should be none)."""
    out = {}
    for model_name, make in MODELS.items():
        if model_name == "small":
            continue
        model = ddp(make, 0.0)[0]
        strategy = scratch(make, 0.0, zero_stage=3)
        data = batches(rank, ACCUM)
        for i in range(ACCUM):
            with contextlib.nullcontext() if i == ACCUM - 1 else model.no_sync():
                (loss_of(model, data[i]) / ACCUM).backward()
            with strategy.accumulating(sync=i == ACCUM - 1):
                loss = loss_of(strategy.model, data[i])
            strategy.backward(loss)
        expected = dict(model.module.named_parameters())
        found = {"shapes_ok": True, "max_abs_diff": 0.0, "frozen_grads": 0, "padded": 0}
        for name, sp in strategy.shards._sharded().items():
            if not sp.trainable:
                found["frozen_grads"] += sp.shard.grad is not None or sp.param.grad is not None
                continue
            chunks = torch.chunk(expected[name].grad, WORLD, dim=0)
            rows = chunks[rank] if rank < len(chunks) else expected[name].grad[:0]
            found["shapes_ok"] &= sp.shard.grad.shape == rows.shape
            found["max_abs_diff"] = max(found["max_abs_diff"], float((sp.shard.grad - rows).abs().max()))
            found["padded"] += sp.rows != sp.length
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, found)
        out[model_name] = everyone
        strategy.close()
    return out


def check_memory(rank: int) -> dict[str, Any]:
    """AdamW state and master elements per rank against one process's, and resident parameter bytes."""
    from torch_handle.api import optimizer_state_tensors

    model = tiny_model()
    n_params = sum(p.numel() for p in model.parameters())
    out = {"n_params": n_params}
    for variant in ("zero2", "zero3"):
        strategy = scratch(tiny_model, 0.0, **VARIANTS[variant])
        stats = train(strategy, rank, steps=1)
        moments = [t for t in optimizer_state_tensors(strategy.optimizer) if t.dim() > 0]
        out[variant] = {"moment_elements": sum(t.numel() for t in moments),
                        "master_elements": sum(s.numel() for s in strategy.trainable_shards()),
                        "padding": sum(WORLD * sp.chunk_numel - sp.param.numel() for u in strategy.units
                                       for sp in u.params),
                        "units": len(strategy.units), "param_bytes": stats[-1]["param_bytes"],
                        "optimizer_bytes": stats[-1]["optimizer_bytes"], "comm": stats[-1],
                        "blocks": len([u for u in strategy.units if u.name])}
        strategy.close()
    return out


BF16_STEPS = 3


def cast_reference(make, precision: str, scale: float = 2.0 ** 16) -> tuple[dict[str, torch.Tensor], list[bool]]:
    """bf16/fp16 compute emulated in one process: every step, for each rank's micro-batches in turn, a copy of the
    model whose weights are the fp32 masters cast to the compute dtype (buffers stay fp32) runs forward under
    autocast and backward (fp16: of the loss times the loss scale), accumulating gradients in that dtype; the ranks'
    gradients are summed in fp32 and halved (fp16: unscaled, or the step skipped and the scale halved when any is
    inf/nan), and the project's AdamW steps the fp32 masters. What scratch-fsdp should do on 2 ranks. Returns the
    masters by name and, per step, whether it was skipped."""
    import dataclasses

    from torch_handle.train.strategy import lr_lambda

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    t = dataclasses.replace(config(0.0), precision=precision)
    masters = [torch.nn.Parameter(p.detach().clone()) for p in make().parameters()]
    optimizer = torch.optim.AdamW(masters, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t))
    scale = scale if precision == "fp16" else 1.0
    data = [batches(r, BF16_STEPS * ACCUM) for r in range(WORLD)]
    skipped = []
    for step in range(BF16_STEPS):
        summed = [torch.zeros_like(m) for m in masters]
        for r in range(WORLD):
            model = make()
            for p, m in zip(model.parameters(), masters):
                p.data = m.detach().to(dtype)
            for i in range(ACCUM):
                with torch.autocast("cpu", dtype=dtype):
                    loss = loss_of(model, data[r][step * ACCUM + i])
                loss = loss / ACCUM
                (loss * scale if precision == "fp16" else loss).backward()
            for acc, p in zip(summed, model.parameters()):
                acc += p.grad.float()
        grads = [g / WORLD for g in summed]
        skipped.append(not all(bool(torch.isfinite(g).all()) for g in grads))
        if not skipped[-1]:
            for m, g in zip(masters, grads):
                m.grad = g.mul_(1.0 / scale) if precision == "fp16" else g
            optimizer.step()
        else:
            scale /= 2
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {n: m.detach() for (n, _), m in zip(make().named_parameters(), masters)}, skipped


def check_bf16(rank: int) -> dict[str, Any]:
    """ZeRO-2 and ZeRO-3 in bf16 and fp16 against :func:`cast_reference` (and, for scale, against fp32 DDP)."""
    import dataclasses

    from handle_plugins.strategies import ScratchFSDPConfig
    from handle_plugins.strategies.scratch_fsdp.strategy import ScratchFSDPStrategy

    fp32 = ddp(tiny_model, 0.0)
    ddp_train(fp32, rank, 0.0, steps=BF16_STEPS)
    out = {}
    for name, precision, stage, scale in (("bf16/zero2", "bf16", 2, 1.0), ("bf16/zero3", "bf16", 3, 1.0),
                                          ("fp16/zero3", "fp16", 3, 2.0 ** 16),
                                          ("fp16-overflow/zero2", "fp16", 2, 2.0 ** 20)):
        expected, skipped = cast_reference(tiny_model, precision, scale) if rank == 0 else (None, None)
        t = dataclasses.replace(config(0.0), precision=precision)
        strategy = ScratchFSDPStrategy(ScratchFSDPConfig(zero_stage=stage), t, ctx_of(rank), tiny_model())
        if strategy.scaler is not None:
            strategy.scaler.scale = scale
        stats = train(strategy, rank, steps=BF16_STEPS)
        weights = strategy.full_state_dict()
        if rank == 0:
            out[name] = {
                "skipped": skipped, "grad_norms": [x["grad_norm"] for x in stats],
                "max_abs_diff": max(float((weights[n] - v).abs().max()) for n, v in expected.items()),
                "fp32_ddp_diff": max(float((weights[n] - p.detach()).abs().max())
                                     for n, p in fp32[0].module.named_parameters()),
                "allgather_bytes": stats[-1]["allgather_bytes"], "reducescatter_bytes": stats[-1]["reducescatter_bytes"],
                "weight_dtype": str(strategy.units[0].params[0].full.dtype)}
        strategy.close()
    return out


def shared_dir(rank: int, root: str | None) -> Path:
    found = [root]
    dist.broadcast_object_list(found, src=0)
    return Path(found[0])


def save_everywhere(strategy, rank: int, directory: Path) -> Path:
    """``strategy.save`` on every rank into ``directory`` (made by rank 0), the ranks waiting for each other."""
    if rank == 0:
        directory.mkdir()
    dist.barrier()
    strategy.save(directory)
    dist.barrier()
    return directory


def check_checkpoint(rank: int, root: Path) -> dict[str, Any]:
    """A ZeRO-3 run saved after 2 steps: its files; their portable form against the gathered weights; loaded
    natively as ZeRO-2 and through the portable form as ZeRO-3, 2 more steps against the run's own 2 more. The
    reverse: torch DDP's checkpoint in the ``torch`` format (as ``single``/``ddp`` write it) converted and loaded
    by ZeRO-3, 2 more steps against DDP's 2 more."""
    from torch_handle.checkpoint import convert

    out: dict[str, Any] = {}
    run = scratch(tiny_model, 0.0, zero_stage=3)
    train(run, rank, steps=2)
    names = [n for n, _ in run.model.named_parameters()]
    saved = save_everywhere(run, rank, root / "fsdp")
    at_save = run.full_state_dict()
    if rank == 0:
        out["files"] = sorted(p.name for p in saved.iterdir())
        convert.ensure_portable(saved, {**run.checkpoint_layout(), "world_size": WORLD}, names)
        weights, state, _ = convert.read_portable(saved / "portable")
        out["portable_keys_equal"] = sorted(weights) == sorted(at_save)
        out["converted_max_diff"] = max(float((weights[k] - v).abs().max()) for k, v in at_save.items())
        out["portable_state"] = sorted(state) == sorted(names) and all(
            sorted(v) == ["exp_avg", "exp_avg_sq", "step"] for v in state.values())
    dist.barrier()
    train(run, rank, steps=2)
    expected = run.full_state_dict()
    for how, stage in (("native", 2), ("portable", 3)):
        resumed = scratch(tiny_model, 0.0, zero_stage=stage)
        resumed.load(saved) if how == "native" else resumed.load_portable(saved / "portable")
        train(resumed, rank, steps=2)
        weights = resumed.full_state_dict()
        if rank == 0:
            out[f"{how}_max_diff"] = max(float((weights[k] - v).abs().max()) for k, v in expected.items())
        resumed.close()
    reference = ddp(tiny_model, 0.0)
    ddp_train(reference, rank, 0.0, steps=2)
    torch_dir = root / "torch"
    if rank == 0:
        torch_dir.mkdir()
        model, opt, sched = reference
        torch.save(model.module.state_dict(), torch_dir / "model.pt")
        torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, torch_dir / "optim.pt")
        convert.ensure_portable(torch_dir, {"format": "torch", "world_size": WORLD}, names)
    dist.barrier()
    resumed = scratch(tiny_model, 0.0, zero_stage=3)
    resumed.load_portable(torch_dir / "portable")
    train(resumed, rank, steps=2)
    ddp_train(reference, rank, 0.0, steps=2)
    weights = resumed.full_state_dict()
    if rank == 0:
        out["from_torch_max_diff"] = max(float((weights[n] - p.detach()).abs().max())
                                         for n, p in reference[0].module.named_parameters())
    out.update(check_frozen_checkpoint(rank, root))
    return out


def check_frozen_checkpoint(rank: int, root: Path) -> dict[str, Any]:
    """:func:`frozen_tiny` under ZeRO-3 saved after a step, converted, loaded through the portable form as ZeRO-2:
    the portable form's optimizer state (trainable parameters only), and the next step against the run's own."""
    from torch_handle.checkpoint import convert

    out: dict[str, Any] = {}
    run = scratch(frozen_tiny, 0.0, zero_stage=3)
    train(run, rank, steps=1)
    saved = save_everywhere(run, rank, root / "frozen")
    if rank == 0:
        names = [n for n, _ in run.model.named_parameters()]
        convert.ensure_portable(saved, {**run.checkpoint_layout(), "world_size": WORLD}, names)
        _, state, _ = convert.read_portable(saved / "portable")
        out["frozen_portable_state"] = sorted(state) == sorted(
            n for n, p in run.model.named_parameters() if p.requires_grad)
    dist.barrier()
    train(run, rank, steps=1)
    expected = run.full_state_dict()
    resumed = scratch(frozen_tiny, 0.0, zero_stage=2)
    resumed.load_portable(saved / "portable")
    train(resumed, rank, steps=1)
    weights = resumed.full_state_dict()
    if rank == 0:
        out["frozen_portable_max_diff"] = max(float((weights[k] - v).abs().max()) for k, v in expected.items())
    for strategy in (run, resumed):
        strategy.close()
    return out


def run_checks(rank: int, store: str, out_path: str) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        results: dict[str, Any] = {}
        timings = {}
        for name, check in (("equivalence", check_equivalence), ("grad_shards", check_grad_shards),
                            ("memory", check_memory), ("bf16", check_bf16)):
            t0 = time.perf_counter()
            results[name] = check(rank)
            timings[name] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            results["checkpoint"] = check_checkpoint(rank, shared_dir(rank, tmp if rank == 0 else None))
            dist.barrier()
        timings["checkpoint"] = time.perf_counter() - t0
        results["timings_s"] = timings
        scratch_ddp_worker.write_results(results, out_path)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    scratch_ddp_worker.main(sys.argv[1], run_checks)
