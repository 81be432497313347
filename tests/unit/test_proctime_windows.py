"""Processing-time windows (raystream.operators.proctime) on a real keyed processor (RocksDB
state and timers, no Ray) with an injected processing clock: the harness moves the clock, the
exact per-window results are checked against DuckDB over the processing time at which each
record was fed."""

from __future__ import annotations

from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from raystream.operators import count, proctime, sum
from raystream.operators.proctime_logic import ProcessingTimeWindows

from raystream.errors import DataflowDefinitionError
from raystream.testing import KeyedStepHarness

T0 = 1_700_000_000_123  # ms since the epoch, not aligned to any window


class FakeClock:
    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def _drive(
    op_of: Any, seed: int, batches: int, key_type: str = "int"
) -> tuple[pa.Table, pa.Table, pa.Table, KeyedStepHarness]:
    """Feed random batches at a random, advancing processing clock, moving the harness's
    timers along; returns (every record with the time it was fed, rows fired by timers, rows
    fired at the end of input, the harness)."""
    rng = np.random.default_rng(seed)
    clock = FakeClock(T0)
    h = KeyedStepHarness(op_of(clock), key="bidder")
    fed: list[pa.Table] = []
    for _ in range(batches):
        clock.now += int(rng.integers(0, 4_000))
        if rng.random() < 0.5:  # the timers due by now fire (not every batch: late firings)
            h.advance_processing_time(clock.now)
        n = int(rng.integers(1, 60))
        bidder = rng.integers(0, 12, n)
        keys: Any = bidder if key_type == "int" else [f"b{b}" for b in bidder.tolist()]
        batch = pa.table({"bidder": keys, "x": rng.integers(0, 100, n)})
        h.process(batch)
        fed.append(batch.append_column("p", pa.array(np.full(n, clock.now, np.int64))))
    by_timers = h.output
    at_end = h.end_of_input()
    return pa.concat_tables(fed), by_timers, at_end, h


def _rows(con: duckdb.DuckDBPyConnection, sql: str) -> list[tuple[Any, ...]]:
    return sorted(con.sql(sql).fetchall())


@pytest.mark.parametrize("key_type", ["int", "str"])
def test_tumbling_counts_equal_duckdb_over_the_recorded_processing_times(key_type: str) -> None:
    fed, by_timers, at_end, h = _drive(
        lambda c: proctime.tumbling(10_000, [count(), sum("x")], clock=c), 7, 150, key_type
    )
    with h:
        con = duckdb.connect()
        con.register("fed", fed)
        con.register("fired", pa.concat_tables([by_timers, at_end]))
        con.register("by_timers", by_timers)
        con.register("at_end", at_end)
        want = _rows(
            con,
            "SELECT bidder, p - p % 10000, p - p % 10000 + 10000, count(*), sum(x) "
            "FROM fed GROUP BY ALL",
        )
        got = _rows(con, "SELECT bidder, window_start, window_end, count, x_sum FROM fired")
        assert by_timers.num_rows > 0 and at_end.num_rows > 0
        assert got == want
        # a timer fires a window once the clock reached its end, never before
        early = "SELECT count(*) FROM by_timers WHERE fired_at < window_end"
        assert con.sql(early).fetchall() == [(0,)]
        # the end of input flushes the windows still open: at most one per key (its latest)
        assert (
            con.sql("SELECT count(*) FROM at_end GROUP BY bidder HAVING count(*) > 1").fetchall()
            == []
        )
        assert h.state_items() == {}
        assert h.pending_timers() == 0


def test_sliding_windows_equal_duckdb() -> None:
    fed, by_timers, at_end, h = _drive(
        lambda c: proctime.sliding(10_000, 4_000, count(), clock=c), 11, 120
    )
    with h:
        con = duckdb.connect()
        con.register("fed", fed)
        con.register("fired", pa.concat_tables([by_timers, at_end]))
        # every window [s, s + 10 s) with s a multiple of 4 s and s <= p < s + 10 s
        want = _rows(
            con,
            "SELECT bidder, s, s + 10000, count(*) FROM "
            "(SELECT bidder, p - p % 4000 - d AS s, p FROM fed, "
            " (SELECT unnest([0, 4000, 8000]) AS d)) WHERE p < s + 10000 GROUP BY ALL",
        )
        got = _rows(con, "SELECT bidder, window_start, window_end, count FROM fired")
        assert got == want
        assert (
            con.sql(
                "SELECT count(*) FROM fired GROUP BY bidder, window_start HAVING count(*) > 1"
            ).fetchall()
            == []
        )


def test_a_window_fires_when_the_clock_reaches_its_end() -> None:
    clock = FakeClock(12_345)
    with KeyedStepHarness(
        proctime.tumbling(10_000, count(), clock=clock), key="k", keep_event_time=True
    ) as h:
        assert h.process({"k": [1, 1, 2]}).num_rows == 0
        assert h.state(1) is not None  # the open window is keyed state
        clock.now = 19_999
        assert h.advance_processing_time(19_999).num_rows == 0
        clock.now = 19_999  # a batch run later in the same window joins it
        h.process({"k": [1]})
        clock.now = 20_000
        h.process({"k": [1]})  # the next window: the clock reached 20 s
        out = h.advance_processing_time(20_000).to_pylist()
        assert [
            (r["k"], r["window_start"], r["window_end"], r["count"], r["fired_at"]) for r in out
        ] == [
            (1, 10_000, 20_000, 3, 20_000),
            (2, 10_000, 20_000, 1, 20_000),
        ]
        assert out[0]["event_time"] == 19_999
        clock.now = 31_000
        assert h.advance_processing_time(31_000).to_pylist()[0]["window_start"] == 20_000
        assert h.state_items() == {} and h.pending_timers() == 0


def test_logic_assigns_by_the_batch_time_and_fires_per_key() -> None:
    from raystream.operators.aggregations import Rows

    logic = ProcessingTimeWindows.of(count(), size=1_000, slide=1_000, offset=100)
    rows = Rows(pa.RecordBatch.from_pydict({"x": [1, 2, 3]}))
    res = logic.on_batch(np.array([0, 1, 1]), 1_099, rows, [None, None])
    assert res.timer_ts.tolist() == [1_100, 1_100] and res.first.tolist() == [0, 1]
    again = logic.on_batch(
        np.array([1]), 1_100, Rows(pa.RecordBatch.from_pydict({"x": [4]})), [None, res.state[1]]
    )
    assert again.timer_key.tolist() == [1] and again.timer_ts.tolist() == [2_100]
    assert again.first.tolist() == []  # key 1 held a window already
    fired, left = logic.on_timer([None, again.state[1]], np.array([0, 1_100]))
    assert fired.start.tolist() == [100] and left[1] is not None
    assert logic.at_end(left).start.tolist() == [1_100]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: proctime.tumbling(0, count()), "size_ms .* > 0, got 0"),
        (lambda: proctime.tumbling(1.5, count()), "got 1.5"),
        (lambda: proctime.sliding(1_000, 2_000, count()), "slide_ms must be <= size_ms"),
        (lambda: proctime.sliding(1_000, -1, count()), "slide_ms .* got -1"),
        (lambda: proctime.tumbling(1_000, count(), clock=5), "clock must be a function"),
        (lambda: proctime.tumbling(1_000, count(), offset_ms="1"), "offset_ms must be an int"),
    ],
)
def test_bad_arguments_say_what_came(make: Any, match: str) -> None:
    with pytest.raises(DataflowDefinitionError, match=match):
        make()
