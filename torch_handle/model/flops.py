"""Training FLOPs per token, the count behind MFU and the TFLOP/s figure; one formula for every model.

A model offers ``flops_per_token(seq_len)`` (optional in the model contract); the project's Transformer and the
``hf`` plugin's wrapper both compute it here, from their own parameter count and attention width. It is kept
beside the model rather than inside it because it describes the model's cost, not its computation.
"""

from __future__ import annotations

from torch import Tensor, nn


def embedding_weights(model: nn.Module) -> list[Tensor]:
    """The weight of every ``nn.Embedding`` in ``model`` (learned-position subclasses included), each tensor
    once: tables that are indexed, not multiplied."""
    seen: dict[int, Tensor] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            seen.setdefault(id(module.weight), module.weight)
    return list(seen.values())


def matmul_params(model: nn.Module, output: nn.Module | None) -> int:
    """Parameters that take part in a matmul: every parameter (each shared tensor once) except the embedding
    tables, plus the output projection ``output`` when its weight is one of those tables (tied embeddings: the
    table is indexed on the way in and multiplied on the way out)."""
    tables = embedding_weights(model)
    n = sum(p.numel() for p in model.parameters()) - sum(w.numel() for w in tables)
    if output is not None and any(output.weight is w for w in tables):
        n += output.weight.numel()
    return n


def training_flops_per_token(n_matmul: int, n_layers: int, attention_width: int, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, PaLM appendix B (Chowdhery et al. 2022), after Kaplan et
    al. 2020::

        6 N + 12 · L · attention_width · seq_len

    6N covers the matmuls with the weights (2 FLOPs per multiply-add, ×3 for forward plus the backward's two
    matmuls); the second term covers the attention scores QKᵀ and the weighted sum with V over a context of
    ``seq_len`` keys in each of L layers. N is counted from the built model, so it holds grouped-query attention's
    smaller K and V projections and SwiGLU's three matrices as they are; the scores' width stays n_heads · head_dim
    whatever the number of key/value heads (each query head still attends over every key).

    Args:
        n_matmul: N, the parameters that take part in a matmul (``matmul_params``).
        n_layers: L, the attention layers a token passes through.
        attention_width: n_heads · head_dim (d_model in most models).
        seq_len: the context length, in tokens.
    """
    return 6.0 * n_matmul + 12.0 * n_layers * attention_width * seq_len
