"""Label smoothing (Szegedy et al. 2016; Vaswani et al. 2017, eps = 0.1): the CPU chunked cross-entropy equals
``F.cross_entropy(label_smoothing=eps)`` in value and gradient, training steps use it, evaluation does not, and the
preset key is range-checked and may change on --resume."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch_handle.config.loader import dump_preset, load_preset
from torch_handle.data.corpus import pydoc_corpus
from torch_handle.data.datasets import IGNORE_INDEX
from torch_handle.errors import PresetError
from torch_handle.registry import get_registry
from torch_handle.checkpoint.resume import rule
from torch_handle.rundir import create_run_dir
from torch_handle.train.strategy import DistContext
from torch_handle.model.kernels import CE_CHUNK_ELEMENTS
from torch_handle.train.loss import loss_fn
from torch_handle.train.trainer import Trainer
from torch_handle.launch.run import prepare_data


def _logits_labels(seed: int = 0, vocab: int = 300):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 50, vocab, generator=g) * 2  # (B, T, V) fp32: 150 rows
    labels = torch.randint(0, vocab, (3, 50), generator=g)
    logits.scatter_add_(2, labels[..., None], torch.full((3, 50, 1), 8.0))  # a model that has learnt something:
    # the loss is O(1), so fp32 resolves 1e-6 in it (one ulp of a loss of 16 is 1.9e-6)
    labels[0, :7] = IGNORE_INDEX
    labels[2, -5:] = IGNORE_INDEX
    return logits, labels


@pytest.mark.parametrize("eps", [0.1, 0.35])
@pytest.mark.parametrize("vocab", [300, 9000])  # 9000: 29 rows per chunk, so 150 rows make 6 chunks
def test_chunked_label_smoothing_equals_f_cross_entropy_fp32(eps, vocab) -> None:
    logits, labels = _logits_labels(vocab=vocab)
    assert vocab == 300 or CE_CHUNK_ELEMENTS // vocab < 150  # the large vocabulary spans several chunks
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    new, n = loss_fn(a, labels, eps)
    ref = F.cross_entropy(b.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, label_smoothing=eps)
    (new * 3.0).backward()  # an upstream gradient other than 1
    (ref * 3.0).backward()
    assert int(n) == 150 - 12
    assert torch.allclose(new, ref, rtol=0, atol=1e-6), (new.item(), ref.item())
    assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-6), (a.grad - b.grad).abs().max()
    assert torch.all(a.grad[0, :7] == 0) and torch.all(a.grad[2, -5:] == 0)  # ignored labels: no gradient
    plain = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    assert abs(new.item() - plain.item()) > 1e-2  # smoothing changed the loss (a no-op would fail here)


def test_zero_smoothing_is_plain_cross_entropy_and_bf16_logits_work() -> None:
    logits, labels = _logits_labels()
    assert torch.equal(loss_fn(logits, labels)[0], loss_fn(logits, labels, 0.0)[0])
    x = logits.to(torch.bfloat16).requires_grad_()
    loss, _ = loss_fn(x, labels, 0.1)
    loss.backward()
    ref = F.cross_entropy(x.detach().float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                          label_smoothing=0.1)
    assert x.grad.dtype == torch.bfloat16 and abs(loss.item() - ref.item()) < 1e-5


def test_every_label_ignored_is_nan_with_smoothing_too() -> None:
    labels = torch.full((1, 4), IGNORE_INDEX)
    assert loss_fn(torch.randn(1, 4, 9), labels, 0.1)[0].isnan()


# -- the preset key --------------------------------------------------------------------------------------------

def _preset(tmp_path: Path, extra: list[str] | None = None):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("\n\n".join(pydoc_corpus())[:40_000], encoding="utf-8")
    path = tmp_path / "p.toml"
    path.write_text(f"""
[run]
output_dir = "{tmp_path / 'runs'}"
[model]
d_model = 32
n_heads = 2
n_layers = 1
d_ff = 64
dropout = 0.0
[data]
name = "text"
path = "{corpus}"
seq_len = 16
vocab_size = 300
[training]
steps = 1
micro_batch_size = 4
precision = "fp32"
eval_steps = 2
label_smoothing = 0.1
""", encoding="utf-8")
    return load_preset(path, extra or [])


@pytest.mark.parametrize("value, message", [("1.0", "must be < 1.0"), ("-0.1", "must be >= 0.0")])
def test_out_of_range_label_smoothing_is_one_line_naming_the_key(tmp_path, value, message) -> None:
    with pytest.raises(PresetError, match=rf"training\.label_smoothing: {value} {message}"):
        _preset(tmp_path, [f"training.label_smoothing={value}"])


def test_label_smoothing_may_change_on_resume() -> None:
    assert rule("training.label_smoothing") is None


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    dist.destroy_process_group()


def test_training_loss_is_smoothed_and_validation_loss_is_not(tmp_path, process_group) -> None:
    preset = _preset(tmp_path)
    assert preset.training.label_smoothing == 0.1
    run_dir = create_run_dir(tmp_path / "runs", "ls", dump_preset(preset), {"status": "starting"})
    prepare_data(preset)  # what the launcher does before the workers start
    trainer = Trainer(preset, run_dir, process_group, get_registry())
    trainer.build()
    try:
        model = trainer.strategy.model
        batch = next(trainer.batches())
        with torch.no_grad():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"})
        flat, labels = logits.float().flatten(0, 1), batch["labels"].flatten()
        smooth = F.cross_entropy(flat, labels, ignore_index=IGNORE_INDEX, label_smoothing=0.1).item()
        plain = F.cross_entropy(flat, labels, ignore_index=IGNORE_INDEX).item()
        assert smooth - plain > 1e-3  # near-uniform logits at init: smoothing adds little, but 100x the tolerance
        assert math.isclose(trainer.forward_loss(dict(batch))[0].item(), smooth, abs_tol=1e-5)
        assert math.isclose(trainer.forward_loss(dict(batch), train=False)[0].item(), plain, abs_tol=1e-5)
        # evaluate(): the token-weighted plain cross-entropy of the first eval_steps validation batches
        total = count = 0.0
        with torch.no_grad():
            for i, vb in enumerate(trainer.valid_loader):
                if i >= preset.training.eval_steps:
                    break
                loss, n = loss_fn(model(**{k: v for k, v in vb.items() if k != "labels"}), vb["labels"])
                total, count = total + loss.item() * int(n), count + int(n)
        assert math.isclose(trainer.evaluate(), total / count, rel_tol=1e-6)
    finally:
        trainer.close("finished")
