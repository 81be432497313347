"""A slow key-count that checks its own input order: each record carries ``seq``, its rank
among its key's records in the source's stream (the generator's), so a record lost, applied
twice or out of order shows as ``out_of_order`` > 0 in the output."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa

import raystream as rs


def ordered_count(cost_s: float) -> Any:
    """The count step (named ``count``), sleeping ``cost_s`` per record."""

    @rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
    def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
        time.sleep(len(batch) * cost_s)
        seen = state.get(batch.keys)
        counts = batch.counts
        rank = np.arange(len(batch)) - np.repeat(batch.offsets[:-1], counts)
        expected = np.repeat(seen, counts) + rank
        seq = batch.records.column("seq").to_numpy()
        bad = np.add.reduceat((seq != expected).astype(np.int64), batch.offsets[:-1])
        new = seen + counts
        state.put(batch.keys, new)
        return batch.output({"count": new, "out_of_order": bad})

    return count
