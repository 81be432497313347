"""Record batches on the wire: a slice is sent as its rows, any batch comes back equal."""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pytest

from raystream.runtime.wire import from_wire, to_wire


def _batch(n: int = 100_000) -> pa.RecordBatch:
    return pa.record_batch(
        {
            "key": pa.array(np.arange(n)),
            "name": pa.array([f"k{i}" for i in range(n)]),
            "cat": pa.array(["a", "b", None, "c"] * (n // 4)).dictionary_encode(),
            "tags": pa.array([[i, i + 1] for i in range(n)], pa.list_(pa.int64())),
            "maybe": pa.array([None if i % 7 == 0 else float(i) for i in range(n)]),
        }
    ).replace_schema_metadata({"raystream.handover": "17"})


@pytest.mark.parametrize(
    ("offset", "length"),
    [(0, 100_000), (10, 5), (0, 60_000), (99_990, 10), (3, 1), (5, 0), (0, 0), (40_001, 20_003)],
)
def test_every_batch_comes_back_equal_with_its_schema(offset: int, length: int) -> None:
    batch = _batch().slice(offset, length)
    back = from_wire(pickle.loads(pickle.dumps(to_wire(batch), protocol=5)))
    assert isinstance(back, pa.RecordBatch)
    assert back.schema.equals(batch.schema, check_metadata=True)
    assert back.num_rows == length
    assert back.equals(batch)


def test_a_slice_is_sent_as_its_rows_not_its_parents_buffers() -> None:
    batch = _batch()
    piece = batch.slice(50_000, 100)
    assert len(pickle.dumps(piece, protocol=5)) > 0.9 * batch.get_total_buffer_size()  # pyarrow
    sent = len(pickle.dumps(to_wire(piece), protocol=5))
    assert sent < 4 * piece.nbytes + 4096, (sent, piece.nbytes)
    # a whole batch goes as its columns, no bigger than pyarrow's own pickle
    whole = len(pickle.dumps(to_wire(batch), protocol=5))
    assert whole <= len(pickle.dumps(batch, protocol=5)) + 1024
