"""A tensor-parallel model's checkpoint is the one-process checkpoint: gathered, written in the portable form, read
back and sliced, by hand (scratch) and with DTensor (native), fused and separate QKV, tied embeddings; and a Qwen
3-shaped decoder (grouped-query attention, whose fused QKV the native path keeps as hand-written slices; q/k norms).

Two real gloo processes; a tiny decoder, fp32, dropout 0, AdamW. Every rank also trains the one-process model
itself (the same seed builds the same model everywhere), so the reference needs no communication. Per case:

(a) after 2 TP steps the full model and optimizer state equal the one-process model's after 2 steps, in the form
    ``get_state_dict`` gives (the portable form's names), a tied weight one tensor under both names;
(b) that state, written as a portable form and read back, loaded into a TP model built from another seed, trains
    2 more steps to the one-process losses and state after 4 steps;
(c) the one-process model's state after 2 steps, loaded into a fresh TP model, gives its third-step loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from torch_handle.checkpoint.convert import read_portable, write_portable
from torch_handle.model.args import TransformerArgs
from torch_handle.model.parallelize import parallelize_tensor, tensor_parallel_plan
from torch_handle.model.transformer import DecoderLM
from torch_handle.parallel.tensor.checkpoint import full_model_state, full_optimizer_state, load_full_state
from torch_handle.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from torch_handle.parallel.tensor.layers import all_reduce_sp_grads
from torch_handle.parallel.tensor.mappings import TPGroup

from tests.helpers import run_on_gloo

pytestmark = pytest.mark.dist

B, T, V = 2, 8, 32
CASES = [("scratch", True, False, False), ("scratch", False, True, True),  # impl, fused_qkv, sp, norm_first
         ("native", True, True, False), ("native", False, False, True),
         ("scratch", True, False, True, "qwen3"), ("native", True, True, True, "qwen3")]
QWEN3 = {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu", "n_kv_heads": 2, "bias": False, "qk_norm": True,
         "head_dim": 8, "scale_embeddings": False, "tie_embeddings": False}


def _args(fused: bool, norm_first: bool, shape: str = "paper") -> TransformerArgs:
    return TransformerArgs(**{"vocab_size": V, "d_model": 16, "n_heads": 4, "n_layers": 2, "d_ff": 32,
                              "dropout": 0.0, "max_len": T, "norm_first": norm_first, "fused_qkv": fused,
                              "tie_embeddings": True, **(QWEN3 if shape == "qwen3" else {})})


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _drop_key_bias_grad(model: torch.nn.Module) -> None:
    """Zero the gradient of the attention's key bias, in any layout: it is exactly zero in exact arithmetic
    (softmax over keys is shift invariant; q·(k_j + b) - q·k_j does not depend on j), but rounding leaves ~1e-9,
    which Adam normalises to ±lr, differently in each layout. Rank r's fused bias is [Q_r; K_r; V_r]."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.grad is not None and name.endswith(("k_proj.bias", "qkv_proj.bias")):
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                (grad.chunk(3)[1] if name.endswith("qkv_proj.bias") else grad).zero_()


def _optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


class Run:
    """A model (one-process when ``impl`` is None, else split ``impl``-wise over ``tp``/``mesh``), its AdamW and
    its step count."""

    def __init__(self, args: TransformerArgs, seed: int, impl: str | None = None, sp: bool = False,
                 tp: TPGroup | None = None, mesh=None) -> None:
        torch.manual_seed(seed)
        self.model = DecoderLM(args)
        self.plan = tensor_parallel_plan(self.model)
        self.impl, self.sp, self.tp = impl, sp, tp
        self.group = tp if impl == "scratch" else mesh
        if impl:
            parallelize_tensor(self.model, impl, self.group, sequence_parallel=sp)
        self.optimizer = _optimizer(self.model)
        self.steps = 0

    def step(self) -> float:
        ids, labels = _batch(self.steps)
        self.steps += 1
        self.optimizer.zero_grad()
        if self.impl == "scratch":
            loss, _ = vocab_parallel_cross_entropy(self.model(ids), labels, self.tp)
            loss.backward()
            all_reduce_sp_grads(self.model, self.tp)  # under SP the norms'; the q/k norms' always
        elif self.impl == "native":
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                loss = F.cross_entropy(self.model(ids).flatten(0, 1), labels.flatten())
                loss.backward()
            loss = loss.full_tensor()
            all_reduce_sp_grads(self.model, self.tp)  # the q/k norms' (DTensor sums the rest)
        else:
            loss = F.cross_entropy(self.model(ids).flatten(0, 1), labels.flatten())
            loss.backward()
        _drop_key_bias_grad(self.model)
        self.optimizer.step()
        return loss.item()

    def full_state(self):
        """(model state, optimizer state by name): gathered for a TP run (None off TP rank 0), else
        ``get_state_dict``'s, the portable form's producer."""
        if self.impl is None:
            model, optim = get_state_dict(self.model, self.optimizer)
            return {k: v.clone() for k, v in model.items()}, {n: {k: v.clone() for k, v in s.items()}
                                                               for n, s in optim["state"].items()}
        return (full_model_state(self.model, self.impl, self.plan, self.group),
                full_optimizer_state(self.model, self.optimizer, self.impl, self.plan, self.group))

    def load(self, model_state, optim_state, steps: int) -> None:
        load_full_state(self.model, self.optimizer, model_state, optim_state, self.impl, self.plan, self.group)
        self.steps = steps


def _close(got, want, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for key in want:
        if isinstance(want[key], dict):
            _close(got[key], want[key], f"{what} {key}")
        else:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, key=key: f"{what} {key}: {m}")


def _check_case(impl: str, fused: bool, sp: bool, norm_first: bool, shape: str, tp: TPGroup, mesh, tmp: Path
                ) -> None:
    case = f"{shape} {impl} fused_qkv={fused} sp={sp} norm_first={norm_first}"
    args = _args(fused, norm_first, shape)
    ref = Run(args, seed=0)
    ref_losses = [ref.step(), ref.step()]
    ref_model2, ref_optim2 = ref.full_state()
    ref_losses += [ref.step(), ref.step()]
    ref_model4, ref_optim4 = ref.full_state()

    run = Run(args, 0, impl, sp, tp, mesh)
    losses = [run.step(), run.step()]
    model_state, optim_state = run.full_state()
    if tp.rank == 0:  # (a)
        _close(model_state, ref_model2, f"{case} (a) model")
        _close(optim_state, ref_optim2, f"{case} (a) optimizer")
        assert (model_state["lm_head.weight"] is model_state["embed.weight"]) == args.tie_embeddings, case
        write_portable(tmp / "portable", model_state, optim_state, {})
    else:
        assert model_state is None and optim_state is None, case
    dist.barrier()
    model_state, optim_state, _ = read_portable(tmp / "portable")

    resumed = Run(args, 1, impl, sp, tp, mesh)  # (b)
    resumed.load(model_state, optim_state, steps=2)
    losses += [resumed.step(), resumed.step()]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                               msg=lambda m: f"{case} (b) losses: {m}")
    model4, optim4 = resumed.full_state()
    if tp.rank == 0:
        _close(model4, ref_model4, f"{case} (b) model")
        _close(optim4, ref_optim4, f"{case} (b) optimizer")

    from_single = Run(args, 1, impl, sp, tp, mesh)  # (c)
    from_single.load(ref_model2, ref_optim2, steps=2)
    loss = from_single.step()
    assert abs(loss - ref_losses[2]) <= 1e-5 * abs(ref_losses[2]), (case, "(c)", loss, ref_losses[2])
    dist.barrier()  # rank 0 may write the next case's portable form


def _cases(rank: int, tmp: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    tp = TPGroup(mesh.get_group())
    for k, (impl, fused, sp, norm_first, *shape) in enumerate(CASES):
        _check_case(impl, fused, sp, norm_first, *(shape or ["paper"]), tp, mesh, tmp / f"case{k}")


def test_tp_checkpoint_is_the_one_process_checkpoint(tmp_path: Path) -> None:
    run_on_gloo(_cases, tmp_path)
