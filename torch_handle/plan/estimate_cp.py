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
  ``2 · B · (2H + 2H_kv) · T/cp · D · e``;
* native (torch's FlexAttention context parallel, :mod:`torch_handle.parallel.context.native`): ``flex_attention``
  saves the *gathered* K/V for its backward, so each of the L layers a rank runs holds the other ranks' K/V from
  forward to backward (L = 1 under activation checkpointing, which recomputes them a layer at a time), and the
  backward's dK/dV of the whole sequence wait for their reduce-scatter in the compute dtype:
  ``2 · B · H_kv · D · e · (L · (T − T/cp) + T)``. Not measured: no GPU has run it.

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
                    element_bytes: int, accumulation_bytes: int = 4, layers: int = 1) -> int:
    """The transient bytes of one layer's context-parallel attention on one rank (the module's formulas): ``batch``
    sequences of ``seq_len`` tokens (the whole sequence, T), ``n_heads`` query and ``n_kv_heads`` key/value heads of
    ``head_dim`` channels, ``element_bytes`` per value in compute, ``accumulation_bytes`` per accumulated one; for
    ``native``, with the gathered K/V of ``layers`` layers held until backward.

    Raises:
        ValueError: an ``impl`` other than ring, allgather, ulysses, native."""
    local = batch * (seq_len // cp) * head_dim  # one head's shard of the sequence
    if impl == "ring":
        return 2 * 2 * n_kv_heads * local * (element_bytes + accumulation_bytes)
    if impl == "allgather":
        return 2 * n_kv_heads * local * cp * (element_bytes + accumulation_bytes)
    if impl == "ulysses":
        return 2 * (2 * n_heads + 2 * n_kv_heads) * local * element_bytes
    if impl == "native":
        return 2 * n_kv_heads * local * (layers * (cp - 1) + cp) * element_bytes
    raise ValueError(f"no buffer model for cp_impl {impl!r} (valid: ring, allgather, ulysses, native)")


def cp_activation_bytes(preset: Preset, registry: PluginRegistry, strategy: str | None = None,
                        loss_impl: str | None = None) -> tuple[ActivationBytes, int, str]:
    """(one cp rank's :class:`ActivationBytes` for a micro-batch, its attention's buffer bytes, the ``cp_impl`` they
    are priced for) of ``preset`` (``parallel.cp > 1``), under ``strategy``'s way of computing (default: the
    preset's).

    Raises:
        PresetError: a dataset without ``vocab_size``/``seq_len`` options."""
    par, model, data, t = preset.parallel, preset.model.options, preset.data.options, preset.training
    build = model_build(preset, registry)
    mode = compute_mode(strategy or preset.strategy.name, t.precision)
    act = fake_activations(build, t.micro_batch_size, data.seq_len // par.cp, t.precision, mode,
                           bool(getattr(model, "activation_checkpointing", False)),
                           loss_impl=loss_impl or loss_impl_of(preset, registry))
    buffers, impl = preset_cp_buffer_bytes(preset, mode)
    return act, buffers, impl


def _attention_heads(preset: Preset) -> tuple[int, int]:
    """(query heads, key/value heads) one rank attends: with tp its H/tp and H_kv/tp (one when H_kv < tp: the
    key/value heads replicated)."""
    model, tp = preset.model.options, preset.parallel.tp
    kv_heads = getattr(model, "n_kv_heads", None) or model.n_heads
    return model.n_heads // tp, max(1, kv_heads // tp)


def _head_dim(preset: Preset) -> int:
    model = preset.model.options
    return getattr(model, "head_dim", None) or model.d_model // model.n_heads


def preset_cp_buffer_bytes(preset: Preset, mode: str) -> tuple[int, str]:
    """(:func:`cp_buffer_bytes` of ``preset``'s attention on one rank, the ``cp_impl`` priced) computing in ``mode``
    (:func:`~torch_handle.plan.estimate_activations.compute_mode`'s)."""
    from torch_handle.config.context_parallel import chosen_cp_impl

    par, data, t, model = preset.parallel, preset.data.options, preset.training, preset.model.options
    impl = chosen_cp_impl(par.cp_impl, bool(getattr(data, "document_mask", False)))
    element = 4 if mode == "fp32" else _DTYPE_BYTES.get(t.precision, 4)
    held = 1 if getattr(model, "activation_checkpointing", False) else -(-int(getattr(model, "n_layers", 1)) // par.pp)
    return cp_buffer_bytes(impl, t.micro_batch_size, *_attention_heads(preset), data.seq_len, par.cp,
                           _head_dim(preset), element, layers=held), impl


def cp_step_volume(preset: Preset, element_bytes: int, micro_batch_size: int, microbatches: int,
                   accumulation_bytes: int = 4) -> dict[str, int]:
    """``{"bytes", "calls"}``: what one rank of ``preset``'s cp group sends in one optimizer step of
    ``microbatches`` micro-batches of ``micro_batch_size`` sequences, for ``handle plan``'s step time. Per layer
    and micro-batch, with ``s = B · H_kv/tp · T/cp · D`` one head group's shard (values, not bytes):

    * ring: forward, cp − 1 passes of the K/V block (``2s`` values of ``e`` bytes); backward, the same passes and
      cp of the travelling dK/dV sums (``2s`` of ``a`` bytes; the last brings them home): ``2s · ((cp − 1) · 2e +
      cp · a)`` bytes, ``3cp − 2`` passes;
    * allgather: the K/V all-gathered in forward and again in backward (a ring all-gather sends cp − 1 shards per
      rank), their gradients reduce-scattered (cp − 1 shards): ``2s · (cp − 1) · (2e + a)``, 8 calls (the run's
      ``cp_comm_calls``: docs/context-parallel.md);
    * ulysses: q, k, v and the output all-to-all'd in forward and their gradients in backward, (cp − 1)/cp of each
      rank's ``B · (2H + 2H_kv)/tp · T/cp · D`` values: ``2 · (cp − 1)/cp · B · (2H + 2H_kv)/tp · T/cp · D · e``,
      8 calls;
    * native: K/V all-gathered in forward (torch's ``flex_cp_allgather``: one all-gather each), their gradients
      reduce-scattered in the compute dtype (its autograd): ``2s · (cp − 1) · 2e``, 4 calls (the positions'
      gather, once per micro-batch, left out).

    Raises:
        ValueError: a ``cp_impl`` other than ring, allgather, ulysses, native (or auto)."""
    from torch_handle.config.context_parallel import chosen_cp_impl

    par, data = preset.parallel, preset.data.options
    cp, layers = par.cp, int(getattr(preset.model.options, "n_layers", 0))
    impl = chosen_cp_impl(par.cp_impl, bool(getattr(data, "document_mask", False)))
    heads, kv_heads = _attention_heads(preset)
    local = micro_batch_size * (data.seq_len // cp) * _head_dim(preset)
    if impl == "ring":
        per, calls = 2 * kv_heads * local * ((cp - 1) * 2 * element_bytes + cp * accumulation_bytes), 3 * cp - 2
    elif impl == "allgather":
        per, calls = 2 * kv_heads * local * (cp - 1) * (2 * element_bytes + accumulation_bytes), 8
    elif impl == "ulysses":
        per, calls = 2 * (cp - 1) * (2 * heads + 2 * kv_heads) * local * element_bytes // cp, 8
    elif impl == "native":
        per, calls = 2 * kv_heads * local * (cp - 1) * 2 * element_bytes, 4
    else:
        raise ValueError(f"no communication model for cp_impl {impl!r} (valid: ring, allgather, ulysses, native)")
    return {"bytes": per * layers * microbatches, "calls": calls * layers * microbatches}
