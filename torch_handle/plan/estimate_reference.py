"""What a DPO preset's reference (``[finetune.preference] reference``) holds on a rank, for ``handle estimate``:

==============  ==============================================================================================
reference       bytes per rank
==============  ==============================================================================================
none            0 (a reference-free loss)
adapters_off    0: the policy's own base with its LoRA adapters switched off (no second copy)
copy            the model's parameters as the strategy holds the policy's (whole under single/ddp/ZeRO-1/2,
                1/dp under fsdp), and nothing else: no gradients, no optimizer state, no saved activations (its
                forward runs under ``no_grad``, before the policy's)
precomputed     the table: 16 bytes a pair of both splits (two float64 sums), on the device; no model
==============  ==============================================================================================

No torch import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TABLE_BYTES_PER_PAIR = 16
"""The precomputed table's bytes a pair: the chosen and the rejected sums in float64
(:data:`~torch_handle.train.objectives.pairs.REFERENCE_FILE`)."""


def prepared_pairs(preset: Any) -> int | None:
    """The pairs (training and validation) ``data.path``'s ``meta.json`` counts (``handle data prepare
    --preference``), or None when it is not prepared yet or not readable."""
    from torch_handle.data.shards import prepared_parts

    path = getattr(preset.data.options, "path", "")
    if not path:
        return None
    try:
        return sum(int(meta["chat"]["pairs"]) for _, meta in prepared_parts(Path(path)))
    except Exception:  # noqa: BLE001 - not prepared (yet), not pairs: the table is then priced at 0
        return None


def reference_bytes(preset: Any, param_bytes: int) -> tuple[str | None, int | None]:
    """(the reference a DPO preset keeps, its bytes on a rank whose policy holds ``param_bytes`` of parameters)
    ``(None, None)`` for another objective. A ``copy`` of a full fine-tune is priced as the policy's parameters (the
    copy is built in the policy parameters' dtype and sharded as they are); ``precomputed`` as its table."""
    finetune = preset.finetune
    if finetune.objective != "dpo":
        return None, None
    kind = finetune.preference.resolved(finetune.method)
    if kind == "copy":
        return kind, param_bytes
    if kind == "precomputed":
        return kind, (prepared_pairs(preset) or 0) * TABLE_BYTES_PER_PAIR
    return kind, 0
