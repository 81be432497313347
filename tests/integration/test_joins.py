"""Interval, window and regular joins of two sources on Ray at parallelism 3, against DuckDB SQL
joins over the same rows (parallelism 1 runs in-process: tests/unit/test_joins_local.py)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from raystream.operators import joins

import raystream as rs
from tests.integration._helpers import NOT_SCALED_OUT
from tests.integration._window_helpers import (
    OUT_OF_ORDERNESS_MS,
    equi_join_oracle,
    events,
    interval_oracle,
    window_join_oracle,
    window_rows,
)

N = 12_000
RUNTIME = {"linger_ms": 5.0, "source_batch_rows": 1_000, **NOT_SCALED_OUT}


def _run(name: str, op: Any, parallelism: int, left: pa.Table, right: pa.Table) -> pa.Table:
    flow = rs.Dataflow(name, num_key_groups=32, sub_groups=4)

    def source(t: pa.Table, side: str) -> rs.Stream:
        return flow.source(
            rs.sources.from_table(t, rate_eps=20_000),
            name=side,
            event_time="ts",
            max_out_of_orderness_ms=OUT_OF_ORDERNESS_MS,
        ).key_by("k")

    source(left, "left").connect(source(right, "right")).apply(op, name="join").sink(
        rs.sinks.collect(), name="out"
    )
    result = rs.run(flow, parallelism={"join": parallelism}, timeout_s=240, **RUNTIME)
    assert result.state == "finished"
    return result.table("out")


@pytest.mark.parametrize("parallelism", [3])
def test_interval_join_equals_duckdb(parallelism: int) -> None:
    left, right = events(N, keys=400, seed=4), events(N, keys=400, seed=5)
    out = _run(f"ijoin-p{parallelism}", joins.interval_join(-300, 200), parallelism, left, right)
    got = window_rows(out, "id_left", "id_right")
    expected = interval_oracle(left, right, -300, 200)
    assert len(expected) > 1000
    assert got == expected
    assert out.column_names[0] == "k"
    assert (out["event_time"].to_numpy() >= out["ts_left"].to_numpy()).all()


@pytest.mark.parametrize("parallelism", [3])
def test_window_join_equals_duckdb(parallelism: int) -> None:
    left, right = events(N, keys=600, seed=6), events(N // 2, keys=600, seed=7)
    out = _run(f"wjoin-p{parallelism}", joins.window_join(1_000), parallelism, left, right)
    got = window_rows(out, "id_left", "id_right", "window_start")
    expected = window_join_oracle(left, right, 1_000)
    assert len(expected) > 1000
    assert got == expected


@pytest.mark.parametrize("parallelism", [3])
def test_regular_join_equals_duckdb(parallelism: int) -> None:
    left, right = events(N // 4, keys=800, seed=8), events(N // 4, keys=800, seed=9)
    out = _run(f"join-p{parallelism}", joins.join(), parallelism, left, right)
    got = window_rows(out, "id_left", "id_right")
    expected = equi_join_oracle(left, right)
    assert len(expected) > 1000
    assert got == expected, "every matching pair exactly once"


def test_latest_join_is_an_upsert_table_per_key() -> None:
    """keep='latest': per key the last emitted row joins the last left and last right record
    (the one each source sent last), as DuckDB computes with row numbers."""
    left, right = events(3_000, keys=150, seed=10), events(3_000, keys=150, seed=11)
    out = _run("join-latest", joins.join(keep="latest"), 2, left, right)
    # rows of one key reach the sink in order (one join instance per key, one sink)
    last: dict[Any, tuple[int, int]] = {}
    for k, a, b in zip(
        out["k"].to_pylist(), out["id_left"].to_pylist(), out["id_right"].to_pylist(), strict=True
    ):
        last[k] = (a, b)
    from tests.integration._window_helpers import sql

    expected = sql(
        """SELECT a.k, a.id, b.id FROM
             (SELECT k, max(id) AS id FROM a GROUP BY k) a
             JOIN (SELECT k, max(id) AS id FROM b GROUP BY k) b ON a.k = b.k""",
        a=left,
        b=right,
    )
    assert last == {k: (a, b) for k, a, b in expected}
