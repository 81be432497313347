"""Direct push, end to end: real PySpark tasks reserve sequence numbers at the job's source
instances and push their rows straight to the keyed instances (raystream.direct), on a real
local Ray with key-count state in RocksDB. The oracle is numpy's count of the same input rows.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raystream as rs

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(600)]

from ray import cloudpickle as _ray_cloudpickle  # noqa: E402

_ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    import pyspark.cloudpickle

    pyspark.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # local[2, 2]: two task slots, and a failed task is retried once
    session = rs.spark.session("raystream-e2e-direct", master="local[2, 2]", arrow_batch_rows=20_000)
    try:
        yield session
    finally:
        session.stop()


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def keycount(name: str, source: Any, fn: Any = count) -> rs.Dataflow:
    flow = rs.Dataflow(name, num_key_groups=64)
    flow.source(source).key_by("key").apply(fn).sink(rs.sinks.collect(), name="out")
    return flow


def final_counts(result: rs.JobResult) -> dict[int, int]:
    t = result.table("out")
    out: dict[int, int] = {}
    for k, c in zip(t.column("key").to_pylist(), t.column("count").to_pylist(), strict=True):
        out[k] = max(out.get(k, 0), c)
    return out


def oracle(keys: np.ndarray) -> dict[int, int]:
    uniq, n = np.unique(keys, return_counts=True)
    return dict(zip(uniq.tolist(), n.tolist(), strict=True))


def events(n: int, seed: int) -> pa.Table:
    return rs.sources.generator(events=n, keys=20_000, zipf=1.1, seed=seed).generate_all()


def ingest_stats(result: rs.JobResult) -> list[dict[str, Any]]:
    return [m["ingest"] for m in result.metrics if "ingest" in m]


def test_direct_and_through_the_source_count_the_same_rows_exactly(
    spark: Any, tmp_path: Path
) -> None:
    table = events(400_000, seed=31)
    pq.write_table(table, tmp_path / "events.parquet", row_group_size=50_000)
    df = spark.read.parquet(str(tmp_path / "events.parquet")).repartition(4)
    want = oracle(table.column("key").to_numpy())
    for direct in (True, False):
        src = rs.sources.spark(df, push_rows=20_000, direct=direct)
        job = rs.start(
            keycount(f"e2e-direct-{direct}", src),
            parallelism={"count": 2, "source": 2},
            standby_instances=0,
        )
        result = job.wait(300)
        assert result.state == "finished"
        assert final_counts(result) == want, f"direct={direct}"
        ingest = ingest_stats(result)
        reserved = sum(i["rows_reserved"] for i in ingest)
        accepted = sum(i["rows_accepted"] for i in ingest)
        assert accepted == 400_000, ingest
        # direct: every row reserved, none queued at a source; else every row passed one
        assert reserved == (400_000 if direct else 0), ingest
        # the sources take direct pushes either way (key_by follows); only the writers differ
        assert all(i["direct"] for i in ingest), ingest


def _slow_until(gate: str) -> Any:
    """A count that takes 100 us per row until the file ``gate`` exists, then runs at full speed:
    an ingest of millions of rows lasts minutes unless the test opens the gate, so it is still
    running whatever a change costs on a slow machine, and ends soon after the change."""

    @rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
    def gated_count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
        if not os.path.exists(gate):
            time.sleep(len(batch) * 100e-6)
        new = state.get(batch.keys) + batch.counts
        state.put(batch.keys, new)
        return batch.output({"count": new})

    return gated_count


def _ingesting(spark: Any, name: str, rows: int, gate: Path) -> tuple[rs.Job, Any]:
    """A key-count over ``rows`` Spark rows pushed straight to its count, slow until ``gate``
    exists; returns it running once the count took rows, and a reading of the rows it took."""
    df = spark.range(0, rows, numPartitions=4).selectExpr("(id * 7919) % 5003 as key", "id as seq")
    src = rs.sources.spark(df, push_rows=10_000, direct=True)
    job = rs.start(keycount(name, src, _slow_until(str(gate))), parallelism={"count": 2})

    def counted() -> int:
        instances = job.metrics()["instances"]
        return sum(int(m.get("records_in", 0)) for m in instances if m.get("step") == "count")

    deadline = time.monotonic() + 120
    while counted() < 10_000 and time.monotonic() < deadline:
        time.sleep(0.05)
    return job, counted


def test_direct_push_stays_exact_across_a_rescale_during_ingest(spark: Any, tmp_path: Path) -> None:
    rows = 2_000_000
    gate = tmp_path / "gate"
    job, counted = _ingesting(spark, "e2e-direct-rescale", rows, gate)
    assert 0 < counted() < rows, "the rescale would not run during the ingest"
    stats = job.rescale("count", 3)
    assert stats["to"] == 3
    assert counted() < rows, "the ingest ended before the rescale did"
    gate.touch()
    result = job.wait(300)
    assert result.state == "finished"
    assert final_counts(result) == oracle((np.arange(rows) * 7919) % 5003)
    ingest = ingest_stats(result)
    assert sum(i["rows_reserved"] for i in ingest) == rows, ingest
    # the rescale barrier passed the source while tasks still reserved: they were re-routed
    assert max(i["routing_version"] for i in ingest) >= 1, ingest
    # each task's first reservation fetches the route; a task running at the rescale re-cuts
    assert sum(i["reroutes"] for i in ingest) > 4, ingest


def _fail_after_first_batches(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Partition 1's first attempt dies once 40k rows went on (the pusher reserved and pushed
    them), after giving its pushes time to land."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    seen = 0
    for b in batches:
        yield b
        seen += b.num_rows
        if ctx.partitionId() == 1 and ctx.attemptNumber() == 0 and seen >= 40_000:
            time.sleep(2)
            msg = f"injected failure after {seen} rows (attempt 0)"
            raise RuntimeError(msg)


def test_a_task_that_dies_after_reserving_is_retried_without_double_counting(
    spark: Any, tmp_path: Path
) -> None:
    table = events(240_000, seed=32)
    pq.write_table(table, tmp_path / "events.parquet")
    df = spark.read.parquet(str(tmp_path / "events.parquet")).repartition(3)
    df = df.mapInArrow(_fail_after_first_batches, df.schema)
    job = rs.start(
        # small reservations, so attempt 0 reserves several before it dies
        keycount("e2e-direct-retry", rs.sources.spark(df, push_rows=10_000, direct=True, direct_rows=10_000)),
        parallelism={"count": 2},
        standby_instances=0,
    )
    result = job.wait(300)
    assert result.state == "finished"
    assert final_counts(result) == oracle(table.column("key").to_numpy())
    assert job.feeders[0].stats["retried"] == 1, job.feeders[0].stats
    ingest = ingest_stats(result)
    # the retry asked again for what attempt 0 had reserved: the same sequence numbers, and
    # the keyed instances dropped the pieces they already had
    assert sum(i["reservations_again"] for i in ingest) >= 2, ingest
    assert sum(i["rows_accepted"] for i in ingest) == 240_000, ingest
    dropped = sum(m.get("duplicate_pushes", 0) for m in result.metrics if m["step"] == "count")
    assert dropped >= 2, [m.get("duplicate_pushes") for m in result.metrics]


def test_direct_windows_fire_on_watermarks_from_the_reservations(
    spark: Any, tmp_path: Path
) -> None:
    """Event time: tasks stamp each row's event time and report the newest to the source with
    the reservation; the source's watermarks follow them (windows fire before the input ends)
    and the tumbling counts equal DuckDB's over the same rows."""
    import raystream.operators as ops
    from raystream.operators import windows

    from tests.integration._window_helpers import (
        OUT_OF_ORDERNESS_MS,
        events as timed_events,
        tumbling_oracle,
        window_rows,
    )

    table = timed_events(40_000, keys=100, seed=33)
    pq.write_table(table, tmp_path / "timed.parquet")
    df = spark.read.parquet(str(tmp_path / "timed.parquet")).coalesce(1)  # one task, in order
    flow = rs.Dataflow("e2e-direct-windows", num_key_groups=32, sub_groups=4)
    (
        flow.source(
            rs.sources.spark(df, push_rows=2_000, direct=True),
            event_time="ts",
            max_out_of_orderness_ms=OUT_OF_ORDERNESS_MS,
        )
        .key_by("k")
        .apply(windows.tumbling(1_000, [ops.count(), ops.sum("x"), ops.max("x")]), name="window")
        .sink(rs.sinks.collect(), name="out")
    )
    result = rs.run(
        flow, parallelism={"window": 2}, timeout_s=300, linger_ms=5.0, standby_instances=0
    )
    assert result.state == "finished"
    out = result.table("out")
    got = window_rows(out, "k", "window_start", "count", "x_sum", "x_max")
    assert got == tumbling_oracle(table, 1_000)
    (source,) = [m for m in result.metrics if m["step"] == "source"]
    assert source["ingest"]["rows_reserved"] == 40_000, source["ingest"]
    newest = int(table.column("ts").to_numpy().max())
    during = [w for _, w in source["watermark_timeline"] if w <= newest]
    assert len(during) >= 3, source["watermark_timeline"]  # watermarks while rows came in


def test_direct_push_stays_exact_across_a_move_during_ingest(spark: Any, tmp_path: Path) -> None:
    """A move ends the source's channel to the old instance (what was reserved before the
    barrier, the barrier, EndOfStream) and opens one to the new instance: tasks re-route to it."""
    import ray

    rows = 2_000_000
    gate = tmp_path / "gate"
    job, counted = _ingesting(spark, "e2e-direct-move", rows, gate)
    node = ray.get_runtime_context().get_node_id()
    moves = [job.move("count", 1, node)]  # the sources must still run (its barrier starts there)
    assert counted() < rows, "the ingest ended before the move did"
    gate.touch()
    result = job.wait(300)
    assert result.state == "finished"
    assert [m["kind"] for m in moves] == ["move"], moves
    assert final_counts(result) == oracle((np.arange(rows) * 7919) % 5003)
    ingest = ingest_stats(result)
    assert sum(i["rows_reserved"] for i in ingest) == rows, ingest
    assert max(i["routing_version"] for i in ingest) >= 1, ingest  # the move re-routed
