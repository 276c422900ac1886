"""The model's profiler ranges: its structure, named in a ``torch.profiler`` trace.

``decoder.layer<i>`` / ``encoder.layer<i>`` around each block's forward (``transformer.py``), and ``attention`` /
``cross_attention`` / ``feed_forward`` around each sub-layer inside it (``layers.py``); under activation
checkpointing the sub-layer ranges also mark the recomputation in backward. Kept apart from both files because
they are a view of the model, not a part of it (``handle profile`` reads them; ``observe/profile_summary.py``).
"""

from __future__ import annotations

import contextlib

import torch


def record_range(name: str) -> contextlib.AbstractContextManager:
    """A ``torch.profiler.record_function(name)`` range while a profiler records, else a no-op context.

    ``torch.autograd._profiler_enabled()`` (a C++ flag, true while any ``torch.profiler`` records) guards it: an
    unguarded range costs microseconds per call even with no profiler, a guarded one about as much as a plain
    no-op context.

    Under ``torch.compile`` (``torch.compiler.is_compiling()``, a constant while Dynamo traces) it is always the
    no-op: ``_profiler_enabled()`` returns a bool Dynamo cannot put in a graph, so calling it there breaks the graph
    (and every break splits a block into separate graphs and frames, each guarded and recompiled apart). A compiled
    block's sub-layer ranges are therefore absent from a trace (Inductor fuses across them anyway); the per-block
    ranges, which ``transformer.py`` opens outside the compiled blocks, stay.
    """
    if not torch.compiler.is_compiling() and torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
