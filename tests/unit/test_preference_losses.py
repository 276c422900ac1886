"""The preference losses (torch_handle/train/objectives/preference.py) without a reference implementation: DPO's
loss is ln 2 with zero margins when the policy is its reference; which losses are reference-free; an unknown name.
tests/test_preference_trl.py compares every loss with TRL's own."""

from __future__ import annotations

import math

import pytest
import torch

from torch_handle.train.objectives.preference import LOSSES, PairLogps, preference_loss

B, T = 6, 12


def _batch(seed: int = 0):
    """Per-token log-probabilities of 2B rows ([chosen..., rejected...]) on their completion tokens (zero on the
    prompt and the padding, as TRL's fused head returns them), the completion mask, and reference sums."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * B, T, dtype=torch.long)
    for row in range(2 * B):
        start = int(torch.randint(1, 5, (1,), generator=g))
        stop = int(torch.randint(start + 1, T + 1, (1,), generator=g))
        mask[row, start:stop] = 1
    per_token = -torch.rand(2 * B, T - 1, generator=g, dtype=torch.float64) * 3 * mask[:, 1:]
    ref = per_token.sum(1) + torch.randn(2 * B, generator=g, dtype=torch.float64)
    return per_token, mask, ref


def _pairs(per_token, mask, ref) -> PairLogps:
    sums, counts = per_token.sum(1), mask[:, 1:].sum(1).double()
    return PairLogps(sums[:B], sums[B:], counts[:B], counts[B:], *((ref[:B], ref[B:]) if ref is not None else ()))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_sigmoid_is_ln2_when_policy_is_reference(label_smoothing):
    per_token, mask, _ = _batch(4)
    sums = per_token.sum(1)
    pairs = _pairs(per_token, mask, sums)  # the reference's sums are the policy's own
    losses, metrics = preference_loss("sigmoid", 0.1, label_smoothing)(pairs)
    assert float(losses.mean()) == pytest.approx(math.log(2), abs=1e-6)
    assert float(metrics["rewards/margins"].abs().max()) == 0.0


def test_reference_free_and_unknown():
    assert {n for n, c in LOSSES.items() if c.reference_free} == {"simpo", "orpo"}
    with pytest.raises(ValueError, match="valid: sigmoid, ipo, hinge, simpo, orpo"):
        preference_loss("kto")
    with pytest.raises(ValueError, match="reference"):
        preference_loss("sigmoid")(PairLogps(*(torch.zeros(2) for _ in range(4))))
