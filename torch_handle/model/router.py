"""The router of a mixture-of-experts layer: which k of E experts each token goes to, with what weights, and the
losses and bias that keep the experts evenly loaded.

* ``TopKRouter`` -- token-choice top-k routing (Shazeer et al. 2017, "Outrageously Large Neural Networks"), in
  fp32: softmax scores (Switch Transformer, Mixtral, Qwen 3 MoE) or sigmoid scores (DeepSeek-V3), the k largest
  chosen per token, their weights optionally renormalised to sum to 1 (``norm_topk_prob``); optionally a
  per-expert bias added to the scores for the choice only (auxiliary-loss-free balancing).
* ``load_balancing_loss`` -- the Switch Transformer's E·Σᵢ fᵢ·Pᵢ (Fedus et al. 2021, eq. 4-6).
* ``router_z_loss`` -- ST-MoE's mean squared log-sum-exp of the router logits (Zoph et al. 2022, eq. 5).
The bias moves after each optimizer step by the load the router records (``record_load``): DeepSeek-V3's update
(Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts", Algorithm 1), applied by
the training code (``torch_handle.train.routing.update_expert_biases``), not here.

Shape letters: N tokens (batch × sequence, flattened), C = d_model channels, E experts, k = top_k.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_handle.model.args import ROUTERS, Router, check_choice


class Routing(NamedTuple):
    """What ``TopKRouter`` decided for N tokens (all fp32 or int64, whatever the model's dtype).

    Fields:
        weights: (N, k) fp32, the weight of each chosen expert's output in the token's sum.
        experts: (N, k) int64, the chosen experts, in descending order of score (+ bias).
        probs: (N, E) fp32, each token's distribution over the experts (softmax; sigmoid scores divided by their
            sum): the P of the load-balancing loss.
        logits: (N, E) fp32, the router's logits (the z-loss's input).
    """

    weights: Tensor
    experts: Tensor
    probs: Tensor
    logits: Tensor


class TopKRouter(nn.Module):
    """Token-choice top-k router: logits = x Wᵀ (fp32), scores = softmax(logits) or sigmoid(logits), the k experts
    of highest score (+ ``expert_bias``) per token, weighted by their scores (renormalised to sum to 1 when
    ``norm_topk_prob``).

    ``weight`` is ``transformers``' ``Qwen3MoeTopKRouter.weight`` / ``DeepseekV3TopkRouter.weight`` (E, C), and
    ``expert_bias`` DeepSeek-V3's ``e_score_correction_bias``: it changes which experts are chosen, never the weights
    they get, and no gradient reaches it (Wang et al. 2024: a biased choice, unbiased gating).

    Args:
        d_model: C.
        n_experts: E.
        top_k: k, at most E.
        score: ``"softmax"`` or ``"sigmoid"``.
        norm_topk_prob: divide the k chosen scores by their sum.
        expert_bias: keep a bias buffer (E,) for auxiliary-loss-free balancing, moved by the training code
            (``torch_handle.train.routing.update_expert_bias``).
        bias_update_rate: γ, the step of that update.

    Shape:
        forward(x (N, C)) -> ``Routing``.

    Raises:
        ValueError: top_k not in [1, n_experts], or an unknown score function.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, *, score: Router = "softmax",
                 norm_topk_prob: bool = True, expert_bias: bool = False, bias_update_rate: float = 1e-3) -> None:
        super().__init__()
        check_choice("router", score, ROUTERS)
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.n_experts, self.top_k, self.score = n_experts, top_k, score
        self.norm_topk_prob, self.bias_update_rate = norm_topk_prob, bias_update_rate
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        self.expert_bias: Tensor | None
        self.register_buffer("expert_bias", torch.zeros(n_experts) if expert_bias else None)
        # assignments per expert since the last bias update (a step's micro-batches). A plain tensor, not a
        # buffer: DDP would overwrite every rank's with rank 0's at each forward
        self.pending_load: Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02²), transformers' ``initializer_range``: small logits, so routing starts near uniform (the
        Switch Transformer's advice, §2.4, of a reduced initialisation scale for stable routing)."""
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor) -> Routing:
        # fp32 whatever the autocast: a bf16 softmax over E logits can flip the top-k of near ties, and the
        # losses' log-sum-exp needs the range (Zoph et al. 2022, §3: "router in float32")
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())  # (N, E)
        if self.score == "softmax":
            scores = logits.softmax(dim=-1)  # (N, E)
            probs = scores
        else:
            scores = logits.sigmoid()  # (N, E), each expert's affinity on its own
            probs = scores / scores.sum(dim=-1, keepdim=True)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        experts = choice.topk(self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, experts)  # (N, k): unbiased scores of the chosen experts
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights, experts, probs, logits)

    @torch.no_grad()
    def record_load(self, routed: Tensor) -> None:
        """Add one micro-batch's assignments per expert (E,) to ``pending_load``, the load the next bias update acts
        on (nothing without ``expert_bias``)."""
        if self.expert_bias is not None:
            load = routed.to(self.expert_bias.dtype)
            self.pending_load = load if self.pending_load is None else self.pending_load + load


def load_balancing_loss(probs: Tensor, routed: Tensor, top_k: int) -> Tensor:
    """The Switch Transformer's load-balancing loss (Fedus et al. 2021, eq. 4-6), E · Σᵢ fᵢ · Pᵢ, where fᵢ is the
    fraction of the N·k assignments that went to expert i (a count: no gradient) and Pᵢ the mean probability the
    router gave expert i (differentiable). 1 when the load is uniform, E when every token picks the same experts
    with certainty. For top-k the fraction is over N·k assignments (Megatron-LM, DeepSeek-V3's fᵢ up to E);
    ``transformers``' ``load_balancing_loss_func`` divides by N only, so its loss is k times this one.

    Args:
        probs: (N, E) fp32, each token's distribution over the experts (``Routing.probs``).
        routed: (E,) assignments per expert before any capacity drop.
        top_k: k.

    Returns:
        A scalar tensor (fp32).
    """
    n_tokens, n_experts = probs.shape
    f = routed.to(probs.dtype) / (n_tokens * top_k)  # (E,), sums to 1
    return n_experts * (f * probs.mean(dim=0)).sum()


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): (1/N) Σₜ (log Σⱼ exp xₜⱼ)², which keeps the router's
    logits small (large ones make the fp32 softmax and its gradient unstable). logits (N, E) -> scalar."""
    return torch.logsumexp(logits, dim=-1).square().mean()
