"""``training.compile`` as the trainer does it (``block.compile()`` for each of ``model_blocks``): every block of a
dense, an MoE and a LoRA decoder is one graph, with no graph break, and compiles at most once more after the first
step (issue 40: the profiler ranges inside each block broke its graph 12 times, and the frames Dynamo resumed after
each break recompiled on the sub-layer's name). Counted with Dynamo's own counters (``torch._dynamo.utils.counters``:
``graph_break`` by reason, ``stats.unique_graphs``), reset between cases; the compiled steps also compute what the
eager ones do (loss, and for MoE the routing statistics, under activation checkpointing too).

The ``eager`` backend: Dynamo's tracing, where breaks and guards happen (on fake tensors, so an op whose meta function
refuses the dtype fails here too), without AOTAutograd and Inductor's code generation, which take seconds a graph on
CPU and cannot add a break."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from torch_handle.finetune.lora import apply_lora
from torch_handle.model.args import TransformerArgs
from torch_handle.model.parallelize import model_blocks
from torch_handle.model.transformer import DecoderLM
from torch_handle.train.routing import routing_stats

BACKEND = "eager"
VOCAB, BATCH, SEQ, STEPS = 97, 2, 16, 3
LLAMA = dict(d_model=32, n_heads=4, n_layers=2, d_ff=48, dropout=0.0, max_len=SEQ, norm="rmsnorm", position="rope",
             mlp="swiglu", norm_first=True, bias=False, scale_embeddings=False, n_kv_heads=2)
CASES = {
    "dense": {},
    # checkpointed: each block's forward runs again inside backward, where its routing must not count
    "moe": dict(n_experts=4, top_k=2, router_z_loss=0.001, activation_checkpointing=True),
    "lora": {},
}


def _model(case: str) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM(TransformerArgs(VOCAB, **LLAMA, **CASES[case]))
    if case == "lora":
        apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["all"])
    return model


def _train(model: DecoderLM, after_step=lambda step: None) -> tuple[list[float], list[dict | None]]:
    """STEPS AdamW steps on fixed random batches; per step the loss and the routing statistics (None: no MoE)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    losses, routing = [], []
    for step in range(STEPS):
        logits = model(ids[step, :, :-1])  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[step, :, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        routing.append(routing_stats(model))
        after_step(step)
    return losses, routing


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


@pytest.mark.parametrize("case", list(CASES))
def test_a_compiled_block_is_one_graph_that_does_not_recompile(case):
    eager = _model(case)
    compiled = copy.deepcopy(eager)
    blocks = model_blocks(compiled)
    for block in blocks:
        block.compile(backend=BACKEND)
    graphs: list[int] = []
    losses, routing = _train(compiled, after_step=lambda step: graphs.append(counters["stats"]["unique_graphs"]))

    breaks = dict(counters["graph_break"])
    assert not breaks, f"graph breaks inside a compiled block: {breaks}"
    assert 1 <= graphs[0] <= len(blocks), graphs  # the blocks share their code: one graph, or one each at most
    assert graphs[-1] - graphs[0] <= 1, f"recompiled after the first step: unique graphs per step {graphs}"
    expected_losses, expected_routing = _train(eager)
    assert losses == pytest.approx(expected_losses, rel=1e-4)
    if "moe" in case:  # counted once per micro-batch, not again in an activation checkpoint's recompute
        for got, want in zip(routing, expected_routing):
            assert got["micro_batches"] == want["micro_batches"] == 1
            assert got["tokens_per_expert"] == want["tokens_per_expert"]
            assert got["aux_loss"] == pytest.approx(want["aux_loss"], rel=1e-4)


def test_a_compiled_moe_blocks_balancing_losses_get_the_loops_scale():
    """The aux losses' gradient is the factor the loop scaled its loss by (``AuxLossScale``), read when backward
    runs: a compiled block took the value it had when traced (1) whatever the loop's scale, until the scale became
    a tensor written in place. Gradient accumulation's 1/grad_accum changes from step to step here."""
    from torch_handle.train.loss import AuxLossScale, loss_fn

    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))

    def grads(compiled: bool) -> list[torch.Tensor]:
        model = _model("moe")
        model.layers[0].ff.aux_loss_coef = 0.5  # a large coefficient: the router's gradient is mostly the aux loss
        if compiled:
            for block in model_blocks(model):
                block.compile(backend=BACKEND)
        scale, out = AuxLossScale(model), []
        for accum in (2, 4, 1):
            model.zero_grad()
            (scale.probe(loss_fn(model(ids[:, :-1]), ids[:, 1:])[0]) / accum).backward()
            out.append(model.layers[0].ff.gate.weight.grad.clone())
        return out

    compiled = grads(True)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for got, want in zip(compiled, grads(False)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_loss_is_the_chunked_loss(dtype, monkeypatch):
    """``training.compile`` also compiles the loss's cross-entropy (``loss_fn(compiled=True)``: ``F.cross_entropy``
    on fp32 under ``torch.compile``): one graph, no break, no recompile over steps and label smoothing kept apart,
    and the loss and the logits' gradient of the eager ``ChunkedCrossEntropy`` (the ``aot_eager`` backend: Dynamo and
    AOTAutograd's joint graph, without Inductor's code generation)."""
    from torch_handle.model import kernels
    from torch_handle.train.loss import loss_fn

    compiled = torch.compile(kernels._fp32_cross_entropy, backend="aot_eager")
    monkeypatch.setattr(kernels, "_compiled_cross_entropy", lambda: compiled)
    gen = torch.Generator().manual_seed(2)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[0, :3] = -100  # ignored positions leave the mean
    for eps in (0.0, 0.0, 0.1):
        logits = torch.randn(BATCH, SEQ, VOCAB, generator=gen).to(dtype).requires_grad_()
        reference = logits.detach().clone().requires_grad_()
        loss, n = loss_fn(logits, labels, eps, compiled=True)
        want, want_n = loss_fn(reference, labels, eps)
        loss.backward()
        want.backward()
        assert loss.dtype == torch.float32 and int(n) == int(want_n) == BATCH * SEQ - 3
        assert loss.item() == pytest.approx(want.item(), rel=1e-5)
        torch.testing.assert_close(logits.grad, reference.grad, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-7 if dtype == torch.float32 else 1e-4)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 2  # one per label smoothing, none more


def test_training_compile_takes_the_whole_model_on_one_process_only():
    """``compiles_whole``: the whole model on one process (``single``) with nothing that needs the blocks; per block
    under DDP or FSDP (their overlap and units), a parallel share, activation checkpointing, an MoE model or frozen
    parameters (LoRA)."""
    from types import SimpleNamespace as NS

    from torch_handle.train.compiled import compiles_whole

    def whole(model, strategy="single", share=None, **options):
        options = {"activation_checkpointing": False, "n_experts": 0, **options}
        return compiles_whole(model, NS(strategy=NS(name=strategy), model=NS(options=NS(**options))), share)

    dense = _model("dense")
    assert whole(dense)
    assert not any([whole(dense, "ddp"), whole(dense, "fsdp"), whole(dense, share=object()),
                    whole(dense, activation_checkpointing=True), whole(dense, n_experts=4), whole(_model("lora"))])


@pytest.mark.parametrize("whole", [True, False], ids=["whole model", "per block"])
def test_the_rope_angles_are_not_computed_inside_the_compiled_model(whole):
    """The model computes RoPE's cos and sin once (``rope_cos``/``rope_sin``) and hands them to every block: no
    ``cos`` or ``sin`` in any graph Dynamo captures, compiled whole or per block. Computed inside, Inductor fused the
    angles into every (B, H, T, d_k) rotation and recomputed them in backward (11 of 330 ms a step, issue 40). Also:
    the table's rows are exactly the angles the attention computes without a table."""
    ops: list[str] = []

    def record(gm, example_inputs):
        ops.extend(str(node.target) for node in gm.graph.nodes if node.op in ("call_function", "call_method"))
        return gm.forward

    model = _model("dense")
    if whole:
        model = torch.compile(model, backend=record)
    else:
        for block in model_blocks(model):
            block.compile(backend=record)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    model(ids).sum().backward()
    assert ops and not [op for op in ops if "cos" in op or "sin" in op], sorted(set(ops))
    eager = _model("dense")
    with_table = eager(ids)
    eager._rope = lambda: {}  # each attention computes its angles
    assert torch.equal(with_table, eager(ids))
    assert "rope_cos" not in eager.state_dict()  # derived from the arguments: never saved
