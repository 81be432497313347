"""NEXMark q12 (bids per bidder per 10 s processing-time window) without Ray: its keyed step
with an injected processing clock against DuckDB's windows over the recorded processing times
(exact), the whole dataflow in one process against the checks of
``bench.nexmark.processing_time``, and each check failing on a result that breaks it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import raystream as rs
from raystream.runtime.local import run_local
from raystream.testing import KeyedStepHarness
from tests._bench import import_bench

gen = import_bench("bench.nexmark.generator")
oracle = import_bench("bench.nexmark.oracle")
queries = import_bench("bench.nexmark.queries")
q12 = import_bench("bench.nexmark.processing_time")


@pytest.fixture(scope="module")
def bids() -> pa.Table:
    return gen.generate(gen.NexmarkConfig(events=20_000, rate_eps=1_000, seed=5)).table("bid")


class FakeClock:
    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def test_windows_equal_duckdb_over_the_recorded_processing_times(bids: pa.Table) -> None:
    """The bids fed in batches at a stepping clock (timers moved along now and then): q12's
    rows equal q12's SQL with ``p_time`` = the time each bid was fed."""
    rng = np.random.default_rng(3)
    clock = FakeClock(1_700_000_003_217)
    fed = []
    with KeyedStepHarness(q12.q12_window(clock), key="bidder") as h:
        at = 0
        while at < bids.num_rows:
            n = int(rng.integers(1, 700))
            batch = bids.slice(at, n)
            at += n
            clock.now += int(rng.integers(0, 3_000))
            if rng.random() < 0.6:
                h.advance_processing_time(clock.now)
            h.process(batch)
            fed.append(pa.table({"bidder": batch["bidder"], "p": np.full(len(batch), clock.now)}))
        h.end_of_input()
        got = queries.final_result("q12", h.output)
    con = duckdb.connect()
    con.register("B", pa.concat_tables(fed))
    want = con.sql(
        "SELECT bidder, count(*) AS bid_count, p - p % 10000 AS starttime, "
        "p - p % 10000 + 10000 AS endtime FROM B GROUP BY ALL ORDER BY bidder, starttime"
    ).to_arrow_table()
    assert got.num_rows == want.num_rows > 100
    assert got.select(want.column_names).equals(want.cast(got.select(want.column_names).schema))
    checks = q12.check(got, {"bid": bids})
    assert checks["ok"], checks
    assert 0 < checks["flushed_at_end"] <= checks["bidders"]


def _run_local(bids: pa.Table, tmp: Path) -> pa.Table:
    flow, spec = queries.build_flow("q12", {"bid": rs.sources.from_table(bids)}, rs.sinks.collect())
    config = rs.RuntimeConfig(batch_rows=512, source_batch_rows=512)
    out = asyncio.run(run_local(flow, {spec.step: 2}, state_dir=str(tmp), config=config))
    return queries.final_result("q12", out[queries.SINK])


def test_the_dataflow_passes_the_checks(bids: pa.Table, tmp_path: Path) -> None:
    got = _run_local(bids, tmp_path)
    checks = q12.check(got, {"bid": bids})
    assert checks["ok"], checks
    assert checks["bids_counted"] == checks["bids"] == bids.num_rows


def _replace(table: pa.Table, name: str, values: Any) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, pa.array(values, pa.int64()))


def test_each_check_fails_on_a_result_that_breaks_it() -> None:
    bids = pa.table({"bidder": [1, 1, 1, 2]})
    good = pa.table(
        {
            "bidder": [1, 1, 2],
            "bid_count": [2, 1, 1],
            "starttime": [0, 10_000, 10_000],
            "endtime": [10_000, 20_000, 20_000],
            "fired_at": [10_005, 15_000, 15_000],  # the latest windows flushed at the end
        }
    )
    assert q12.check(good, {"bid": bids})["ok"]

    def broken(table: pa.Table) -> dict[str, int]:
        res = q12.check(table, {"bid": bids})
        assert not res["ok"]
        return {k: v for k, v in res["broken"].items() if v}

    assert broken(good.slice(1)) == {"totals": 1}  # bidder 1 lost two bids
    assert broken(pa.concat_tables([good, good.slice(2)])) == {"totals": 1, "twice": 1}
    assert broken(_replace(good, "starttime", [5, 10_000, 10_000])) == {"aligned": 1}
    assert broken(_replace(good, "fired_at", [9_999, 15_000, 15_000])) == {"early": 1}
    assert broken(_replace(good, "bid_count", pc.add(good["bid_count"], 1))) == {"totals": 2}
