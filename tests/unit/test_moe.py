"""The mixture-of-experts feed-forward network (torch_handle/model/router.py, moe.py, aux_loss.py) in this process:
against transformers' Qwen 3 MoE and DeepSeek-V3 blocks with copied weights, grouped against looped experts,
dispatch and capacity on hand-made routings, the balancing losses on hand-computed cases, and their gradients
through the training loss."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from torch_handle.model.args import TransformerArgs
from torch_handle.model.moe import MoEFeedForward, combine, dispatch, expert_capacity, no_grouped_kernel
from torch_handle.model.router import TopKRouter, load_balancing_loss, router_z_loss
from torch_handle.model.transformer import build_transformer
from torch_handle.train.loss import AuxLossScale, loss_fn
from torch_handle.train.routing import register_expert_bias_updates, routing_stats

C, F, E = 16, 8, 4


def _args(**kw) -> TransformerArgs:
    base = dict(vocab_size=1, d_model=C, n_heads=2, d_ff=32, d_ff_expert=F, n_experts=E, top_k=2, mlp="swiglu",
                dropout=0.0, bias=False)
    return TransformerArgs(**{**base, **kw})


def _moe(**kw) -> MoEFeedForward:
    torch.manual_seed(0)
    moe = MoEFeedForward(_args(**kw))
    nn.init.normal_(moe.gate.weight, std=0.5)  # routing far from uniform: ties and near-ties out of the way
    return moe


def _grads(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output, and the gradients of <output, g> w.r.t. x and every parameter."""
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    y = module(x)
    (y * g).sum().backward()
    return y.detach(), {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}


def _copy_experts(ours: MoEFeedForward, theirs: nn.Module) -> None:
    """transformers' fused experts (gate_up_proj (E, 2F, C), down_proj (E, C, F)) into ours, and the router."""
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.gate.weight)
        theirs.experts.gate_up_proj.copy_(torch.cat([ours.experts.gate_proj, ours.experts.up_proj], dim=1))
        theirs.experts.down_proj.copy_(ours.experts.down_proj)


def _their_grads(theirs: nn.Module) -> dict[str, torch.Tensor]:
    gate_up = theirs.experts.gate_up_proj.grad
    return {"gate.weight": theirs.gate.weight.grad, "experts.gate_proj": gate_up[:, :F],
            "experts.up_proj": gate_up[:, F:], "experts.down_proj": theirs.experts.down_proj.grad}


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_equals_transformers_qwen3_moe_block(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    ours = _moe(norm_topk_prob=norm_topk_prob).eval()  # eval: no balancing loss attached (theirs has none)
    config = Qwen3MoeConfig(hidden_size=C, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=2,
                            norm_topk_prob=norm_topk_prob)
    theirs = Qwen3MoeSparseMoeBlock(config)
    _copy_experts(ours, theirs)
    x, g = torch.randn(3, 5, C), torch.randn(3, 5, C)
    y, grads = _grads(ours, x, g)
    y_ref, ref = _grads(theirs, x, g)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
    for name, grad in _their_grads(theirs).items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=0, msg=name)
    torch.testing.assert_close(grads["x"], ref["x"], atol=1e-5, rtol=0)


def test_sigmoid_router_with_bias_and_shared_expert_equals_transformers_deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    ours = _moe(router="sigmoid", balance="aux_free", n_shared_experts=1).eval()
    with torch.no_grad():
        ours.gate.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))  # changes the choice, not the weights
    config = DeepseekV3Config(hidden_size=C, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=2,
                              n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
                              routed_scaling_factor=1.0)
    theirs = DeepseekV3MoE(config)
    _copy_experts(ours, theirs)
    with torch.no_grad():
        theirs.gate.e_score_correction_bias.copy_(ours.gate.expert_bias)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(theirs.shared_experts, name).weight.copy_(getattr(ours.shared_experts, name).weight)
    x, g = torch.randn(3, 5, C), torch.randn(3, 5, C)
    y, grads = _grads(ours, x, g)
    y_ref, ref = _grads(theirs, x, g)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
    for name, grad in {**_their_grads(theirs), "x": ref["x"],
                       "shared_experts.down_proj.weight": theirs.shared_experts.down_proj.weight.grad}.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("mlp, capacity_factor", [("swiglu", None), ("gelu", 0.75)])
def test_grouped_experts_equal_the_loop(mlp, capacity_factor):
    moe = _moe(mlp=mlp, capacity_factor=capacity_factor, top_k=3).eval()
    x, g = torch.randn(4, 6, C), torch.randn(4, 6, C)
    assert moe.experts.impl == "grouped"
    y, grads = _grads(moe, x, g)
    moe.experts.impl = "loop"
    y_loop, grads_loop = _grads(moe, x, g)
    torch.testing.assert_close(y, y_loop, atol=1e-6, rtol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_loop[name], atol=1e-6, rtol=1e-6, msg=name)


def test_the_grouped_matmul_falls_back_to_the_loop_only_when_it_has_no_kernel(monkeypatch):
    """float64 has no grouped kernel (torch's own refusal): the loop computes, and the layer remembers; an
    out-of-memory error from a kernel that exists propagates and the grouped path stays on."""
    moe = _moe().eval()
    x, counts = torch.randn(10, C, dtype=torch.float64), torch.tensor([4, 3, 0, 3])
    experts = moe.experts.double()
    try:
        experts._grouped(x, counts)
        refused = False  # a later torch with a float64 kernel: nothing to fall back from
    except RuntimeError as refusal:
        assert no_grouped_kernel(refusal), refusal
        refused = True
    y = experts(x, counts)
    assert experts.grouped_ok == ({"cpu": False} if refused else {})
    experts.impl = "loop"
    torch.testing.assert_close(y, experts(x, counts))

    experts.impl, experts.grouped_ok = "grouped", {}
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def out_of_memory(*args):
        raise oom

    monkeypatch.setattr(experts, "_grouped", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        experts(x, counts)
    assert experts.grouped_ok == {}
    assert not no_grouped_kernel(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert no_grouped_kernel(NotImplementedError("Could not run 'aten::_grouped_mm' with arguments from the "
                                                 "'XLA' backend"))


def test_dispatch_then_combine_with_unit_weights_returns_the_input_and_its_gradient():
    x = torch.randn(6, C, requires_grad=True)
    experts = torch.tensor([[3, 0], [0, 2], [3, 1], [0, 3], [2, 0], [1, 3]])
    x_sorted, plan = dispatch(x, experts, E)
    assert plan.counts.tolist() == [4, 2, 2, 4] and plan.dropped == 0
    y = combine(x_sorted, plan, torch.full((6, 2), 0.5))
    torch.testing.assert_close(y, x, atol=0, rtol=0)
    g = torch.randn(6, C)
    (y * g).sum().backward()
    torch.testing.assert_close(x.grad, g, atol=0, rtol=0)


def test_capacity_keeps_each_experts_first_tokens_and_counts_the_rest():
    x = torch.arange(6.0).unsqueeze(1).expand(6, C)  # row t holds t
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 3], [1, 0], [2, 1]])  # expert 0: 5 tokens, 1: 4, 2: 2, 3: 1
    capacity = expert_capacity(6, 2, E, capacity_factor=1.0)
    assert capacity == 3
    x_sorted, plan = dispatch(x, experts, E, capacity)
    assert plan.routed.tolist() == [5, 4, 2, 1] and plan.counts.tolist() == [3, 3, 2, 1]
    assert plan.dropped == 3 and int(plan.counts.sum()) == 6 * 2 - plan.dropped
    assert x_sorted[:, 0].tolist() == [0, 1, 2, 0, 2, 4, 1, 5, 3]  # in batch order within each expert
    y = combine(x_sorted, plan, torch.ones(6, 2))
    # tokens 3 and 4 lost their expert 0 and token 5 its expert 1: one copy instead of two
    assert y[:, 0].tolist() == [0, 2, 4, 3, 4, 5]


def test_tokens_per_expert_sum_to_tokens_times_top_k_minus_dropped():
    moe = _moe(capacity_factor=1.0).train()
    for _ in range(2):  # two micro-batches accumulate
        moe(torch.randn(2, 16, C)).sum().backward()
    stats = routing_stats(moe)
    counts = stats["tokens_per_expert"][0]
    assert stats["micro_batches"] == 2 and stats["dropped_tokens"] > 0
    assert sum(counts) == 2 * 32 * 2 - stats["dropped_tokens"]
    assert max(counts) <= 2 * expert_capacity(32, 2, E, 1.0)
    assert routing_stats(moe)["micro_batches"] == 0  # read and reset


def test_an_expert_without_tokens_trains_with_zero_gradients():
    moe = _moe(balance="aux_free", n_shared_experts=1).train()
    with torch.no_grad():
        moe.gate.expert_bias[3] = -10.0  # sigmoid/softmax scores are < 1: expert 3 is never chosen
    for impl in ("grouped", "loop"):
        moe.experts.impl = impl
        _, grads = _grads(moe, torch.randn(2, 8, C), torch.randn(2, 8, C))
        assert all(torch.isfinite(g).all() for g in grads.values())
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = grads[f"experts.{name}"]
            assert w[3].abs().sum() == 0 and w[:3].abs().sum() > 0, (impl, name)
    assert routing_stats(moe)["tokens_per_expert"][0][3] == 0


def test_load_balancing_loss_on_a_hand_computed_case():
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    # top-1, both tokens to expert 0: f = (1, 0), P = (0.625, 0.375): 2 · (1 · 0.625 + 0 · 0.375)
    assert load_balancing_loss(probs, torch.tensor([2, 0]), top_k=1).item() == pytest.approx(1.25)
    # a uniform load gives 1 whatever P
    assert load_balancing_loss(probs, torch.tensor([1, 1]), top_k=1).item() == pytest.approx(1.0)


def test_load_balancing_loss_is_transformers_divided_by_top_k():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(0)
    logits = torch.randn(20, E)
    probs = logits.softmax(-1)
    routed = torch.bincount(probs.topk(2).indices.flatten(), minlength=E)
    ours = load_balancing_loss(probs, routed, top_k=2)
    theirs = load_balancing_loss_func((logits,), E, top_k=2)
    assert ours.item() == pytest.approx(theirs.item() / 2, rel=1e-6)


def test_z_loss_is_the_mean_squared_logsumexp():
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    expected = (math.log(2.0) ** 2 + math.log(math.e + math.e**2) ** 2) / 2
    assert router_z_loss(logits).item() == pytest.approx(expected)


@pytest.mark.parametrize("balance", ["aux_loss", "aux_free"])
def test_training_gradients_include_the_weighted_router_losses_scaled_as_the_loss(balance):
    """backward of (loss_fn-probed loss) · s, as a strategy runs it with gradient accumulation, equals backward of
    s · (loss + router_aux_loss · aux + router_z_loss · z) computed by hand (aux_free: no aux term)."""
    moe = _moe(router_aux_loss=0.3, router_z_loss=0.2, balance=balance)
    x, g, scale = torch.randn(2, 6, C), torch.randn(2, 6, C), 0.25
    moe.train()
    moe.zero_grad()
    loss_scale = AuxLossScale(moe)
    (loss_scale.probe((moe(x) * g).sum()) * scale).backward()
    got = moe.gate.weight.grad.clone()

    moe.eval()  # the same routing and output, nothing attached; the losses by hand
    moe.zero_grad()
    h = x.reshape(-1, C)
    routing = moe.gate(h)
    routed = torch.bincount(routing.experts.flatten(), minlength=E)
    aux = load_balancing_loss(routing.probs, routed, 2) * (0.3 if balance == "aux_loss" else 0.0)
    (scale * ((moe(x) * g).sum() + aux + 0.2 * router_z_loss(routing.logits))).backward()
    torch.testing.assert_close(got, moe.gate.weight.grad, atol=1e-6, rtol=1e-5)
    moe.train()
    loss_scale.set(1.0)
    moe.zero_grad()
    (moe(x) * g).sum().backward()  # a backward not from the probed loss: the factor set by hand
    assert not torch.allclose(moe.gate.weight.grad, got)


def test_aux_free_biases_move_once_per_optimizer_step_against_the_load():
    torch.manual_seed(0)
    model = build_transformer(_args(vocab_size=40, n_layers=2, balance="aux_free", bias_update_rate=0.01,
                                    moe_every=2))
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert len(routers) == 1 and routers[0] is model.layers[1].ff.gate  # moe_every = 2: layer 1 only
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    assert register_expert_bias_updates(model, optimizer) is not None
    ids = torch.randint(0, 40, (4, 8))
    for _ in range(2):  # two micro-batches, one step
        loss, _ = loss_fn(model(ids), ids)
        loss.backward()
    load = routers[0].pending_load.clone()
    assert load.sum() == 2 * 32 * 2
    optimizer.step()
    expected = 0.01 * torch.sign(load.mean() - load)
    torch.testing.assert_close(routers[0].expert_bias, expected)
    assert routers[0].pending_load is None
    assert register_expert_bias_updates(build_transformer(_args(vocab_size=40)), optimizer) is None


def test_checkpointed_recompute_is_not_counted_twice_and_dense_models_have_no_moe():
    args = _args(vocab_size=40, n_layers=2, activation_checkpointing=True)
    model = build_transformer(args).train()
    ids = torch.randint(0, 40, (2, 8))
    loss, _ = loss_fn(model(ids), ids)
    loss.backward()
    stats = routing_stats(model)
    assert stats["micro_batches"] == 1 and [sum(c) for c in stats["tokens_per_expert"]] == [16 * 2, 16 * 2]
    dense = build_transformer(dataclasses.replace(args, n_experts=0))
    assert routing_stats(dense) is None
    # FLOPs count the router and the 2 of 4 experts a token passes through, in place of each layer's dense FFN
    active_moe, dense_ffn = E * C + 2 * (3 * F * C), 3 * 32 * C
    assert model.flops_per_token(8) == dense.flops_per_token(8) + 6 * 2 * (active_moe - dense_ffn)


@pytest.mark.parametrize("tables, message", [
    ({"model": {"n_experts": 4, "top_k": 5}}, "model.top_k: 5 is more than n_experts=4"),
    ({"model": {"n_experts": 4, "moe_every": 9}}, "model.moe_every: 9 is more than n_layers="),
    ({"model": {"n_experts": 4, "top_k": 1}}, "model.norm_topk_prob: with top_k = 1"),
    ({"model": {"n_experts": 4, "router": "topk"}}, "model.router: 'topk' is not one of 'softmax', 'sigmoid'"),
    ({"model": {"n_experts": 4}, "parallel": {"tp": 2, "sequence_parallel": True}, "launch": {"nproc_per_node": 2}},
     "parallel.tp: mixture-of-experts layers (n_experts = 4) are replicated over the TP ranks"),
    ({"model": {"n_experts": 4}, "parallel": {"tp": 2, "ep": 2}, "strategy": {"name": "ddp"},
      "launch": {"nproc_per_node": 4}}, "parallel.tp: mixture-of-experts layers (n_experts = 4) are replicated"),
    ({"model": {"n_experts": 4}, "training": {"compile": True}}, "training.compile: mixture-of-experts layers"),
])
def test_bad_moe_options_are_one_line_naming_the_key(tables, message):
    from torch_handle.config.loader import PresetError, preset_from_dict

    with pytest.raises(PresetError) as e:
        preset_from_dict(tables)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    preset_from_dict({"model": {"top_k": 5}})  # a dense model ignores the MoE options
