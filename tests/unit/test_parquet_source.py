"""A Parquet corpus: one row of the column is one document, read in record batches (pyarrow); the shards decode
to the rows, each ended by <eos>, and the other columns are not read."""

from __future__ import annotations

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def test_a_parquet_column_prepares_into_one_document_a_row(tmp_path) -> None:
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer

    from torch_handle.data.prepare import prepare
    from torch_handle.data.shards import open_prepared

    rows = [topics[k] for k in sorted(topics)[:40]]
    # small row groups: the reader walks several record batches
    pq.write_table(pa.table({"content": rows, "n": list(range(len(rows)))}), tmp_path / "t.parquet",
                   row_group_size=7)
    out = tmp_path / "out"
    prepare([str(tmp_path / "t.parquet")], out, column="content", vocab_size=600, valid_fraction=0.0, workers=0)
    data = open_prepared(out)
    tok = Tokenizer.from_file(str(data.tokenizer_path))
    eos = data.meta["tokenizer"]["eos_id"]
    ids = data.train.window(0, data.train.n_tokens)
    assert data.train.n_documents == len(rows) and int(np.sum(ids == eos)) == len(rows)
    ends = np.flatnonzero(ids == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    assert [tok.decode(ids[s:e].tolist()) for s, e in zip(starts, ends)] == rows
