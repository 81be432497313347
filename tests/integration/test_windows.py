"""Tumbling, sliding and session windows on Ray, at parallelism 3 (one instance runs in the
unit tests, through run_local), against DuckDB SQL over
the same input; the sources emit watermarks from an out-of-order time column."""

from __future__ import annotations

from typing import Any

import pytest
import raystream.operators as ops
from raystream.operators import windows

import raystream as rs
from tests.integration._helpers import NOT_SCALED_OUT
from tests.integration._window_helpers import (
    OUT_OF_ORDERNESS_MS,
    events,
    session_oracle,
    sliding_oracle,
    tumbling_oracle,
    window_rows,
)

N = 30_000
RUNTIME = {"linger_ms": 5.0, "source_batch_rows": 2_000, **NOT_SCALED_OUT}
AGG = [ops.count(), ops.sum("x"), ops.max("x")]


def _run(name: str, op: Any, parallelism: int, table: Any) -> Any:
    flow = rs.Dataflow(name, num_key_groups=32, sub_groups=4)
    (
        flow.source(
            rs.sources.from_table(table, rate_eps=60_000),
            event_time="ts",
            max_out_of_orderness_ms=OUT_OF_ORDERNESS_MS,
        )
        .key_by("k")
        .apply(op, name="window")
        .sink(rs.sinks.collect(), name="out")
    )
    result = rs.run(flow, parallelism={"window": parallelism}, timeout_s=240, **RUNTIME)
    assert result.state == "finished"
    return result.table("out")


@pytest.mark.parametrize("parallelism", [3])
def test_tumbling_equals_duckdb(parallelism: int) -> None:
    table = events(N, keys=200, seed=1)
    out = _run(f"tumbling-p{parallelism}", windows.tumbling(1_000, AGG), parallelism, table)
    got = window_rows(out, "k", "window_start", "count", "x_sum", "x_max")
    assert got == tumbling_oracle(table, 1_000)
    assert (out["window_end"].to_numpy() - out["window_start"].to_numpy() == 1_000).all()


@pytest.mark.parametrize("parallelism", [3])
def test_sliding_equals_duckdb(parallelism: int) -> None:
    table = events(N, keys=100, seed=2)
    op = windows.sliding(2_000, 500, AGG)
    out = _run(f"sliding-p{parallelism}", op, parallelism, table)
    got = window_rows(out, "k", "window_start", "count", "x_sum", "x_max")
    assert got == sliding_oracle(table, 2_000, 500)


@pytest.mark.parametrize("parallelism", [3])
def test_session_equals_duckdb(parallelism: int) -> None:
    table = events(N, keys=300, seed=3)  # ~1.5 s between a key's records on average
    out = _run(f"session-p{parallelism}", windows.session(1_500, AGG), parallelism, table)
    got = window_rows(out, "k", "window_start", "window_end", "count", "x_sum", "x_max")
    expected = session_oracle(table, 1_500)
    assert got == expected
    assert max(r[3] for r in expected) > 3, "sessions must span several records"
