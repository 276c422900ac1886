"""Dropout under tensor parallelism (:mod:`torch_handle.parallel.tensor.random`), what docs/tensor-parallel.md
"Dropout" claims, on 2 real gloo processes: a tiny fp32 decoder with dropout 0.25, split by hand (scratch) and with
DTensor (native), sequence parallelism on and off. Each rank also runs the one-process model itself.

1. Inside the TP regions (attention probabilities of a rank's heads, its slice of the FFN hidden units) the two
   ranks draw different masks, and the same seed draws the same ones again (with the tracker unseeded they are
   the same masks: the check can fail).
2. Outside them, without SP, both ranks draw the same embedding and residual masks, so the block outputs stay
   bitwise identical on the two ranks.
3. Those masks are the one-process model's, exactly: the whole mask without SP, this rank's sequence slice with
   SP. With dropout only outside the TP regions, the loss and every gathered gradient are the one-process ones.
4. A checkpoint's trainer state (``save_trainer_state``/``load_trainer_state``) brings the tensor-parallel stream
   back; restoring the default generators alone draws other TP-region masks.
5. Activation checkpointing recomputes the masks the forward drew: the gradients equal those without it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import torch_handle.model.attention as attention
from torch_handle.checkpoint import store
from torch_handle.model.args import TransformerArgs
from torch_handle.model.parallelize import parallelize_tensor, tensor_parallel_plan
from torch_handle.model.transformer import DecoderLM
from torch_handle.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from torch_handle.parallel.tensor.layers import all_reduce_sp_grads
from torch_handle.parallel.tensor.mappings import TPGroup
from torch_handle.parallel.tensor.plan import unshard
from torch_handle.parallel.tensor.random import get_rng_tracker, seed_tensor_parallel_rng

from tests.helpers import run_on_gloo

B, T, V, P, SEED = 2, 8, 32, 0.25, 7
ARGS = TransformerArgs(vocab_size=V, d_model=16, n_heads=4, n_layers=2, d_ff=32, dropout=P, max_len=T,
                       mlp="gelu", norm_first=True, tie_embeddings=True)
REPLICATED = ["embed_dropout", "layers.0.dropout", "layers.1.dropout"]
FFN = ["layers.0.ff.dropout", "layers.1.ff.dropout"]


class Setup:
    """The TP group, the "tp" mesh and one micro-batch, the same on both ranks."""

    def __init__(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        self.tp = TPGroup(self.mesh.get_group())
        g = torch.Generator().manual_seed(3)
        self.ids, self.labels = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)

    def model(self, impl: str | None, sp: bool = False, checkpointing: bool = False) -> DecoderLM:
        """Built from seed 0 on both ranks, split ``impl``-wise (None: one process); then the generators seeded as
        the trainer seeds them after the build (the one-process model as TP rank 0)."""
        torch.manual_seed(0)
        model = DecoderLM(dataclasses.replace(ARGS, activation_checkpointing=checkpointing))
        if impl:
            parallelize_tensor(model, impl, self.tp if impl == "scratch" else self.mesh, sequence_parallel=sp)
        seed_tensor_parallel_rng(SEED, self.tp.rank if impl else 0)
        return model.train()

    def loss(self, model: DecoderLM, impl: str | None, sp: bool = False) -> float:
        """Forward, loss and backward of the micro-batch (SP gradients summed); returns the loss."""
        if impl == "scratch":
            loss, _ = vocab_parallel_cross_entropy(model(self.ids), self.labels, self.tp)
            loss.backward()
            if sp:
                all_reduce_sp_grads(model, self.tp)
            return loss.item()
        if impl == "native":
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                loss = F.cross_entropy(model(self.ids).flatten(0, 1), self.labels.flatten())
                loss.backward()
            return loss.full_tensor().item()
        loss = F.cross_entropy(model(self.ids).flatten(0, 1), self.labels.flatten())
        loss.backward()
        return loss.item()

    def grads(self, model: DecoderLM, impl: str | None) -> dict[str, torch.Tensor]:
        """Every parameter's gradient as the one-process model's shape (gathered over the TP group)."""
        plan = tensor_parallel_plan(model) if impl else {}
        out = {}
        for name, p in model.named_parameters():
            if impl == "native":
                out[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            else:
                out[name] = unshard(name, p.grad, plan, self.tp) if impl else p.grad
        return out

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.tp.size)]
        dist.all_gather(parts, t.contiguous(), group=self.tp.group)
        return parts


class Masks:
    """The dropout masks one forward draws (True = dropped), by module name; ``"attn"`` lists the attention
    probabilities' masks, (B, heads, T, T) per layer."""

    def __init__(self, model: DecoderLM, names: list[str]) -> None:
        self.by_name: dict[str, torch.Tensor] = {}
        self.attn: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        self.handles = [model.get_submodule(n).register_forward_hook(self._hook(n)) for n in names]
        self.handles += [layer.register_forward_hook(lambda _m, _a, out: self.outputs.append(out.detach()))
                         for layer in model.layers]
        self.real = attention.dropout
        attention.dropout = self._spy

    def _hook(self, name: str):
        def record(_module, args, out):
            self.by_name[name] = (out == 0) & (args[0] != 0)
        return record

    def _spy(self, x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
        out = self.real(x, p, training)
        self.attn.append((out == 0) & (x != 0))  # x: softmax weights, 0 only where masked
        return out

    def close(self) -> None:
        attention.dropout = self.real
        for h in self.handles:
            h.remove()


def record(s: Setup, impl: str | None, sp: bool = False, *, checkpointing: bool = False, tp_dropout: bool = True,
           seeded: bool = True) -> tuple[Masks, float, dict[str, torch.Tensor]]:
    """One forward and backward of a fresh model: (its masks, the loss, the gathered gradients).
    ``tp_dropout=False``: no dropout inside the TP regions (attention probabilities, FFN hidden units)."""
    model = s.model(impl, sp, checkpointing)
    if not seeded:
        get_rng_tracker().reset()
    if not tp_dropout:
        for layer in model.layers:
            layer.self_attn.dropout, layer.ff.dropout.p = 0.0, 0.0
    masks = Masks(model, REPLICATED + FFN)
    try:
        loss = s.loss(model, impl, sp)
    finally:
        masks.close()
    return masks, loss, s.grads(model, impl)


def check_tp_regions_differ_across_ranks(s: Setup, impl: str) -> None:
    """(1)"""
    masks, *_ = record(s, impl)
    again, *_ = record(s, impl)
    unseeded, *_ = record(s, impl, seeded=False)
    assert len(masks.attn) == ARGS.n_layers and masks.attn[0].shape == (B, ARGS.n_heads // 2, T, T)
    for i, (mask, mask_again) in enumerate(zip(masks.attn, again.attn)):
        assert torch.equal(mask, mask_again), (impl, "same seed, other attention masks", i)
        mine, other = s.gather(mask.to(torch.uint8))
        assert not torch.equal(mine, other), (impl, f"layer {i}: both ranks' heads dropped alike")
        allowed = (B * ARGS.n_heads // 2) * T * (T + 1) // 2  # causal: the probabilities that are not 0
        assert 0.15 < mask.sum().item() / allowed < 0.35, (impl, i, mask.float().mean())
        mine, other = s.gather(unseeded.attn[i].to(torch.uint8))
        assert torch.equal(mine, other), (impl, "without the tracker both ranks draw the default stream")
    for name in FFN:
        assert torch.equal(masks.by_name[name], again.by_name[name]), (impl, name)
        mine, other = s.gather(masks.by_name[name].to(torch.uint8))
        assert not torch.equal(mine, other), (impl, name, "both ranks' hidden units dropped alike")


def check_replicated_regions_agree_and_equal_one_process(s: Setup, impl: str, sp: bool) -> None:
    """(2) and (3)"""
    one, one_loss, one_grads = record(s, None)
    masks, loss, _ = record(s, impl, sp)
    assert loss != one_loss, (impl, sp, "the TP-region masks are other than one process's")
    for name in REPLICATED:
        mask, full = masks.by_name[name], one.by_name[name]  # (B, T/2 or T, C), (B, T, C)
        want = full.chunk(2, dim=1)[s.tp.rank] if sp else full
        assert torch.equal(mask, want), (impl, sp, name, "not the one-process mask")
        assert 0.15 < mask.float().mean().item() < 0.35, (impl, sp, name)
    if not sp:
        for i, out in enumerate(masks.outputs):
            mine, other = s.gather(out)
            assert torch.equal(mine, other), (impl, f"block {i}'s output differs between the TP ranks")
    one, one_loss, one_grads = record(s, None, tp_dropout=False)
    _, loss, grads = record(s, impl, sp, tp_dropout=False)
    assert abs(loss - one_loss) <= 1e-5 * abs(one_loss), (impl, sp, loss, one_loss)
    for name, want in one_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{impl} sp={sp} {name}: {m}")


def check_checkpoint_restores_the_stream(s: Setup, tmp: Path) -> None:
    """(4)"""
    model = s.model("scratch", sp=True)
    s.loss(model, "scratch", sp=True)  # the streams move on from their seeds
    ckpt_dir = tmp / f"ckpt{s.tp.rank}"
    ckpt_dir.mkdir()
    store.save_trainer_state(ckpt_dir, s.tp.rank, store.TrainerState(step=1, epoch=0))
    draws = []
    for restore in ("nothing", "all", "default generators only"):
        if restore == "all":
            store.load_trainer_state(ckpt_dir, s.tp.rank)
        elif restore != "nothing":
            saved = store.safe_load(store.trainer_state_path(ckpt_dir, s.tp.rank))["rng"]
            store.set_rng_state({k: v for k, v in saved.items() if k != "tracker"})
        masks = Masks(model, REPLICATED + FFN)
        try:
            s.loss(model, "scratch", sp=True)
        finally:
            masks.close()
        draws.append(masks)
    first, resumed, untracked = draws
    for a, b, c in zip(first.attn, resumed.attn, untracked.attn):
        assert torch.equal(a, b), "a restored checkpoint draws other attention masks"
        assert not torch.equal(a, c), "the tracker's stream did not matter"
    for name in REPLICATED:
        assert torch.equal(first.by_name[name], resumed.by_name[name]), name
        assert torch.equal(first.by_name[name], untracked.by_name[name]), name


def check_activation_checkpointing_recomputes_the_masks(s: Setup, impl: str, sp: bool) -> None:
    """(5)"""
    _, loss, grads = record(s, impl, sp)
    _, ckpt_loss, ckpt_grads = record(s, impl, sp, checkpointing=True)
    assert ckpt_loss == loss, (impl, sp, ckpt_loss, loss)
    for name, want in grads.items():
        torch.testing.assert_close(ckpt_grads[name], want, rtol=1e-6, atol=1e-7,
                                   msg=lambda m, name=name: f"{impl} sp={sp} {name}: {m}")


def _checks(rank: int, tmp: Path) -> None:
    s = Setup()
    for impl in ("scratch", "native"):
        check_tp_regions_differ_across_ranks(s, impl)
    for impl, sp in (("scratch", False), ("scratch", True), ("native", False), ("native", True)):
        check_replicated_regions_agree_and_equal_one_process(s, impl, sp)
    check_checkpoint_restores_the_stream(s, tmp)
    check_activation_checkpointing_recomputes_the_masks(s, "scratch", sp=True)
    check_activation_checkpointing_recomputes_the_masks(s, "native", sp=False)


@pytest.mark.dist
def test_dropout_under_tensor_parallelism(tmp_path: Path) -> None:
    run_on_gloo(_checks, tmp_path)


def test_a_rank_resumes_its_own_rng_state_only_under_the_same_tp(tmp_path: Path) -> None:
    store.save_trainer_state(tmp_path, 1, store.TrainerState(step=3, epoch=0))
    assert store.own_rng_state(tmp_path, 1, {"world_size": 2, "tp": 2}, tp=2)
    assert store.own_rng_state(tmp_path, 1, {"world_size": 2}, tp=1)
    assert not store.own_rng_state(tmp_path, 1, {"world_size": 2}, tp=2)  # ddp's rank 1: another replica's masks
    assert not store.own_rng_state(tmp_path, 1, {"world_size": 2, "tp": 2}, tp=1)
    assert not store.own_rng_state(tmp_path, 0, {"world_size": 2, "tp": 2}, tp=2)  # rank 0 wrote no file here
