"""The records an old instance hands over at a move's seal travel as few compact batches (no Ray).

When the move barrier overtakes a batch the old instance is working through, the rest of it is
cut into one piece per sub-group (``MigrationEngine.hold_back``). Each piece is a slice of that
batch, and pickling a slice writes its whole parent buffers: hundreds of pieces went as hundreds
of copies of the batch. Packed, the answer holds the rows once; unpacked, every sub-group gets
its pieces back, in order, with the same rows.
"""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa

from raystream.runtime.migration import MigrationEngine, MigrationTask
from raystream.runtime.move_files import FILES_POLICY, pack_records, unpack_records

ROWS = 1_200
SUB_GROUPS = 300


def _batch(rows: int, start: int) -> pa.RecordBatch:
    keys = np.arange(start, start + rows)
    return pa.RecordBatch.from_arrays(
        [pa.array(keys), pa.array([b"%04d" % k + b"x" * 996 for k in keys], pa.binary())],
        names=["key", "value"],
    )


def test_handed_over_records_are_packed_once_and_come_back_per_sub_group_in_order() -> None:
    engine = MigrationEngine(None, SUB_GROUPS // 4, 4, range(SUB_GROUPS // 4))
    engine.task = MigrationTask(1, FILES_POLICY, {}, set(range(SUB_GROUPS)))
    # two overtaken batches (the engine cuts them per sub-group, as at a seal)
    batches = [_batch(ROWS, 0), _batch(ROWS // 2, ROWS)]
    rng = np.random.default_rng(4)
    for b in batches:
        assert engine.hold_back(b, rng.integers(0, SUB_GROUPS, b.num_rows)) is None
    pieces = engine.handover
    assert sum(len(ps) for ps in pieces.values()) > SUB_GROUPS  # hundreds of slices

    packed = pack_records(pieces)
    rows_bytes = sum(b.nbytes for b in batches)
    sliced = len(pickle.dumps(dict(pieces), protocol=5))
    size = len(pickle.dumps(packed, protocol=5))
    assert sliced > 50 * rows_bytes  # the slices carry their parents' buffers
    assert size < 1.5 * rows_bytes, f"packed records pickle to {size} bytes for {rows_bytes}"

    back = unpack_records(pickle.loads(pickle.dumps(packed, protocol=5)))
    assert list(back) == list(pieces)  # the sub-groups in the order handed over
    for g, ps in pieces.items():
        got = back[g]
        assert [p.num_rows for p in got] == [p.num_rows for p in ps]
        for a, b in zip(got, ps, strict=True):
            assert a.equals(b)
    assert sum(p.num_rows for ps in back.values() for p in ps) == ROWS + ROWS // 2


def test_pieces_of_different_schemas_keep_theirs() -> None:
    a = _batch(10, 0)
    b = pa.RecordBatch.from_arrays([pa.array(["k1", "k2"])], names=["key"])
    back = unpack_records(pack_records({3: [a.slice(0, 4), b], 5: [a.slice(4, 6)]}))
    assert [p.schema.names for p in back[3]] == [["key", "value"], ["key"]]
    assert back[3][0].equals(a.slice(0, 4)) and back[3][1].equals(b)
    assert back[5][0].equals(a.slice(4, 6))
    assert unpack_records(pack_records({})) == {}
