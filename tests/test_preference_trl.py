"""The preference losses (torch_handle/train/objectives/preference.py) against TRL's own, for the same
log-probabilities, within 1e-6: ``DPOTrainer._compute_loss`` (sigmoid, ipo, hinge; the reference log-probabilities
precomputed, the policy's per-token log-probabilities from a stand-in for the fused LM head), ``CPOTrainer.cpo_loss``
(simpo; and conservative DPO, sigmoid with label smoothing, which TRL 1.x keeps in CPO's sigmoid: fed the log-ratios)
and ``ORPOTrainer.odds_ratio_loss`` (orpo's odds-ratio term). TRL is a test-only reference (the dev extra); its
trainers are built with ``object.__new__`` and the attributes the loss reads, not a whole trainer."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from tests.unit.test_preference_losses import B, T, _batch, _pairs
from torch_handle.train.objectives.preference import METRICS, preference_loss

trl = pytest.importorskip("trl", reason="TRL is the reference: pip install -e '.[dev]'")


class _FusedHead(torch.nn.Module):
    """What TRL's ``fused_lm_head=True`` forward returns, with the given per-token log-probabilities."""

    def __init__(self, per_token):
        super().__init__()
        self.per_token = per_token

    def forward(self, **kwargs):
        zeros = torch.zeros_like(self.per_token)
        return SimpleNamespace(log_probs=self.per_token, entropy=zeros, mean_logits=zeros,
                               is_top1=torch.zeros_like(self.per_token, dtype=torch.bool))


def _trl_dpo(loss_type: str, beta: float, per_token, mask, ref):
    from accelerate import Accelerator
    from trl import DPOTrainer

    trainer = object.__new__(DPOTrainer)
    model = _FusedHead(per_token).train()
    trainer.__dict__.update(model=model, accelerator=Accelerator(cpu=True), aux_loss_enabled=False, ld_alpha=None,
                            precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
                            loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False,
                            _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                            _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(2 * B, T, dtype=torch.long), "attention_mask": torch.ones(2 * B, T),
              "completion_mask": mask, "ref_chosen_logps": ref[:B], "ref_rejected_logps": ref[B:]}
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_reference_losses_equal_trl_dpo_trainer(loss_type, beta):
    per_token, mask, ref = _batch()
    theirs, metrics = _trl_dpo(loss_type, beta, per_token, mask, ref)
    losses, ours = preference_loss(loss_type, beta)(_pairs(per_token, mask, ref))
    assert float(losses.mean()) == pytest.approx(theirs, abs=1e-6)
    for name in METRICS:
        assert float(ours[name].mean()) == pytest.approx(metrics[name], abs=1e-6), name


def _cpo(loss_type: str, beta: float, label_smoothing: float = 0.0, gamma: float = 0.5):
    from accelerate import Accelerator
    from trl.experimental.cpo import CPOTrainer

    trainer = object.__new__(CPOTrainer)
    trainer.__dict__.update(alpha=0.0, loss_type=loss_type, beta=beta, label_smoothing=label_smoothing,
                            simpo_gamma=gamma, accelerator=Accelerator(cpu=True))
    return trainer


@pytest.mark.parametrize("label_smoothing", [0.1, 0.3])
def test_conservative_dpo_equals_trl_smoothed_sigmoid(label_smoothing):
    """cDPO: TRL's CPO sigmoid with label smoothing is ``-(1-ε) log σ(β x) - ε log σ(-β x)`` of x = its chosen minus
    rejected input; given the log-ratios, x = Δ."""
    per_token, mask, ref = _batch(1)
    pairs = _pairs(per_token, mask, ref)
    r_w, r_l = pairs.log_ratios()
    theirs, *_ = _cpo("sigmoid", 0.2, label_smoothing).cpo_loss(r_w, r_l)
    losses, _ = preference_loss("sigmoid", 0.2, label_smoothing)(pairs)
    torch.testing.assert_close(losses, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_simpo_equals_trl_cpo_simpo(label_smoothing):
    per_token, mask, ref = _batch(2)
    pairs = _pairs(per_token, mask, None)
    m_w, m_l = pairs.means()
    theirs, chosen, rejected = _cpo("simpo", 2.0, label_smoothing, gamma=0.7).cpo_loss(m_w, m_l)
    losses, ours = preference_loss("simpo", 2.0, label_smoothing, gamma=0.7)(pairs)
    torch.testing.assert_close(losses, theirs, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["rewards/chosen"], chosen.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["rewards/rejected"], rejected.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["logps/chosen"], m_w.float(), rtol=0, atol=1e-6)


def test_orpo_equals_trl_odds_ratio_plus_the_chosen_nll():
    """ORPO = the chosen completion's mean NLL (the paper's L_SFT) minus TRL's ``odds_ratio_loss`` (β log σ(log
    odds ratio))."""
    from accelerate import Accelerator
    from trl.experimental.orpo import ORPOTrainer

    per_token, mask, _ = _batch(3)
    pairs = _pairs(per_token, mask, None)
    m_w, m_l = pairs.means()
    trainer = object.__new__(ORPOTrainer)
    trainer.__dict__.update(beta=0.25, accelerator=Accelerator(cpu=True))
    ratio_term, chosen, rejected, *_ = trainer.odds_ratio_loss(m_w, m_l)
    losses, ours = preference_loss("orpo", 0.25)(pairs)
    torch.testing.assert_close(losses, (-m_w - ratio_term).to(losses.dtype), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["rewards/chosen"], chosen.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["rewards/margins"], (chosen - rejected).float(), rtol=0, atol=1e-6)
    assert ours["rewards/accuracies"].tolist() == (chosen > rejected).float().tolist()
