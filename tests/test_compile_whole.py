"""A model compiled whole, as ``training.compile`` compiles it on one process, runs the trainer's steps and its
evaluation with no graph break and one graph each (issue 49: ``padding_mask_of``'s ``is_fake`` and ``mask.any()``
broke every forward, 12 breaks and 8 recompiles in a 4-step run of the tiny llama preset). The trainer decides the
data-dependent masks once per batch outside the compiled region (``DecoderLM.checked_inputs``) and the forward reads
nothing back. Counted with Dynamo's counters (``graph_break``; ``stats.unique_graphs``: a recompile is one more
graph), through the trainer's own micro-batch loss (``torch_handle.train.loss.micro_batch_loss``) with both loss implementations, for a dense, an MoE, a LoRA and a
document-masked decoder; the ``eager`` backend (Dynamo's tracing, where breaks and guards happen, without Inductor)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from torch._dynamo.utils import counters

from torch_handle.finetune.lora import apply_lora
from torch_handle.model.args import TransformerArgs
from torch_handle.model.transformer import DecoderLM
from torch_handle.train.loss import micro_batch_loss
from tests.unit.test_compile_blocks import _fresh_dynamo  # noqa: F401 (autouse: Dynamo's caches and counters reset)

VOCAB, BATCH, SEQ, PAD = 97, 2, 16, 0
LLAMA = dict(d_model=32, n_heads=4, n_layers=1, d_ff=48, dropout=0.0, max_len=SEQ, norm="rmsnorm", position="rope",
             mlp="swiglu", norm_first=True, bias=False, scale_embeddings=False, n_kv_heads=2, pad_id=PAD)
CASES = {"dense": {}, "moe, lora, documents": dict(n_experts=4, top_k=2)}
"""Two models: a dense decoder, and one with every part that could break a graph at once (an MoE layer, LoRA
adapters on the attention, packed documents' block-causal mask): tracing is what costs here, ~1 s a graph."""


def _strategy(case: str) -> NS:
    """What ``micro_batch_loss`` reads of a strategy: its model (compiled whole), the model, its autocast."""
    torch.manual_seed(0)
    model = DecoderLM(TransformerArgs(VOCAB, **LLAMA, **CASES[case]))
    if "lora" in case:
        apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["attention"])
    model.compile(backend="eager")
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


@pytest.mark.parametrize(("case", "loss_impl"), [("dense", "full"), ("moe, lora, documents", "chunked")])
def test_the_whole_compiled_model_trains_and_evaluates_without_a_break(case, loss_impl):
    """Steps on an unpadded and a padded batch (with and without a padding mask: a graph each), an evaluation
    (no_grad and eval mode: one graph more), then the same again: nothing new is traced."""
    strategy = _strategy(case)
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
