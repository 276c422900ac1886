"""``handle estimate`` with context parallelism (``[parallel] cp > 1``): one cp rank's activations and the
algorithm's communication buffers.

A cp rank runs the whole model on its T/cp tokens of every sequence: every activation but attention's key-value
exchange is that of a T/cp-token micro-batch, so the activations are measured as the other estimates' are -- the
model's forward and backward on fake tensors (:func:`~torch_handle.plan.estimate_activations.fake_activations`) --
at ``seq_len / cp``. The hand-written attentions save q, k, v, the fp32 output and its log-sum-exp, where the fake
run's SDPA saves its own (output, log-sum-exp or probabilities): measured on a 2-layer Llama-shaped decoder at
seq_len 256, cp 2 (fp32, packed documents), the fake figure is 4% above the run's ``activation_saved_bytes`` for
ring and all-gather and 11% above for Ulysses, whose head-sharded q, k, v replace the sequence-sharded ones.

On top of them, transient and held for one layer at a time (:func:`cp_buffer_bytes`, ``e`` the compute dtype's bytes,
``a`` the accumulation dtype's, 4 unless fp64):

* ring: the K/V block in hand and the one arriving, and in backward the dK/dV sums travelling with them:
  ``2 · 2 · B · H_kv · T/cp · D · (e + a)``;
* allgather: the gathered K/V of the whole sequence, and in backward their gradients before the reduce-scatter:
  ``2 · B · H_kv · T · D · (e + a)``;
* ulysses: the all-to-all's send and receive copies of q, k, v (and of the output):
  ``2 · B · (2H + 2H_kv) · T/cp · D · e``.

Model states are the strategy's over dp × cp ranks (DDP replicates, FSDP2 shards over all of them), as without cp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch_handle.plan.estimate_activations import ActivationBytes, compute_mode, fake_activations, loss_impl_of
from torch_handle.plan.estimate_model import model_build

if TYPE_CHECKING:
    from torch_handle.config.schema import Preset
    from torch_handle.registry import PluginRegistry

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "auto": 4, "fp64": 8}


def cp_buffer_bytes(impl: str, batch: int, n_heads: int, n_kv_heads: int, seq_len: int, cp: int, head_dim: int,
                    element_bytes: int, accumulation_bytes: int = 4) -> int:
    """The transient bytes of one layer's context-parallel attention on one rank (the module's formulas): ``batch``
    sequences of ``seq_len`` tokens (the whole sequence, T), ``n_heads`` query and ``n_kv_heads`` key/value heads of
    ``head_dim`` channels, ``element_bytes`` per value in compute, ``accumulation_bytes`` per accumulated one.

    Raises:
        ValueError: an ``impl`` other than ring, allgather, ulysses."""
    local = batch * (seq_len // cp) * head_dim  # one head's shard of the sequence
    if impl == "ring":
        return 2 * 2 * n_kv_heads * local * (element_bytes + accumulation_bytes)
    if impl == "allgather":
        return 2 * n_kv_heads * local * cp * (element_bytes + accumulation_bytes)
    if impl == "ulysses":
        return 2 * (2 * n_heads + 2 * n_kv_heads) * local * element_bytes
    raise ValueError(f"no buffer model for cp_impl {impl!r} (valid: ring, allgather, ulysses)")


def cp_activation_bytes(preset: Preset, registry: PluginRegistry, strategy: str | None = None,
                        loss_impl: str | None = None) -> tuple[ActivationBytes, int, str]:
    """(one cp rank's :class:`ActivationBytes` for a micro-batch, its attention's buffer bytes, the ``cp_impl`` they
    are priced for) of ``preset`` (``parallel.cp > 1``), under ``strategy``'s way of computing (default: the
    preset's).

    Raises:
        PresetError: a dataset without ``vocab_size``/``seq_len`` options."""
    from torch_handle.config.context_parallel import chosen_cp_impl

    par, model, data, t = preset.parallel, preset.model.options, preset.data.options, preset.training
    impl = chosen_cp_impl(par.cp_impl, bool(getattr(data, "document_mask", False)))
    build = model_build(preset, registry)
    mode = compute_mode(strategy or preset.strategy.name, t.precision)
    act = fake_activations(build, t.micro_batch_size, data.seq_len // par.cp, t.precision, mode,
                           bool(getattr(model, "activation_checkpointing", False)),
                           loss_impl=loss_impl or loss_impl_of(preset, registry))
    n_heads = model.n_heads
    head_dim = getattr(model, "head_dim", None) or model.d_model // n_heads
    kv_heads = getattr(model, "n_kv_heads", None) or n_heads
    element = 4 if mode == "fp32" else _DTYPE_BYTES.get(t.precision, 4)
    # with tp, a rank attends its H/tp query heads and H_kv/tp key/value heads (one when H_kv < tp: replicated)
    buffers = cp_buffer_bytes(impl, t.micro_batch_size, n_heads // par.tp, max(1, kv_heads // par.tp), data.seq_len,
                              par.cp, head_dim, element)
    return act, buffers, impl
