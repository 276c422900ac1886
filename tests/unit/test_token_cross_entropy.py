"""``kernels.token_cross_entropy``: each row's cross-entropy (the DPO log-probabilities' path), chunked on CPU, equals
``F.cross_entropy(reduction="none")`` in value and gradient, ignored rows 0; the token-mean path is unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_handle.model import kernels


def test_rows_and_gradients_are_torch_s():
    torch.manual_seed(0)
    logits = torch.randn(37, 300, dtype=torch.float64, requires_grad=True)  # 37 rows: chunks of 16 and a tail
    labels = torch.randint(0, 300, (37,))
    labels[[3, 20]] = -100
    weights = torch.randn(37, dtype=torch.float64)
    old = kernels.CE_CHUNK_ELEMENTS
    kernels.CE_CHUNK_ELEMENTS = 16 * 300
    try:
        mine = kernels.token_cross_entropy(logits, labels)
        (mine * weights).sum().backward()
    finally:
        kernels.CE_CHUNK_ELEMENTS = old
    grad, logits.grad = logits.grad, None
    theirs = F.cross_entropy(logits.float(), labels, reduction="none")
    (theirs * weights).sum().backward()
    assert mine.dtype == torch.float32 and mine.shape == (37,) and mine[3] == 0 and mine[20] == 0
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, logits.grad, rtol=1e-5, atol=1e-7)
    assert grad[3].abs().max() == 0
    mean = kernels.cross_entropy(logits.detach(), labels)  # the token mean: the same kernel, mean=True
    torch.testing.assert_close(mean, F.cross_entropy(logits.detach().float(), labels), rtol=1e-6, atol=1e-6)
