"""File and directory names that more than one layer reads: defined once here, at the bottom of the import graph.

* :data:`TOKENIZER_FILE`: the HF ``tokenizers`` JSON of a prepared token directory, a run directory, a
  ``handle export`` and a Hugging Face model directory alike.
* :data:`STEP_DIR`: a checkpoint's directory, ``checkpoints/step-N``.

Standard library only.
"""

from __future__ import annotations

import re

TOKENIZER_FILE = "tokenizer.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
"""``step-N``: group 1 is the optimizer step N the checkpoint was taken after."""


def step_of(name: str) -> int | None:
    """N of a ``step-N`` directory name, None for any other name."""
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else None
