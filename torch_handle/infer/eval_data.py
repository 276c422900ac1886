"""``handle eval RUN --data DIR``: a run's model scored on any prepared token directory (``handle data prepare``).

The directory must hold the run's tokenizer (the same ``tokenizer.json`` bytes, by SHA-256): other ids would
score nonsense. Samples are the windows the ``tokens`` dataset builds (:class:`~torch_handle.data.datasets
.TokenWindows`) at the run's ``data.seq_len``, with ``position_ids`` when the run masks documents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch_handle.common.names import TOKENIZER_FILE
from torch_handle.data.datasets import TokenWindows
from torch_handle.data.shards import file_sha256, open_prepared, tokenizer_problem
from torch_handle.errors import DataError


def prepared_split(run_dir: Path, preset: Any, max_len: int, directory: Path, split: str) -> TokenWindows:
    """The ``split`` (``train`` or ``valid``) of the prepared ``directory`` as windows of the run's seq_len
    (at most ``max_len``, the model's positions).

    Raises:
        DataError: not a prepared directory (see :func:`~torch_handle.data.shards.open_prepared`), prepared with
            another tokenizer than the run's, or a split too short for one window.
    """
    prepared = open_prepared(Path(directory))
    ours = Path(run_dir) / TOKENIZER_FILE
    if problem := tokenizer_problem(f"{directory} was prepared with", prepared.identity().tokenizer_sha256,
                                    file_sha256(ours), f"the run's ({ours})",
                                    f"prepare it with: handle data prepare ... --tokenizer {run_dir}"):
        raise DataError(problem)
    options = preset.data.options
    seq_len = min(int(getattr(options, "seq_len", max_len) or max_len), max_len)
    return TokenWindows(getattr(prepared, split), seq_len, document_mask=bool(getattr(options, "document_mask", False)),
                        name=f"{directory} ({split} split)")
