"""Interval, window and regular joins of two sources at parallelism 1, run in-process
(``run_local``: the same instances, channels, watermarks and RocksDB state as on Ray), against
the DuckDB SQL joins the Ray tests use (``tests/integration/test_joins.py`` runs them at 3)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pyarrow as pa
from raystream.operators import joins

import raystream as rs
from raystream.runtime.instance import RuntimeConfig
from raystream.runtime.local import run_local
from tests.integration._window_helpers import (
    OUT_OF_ORDERNESS_MS,
    equi_join_oracle,
    events,
    interval_oracle,
    window_join_oracle,
    window_rows,
)

N = 12_000


def _run(tmp: Path, op: Any, left: pa.Table, right: pa.Table) -> pa.Table:
    flow = rs.Dataflow("join-local", num_key_groups=32, sub_groups=4)

    def source(t: pa.Table, side: str) -> rs.Stream:
        return flow.source(
            rs.sources.from_table(t),
            name=side,
            event_time="ts",
            max_out_of_orderness_ms=OUT_OF_ORDERNESS_MS,
        ).key_by("k")

    source(left, "left").connect(source(right, "right")).apply(op, name="join").sink(
        rs.sinks.collect(), name="out"
    )
    cfg = RuntimeConfig(linger_ms=5.0, source_batch_rows=1_000)
    out = asyncio.run(run_local(flow, {"join": 1}, state_dir=tmp, config=cfg))["out"]
    assert out is not None
    return out


def test_interval_join_at_parallelism_1_equals_duckdb(tmp_path: Path) -> None:
    left, right = events(N, keys=400, seed=4), events(N, keys=400, seed=5)
    out = _run(tmp_path, joins.interval_join(-300, 200), left, right)
    expected = interval_oracle(left, right, -300, 200)
    assert len(expected) > 1000
    assert window_rows(out, "id_left", "id_right") == expected


def test_window_join_at_parallelism_1_equals_duckdb(tmp_path: Path) -> None:
    left, right = events(N, keys=600, seed=6), events(N // 2, keys=600, seed=7)
    out = _run(tmp_path, joins.window_join(1_000), left, right)
    expected = window_join_oracle(left, right, 1_000)
    assert len(expected) > 1000
    assert window_rows(out, "id_left", "id_right", "window_start") == expected


def test_regular_join_at_parallelism_1_equals_duckdb(tmp_path: Path) -> None:
    left, right = events(N // 4, keys=800, seed=8), events(N // 4, keys=800, seed=9)
    out = _run(tmp_path, joins.join(), left, right)
    expected = equi_join_oracle(left, right)
    assert len(expected) > 1000
    assert window_rows(out, "id_left", "id_right") == expected, "every matching pair once"
