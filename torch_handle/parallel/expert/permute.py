"""The permutation between the all-to-all's row order and the experts' order (shared by both implementations).

After the dispatch all-to-all a rank holds the rows of its L = E/ep local experts from every EP rank, in the order
the collective delivers them: grouped by source rank, and within a source by local expert (each rank sorted its
rows by expert before sending: ``moe.dispatch``). The experts' grouped matmul needs them grouped by local expert
(each expert one contiguous run), so they are regrouped -- source-major to expert-major -- before the experts and
put back after them, before the combine all-to-all returns them (torchtitan's ``_permute`` / ``_unpermute``;
Megatron-Core's ``sort_chunks_by_idxs``).

Shape letters: ep ranks, L local experts, R rows received (the sum of the counts).
"""

from __future__ import annotations

import torch
from torch import Tensor


def source_to_expert_order(counts: Tensor) -> Tensor:
    """The gather index that regroups received rows from source-major to expert-major order.

    Args:
        counts: (ep, L) int64, rows received from source rank s for local expert e (the exchanged counts).

    Returns:
        (R,) int64 ``index``: ``rows[index]`` lists local expert 0's rows (from source 0, then 1, ...), then expert
        1's, and so on; within a source and expert the rows keep their order. No host synchronisation.
    """
    ep, n_local = counts.shape
    arrival_start = (counts.flatten().cumsum(0) - counts.flatten()).view(ep, n_local)  # where chunk (s, e) begins
    chunk_rows = counts.t().flatten()  # (L·ep,): chunks in the target order (e, s)
    chunk_start = arrival_start.t().flatten()
    total = int(counts.sum())  # the host read the split sizes need anyway
    chunk = torch.repeat_interleave(torch.arange(chunk_rows.numel(), device=counts.device), chunk_rows,
                                    output_size=total)  # (R,): each target row's chunk
    within = torch.arange(total, device=counts.device) - (chunk_rows.cumsum(0) - chunk_rows)[chunk]
    return chunk_start[chunk] + within


def inverse(index: Tensor) -> Tensor:
    """The inverse permutation of ``index`` (R,): ``x[index][inverse(index)]`` is ``x``."""
    out = torch.empty_like(index)
    out[index] = torch.arange(index.numel(), device=index.device)
    return out
