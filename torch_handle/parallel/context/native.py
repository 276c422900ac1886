"""PyTorch's own context parallelism (``parallel.cp_impl = "native"``): K/V all-gathered by torch's FlexAttention
context-parallel path, the attention by ``flex_attention`` with a block mask of the true positions and documents.

This is the all-gather algorithm (Llama 3, §3.3.2; :mod:`~torch_handle.parallel.context.allgather`) with torch's
pieces instead of the hand-written ones, as torchtitan applies it (``apply_cp(..., use_flex_attn=True)`` in
``torchtitan/distributed/context_parallel.py``: ``_ContextParallel(seq_dim=2, attention_type=FLEX)`` through
``parallelize_module`` on the module that calls ``flex_attention``)::

    forward, cp = 4                                          backward (torch's, not written here)

    K0 K1 K2 K3 ── flex_cp_allgather ──▶ K (every rank)       flex_attention's backward: dQ, and dK, dV of all T keys
    positions, documents ── the same op (no grad) ──▶ (B, T)  flex_cp_allgather's autograd: dK, dV reduce-scattered
    rank r: flex_attention(Qr, K, V, block_mask)                 to their owners (``reduce_scatter_single``, sum)

* **The gather** is ``_ContextParallel(FLEX)``'s forward pre-hook on :class:`_FlexAttention` (a module holding the
  flex call, torchtitan's ``inner_attention``): it replaces the module's key and value arguments by
  ``torch.distributed.tensor.experimental._context_parallel._cp_custom_ops.flex_cp_allgather`` of them (an
  all-gather along the sequence in rank order), and leaves the keyword arguments -- the block mask -- as they are.
  The local tokens' positions and documents are gathered by the same custom op under ``torch.no_grad``, so the key
  at gathered index j carries the position and document of the token it is, whatever order the shards hold.
* **The mask** is built by ``create_block_mask`` from a ``mask_mod`` that looks the query's position and document
  up in the local tokens and the key's in the gathered ones: key s is visible to query t when both lie in one
  document and, causal, s's position ≤ t's (the relation of :func:`~torch_handle.parallel.context.blocks.visible`).
  torch's ``_create_cp_block_mask`` is not used: it turns a local query index into a global one by assuming
  contiguous shards or its own load balancer's permutation (one for the whole batch, not handle's head-tail order
  per document and per row), and refuses a local length that is not a multiple of 128 (``Q_LEN`` divisible by
  cp × 128); looking positions up needs neither, so any shard order, any documents and any T/cp work.
* **The kernel** is ``flex_attention`` with ``enable_gqa=True`` (query head h reads K/V head h // (H / H_kv), as
  ``repeat_kv``). On CUDA both ``flex_attention`` and ``create_block_mask`` are compiled (``torch.compile``, as
  torchtitan's ``models/attention.py`` does: the fused kernel, its backward, and a block mask that never
  materialises T/cp × T booleans); elsewhere they run eagerly, which computes the forward (the whole score matrix
  at once) but has no backward: torch 2.13 raises "FlexAttention does not support backward on CPU" as soon as an
  input needs a gradient. So ``handle validate`` refuses ``native`` without CUDA
  (:mod:`torch_handle.config.context_parallel`).

**Cost.** One all-gather of K and V per layer in forward, a reduce-scatter of dK/dV in backward, like the
hand-written all-gather; but ``flex_attention`` saves the *gathered* K and V for its backward, so every layer holds
cp × its K/V shards (``2 · B · H_kv · T · D`` values) from forward to backward, where the hand-written all-gather
keeps its shards and gathers again. The gathered positions and documents (two (B, T) long tensors) and the block
mask (O(B · T/cp · T / 128²)) are made once per micro-batch and reused by every layer (:data:`_LAST`). The forward's all-gathers are counted in
:data:`~torch_handle.parallel.context.comms.STATS`; the backward's reduce-scatter runs inside torch's autograd and
is not.

Sources: PyTorch's ``torch/distributed/tensor/experimental/_context_parallel/_attention.py`` (``_ContextParallel``,
``_create_cp_block_mask``) and ``_cp_custom_ops.py``; the FlexAttention docs and blog ("FlexAttention: the
flexibility of PyTorch with the performance of FlashAttention", 2024: document masking by a ``mask_mod`` over
document ids); torchtitan's ``apply_cp``.

Shape letters: B batch, H query heads, H_kv key/value heads, T/cp the local shard, T = cp · T/cp, D channels.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torch_handle.parallel.context.blocks import Tokens
from torch_handle.parallel.context.comms import STATS

_KERNELS: dict[str, tuple[Any, Any]] = {}
"""device type -> (flex_attention, create_block_mask): compiled on CUDA, eager elsewhere."""
_MODULES: dict[tuple[str, str], nn.Module] = {}
"""(process group name, device type) -> the :class:`_FlexAttention` that ``_ContextParallel(FLEX)`` hooks."""
_LAST: list[Any] = [None, None]
"""[(the local positions, documents, group, causal, B, T/cp) of the last call, its block mask]: every layer of a
micro-batch attends the same tokens (the CP share passes the same tensors), so the gather of positions and documents
and the block mask are made once per micro-batch, as torchtitan builds its block mask once per batch."""


def _kernels(device_type: str) -> tuple[Any, Any]:
    """(flex_attention, create_block_mask) for ``device_type``: ``torch.compile``'d on CUDA (the fused kernel and its
    backward), eager on the CPU (a forward only)."""
    if device_type not in _KERNELS:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if device_type == "cuda":
            flex_attention, create_block_mask = torch.compile(flex_attention), torch.compile(create_block_mask)
        _KERNELS[device_type] = flex_attention, create_block_mask
    return _KERNELS[device_type]


class _FlexAttention(nn.Module):
    """``flex_attention`` as a module, so that ``_ContextParallel(FLEX)``'s pre-hook can gather its key and value
    (torchtitan's ``inner_attention``). q (B, H, T/cp, D); k, v (B, H_kv, T, D) once gathered -> (B, H, T/cp, D).
    ``sent`` and ``started`` are the call's local K/V and the host time before the gather, for :func:`_counted`."""

    sent: tuple[Tensor, ...] = ()
    started = 0.0

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, block_mask: Any, scale: float | None) -> Tensor:
        flex_attention, _ = _kernels(q.device.type)
        with warnings.catch_warnings():  # eager off CUDA on purpose: the forward is the point there
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def _context_parallel_flex(group: dist.ProcessGroup, device_type: str) -> nn.Module:
    """The :class:`_FlexAttention` of ``group``, context-parallel by torch's ``_ContextParallel(FLEX)`` on a
    one-dimensional ``DeviceMesh`` of the group (made once per group and device type)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental._attention import _ContextParallel
    from torch.distributed.tensor.parallel import parallelize_module

    key = (dist.distributed_c10d._get_process_group_name(group), device_type)
    if key not in _MODULES:
        mesh = DeviceMesh.from_group(group, device_type)
        style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)
        module = parallelize_module(_FlexAttention(), mesh, style)
        module.register_forward_pre_hook(_counted)  # after torch's: the gather is done when it runs
        _MODULES[key] = module
    return _MODULES[key]


def _counted(module: _FlexAttention, args: Any) -> None:
    """Count the K/V all-gather ``_ContextParallel``'s pre-hook just made in :data:`STATS`."""
    STATS.add(module.sent, time.perf_counter() - module.started)


def _gathered(queries: Tokens, group: dist.ProcessGroup) -> Tokens:
    """Every rank's tokens in rank order, (B, T), by torch's ``flex_cp_allgather`` (the op that gathers K and V):
    the gathered keys' positions and documents."""
    from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import flex_cp_allgather

    documents = queries.documents
    with torch.no_grad():
        positions, gathered = flex_cp_allgather(queries.positions.contiguous(),
                                                (queries.positions if documents is None else documents).contiguous(),
                                                1, dist.distributed_c10d._get_process_group_name(group))
    return Tokens(positions, None if documents is None else gathered)


def _mask_mod(queries: Tokens, keys: Tokens, causal: bool) -> Any:
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)``: True where local query q_idx may attend gathered key
    kv_idx (same document and, when ``causal``, ``k_position <= q_position``); None when all keys are visible."""
    q_pos, k_pos, q_doc, k_doc = queries.positions, keys.positions, queries.documents, keys.documents
    if not causal and q_doc is None:
        return None

    def visible(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        past = k_pos[b, kv_idx] <= q_pos[b, q_idx] if causal else None
        if q_doc is None:
            return past
        same = q_doc[b, q_idx] == k_doc[b, kv_idx]
        return same if past is None else past & same

    return visible


def native_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, group: dist.ProcessGroup | None = None,
                     *, document_ids: Tensor | None = None, causal: bool = True,
                     scale: float | None = None) -> Tensor:
    """Attention of this rank's queries to the keys of every rank of ``group`` by torch's FlexAttention context
    parallelism (see the module): K/V gathered by ``_ContextParallel(FLEX)``, the mask from the true positions and
    documents, ``flex_attention``'s kernel.

    Args:
        q: (B, H, T/cp, D) after RoPE; k, v: (B, H_kv, T/cp, D), H_kv dividing H.
        positions: (B, T/cp) long, the local tokens' positions (in the whole sequence or in their document) in
            whatever order the shard holds them (head-tail or contiguous).
        group: the cp process group (None: the default group).
        document_ids: (B, T/cp) long, the local tokens' documents; None for one document per row.
        causal: mask the future (True), or attend every key of the same document.
        scale: the scores' scale, 1/√D unless given.

    Returns:
        (B, H, T/cp, D) in q's dtype: this rank's rows of the whole sequence's attention. Differentiable in q, k and
        v through torch's own backward (``flex_attention``'s, then ``flex_cp_allgather``'s reduce-scatter of dK/dV),
        which needs CUDA.

    Raises:
        NotImplementedError: from torch off CUDA when q, k or v needs a gradient ("FlexAttention does not support
            backward on CPU"); under ``torch.no_grad`` with inputs that need none, the CPU computes the forward.
    """
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    key, (last, block_mask) = (positions, document_ids, group, causal, q.shape[0], q.shape[2]), _LAST
    if last is None or any(a is not b for a, b in zip(key[:3], last[:3])) or key[3:] != last[3:]:
        queries, start = Tokens(positions, document_ids), time.perf_counter()
        keys = _gathered(queries, group)
        STATS.add((positions,) if document_ids is None else (positions, document_ids), time.perf_counter() - start)
        _, create_block_mask = _kernels(q.device.type)
        mask_mod = _mask_mod(queries, keys, causal)
        block_mask = None if mask_mod is None else create_block_mask(
            mask_mod, q.shape[0], None, q.shape[2], len(keys), device=q.device)
        _LAST[:] = key, block_mask
    attention = _context_parallel_flex(group, q.device.type)
    attention.sent, attention.started = (k, v), time.perf_counter()
    return attention(q, k, v, block_mask=block_mask, scale=scale)
