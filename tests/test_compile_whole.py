"""A model compiled whole, as ``training.compile`` compiles it on one process, runs the trainer's steps and its
evaluation with no graph break and one graph each (issue 49: ``padding_mask_of``'s ``is_fake`` and ``mask.any()``
broke every forward, 12 breaks and 8 recompiles in a 4-step run of the tiny llama preset). The trainer decides the
data-dependent masks once per batch outside the compiled region (``DecoderLM.checked_inputs``) and the forward reads
nothing back. Counted with Dynamo's counters (``graph_break``; ``stats.unique_graphs``: a recompile is one more
graph), through the trainer's own micro-batch loss (``torch_handle.train.loss.micro_batch_loss``) with
both loss implementations, for a dense, an MoE, a LoRA and a document-masked decoder; the ``eager`` backend (Dynamo's
tracing, where breaks and guards happen, without Inductor).
With dropout, as the trainer seeds it (the tensor-parallel stream added): the stream's fork (``get_rng_state`` /
``set_rng_state``, which Dynamo skips) broke every attention and FFN dropout, 15 breaks and 17 graphs in the dense
case; at tp = 1 a compiled region draws from the default generators instead, at tp > 1 it still forks. Whole-model
and per-block (``block.compile()``, as under a strategy or a share)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from torch._dynamo.utils import counters

from torch_handle.finetune.lora import apply_lora
from torch_handle.model.args import TransformerArgs
from torch_handle.model.parallelize import model_blocks
from torch_handle.model.transformer import DecoderLM
from torch_handle.parallel.tensor.random import get_rng_tracker, seed_tensor_parallel_rng, tensor_parallel_rng
from torch_handle.train.loss import micro_batch_loss
from tests.unit.test_compile_blocks import _fresh_dynamo  # noqa: F401 (autouse: Dynamo's caches and counters reset)

VOCAB, BATCH, SEQ, PAD = 97, 2, 16, 0
LLAMA = dict(d_model=32, n_heads=4, n_layers=1, d_ff=48, dropout=0.1, max_len=SEQ, norm="rmsnorm", position="rope",
             mlp="swiglu", norm_first=True, bias=False, scale_embeddings=False, n_kv_heads=2, pad_id=PAD)
CASES = {"dense": {}, "moe, lora, documents": dict(n_experts=4, top_k=2)}
"""Two models: a dense decoder, and one with every part that could break a graph at once (an MoE layer, LoRA
adapters on the attention, packed documents' block-causal mask): tracing is what costs here, ~1 s a graph."""


@pytest.fixture(autouse=True)
def _seeded():
    """The trainer's seeding (the tensor-parallel stream added, tp = 1); forgotten afterwards."""
    seed_tensor_parallel_rng(0)
    yield
    get_rng_tracker().reset()
    get_rng_tracker().tp_size = 1


def _strategy(case: str, whole: bool = True) -> NS:
    """What ``micro_batch_loss`` reads of a strategy: its model (compiled whole, or each block), the model, its
    autocast."""
    torch.manual_seed(0)
    model = DecoderLM(TransformerArgs(VOCAB, **LLAMA, **CASES[case]))
    if "lora" in case:
        apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["attention"])
    for module in [model] if whole else model_blocks(model):
        module.compile(backend="eager")
    return NS(model=model, unwrapped=lambda: model, autocast=lambda: torch.autocast("cpu", enabled=False))


def _batch(case: str, padded: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(int(padded)))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone()}
    if padded:  # the end of the first row: the padding mask is there or not, batch by batch
        batch["input_ids"][0, -3:] = PAD
        batch["labels"][0, -3:] = -100
    if "documents" in case:  # two documents in the first row, one in the second
        batch["position_ids"] = torch.arange(SEQ).repeat(BATCH, 1)
        batch["position_ids"][0, 6:] = torch.arange(SEQ - 6)
    return batch


@pytest.mark.parametrize(("case", "loss_impl", "whole"), [("dense", "full", True), ("moe, lora, documents", "chunked",
                                                                                 True),
                                                        ("moe, lora, documents", "full", False)])
def test_the_whole_compiled_model_trains_and_evaluates_without_a_break(case, loss_impl, whole):
    """Steps on an unpadded and a padded batch (with and without a padding mask: a graph each), an evaluation
    (no_grad and eval mode: one graph more), then the same again: nothing new is traced. Per block (``whole``
    False): the same counts, one block."""
    strategy = _strategy(case, whole)
    model = strategy.model
    graphs = []
    for _ in range(2):
        for padded in (False, True):
            batch = _batch(case, padded)
            loss, n = micro_batch_loss(strategy, batch, batch.pop("labels"), loss_impl, 0.1)
            loss.backward()
        model.eval()
        with torch.no_grad():
            batch = _batch(case, True)
            micro_batch_loss(strategy, batch, batch.pop("labels"), loss_impl)
        model.train()
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # MoE: one more, once: the routing counters (``MoEFeedForward.stats``) are None until the first counted
    # forward (and again after the trainer reads them each step), a guard with two values, each traced once
    assert graphs[0] == 3 and graphs[1] == 3 + ("moe" in case), f"unique graphs after each round: {graphs}"


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_compiled_tensor_parallel_dropout_forks_only_where_ranks_share_a_replica(tp_size):
    """Compiled, the tensor-parallel region draws from the default generator at tp = 1 (no break) and from this
    rank's own stream at tp > 1 (the fork kept, with its break): two TP ranks seeded alike must not draw alike."""
    seed_tensor_parallel_rng(5, tp_rank=1, tp_size=tp_size)

    def draw(x):
        with tensor_parallel_rng():
            return x + torch.rand(4)

    got = torch.compile(draw, backend="eager")(torch.zeros(4))
    stream = torch.Generator().manual_seed(5 + (2718 + 1 if tp_size > 1 else 0))
    assert torch.equal(got, torch.rand(4, generator=stream))
    assert bool(counters["graph_break"]) == (tp_size > 1)
