"""Allowed lateness on Ray: late-but-allowed records update a fired window (the sink receives
the update), records after the window closed go to the side output "late".

Lateness is made deterministic by the in-band order on each channel (one source instance,
batches of 100 rows): a block far ahead in time moves the watermark before the next block."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import raystream.operators as ops
from raystream.operators import windows

import raystream as rs
from tests.integration._helpers import NOT_SCALED_OUT
from tests.integration._window_helpers import sql

KEYS = 5


def _block(start: int, stop: int, first_id: int) -> pa.RecordBatch:
    """100 rows from ``start`` to ``stop`` (one source batch each: source_batch_rows=100)."""
    t = np.linspace(start, stop, 100, endpoint=False).astype(np.int64)
    return pa.record_batch(
        {
            "k": [f"k{i % KEYS}" for i in range(len(t))],
            "ts": t,
            "x": (t // 10) % 7,
            "id": np.arange(first_id, first_id + len(t), dtype=np.int64),
        }
    )


def test_allowed_lateness_updates_then_closes() -> None:
    blocks = [
        _block(1_000, 2_000, 0),  # on time: windows [1000, 2000) per key
        _block(5_000, 6_000, 1_000),  # watermark 5989: [1000, 2000) fires
        _block(1_100, 1_200, 2_000),  # late but allowed (closes at 1999 + 4500): an update
        _block(9_000, 10_000, 3_000),  # watermark 9989: [1000, 2000) closed
        _block(1_200, 1_300, 4_000),  # late: to the side output
    ]
    flow = rs.Dataflow("lateness", num_key_groups=16, sub_groups=2)
    counted = (
        flow.source(rs.sources.from_table(blocks), event_time="ts")
        .key_by("k")
        .apply(windows.tumbling(1_000, [ops.count(), ops.sum("x")], allowed_lateness_ms=4_500))
    )
    counted.sink(rs.sinks.collect(), name="out")
    counted.side_output("late").sink(rs.sinks.collect(), name="late")
    result = rs.run(
        flow, parallelism={"tumbling_window": 2}, timeout_s=120,
        source_batch_rows=100,
        linger_ms=1,
        **NOT_SCALED_OUT,
    )
    out, late = result.table("out"), result.table("late")
    assert sorted(late["id"].to_pylist()) == blocks[4].column("id").to_pylist()
    assert set(late["window_start"].to_pylist()) == {1_000}

    assert all(b.num_rows == 100 for b in blocks)
    on_time = pa.Table.from_batches(blocks[:4])
    expected = sql(
        "SELECT k, (ts // 1000) * 1000 AS ws, count(*), sum(x) FROM ev GROUP BY k, ws", ev=on_time
    )
    last: dict[tuple[Any, int], tuple[int, int]] = {}
    emitted: dict[tuple[Any, int], int] = {}
    for r in out.to_pylist():  # per key in the order its instance sent them
        kw = (r["k"], r["window_start"])
        last[kw] = (r["count"], r["x_sum"])
        emitted[kw] = emitted.get(kw, 0) + 1
    assert last == {(k, ws): (n, s) for k, ws, n, s in expected}
    assert all(emitted[(f"k{i}", 1_000)] == 2 for i in range(KEYS)), "fired, then updated"
    assert all(n == 1 for kw, n in emitted.items() if kw[1] != 1_000)
