"""Preference losses: a pair of completions to one prompt, one chosen (y_w) and one rejected (y_l), and the loss
that raises the first over the second. Each loss is a small class with its formula and paper, whether it needs a
reference model (:attr:`PreferenceLoss.reference_free`), and the per-pair metrics TRL's trainers log under the
names its users read (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen``, ``logps/rejected``).

Notation, per pair: ``s_w = Σ_t log π(y_w,t | x, y_w,<t)`` over the chosen completion's trained tokens (``s_l`` the
rejected's), ``n_w`` and ``n_l`` their token counts, ``m_w = s_w / n_w`` the mean; ``r_w = s_w - s_w^ref`` the
log-ratio against the reference model (``r_l`` likewise) and ``Δ = r_w - r_l``. ``σ`` is the logistic function.

=========  ==============================================================  =========================================
name       per-pair loss                                                   source
=========  ==============================================================  =========================================
sigmoid    ``-(1 - ε) log σ(β Δ) - ε log σ(-β Δ)``                         Rafailov et al. 2023 (DPO), eq. 7; ε > 0:
                                                                           conservative DPO (Mitchell 2023)
ipo        ``(r_w / n_w - r_l / n_l - 1 / (2 β))²``                        Azar et al. 2023 (IPO), eq. 17, length-
                                                                           normalised as TRL does (with its authors)
hinge      ``max(0, 1 - β Δ)``                                             Zhao et al. 2023 (SLiC-HF), eq. 1
simpo      ``-(1 - ε) log σ(z) - ε log σ(-z)``,                            Meng et al. 2024 (SimPO), eq. 6
           ``z = β (m_w - m_l) - γ``
orpo       ``-m_w - β log σ(log odds(m_w) - log odds(m_l))``,              Hong et al. 2024 (ORPO), eqs. 2, 4, 7
           ``odds(m) = e^m / (1 - e^m)``
=========  ==============================================================  =========================================

The metrics follow TRL: the rewards are ``β r`` (DPO's implicit reward; sigmoid, ipo, hinge, from the summed
log-ratios even for ipo, as ``DPOTrainer`` logs them) or ``β m`` for the reference-free simpo and orpo
(``CPOTrainer``, ``ORPOTrainer``); ``logps`` are the sums, or the means where the loss reads means (simpo, orpo).

Differences from TRL, on purpose: ORPO's SFT term here is the pair's mean negative log-likelihood over its chosen
completion (the paper's ``L_SFT``); TRL's ``ORPOTrainer`` takes the token mean over the chosen prompt *and*
completion of the micro-batch. Conservative DPO is ``sigmoid`` with ``label_smoothing`` (TRL 1.x keeps that form
in ``CPOTrainer``'s sigmoid; its ``DPOTrainer`` moved it to ``robust``/``exo_pair``).

Shapes: every tensor here is (B,), one entry per pair, fp32. Only torch is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from torch_handle.observe.fields import PREFERENCE_METRICS

METRICS = PREFERENCE_METRICS
"""The per-pair metrics every loss returns, in this order (TRL's names; defined in observe.fields for the sinks and
the dashboard, which do not import torch)."""


@dataclass
class PairLogps:
    """The log-probabilities a preference loss reads, one entry per pair, (B,) each.

    Attributes:
        chosen, rejected: the policy's summed log-probabilities of each completion's trained tokens (s_w, s_l).
        chosen_tokens, rejected_tokens: how many tokens each sum has (n_w, n_l), as floats.
        ref_chosen, ref_rejected: the reference model's sums over the same tokens; None for a reference-free
            loss.
    """

    chosen: Tensor
    rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor
    ref_chosen: Tensor | None = None
    ref_rejected: Tensor | None = None

    def means(self) -> tuple[Tensor, Tensor]:
        """(m_w, m_l): the mean log-probability per trained token of each completion."""
        return self.chosen / self.chosen_tokens.clamp(min=1), self.rejected / self.rejected_tokens.clamp(min=1)

    def log_ratios(self) -> tuple[Tensor, Tensor]:
        """(r_w, r_l): policy minus reference, summed.

        Raises:
            ValueError: no reference log-probabilities."""
        if self.ref_chosen is None or self.ref_rejected is None:
            raise ValueError("a reference-based preference loss needs the reference model's log-probabilities")
        return self.chosen - self.ref_chosen, self.rejected - self.ref_rejected


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - e^x) for x < 0, without cancellation (Mächler 2012: branch at -ln 2)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _smoothed_logistic(logits: Tensor, eps: float) -> Tensor:
    """``-(1 - ε) log σ(z) - ε log σ(-z)``: the logistic loss with label smoothing ε (the label flipped with
    probability ε)."""
    return -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)


class PreferenceLoss:
    """A preference loss: ``loss(pairs) -> (per-pair losses (B,), {metric: (B,)})``.

    Args:
        beta: β > 0, the strength of the KL regularisation towards the reference (sigmoid, hinge), IPO's τ, SimPO's
            reward scale, ORPO's λ (the odds-ratio term's weight).
        label_smoothing: ε in [0, 0.5): the chance a pair's labels are flipped (sigmoid, simpo).
        gamma: SimPO's target reward margin γ.
    """

    name = ""
    reference_free = False
    """True: the loss reads the policy's log-probabilities alone (no reference model is kept or computed)."""
    mean_logps = False
    """True: the loss (and its ``logps`` metrics) read the mean log-probability per token, not the sum."""

    def __init__(self, beta: float = 0.1, label_smoothing: float = 0.0, gamma: float = 0.0) -> None:
        self.beta, self.label_smoothing, self.gamma = float(beta), float(label_smoothing), float(gamma)

    def losses(self, pairs: PairLogps) -> Tensor:
        """(B,) per-pair losses."""
        raise NotImplementedError

    def rewards(self, pairs: PairLogps) -> tuple[Tensor, Tensor]:
        """(chosen, rejected) implicit rewards: ``β r`` (the DPO reward, log-ratio against the reference)."""
        r_w, r_l = pairs.log_ratios()
        return self.beta * r_w, self.beta * r_l

    def __call__(self, pairs: PairLogps) -> tuple[Tensor, dict[str, Tensor]]:
        """(per-pair losses (B,), the :data:`METRICS` per pair (B,) each, detached)."""
        losses = self.losses(pairs)
        with torch.no_grad():
            chosen, rejected = self.rewards(pairs)
            logps = pairs.means() if self.mean_logps else (pairs.chosen, pairs.rejected)
            metrics = dict(zip(METRICS, (chosen, rejected, (chosen > rejected).float(), chosen - rejected,
                                         logps[0].detach(), logps[1].detach())))
        return losses, {k: v.detach().float() for k, v in metrics.items()}

    def __repr__(self) -> str:
        return f"{self.name}(beta={self.beta:g}, label_smoothing={self.label_smoothing:g}, gamma={self.gamma:g})"


class SigmoidLoss(PreferenceLoss):
    """DPO (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward
    Model", eq. 7): ``-log σ(β Δ)``; with ε > 0 conservative DPO (Mitchell 2023, "A note on DPO with noisy
    preferences"): ``-(1 - ε) log σ(β Δ) - ε log σ(-β Δ)``. At policy = reference, Δ = 0 and the loss is ln 2."""

    name = "sigmoid"

    def losses(self, pairs: PairLogps) -> Tensor:
        r_w, r_l = pairs.log_ratios()
        return _smoothed_logistic(self.beta * (r_w - r_l), self.label_smoothing)


class IPOLoss(PreferenceLoss):
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences", eq.
    17, β as its τ): ``(r_w / n_w - r_l / n_l - 1 / (2 β))²``, the log-ratios averaged over each completion's
    tokens (TRL's ``DPOTrainer`` normalises so, confirmed with the paper's authors)."""

    name = "ipo"

    def losses(self, pairs: PairLogps) -> Tensor:
        r_w, r_l = pairs.log_ratios()
        delta = r_w / pairs.chosen_tokens.clamp(min=1) - r_l / pairs.rejected_tokens.clamp(min=1)
        return (delta - 1 / (2 * self.beta)) ** 2


class HingeLoss(PreferenceLoss):
    """The hinge of SLiC (Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration with Human Feedback", eq.
    1, on the log-ratios as TRL's ``DPOTrainer`` ``hinge``; margin 1 / β): ``max(0, 1 - β Δ)``."""

    name = "hinge"

    def losses(self, pairs: PairLogps) -> Tensor:
        r_w, r_l = pairs.log_ratios()
        return torch.relu(1 - self.beta * (r_w - r_l))


class SimPOLoss(PreferenceLoss):
    """SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward", eq. 6):
    reference-free, the mean log-probabilities as the reward, a target margin γ:
    ``-log σ(β (m_w - m_l) - γ)`` (with ε: smoothed as ``sigmoid``; TRL's ``CPOTrainer`` ``simpo``)."""

    name = "simpo"
    reference_free = True
    mean_logps = True

    def losses(self, pairs: PairLogps) -> Tensor:
        m_w, m_l = pairs.means()
        return _smoothed_logistic(self.beta * (m_w - m_l) - self.gamma, self.label_smoothing)

    def rewards(self, pairs: PairLogps) -> tuple[Tensor, Tensor]:
        m_w, m_l = pairs.means()
        return self.beta * m_w, self.beta * m_l


class ORPOLoss(PreferenceLoss):
    """ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model", eqs. 2, 4, 7):
    reference-free, the SFT term plus β (the paper's λ) times the odds-ratio term, on the mean log-probabilities
    (``P(y|x) = exp(m)``): ``-m_w - β log σ(log odds(m_w) - log odds(m_l))``, ``log odds(m) = m - log(1 - e^m)``."""

    name = "orpo"
    reference_free = True
    mean_logps = True

    def losses(self, pairs: PairLogps) -> Tensor:
        m_w, m_l = pairs.means()
        log_odds = (m_w - m_l) - (log1mexp(m_w) - log1mexp(m_l))
        return -m_w - self.beta * F.logsigmoid(log_odds)

    def rewards(self, pairs: PairLogps) -> tuple[Tensor, Tensor]:
        m_w, m_l = pairs.means()
        return self.beta * m_w, self.beta * m_l


LOSSES: dict[str, type[PreferenceLoss]] = {c.name: c for c in (SigmoidLoss, IPOLoss, HingeLoss, SimPOLoss, ORPOLoss)}
"""``[finetune.preference] loss`` -> its class."""


def preference_loss(name: str, beta: float = 0.1, label_smoothing: float = 0.0, gamma: float = 0.0
                    ) -> PreferenceLoss:
    """The loss ``name`` (a key of :data:`LOSSES`) with its parameters.

    Raises:
        ValueError: an unknown name (the valid ones listed)."""
    if name not in LOSSES:
        raise ValueError(f"unknown preference loss {name!r} (valid: {', '.join(LOSSES)})")
    return LOSSES[name](beta, label_smoothing, gamma)
