"""The position-wise feed-forward networks: the paper's two-matrix FFN and SwiGLU's gated three-matrix one, and
the switch between them (``TransformerArgs.mlp``).

* ``PositionwiseFeedForward`` -- W2 · act(W1 x + b1) + b2 with ReLU or GELU (Vaswani et al. 2017, §3.3).
* ``SwiGLUFeedForward`` -- W_down · (SiLU(W_gate x) ⊙ W_up x) (Shazeer 2020, "GLU Variants Improve Transformer",
  eq. 6; Llama, Qwen, Mistral).

Every position is transformed on its own. Shape letters: B batch, T sequence length, C = d_model channels.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from torch_handle.model.args import ACTIVATIONS, MLP, MLPS, Activation, check_choice
from torch_handle.model.kernels import Dropout
from torch_handle.parallel.tensor.random import tensor_parallel_rng


def _reset_linears(*linears: nn.Linear) -> None:
    """Xavier-uniform weights, zero biases (the original Transformer's initialisation), in the order given."""
    for linear in linears:
        nn.init.xavier_uniform_(linear.weight)
        if linear.bias is not None:
            nn.init.zeros_(linear.bias)


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = W2 · dropout(act(W1 x + b1)) + b2, applied to every position independently
    (Vaswani et al. 2017, §3.3).

    Args:
        d_model: model width C.
        d_ff: hidden width (4C in most models).
        dropout: dropout on the hidden activations.
        activation: ``"relu"`` (the paper) or ``"gelu"`` (exact erf form, as in
            ``nn.TransformerEncoderLayer``).
        bias: whether the two linears have biases.

    Shape:
        (B, T, C) -> (B, T, C).

    Raises:
        ValueError: for an unknown activation.
    """

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, activation: Activation = "relu",
                 bias: bool = True) -> None:
        super().__init__()
        check_choice("activation", activation, ACTIVATIONS)
        self.activation = activation
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_linears(self.linear1, self.linear2)

    def forward(self, x: Tensor) -> Tensor:
        act = F.relu if self.activation == "relu" else F.gelu
        h = act(self.linear1(x))  # (B, T, d_ff); under TP this rank's d_ff/tp units, masks of its own
        with tensor_parallel_rng(self.training and self.dropout.p > 0):
            h = self.dropout(h)
        return self.linear2(h)


class SwiGLUFeedForward(nn.Module):
    """FFN_SwiGLU(x) = W_down · dropout(SiLU(W_gate x) ⊙ W_up x) (Shazeer 2020, eq. 6), SiLU(z) = z·σ(z)
    (Ramachandran et al. 2017's Swish with β = 1).

    A gated linear unit (Dauphin et al. 2017): one projection (up) carries the signal, a second (gate), through
    SiLU, decides per hidden unit how much of it passes. Three matrices instead of two, so at equal parameters
    d_ff is 2/3 of the two-matrix FFN's (Shazeer's comparison; Llama's 8/3·C instead of 4C). The names are
    Llama's (``gate_proj``, ``up_proj``, ``down_proj``), so its weights map by name.

    Args:
        d_model: model width C.
        d_ff: hidden width (``intermediate_size`` in transformers).
        dropout: dropout on the gated hidden units.
        bias: whether the three linears have biases (Llama's ``mlp_bias``; none in Llama and Qwen).

    Shape:
        (B, T, C) -> (B, T, C).
    """

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_linears(self.gate_proj, self.up_proj, self.down_proj)

    def forward(self, x: Tensor) -> Tensor:
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (B, T, d_ff)
        with tensor_parallel_rng(self.training and self.dropout.p > 0):
            h = self.dropout(h)
        return self.down_proj(h)


def build_feed_forward(mlp: MLP, d_model: int, d_ff: int, dropout: float = 0.0, bias: bool = True) -> nn.Module:
    """The feed-forward network ``mlp`` names: ``"relu"`` / ``"gelu"`` -> ``PositionwiseFeedForward``, ``"swiglu"``
    -> ``SwiGLUFeedForward``.

    Raises:
        ValueError: an unknown ``mlp`` (the message lists the valid ones).
    """
    check_choice("mlp", mlp, MLPS)
    if mlp == "swiglu":
        return SwiGLUFeedForward(d_model, d_ff, dropout, bias)
    return PositionwiseFeedForward(d_model, d_ff, dropout, mlp, bias)
