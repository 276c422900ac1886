"""``training.loss_impl = "chunked"`` (issue 49): the output layer and the cross-entropy a chunk of tokens at a time
compute what the whole logits' loss computes -- the loss and every gradient (hidden states, the output weight, a
tied embedding, LoRA adapters under a frozen output weight), with label smoothing and ignored labels, in fp32 to
1e-6 and under bf16 autocast to bf16's rounding -- through the trainer's own micro-batch loss; no (tokens x
vocabulary) tensor is ever made; the per-sequence log-probabilities; what ``auto`` picks and what ``handle
validate`` refuses."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from torch_handle.config.loader import preset_problems
from torch_handle.finetune.lora import apply_lora
from torch_handle.model import linear_cross_entropy as lce
from torch_handle.model.args import TransformerArgs
from torch_handle.model.transformer import DecoderLM
from torch_handle.train.loss import AUTO_CHUNKED_LOGITS_BYTES, micro_batch_loss, pick_loss_impl
from tests.unit.test_trainer_step import process_group  # noqa: F401 (a fixture: one gloo process)

VOCAB, BATCH, SEQ = 97, 2, 12
LLAMA = dict(d_model=32, n_heads=4, n_layers=1, d_ff=48, dropout=0.0, max_len=SEQ, norm="rmsnorm", position="rope",
             mlp="swiglu", norm_first=True, bias=False, scale_embeddings=False, n_kv_heads=2)


SHIPPED = dict(lce.CHUNK_ELEMENTS), lce.MIN_CHUNK_ROWS
"""The chunk sizes as they ship (the fixture below shrinks them)."""


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """Five tokens a chunk: 24 tokens are five chunks, the last one short."""
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", {"cpu": 5 * VOCAB, "cuda": 5 * VOCAB})
    monkeypatch.setattr(lce, "MIN_CHUNK_ROWS", 1)


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    labels = ids[:, 1:].clone()
    labels[0, :4] = -100  # a prompt's labels: left out of the mean
    labels[1, -1] = -100
    return {"input_ids": ids[:, :-1], "labels": labels}


def _step(model, loss_impl: str, eps: float, dtype: torch.dtype | None = None):
    """The trainer's micro-batch loss and its backward; (loss, tokens, {name: grad})."""
    autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype else (lambda: torch.autocast("cpu",
                                                                                                enabled=False))
    strategy = NS(model=model, unwrapped=lambda: model, autocast=autocast)
    batch = _batch()
    loss, n = micro_batch_loss(strategy, batch, batch.pop("labels"), loss_impl, eps)
    loss.backward()
    return loss, n, {k: p.grad for k, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("variant", ["tied", "untied", "lora"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_chunked_equals_full_in_loss_and_every_gradient_in_fp32(variant, eps):
    torch.manual_seed(0)
    model = DecoderLM(TransformerArgs(VOCAB, **LLAMA, tie_embeddings=variant == "tied"))
    if variant == "lora":  # the output weight (and everything but the adapters) frozen
        apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["all"])
        for p in model.parameters():
            p.data.add_(torch.randn_like(p) * 0.05 if p.requires_grad else 0)  # B != 0: a gradient everywhere
    full_loss, full_n, full = _step(copy.deepcopy(model), "full", eps)
    loss, n, grads = _step(model, "chunked", eps)
    assert int(n) == int(full_n) == BATCH * SEQ - 5
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, full_loss, rtol=0, atol=1e-6)
    assert grads.keys() == full.keys() and ("lm_head.weight" in grads) == (variant == "untied")
    assert ("embed.weight" in grads) == (variant != "lora")  # tied: the output layer's gradient lands here too
    for name, grad in grads.items():
        torch.testing.assert_close(grad, full[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_weight_cast_a_block_at_a_time_gives_the_same_loss_and_gradients(monkeypatch):
    """Where a whole copy of the output weight in the compute dtype would be large (``COPY_SHARE``), each chunk
    reads it a block of rows at a time (the logits' columns, the hidden states' gradient summed over the blocks in
    fp32): forced here in fp32, the loss and every gradient equal the full path's within 1e-6, and the
    per-sequence log-probabilities' gradients too."""
    monkeypatch.setattr(lce, "cast_whole", lambda *_: False)
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", {"cpu": 5 * VOCAB, "cuda": 5 * VOCAB})  # blocks of 3 weight rows
    torch.manual_seed(0)
    model = DecoderLM(TransformerArgs(VOCAB, **LLAMA))
    full_loss, _, full = _step(copy.deepcopy(model), "full", 0.1)
    loss, _, grads = _step(model, "chunked", 0.1)
    torch.testing.assert_close(loss, full_loss, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, full[name], rtol=1e-5, atol=1e-6, msg=name)
    hidden = torch.randn(2, SEQ, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    labels = _batch()["labels"]
    lce.sequence_logps(hidden, weight, labels).sum().backward()
    want = torch.autograd.grad(-F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten(),
                                                reduction="sum"), (hidden, weight))
    for got, w in zip((hidden.grad, weight.grad), want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)


def test_chunked_equals_full_under_bf16_autocast():
    """The chunk's logits rounded to bf16 as the output layer rounds them, the gradients back through bf16: the
    values of the whole logits' loss to bf16's rounding (the output weight's gradient is summed over chunks in
    fp32 where the full path sums over all tokens in one bf16 matmul)."""
    torch.manual_seed(0)
    model = DecoderLM(TransformerArgs(VOCAB, **LLAMA, tie_embeddings=True))
    full_loss, _, full = _step(copy.deepcopy(model), "full", 0.1, torch.bfloat16)
    loss, _, grads = _step(model, "chunked", 0.1, torch.bfloat16)
    torch.testing.assert_close(loss, full_loss, rtol=1e-3, atol=1e-3)
    for name, grad in grads.items():
        scale = full[name].abs().max()
        torch.testing.assert_close(grad, full[name], rtol=0, atol=2e-2 * scale, msg=name)


def test_the_weight_gradient_accumulated_inside_the_matmul(monkeypatch):
    """Where ``torch.addmm(..., out_dtype=torch.float32)`` runs (CUDA in torch 2.13; this CPU has no kernel, so
    the detection says no), the output weight's fp32 gradient takes each chunk's gᵀ · h in that one call and no
    block product: here the CPU stands in for it with the same arithmetic (the bf16 inputs' product summed in fp32)
    and the loss and gradients stay those of the full path, with the weight cast whole and a block at a time.
    ``benchmarks/loss_memory.py`` checks the real kernel on a GPU."""
    assert not lce.accumulates_in_fp32(torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(2, 2))
    calls = []

    def addmm_fp32(acc, a, b, out_dtype, *, out):
        calls.append(a.shape)
        return out.add_(a.float() @ b.float())

    monkeypatch.setitem(lce._ADDMM_FP32, "cpu", True)
    monkeypatch.setattr(lce.torch, "addmm", addmm_fp32)
    torch.manual_seed(0)
    model = DecoderLM(TransformerArgs(VOCAB, **LLAMA, tie_embeddings=True))
    full_loss, _, full = _step(copy.deepcopy(model), "full", 0.1, torch.bfloat16)
    for whole in (True, False):
        monkeypatch.setattr(lce, "cast_whole", lambda *_, whole=whole: whole)
        calls.clear()
        loss, _, grads = _step(copy.deepcopy(model), "chunked", 0.1, torch.bfloat16)
        assert len(calls) >= 4 and all(shape[0] == VOCAB for shape in calls)  # (V, r) · (r, C): one call a chunk
        torch.testing.assert_close(loss, full_loss, rtol=1e-3, atol=1e-3)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, full[name], rtol=0, atol=2e-2 * full[name].abs().max(), msg=name)


class _LargestOutput(TorchDispatchMode):
    """The most elements any op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("loss_impl", ["chunked", "full"])
def test_no_tensor_of_every_token_by_the_vocabulary(loss_impl):
    """Forward and backward of the loss path: the largest tensor chunked makes is one chunk of logits (5 tokens x V)
    or the output weight's gradient (V x C); full makes the (B·T, V) logits."""
    torch.manual_seed(0)
    hidden = torch.randn(BATCH, SEQ, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    labels = _batch()["labels"]
    with _LargestOutput() as mode:
        if loss_impl == "chunked":
            loss = lce.linear_cross_entropy(hidden, weight, labels)
        else:
            loss = F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten())
        loss.backward()
    tokens_by_vocab = BATCH * SEQ * VOCAB
    if loss_impl == "chunked":
        assert mode.largest == max(5 * VOCAB, weight.numel()) < tokens_by_vocab
    else:
        assert mode.largest == tokens_by_vocab


def test_evaluation_computes_no_gradient_and_a_second_backward_is_refused():
    torch.manual_seed(0)
    hidden = torch.randn(BATCH, SEQ, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    labels = _batch()["labels"]
    with torch.no_grad():
        evaluated = lce.linear_cross_entropy(hidden, weight, labels)
    loss = lce.linear_cross_entropy(hidden, weight, labels)
    assert torch.equal(evaluated, loss.detach()) and not evaluated.requires_grad
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through it twice"):
        loss.backward()
    with pytest.raises(ValueError, match="do not fit"):
        lce.linear_cross_entropy(hidden, weight, labels[:, 1:])


def test_sequence_logps_are_the_summed_log_probabilities_and_their_gradients():
    """Per-sequence Σ log p(label) (preference losses' ``logps``), recomputed chunk by chunk in backward; a sequence
    with no counted token sums to 0."""
    torch.manual_seed(0)
    hidden = torch.randn(3, SEQ, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    labels = torch.randint(0, VOCAB, (3, SEQ))
    labels[0, :5] = -100
    labels[2] = -100
    upstream = torch.tensor([1.0, -2.0, 0.5])  # a preference loss weighs each sequence its own way
    got = lce.sequence_logps(hidden, weight, labels)
    (got * upstream).sum().backward()
    got_grads = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    log_p = torch.log_softmax(hidden @ weight.T, dim=-1)  # (B, T, V)
    want = (log_p.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels != -100)).sum(1)
    (want * upstream).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert got[2] == 0
    for g, w in zip(got_grads, (hidden.grad, weight.grad)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_auto_takes_the_chunked_loss_for_large_logits_where_it_runs():
    big = AUTO_CHUNKED_LOGITS_BYTES // 4 // 128_256 + 1  # tokens whose fp32 logits reach the threshold
    assert pick_loss_impl("auto", big, 128_256) == "chunked"
    assert pick_loss_impl("auto", big - 2, 128_256) == "full"
    assert pick_loss_impl("auto", big, 128_256, problem="a split model") == "full"
    assert pick_loss_impl("full", big, 128_256) == "full"
    with pytest.raises(ValueError, match='training.loss_impl = "chunked": a split model'):
        pick_loss_impl("chunked", 8, 97, problem="a split model")


@pytest.mark.parametrize(("overrides", "why"), [
    (["parallel.pp=2", "training.grad_accum=2"], None),  # the last stage applies the output layer itself
    (["parallel.pp=2", "parallel.pp_impl=native", "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=2",
      "training.grad_accum=2"], "the zero-bubble schedule 'zbv' splits the last stage's backward in two"),
    (["parallel.ep=2", "model.n_experts=4"], "pipeline- or context-parallel models only, not with parallel.ep = 2"),
    (["parallel.cp=2", "model.dropout=0.0"], None),  # each cp rank its tokens, scaled to the whole sequence's count
    (["parallel.tp=2"], None),
    (["parallel.tp=2", "parallel.tp_impl=native", "parallel.sequence_parallel=true", "strategy.name=single"], None),
    (["strategy.name=fsdp"], "needs whole parameters after the forward pass; strategy 'fsdp'"),
    (["strategy.name=deepspeed", "strategy.zero_stage=3"], "strategy 'deepspeed' holds the output weight"),
    ([], None),
])
def test_validate_refuses_chunked_where_it_cannot_run(tmp_path, overrides, why):
    path = Path(__file__).resolve().parents[2] / "presets" / "llama.toml"
    sets = ["training.loss_impl=chunked", "launch.nproc_per_node=2", *overrides]
    preset, problems = preset_problems(path, sets)
    found = [str(p) for p in problems if "training.loss_impl" in str(p)]
    if why is None:
        assert preset is not None and not problems, [str(p) for p in problems]
    else:
        assert len(found) == 1 and why in found[0] and 'use "auto" or "full"' in found[0], found


def test_the_estimate_prices_the_loss_path_the_run_takes(monkeypatch):
    """``handle estimate``'s activations: two fp32 logits-sized buffers for ``full``; for ``chunked`` one GPU
    chunk's logits and their gradient plus the hidden states' gradient, and none of the (B, T, V) tensors the full
    loss saves; a ``--compare`` row whose strategy shards the output weight (ZeRO-3) priced ``full``."""
    from torch_handle.config.loader import load_preset
    from torch_handle.plan.estimate_activations import activation_bytes, chunked_loss_bytes, loss_impl_of
    from torch_handle.registry import get_registry

    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", SHIPPED[0])  # a GPU's chunk: a few, not thousands, on fake tensors
    monkeypatch.setattr(lce, "MIN_CHUNK_ROWS", SHIPPED[1])
    path = Path(__file__).resolve().parents[2] / "presets" / "llama.toml"
    sets = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.n_layers=1", "model.d_ff=64",
            "data.vocab_size=8192", "data.seq_len=256", "training.micro_batch_size=32", "training.precision=fp32"]
    preset, registry = load_preset(path, sets), get_registry()
    tokens, vocab = 32 * 256, 8192
    assert loss_impl_of(preset, registry) == "chunked"  # 256 MiB of fp32 logits
    assert loss_impl_of(preset, registry, "deepspeed", zero_stage=3) == "full"
    full, chunked = (activation_bytes(preset, registry, loss_impl=impl) for impl in ("full", "chunked"))
    assert (full.loss_impl, chunked.loss_impl) == ("full", "chunked")
    assert full.logits == 2 * tokens * vocab * 4  # the logits, then the log-probs' and the logits' gradients
    rows = lce.chunk_rows(tokens, vocab, "cuda")
    assert chunked.logits == rows * vocab * (4 + 4) + tokens * 32 * 4
    assert full.saved - chunked.saved >= tokens * vocab * 4  # the log-probabilities the full loss keeps
    # bf16 autocast over fp32 weights (Llama 3's head): the whole bf16 copy of the weight only from 4·C tokens
    bf16, fp32, C, V = torch.bfloat16, torch.float32, 2048, 128_256
    for n, weight_part in ((2048, 0), (8192, V * C * 2)):  # the chunk's bf16 gradient outweighs two blocks here
        assert chunked_loss_bytes(n, V, C, bf16, fp32, 4) == (lce.chunk_rows(n, V, "cuda") * V * 6 + weight_part
                                                               + n * C * 4)
    two_blocks = 2 * lce.weight_rows(32_000, C, "cuda") * C * 2  # at 32,000 two blocks outweigh the gradient
    assert chunked_loss_bytes(2048, 32_000, C, bf16, fp32, 4) == 512 * 32_000 * 4 + two_blocks + 2048 * C * 4
    assert chunked_loss_bytes(2048, V, C, bf16, bf16, 2) == lce.chunk_rows(2048, V, "cuda") * V * 6 + 2048 * C * 2


def test_a_run_with_the_chunked_loss_trains_as_the_full_one(tmp_path, process_group):
    """The trainer end to end (``single``, fp32, label smoothing, evaluation): the same losses step by step."""
    from tests.unit.test_trainer_step import _events, _preset, _train
    from torch_handle.config.loader import dump_preset, load_preset
    from torch_handle.rundir import create_run_dir

    _preset(tmp_path, steps=2)  # writes p.toml
    losses = {}
    for impl in ("full", "chunked"):
        preset = load_preset(tmp_path / "p.toml", [f"training.loss_impl={impl}", "training.label_smoothing=0.1"])
        run_dir = create_run_dir(tmp_path / "runs", impl, dump_preset(preset), {"status": "starting"})
        assert _train(preset, run_dir, process_group) == "finished"
        losses[impl] = [e.get("loss", e.get("val_loss")) for e in _events(run_dir) if e["kind"] in ("step", "eval")]
    assert len(losses["full"]) == 4 and losses["chunked"] == pytest.approx(losses["full"], rel=1e-5)


def test_under_tp_the_chunked_loss_runs_for_every_objective():
    """Tensor parallelism takes the chunked loss (its vocabulary-parallel form) for the token-mean objectives and
    for a preference objective's per-sequence log-probabilities (``vocab_parallel_sequence_logps``)."""
    from types import SimpleNamespace as NS

    from torch_handle.config.loss_impl import chunked_loss_problem

    preset = NS(model=NS(name="transformer", options=NS(kind="decoder")), parallel=NS(tp=2, pp=1, ep=1, cp=1),
                strategy=NS(name="ddp", options=NS()), finetune=NS(objective="sft"))
    assert chunked_loss_problem(preset) is None
    preset.finetune.objective = "dpo"
    assert chunked_loss_problem(preset) is None

