"""The decoder split into pipeline stages trains as one process does (nanotron's check, gradient by gradient).

In-process: 2 gloo ranks run one step of a tiny decoder (fp32, dropout 0, tied embeddings) through
:class:`~torch_handle.train.shares.pipeline.PipelineParallel` (the trainer's glue: the re-split into m
micro-batches, the schedule, the tied gradients summed, the norm over both stages) with every schedule, hand-written
and torch's; each rank computes the one-process reference itself. Then real runs through ``handle run``.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from torch_handle.config.schema import ParallelConfig
from torch_handle.model.args import TransformerArgs
from torch_handle.model.transformer import DecoderLM
from torch_handle.parallel.pipeline.schedules import Action, gpipe, one_f_one_b, theoretical_bubble
from torch_handle.train.phases import PhaseTimer

from tests.helpers import handle_runs, run_on_gloo

pytestmark = pytest.mark.dist

MICRO, ACCUM, T, VOCAB = 4, 2, 8, 32  # a step of 8 sequences, re-split into m = 4 pipeline micro-batches of 2
CASES = [("scratch", "gpipe", 1), ("scratch", "1f1b", 1), ("native", "gpipe", 1), ("native", "1f1b", 1),
         ("native", "interleaved-1f1b", 2), ("native", "zbv", 2)]
# Llama- and Qwen 3-shaped decoders (RMSNorm, RoPE, SwiGLU, 2 key/value heads for 4 query heads, no biases, untied;
# Qwen 3: q/k norm and a head width of 8 != 16 / 4): the final RMSNorm on the last stage, nothing positional on the
# first. One schedule of each implementation: the schedules do not depend on the block.
LLAMA = {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu", "n_kv_heads": 2, "bias": False,
         "scale_embeddings": False, "tie_embeddings": False}
SHAPES = {"llama": LLAMA, "qwen3": {**LLAMA, "qk_norm": True, "head_dim": 8}}
SHAPE_CASES = [("scratch", "1f1b", 1), ("native", "interleaved-1f1b", 2)]
# training.loss_impl = "chunked": the last stage returns its hidden states, the share applies the output layer
CHUNKED_CASES = [("scratch", "1f1b", 1), ("native", "interleaved-1f1b", 2)]


# ---- the schedules' orders ------------------------------------------------------------------------------------

def test_hand_written_orders_for_two_stages_and_four_microbatches() -> None:
    order = {s: " ".join(map(str, one_f_one_b(2, s, 4))) for s in (0, 1)}
    assert order == {0: "F0 F1 B0 F2 B1 F3 B2 B3", 1: "F0 B0 F1 B1 F2 B2 F3 B3"}
    assert " ".join(map(str, gpipe(2, 0, 4))) == "F0 F1 F2 F3 B0 B1 B2 B3"


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
def test_every_order_runs_each_microbatch_once_forward_before_backward(schedule) -> None:
    for p in range(2, 5):
        for m in range(1, 9):
            for stage in range(p):
                order = schedule(p, stage, m)
                assert sorted(order, key=lambda a: (a.kind, a.microbatch)) == (
                    [Action("B", i) for i in range(m)] + [Action("F", i) for i in range(m)]), (p, m, stage)
                assert all(order.index(Action("F", i)) < order.index(Action("B", i)) for i in range(m))
                in_flight, most = 0, 0
                for action in order:
                    in_flight += 1 if action.kind == "F" else -1
                    most = max(most, in_flight)
                assert most == (min(p - stage, m) if schedule is one_f_one_b else m), (p, m, stage, order)


def test_theoretical_bubble() -> None:
    assert theoretical_bubble("1f1b", 2, 4) == pytest.approx(1 / 5)
    assert theoretical_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("interleaved-1f1b", 2, 4, v=2) == pytest.approx(1 / 9)


# ---- one step, in process: every gradient of every stage ------------------------------------------------------

def _args(**shape) -> TransformerArgs:
    return TransformerArgs(**{"vocab_size": VOCAB, "d_model": 16, "n_heads": 4, "n_layers": 4, "d_ff": 32,
                              "dropout": 0.0, "max_len": T, "norm_first": True, "tie_embeddings": True, **shape})


def _batches() -> list[dict[str, torch.Tensor]]:
    """The step's grad_accum micro-batches; the pipeline's micro-batches hold unequal token counts (ignored labels)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (MICRO * ACCUM, T), generator=g)
    labels = torch.randint(0, VOCAB, (MICRO * ACCUM, T), generator=g)
    labels[0, :3] = -100
    labels[5, 4:] = -100
    return [{"input_ids": ids[i:i + MICRO], "labels": labels[i:i + MICRO]} for i in range(0, MICRO * ACCUM, MICRO)]


def _eval_batch() -> dict[str, torch.Tensor]:
    """3 sequences: fewer than m (they split into 3 pipeline micro-batches of 1)."""
    return {k: v[1:4] for k, v in _batches()[1].items()}


def _reference(args: TransformerArgs) -> tuple[float, float, dict[str, torch.Tensor], float]:
    torch.manual_seed(0)
    model = DecoderLM(args)
    with torch.no_grad():
        batch = _eval_batch()
        val_loss = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten()).item()
    batch = {k: torch.cat([b[k] for b in _batches()]) for k in ("input_ids", "labels")}
    loss = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    norm = torch.stack([g.double().pow(2).sum() for g in grads.values()]).sum().sqrt()
    return loss.item(), norm.item(), grads, val_loss


def _pipeline_step(args: TransformerArgs, impl: str, schedule: str, v: int, loss_impl: str = "full"
                   ) -> tuple[torch.Tensor, float, dict[str, torch.Tensor], float]:
    """One evaluation and one step of PipelineParallel on this rank: (Σ loss·tokens, tokens), the norm before_step
    returns, the gradients of this rank's shard by their one-process names, and the evaluation loss. With
    ``loss_impl = "chunked"`` the last stage's outputs are checked to be hidden states (no logits made)."""
    from torch_handle.train.objectives.tokens import TokenLoss
    from torch_handle.train.shares.pipeline import PipelineParallel
    from torch_handle.train.strategy import DistContext
    from torch_handle.parallel.mesh import attach_layout

    import torch.distributed as dist

    parallel = ParallelConfig(pp=2, pp_impl=impl, pp_schedule=schedule, pp_stages_per_rank=v)
    ctx = attach_layout(DistContext(rank=dist.get_rank(), local_rank=dist.get_rank(), world_size=2,
                                    device=torch.device("cpu"), backend="gloo"), parallel)
    pp = PipelineParallel(parallel, ctx, n_microbatches=4)
    torch.manual_seed(0)
    shard = pp.split(DecoderLM(args))
    strategy = SimpleNamespace(autocast=contextlib.nullcontext, clips_gradients=True, pipeline_grad_sync=lambda: None,
                               ep_share=None)
    pp.bind(strategy)
    trainer = SimpleNamespace(timer=PhaseTimer(), training=SimpleNamespace(grad_accum=ACCUM), step=1,
                              strategy=strategy, objective=TokenLoss(), share=pp, loss_weight=None, loss_impl=loss_impl)
    widths: set[int] = set()
    for stage in pp._stage_modules:
        if stage.last:
            stage.register_forward_hook(lambda module, inputs, out: widths.add(out.shape[-1]))
    val = torch.stack(pp.evaluate(_eval_batch(), trainer))
    dist.all_reduce(val)
    trainer.timer.begin()
    stats = torch.zeros(2, dtype=torch.float64)
    pp.run(trainer, iter(_batches()), stats)
    norm = pp.before_step(float("inf"))
    if pp.has_last:  # the last stage's every output: logits (B, T, V), or hidden states (B, T, C) when chunked
        assert widths == {args.d_model if loss_impl == "chunked" else args.vocab_size}, (loss_impl, widths)
    dist.all_reduce(stats)  # the trainer's all-reduce of the step's stats
    return stats, norm, {n: p.grad for n, p in shard.named_parameters()}, (val[0] / val[1]).item()


def _every_schedule(rank: int, tmp: Path) -> None:
    import torch.distributed as dist

    cases = [("paper", *case, "full") for case in CASES] + [
        (shape, *case, "full") for shape in SHAPES for case in SHAPE_CASES] + [
        ("llama", *case, "chunked") for case in CHUNKED_CASES]
    refs: dict[str, tuple] = {}
    for shape, impl, schedule, v, loss_impl in cases:
        args = _args(**SHAPES.get(shape, {}))
        if shape not in refs:
            refs[shape] = _reference(args)
        ref_loss, ref_norm, ref_grads, ref_val = refs[shape]
        case = f"{shape} {impl} {schedule} v={v} {loss_impl} rank {rank}"
        stats, norm, grads, val_loss = _pipeline_step(args, impl, schedule, v, loss_impl)
        assert abs(val_loss - ref_val) <= 1e-6 * ref_val, (case, val_loss, ref_val)
        loss = (stats[0] / stats[1]).item()
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (case, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-6 * ref_norm, (case, norm, ref_norm)
        assert grads, case
        for name, grad in grads.items():
            tied = name == "lm_head.weight" and args.tie_embeddings
            want = ref_grads["embed.weight" if tied else name]  # tied: the summed copies
            assert grad is not None, (case, name)
            torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"{case} {name}: {m}")
        names: list[set[str] | None] = [None, None]
        dist.all_gather_object(names, set(grads) - ({"lm_head.weight"} if args.tie_embeddings else set()))
        assert set().union(*names) == set(ref_grads), case  # the two shards hold every parameter between them


def test_one_step_of_every_schedule_gives_every_one_process_gradient(tmp_path: Path) -> None:
    """m = 4 over 2 ranks, hand-written GPipe and 1F1B, torch's GPipe, 1F1B, interleaved 1F1B and ZBV (v = 2): the
    step's loss and gradient norm within 1e-6 relative, and every gradient of each stage (the tied embedding after
    summing the first and last stage's copies) within 1e-6; and Llama- and Qwen 3-shaped decoders the same under
    hand-written 1F1B and torch's interleaved 1F1B; and the Llama-shaped one with the chunked loss (the last stage's
    hidden states, the output layer applied a chunk at a time by the share) under hand-written 1F1B and torch's
    interleaved 1F1B."""
    run_on_gloo(_every_schedule, tmp_path)


# ---- real runs through `handle run`: 10 steps, one process against pp = 2 ------------------------------------

COMMON = ("--set", "model.dropout=0", "--set", "model.norm_first=true", "--set", "model.n_layers=4",
          "--set", "training.log_every=1", "--set", "training.eval_every=5")
ONE_STEP = ("--set", "training.micro_batch_size=4", "--set", "training.grad_accum=2", "--set", "training.eval_steps=2")
STEP_OF_8 = {  # 8 sequences a step (and an evaluation of 8): 4 x 2 re-split into m = 4, or 2 x 4 (m = grad_accum)
    "resplit": (*ONE_STEP, "--set", "parallel.pp_microbatches=4"),
    "accum": ("--set", "training.micro_batch_size=2", "--set", "training.grad_accum=4",
              "--set", "training.eval_steps=4")}
PP2 = ("--set", "launch.nproc_per_node=2", "--set", "parallel.pp=2")
# GPipe here: hand-written and torch's 1F1B run end to end in tests/test_pipeline_checkpoint.py, and every
# schedule's step is checked gradient by gradient above.
PP2_RUNS = (("scratch", "gpipe"), ("native", "gpipe"))
# the chunked loss on the last stage (training.loss_impl = "chunked") against the one-process run's full loss
CHUNKED = {"scratch-gpipe", "native-interleaved-1f1b-v2"}
CHUNK = ("--set", "training.loss_impl=chunked")
RUNS = {"one": ONE_STEP,
        **{f"{impl}-{schedule}": (*PP2, "--set", f"parallel.pp_impl={impl}",
                                  "--set", f"parallel.pp_schedule={schedule}",
                                  *STEP_OF_8["resplit" if impl == "scratch" else "accum"],
                                  *(CHUNK if f"{impl}-{schedule}" in CHUNKED else ()))
           for impl, schedule in PP2_RUNS},
        **{f"native-{schedule}-v2": (*PP2, "--set", f"parallel.pp_schedule={schedule}",
                                     "--set", "parallel.pp_stages_per_rank=2", *STEP_OF_8["resplit"],
                                     *(CHUNK if f"native-{schedule}-v2" in CHUNKED else ()))
           for schedule in ("interleaved-1f1b", "zbv")}}


def _events(run_dir: Path, kind: str) -> list[dict]:
    events = map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
    return [e for e in events if e["kind"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Every run of :data:`RUNS` (the tiny preset with 4 layers, fp32, dropout 0, 10 steps of 8 sequences, evals at
    steps 0, 5 and 10), at most four at a time: each costs seconds, mostly starting up."""
    return handle_runs(tmp_path_factory.mktemp("pp-runs"), RUNS, COMMON, at_once=4, timeout=300, here=("one",))


def _loss_impl(run_dir: Path, rank: int) -> str:
    """The loss ``rank`` took, as its log names it (``training.loss_impl: chunked (auto)``)."""
    return re.search(r"training\.loss_impl: (\w+) \(", (run_dir / "logs" / f"rank{rank}.log").read_text()).group(1)


def _assert_trains_as_one_process(runs: dict[str, Path], name: str) -> list[dict]:
    one, split = _events(runs["one"], "step"), _events(runs[name], "step")
    assert [e["step"] for e in split] == list(range(1, 11)), name
    for a, b in zip(one, split):
        assert abs(b["loss"] - a["loss"]) <= 1e-6 * a["loss"], (name, a["step"], a["loss"], b["loss"])
        assert abs(b["grad_norm"] - a["grad_norm"]) <= 1e-5 * a["grad_norm"], (name, a["step"])
        assert b["tokens"] == a["tokens"] and b["layout"] == {"dp": 1, "tp": 1, "pp": 2}, name
    # the one-process reference took the full loss, the last stage (rank 1) the loss the run set
    assert (_loss_impl(runs["one"], 0), _loss_impl(runs[name], 1)) == ("full", "chunked" if name in CHUNKED
                                                                       else "full"), name
    evals = [(e["step"], e["val_loss"]) for e in _events(runs["one"], "eval")]
    got = [(e["step"], e["val_loss"]) for e in _events(runs[name], "eval")]
    assert [s for s, _ in got] == [s for s, _ in evals] == [0, 5, 10], name
    for (_, want), (_, loss) in zip(evals, got):
        assert abs(loss - want) <= 1e-6 * want, (name, evals, got)
    return split


@pytest.mark.parametrize("impl", ["scratch", "native"])
def test_handle_run_with_pp_2_trains_as_one_process(runs, impl: str) -> None:
    """`parallel.pp = 2`, GPipe, m = 4 (hand-written: the step's 2 micro-batches re-split into 4; torch's:
    m = grad_accum = 4): the one-process losses within 1e-6 and gradient norms within 1e-5 for 10 steps, the same
    eval losses, and step events that carry the layout and the pipeline's figures."""
    for schedule in [s for i, s in PP2_RUNS if i == impl]:
        name = f"{impl}-{schedule}"
        for e in _assert_trains_as_one_process(runs, name):
            pipeline = e["pipeline"]
            assert (pipeline["schedule"], pipeline["impl"], pipeline["pp"], pipeline["microbatches"]) == (
                schedule, impl, 2, 4), name
            assert pipeline["layers"] == [2, 2] and len(pipeline["ranks"]) == 2, name
            assert pipeline["bubble_theory"] == pytest.approx((2 - 1) / (4 + 2 - 1)), name
            assert 0 < pipeline["bubble"] < 1 and all(r["busy_s"] > 0 for r in pipeline["ranks"]), name


def test_handle_run_with_interleaved_and_zero_bubble_schedules(runs) -> None:
    """torch's interleaved 1F1B and ZBV with 2 stages per rank (4 stages of one layer on 2 ranks) train as one
    process does; the theory counts v = 2 chunks for interleaving."""
    for schedule in ("interleaved-1f1b", "zbv"):
        split = _assert_trains_as_one_process(runs, f"native-{schedule}-v2")
        assert all(e["pipeline"]["layers"] == [1, 1, 1, 1] for e in split), schedule
    theory = _events(runs["native-interleaved-1f1b-v2"], "step")[0]["pipeline"]["bubble_theory"]
    assert theory == pytest.approx(1 / (2 * 4 + 1))
