"""Spark -> raystream, end to end: real PySpark (local[2], tasks may retry) pushing Arrow batches
into the source actors of a job on a real local Ray, key-count state in RocksDB.

The oracle is numpy over the same input rows the test wrote (or generated) itself.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raystream as rs
from raystream.ingest import FeedContext

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(600)]

# test-defined operators travel by value to Ray workers and to Spark's Python workers
from ray import cloudpickle as _ray_cloudpickle  # noqa: E402

_ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    import pyspark.cloudpickle

    pyspark.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # local[2, 2]: two task slots, and a failed task is retried once (local mode's default is 1)
    session = rs.spark.session("raystream-e2e", master="local[2, 2]", arrow_batch_rows=50_000)
    try:
        yield session
    finally:
        session.stop()


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def keycount(name: str, source: Any) -> rs.Dataflow:
    flow = rs.Dataflow(name, num_key_groups=64)
    flow.source(source).key_by("key").apply(count).sink(rs.sinks.collect(), name="out")
    return flow


def final_counts(result: rs.JobResult) -> dict[int, int]:
    t = result.table("out")
    keys = t.column("key").to_numpy()
    counts = t.column("count").to_numpy()
    out: dict[int, int] = {}
    for k, c in zip(keys.tolist(), counts.tolist(), strict=True):
        out[k] = max(out.get(k, 0), c)  # a key's counts only grow; the last is the largest
    return out


def oracle(keys: np.ndarray) -> dict[int, int]:
    uniq, n = np.unique(keys, return_counts=True)
    return dict(zip(uniq.tolist(), n.tolist(), strict=True))


def events(n: int, seed: int) -> pa.Table:
    return rs.sources.generator(events=n, keys=20_000, zipf=1.1, seed=seed).generate_all()


def test_a_spark_dataframe_of_1m_rows_counts_exactly(spark: Any, tmp_path: Path) -> None:
    table = events(1_000_000, seed=11)
    pq.write_table(table, tmp_path / "events.parquet", row_group_size=125_000)
    df = spark.read.parquet(str(tmp_path / "events.parquet")).repartition(6)
    src = rs.sources.spark(df, direct=True)
    flow = keycount("e2e-spark-batch", src)
    flow.steps["source"]  # noqa: B018 - the source step exists under its default name
    job = rs.start(flow, parallelism={"count": 2, "source": 2}, standby_instances=0)
    result = job.wait(300)
    assert result.state == "finished"
    assert final_counts(result) == oracle(table.column("key").to_numpy())
    stats = job.feeders[0].stats
    assert stats["partitions"] == 6 and stats["accepted"] == 1_000_000 and stats["duplicate"] == 0
    # the step after the source is key_by(column): the tasks sorted every push by key group
    # and sent the rows to the keyed instances themselves; the sources only sequenced them
    ingest = [m["ingest"] for m in result.metrics if "ingest" in m]
    assert sum(i["rows_reserved"] for i in ingest) == 1_000_000, ingest
    assert all(i["direct"] for i in ingest) and sum(i["queued_rows"] for i in ingest) == 0


@rs.map_batches(name="slow")
def slow(batch: pa.RecordBatch) -> pa.RecordBatch:
    time.sleep(0.05)  # a step slower than Spark can push
    return batch


def test_backpressure_reaches_spark_tasks_and_the_buffer_stays_bounded(spark: Any) -> None:
    df = spark.range(0, 120_000, numPartitions=2).selectExpr("id % 997 as key", "id as seq")
    src = rs.sources.spark(df, push_rows=10_000, capacity_rows=20_000)
    flow = rs.Dataflow("e2e-spark-backpressure", num_key_groups=64)
    flow.source(src).apply(slow).options(chain=False).key_by("key").apply(count).sink(
        rs.sinks.collect(), name="out"
    )
    job = rs.start(flow, batch_rows=10_000, max_inflight=1, inbox_capacity=1, standby_instances=0)
    result = job.wait(300)
    assert final_counts(result) == oracle(np.arange(120_000) % 997)
    (ingest,) = [m["ingest"] for m in result.metrics if "ingest" in m]
    assert ingest["backpressure_waits"] > 0, ingest  # Spark tasks had to wait ...
    assert ingest["max_queued_rows"] <= 20_000, ingest  # ... and the buffer never overflowed
    assert ingest["rows_presorted"] == 0, ingest  # a map step reads the source: no key groups


def _fail_first_attempt_midway(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """A user transform whose first attempt of partition 1 dies once 60k rows went on (Spark
    regroups them into 50k-row Arrow batches for the push), after giving the push time to land."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    seen = 0
    for b in batches:
        yield b
        seen += b.num_rows
        if ctx.partitionId() == 1 and ctx.attemptNumber() == 0 and seen >= 60_000:
            time.sleep(3)
            msg = f"injected failure after {seen} rows (attempt 0)"
            raise RuntimeError(msg)


@pytest.mark.parametrize(
    ("direct", "push_rows"),
    # through the source with pushes that do not end where attempt 0's input ended (50k): a
    # retry pushing 30k..60k sorted by key group cannot be cut at 50k (it starts at 50k); direct
    # with 20k-row reservations: attempt 0's last one is 40k..50k, the retry's is cut there
    [(False, 30_000), (True, 10_000)],
    ids=["through_source", "direct"],
)
def test_a_spark_task_that_fails_once_is_retried_without_double_counting(
    spark: Any, tmp_path: Path, direct: bool, push_rows: int
) -> None:
    table = events(300_000, seed=12)
    pq.write_table(table, tmp_path / "events.parquet")
    df = spark.read.parquet(str(tmp_path / "events.parquet")).repartition(3)
    df = df.mapInArrow(_fail_first_attempt_midway, df.schema)
    # small pushes, so attempt 0 delivers some rows before it dies
    src = rs.sources.spark(df, push_rows=push_rows, direct=direct)
    job = rs.start(keycount(f"e2e-spark-retry-{int(direct)}", src), standby_instances=0)
    result = job.wait(300)
    assert result.state == "finished", result.error
    assert final_counts(result) == oracle(table.column("key").to_numpy())
    stats = job.feeders[0].stats
    assert stats["retried"] == 1, stats  # the retry happened ...
    # ... attempt 0 had pushed rows before failing, and the retry did not take them again
    assert stats["duplicate"] >= 10_000, stats
    ingest = [m["ingest"] for m in result.metrics if "ingest" in m]
    assert sum(i["rows_accepted"] for i in ingest) == 300_000, ingest
    if direct:  # the retry re-sent attempt 0's last, shorter reservation, then the rest
        assert sum(i["reservations_split"] for i in ingest) >= 1, ingest


def test_a_spark_failure_fails_the_job_with_sparks_error(spark: Any) -> None:
    def always_fails(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for _ in batches:
            msg = "the input is corrupt"
            raise ValueError(msg)
        yield from ()

    df = spark.range(0, 1000, numPartitions=2).selectExpr("id as key", "id as seq")
    df = df.mapInArrow(always_fails, df.schema)
    with pytest.raises(rs.JobFailedError, match="the input is corrupt"):
        rs.run(keycount("e2e-spark-fail", rs.sources.spark(df)), timeout_s=300, standby_instances=0)


def test_structured_streaming_over_a_growing_directory_with_a_rescale(
    spark: Any, tmp_path: Path
) -> None:
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    files = [events(40_000, seed=100 + i) for i in range(6)]
    total = sum(t.num_rows for t in files)
    schema = files[0].schema
    pq.write_table(files[0], incoming / "part-0.parquet")
    from pyspark.sql.pandas.types import from_arrow_schema

    sdf = (
        spark.readStream.schema(from_arrow_schema(schema))
        .option("maxFilesPerTrigger", 1)
        .parquet(str(incoming))
    )
    src = rs.sources.spark_stream(
        sdf,
        checkpoint_location=str(tmp_path / "checkpoint"),
        trigger={"processingTime": "500 milliseconds"},
        max_rows=total,
        idle_timeout_s=120,
        direct=True,
    )
    job = rs.start(keycount("e2e-spark-stream", src), parallelism={"count": 2})
    # the files after the second come only once the rescale returned: rows reach the job
    # before and after it, however long the rescale takes on the machine
    rescaled = threading.Event()
    waited: list[bool] = []

    def add_files() -> None:
        deadline = time.monotonic() + 120
        while job.feeders[0].stats["accepted"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)  # the first micro-batch is in (Spark's Python workers are up)
        for i, t in enumerate(files[1:], start=1):
            if i == 3:
                waited.append(rescaled.wait(300))
            time.sleep(1.0)
            tmp = tmp_path / f"part-{i}.parquet.tmp"
            pq.write_table(t, tmp)
            shutil.move(tmp, incoming / f"part-{i}.parquet")  # appear whole (rename)

    writer = threading.Thread(target=add_files, daemon=True)
    writer.start()
    # rescale once rows flow, while files are still being added
    deadline = time.monotonic() + 120
    while job.feeders[0].stats["accepted"] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.feeders[0].stats["accepted"] > 0, "no rows reached the job within 120 s"
    try:
        stats = job.rescale("count", 3)
    finally:
        rescaled.set()
    assert stats["to"] == 3
    writer.join()
    assert waited == [True], "the writer did not wait for the rescale before the last files"
    result = job.wait(300)
    assert result.state == "finished"
    everything = pa.concat_tables(files).column("key").to_numpy()
    assert final_counts(result) == oracle(everything)
    assert job.feeders[0].stats["batches"] >= 3  # really several micro-batches
    # tasks pushed straight to the keyed instances before and after the rescale (re-routed
    # once the rescale barrier passed the source); routing stayed exact
    ingest = [m["ingest"] for m in result.metrics if "ingest" in m]
    assert sum(i["rows_reserved"] for i in ingest) == total, ingest
    assert max(i["routing_version"] for i in ingest) >= 1, ingest  # the rescale re-routed


def test_the_rate_source_streams_every_value_exactly_once(spark: Any, tmp_path: Path) -> None:
    """Spark's rate source numbers its rows 0, 1, 2, ...: whatever micro-batches the stream was
    cut into, the job must have seen each value of one unbroken prefix exactly once."""
    sdf = spark.readStream.format("rate").option("rowsPerSecond", 20_000).load()
    src = rs.sources.spark_stream(
        sdf, checkpoint_location=str(tmp_path / "chk"), max_rows=50_000, idle_timeout_s=60
    )
    flow = rs.Dataflow("e2e-spark-rate", num_key_groups=64)
    flow.source(src).key_by("value").apply(count).sink(rs.sinks.collect(), name="out")
    job = rs.start(flow, parallelism={"count": 2}, standby_instances=0)
    result = job.wait(300)
    t = result.table("out")
    per_value: dict[int, int] = {}
    for k, c in zip(t.column("value").to_pylist(), t.column("count").to_pylist(), strict=True):
        per_value[k] = max(per_value.get(k, 0), c)
    n = job.feeders[0].stats["accepted"]
    assert n >= 50_000 and job.feeders[0].stats["batches"] >= 2
    assert per_value == dict.fromkeys(range(n), 1)


def test_a_micro_batch_spark_replays_after_a_restart_is_not_counted_twice(
    spark: Any, tmp_path: Path
) -> None:
    """Spark replays the last micro-batch when its commit is missing (a crash between pushing
    and committing). Two runs of a real streaming query over one checkpoint, the commit of the
    last batch removed in between: the replay reaches the job and is recognised."""
    import ray
    from pyspark.sql.pandas.types import from_arrow_schema

    from raystream.runtime.actors import NAMESPACE, source_actor_name
    from raystream.spark import push_dataframe

    incoming = tmp_path / "incoming"
    incoming.mkdir()
    first, second = events(30_000, seed=21), events(20_000, seed=22)
    pq.write_table(first, incoming / "a.parquet")
    schema = first.schema
    checkpoint = tmp_path / "checkpoint"
    flow = keycount("e2e-spark-replay", rs.sources.push(schema))
    job = rs.start(flow, parallelism={"source": 1, "count": 2}, standby_instances=0)
    ctx = FeedContext(
        "e2e-spark-replay",
        "source",
        1,
        ray.get_runtime_context().gcs_address,
        NAMESPACE,
        __import__("os").environ.get("RAY_AUTH_MODE"),
    )
    pushed: list[tuple[int, dict[str, int]]] = []

    def on_batch(df: Any, batch_id: int) -> None:
        stats = push_dataframe(
            df, ctx, stream=str(checkpoint), batch_id=batch_id, schema=schema, push_rows=10_000
        )
        pushed.append((batch_id, stats))

    def run_query() -> None:
        sdf = spark.readStream.schema(from_arrow_schema(schema)).parquet(str(incoming))
        q = (
            sdf.writeStream.option("checkpointLocation", str(checkpoint))
            .foreachBatch(on_batch)
            .start()
        )
        q.processAllAvailable()
        q.stop()

    run_query()
    last = max(b for b, _ in pushed)
    # as if the driver died after pushing the batch, before Spark committed it
    (checkpoint / "commits" / str(last)).unlink()
    (checkpoint / "commits" / f".{last}.crc").unlink(missing_ok=True)
    pq.write_table(second, incoming / "b.parquet")
    run_query()
    replays = [s for b, s in pushed if b == last]
    assert len(replays) == 2, pushed  # Spark really ran the batch twice
    assert replays[1]["accepted"] == 0 and replays[1]["duplicate"] == replays[0]["accepted"] > 0
    source = ray.get_actor(source_actor_name("e2e-spark-replay", "source", 0), namespace=NAMESPACE)
    ray.get(source.end_ingest.remote())
    result = job.wait(120)
    everything = pa.concat_tables([first, second]).column("key").to_numpy()
    assert final_counts(result) == oracle(everything)


def test_definition_errors_name_what_was_expected(spark: Any, tmp_path: Path) -> None:
    df = spark.range(0, 10).selectExpr("id as user", "id as seq")
    flow = rs.Dataflow("e2e-spark-nokey")
    with pytest.raises(rs.RaystreamError, match="key"):
        flow.source(rs.sources.spark(df)).key_by("key")
    (tmp_path / "in").mkdir()
    sdf = spark.readStream.schema("key long").parquet(str(tmp_path / "in"))
    with pytest.raises(rs.ConfigError, match=r"use rs.sources.spark_stream\(\)"):
        rs.sources.spark(sdf)
    with pytest.raises(rs.ConfigError, match=r"use rs.sources.spark\(\)"):
        rs.sources.spark_stream(df, checkpoint_location=str(tmp_path / "c"))
    with pytest.raises(rs.ConfigError, match="checkpoint_location"):
        rs.sources.spark_stream(sdf, checkpoint_location="")
    with pytest.raises(rs.ConfigError, match="expected a pyspark.sql.DataFrame"):
        rs.sources.spark([1, 2, 3])


def test_the_spark_example_job_file_counts_exactly(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``examples/spark_keycount_job.py`` as ``raystream run`` loads it (run as a file, its
    module-level Dataflow taken), on this session's Ray and Spark: the Parquet counts equal numpy's
    count of the example's generated input. (``tests/e2e/test_examples.py`` runs the other
    examples through the CLI in their own processes.)"""
    import runpy

    example = Path(__file__).resolve().parents[2] / "examples" / "spark_keycount_job.py"
    monkeypatch.setenv("RAYSTREAM_EVENTS", "200000")
    monkeypatch.setenv("RAYSTREAM_OUT", str(tmp_path / "out"))
    namespace = runpy.run_path(str(example), run_name="__raystream_job__")
    flows = [v for v in namespace.values() if isinstance(v, rs.Dataflow)]
    assert len(flows) == 1
    result = rs.run(flows[0], parallelism={"count": 2}, timeout_s=300, standby_instances=0)
    assert result.state == "finished"
    got = pq.read_table(tmp_path / "out")
    counts: dict[int, int] = {}
    for k, c in zip(got.column("key").to_pylist(), got.column("count").to_pylist(), strict=True):
        counts[k] = max(counts.get(k, 0), c)
    expected = rs.sources.generator(events=200_000, keys=50_000, zipf=1.1, seed=7).generate_all()
    assert counts == oracle(expected.column("key").to_numpy())


def test_the_keycount_bench_reads_a_watched_directory_through_spark(tmp_path: Path) -> None:
    """``python -m bench.keycount --source spark-stream --input DIR --events N`` as users run it
    (from the repository root, attached to this session's Ray): the counts it writes equal numpy's
    count of the files' keys."""
    import os
    import subprocess

    import ray

    incoming = tmp_path / "incoming"
    incoming.mkdir()
    parts = [events(20_000, seed=300 + i) for i in range(2)]
    for i, t in enumerate(parts):
        pq.write_table(t, incoming / f"part-{i}.parquet")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    out = tmp_path / "counts.parquet"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.keycount", "--source", "spark-stream", "--input",
         str(incoming), "--events", "40000", "--idle-timeout", "60", "--output", str(out),
         "--quiet"],
        cwd=Path(__file__).resolve().parents[2],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = pq.read_table(out)
    counts = dict(zip(got.column("key").to_pylist(), got.column("count").to_pylist(), strict=True))
    assert counts == oracle(pa.concat_tables(parts).column("key").to_numpy())


# ---- recovery of jobs fed by Spark: the feed re-sends, the restored dedupe table drops what the
# checkpoint holds; the committed Parquet output must hold every input row exactly once ---------

REC_KEYS = 3_000


def running_count_until(gate: Path) -> Any:
    """One output row per record: its key, its seq and the count of its key up to it, taking
    200 us per row until the file ``gate`` exists: a per-call pause shrinks when a backlog merges
    batches into fewer calls, this one does not, so the input outlasts whatever the test does
    (a kill) before it opens the gate."""

    @rs.keyed_batches(name="running_count", state=rs.ValueState(int, default=0))
    def gated_running_count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
        if not gate.exists():
            time.sleep(len(batch) * 200e-6)
        return _count_rows(batch, state)

    return gated_running_count


def _count_rows(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    before = state.get(batch.keys)
    counts = batch.counts
    state.put(batch.keys, before + counts)
    records = batch.records
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    rank = np.arange(records.num_rows) - starts
    return pa.record_batch(
        {
            "key": records.column("key"),
            "seq": records.column("seq"),
            "count": pa.array(np.repeat(before, counts) + rank + 1, pa.int64()),
        }
    )


def _start_checkpointed(
    name: str,
    source: Any,
    source_parallelism: int,
    out: Path,
    tmp_path: Path,
    batch_rows: int,
    count: Any,
) -> rs.Job:
    """The running-count job over ``source`` into a Parquet folder, checkpointing every 0.3 s
    and recovering after 0.2 s (no warm standby actors: no rescale here)."""
    flow = rs.Dataflow(name, num_key_groups=64, sub_groups=8)
    (
        flow.source(source, parallelism=source_parallelism)
        .key_by("key")
        .apply(count, name="count")
        .sink(rs.sinks.parquet(str(out)), name="out")
    )
    return rs.start(
        flow,
        parallelism={"count": 2},
        checkpoint_interval_s=0.3,
        checkpoint_dir=str(tmp_path / "chk"),
        restart_delay_s=0.2,
        batch_rows=batch_rows,
        linger_ms=10.0,
        standby_instances=0,
    )


def _kill_instance(job: rs.Job, step: str, index: int) -> None:
    import ray

    from raystream.runtime.actors import NAMESPACE, instance_actor_name

    ray.kill(ray.get_actor(instance_actor_name(job.name, step, index), namespace=NAMESPACE))


def _wait_for(job: rs.Job, what: str, check: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check(job.status()):
        assert time.monotonic() < deadline, f"no {what}: {job.status()['checkpoints']}"
        time.sleep(0.05)


def _checkpointed(status: dict[str, Any]) -> int:
    """Rows the sources had emitted at the last completed checkpoint (a source that had
    finished reports no offset)."""
    last = status["checkpoints"]["last"] or {}
    return sum(int(v or 0) for v in (last.get("source_offsets") or {}).values())


def assert_committed_exactly_once(
    out: Path, rows: int, expected: dict[int, int] | None = None
) -> None:
    """DuckDB over the published files against DuckDB over the input's definition: every input
    row (seq) once, and per key the running counts are exactly 1..n (a state update applied
    twice or lost shows as a count out of that range or repeated)."""
    import duckdb

    con = duckdb.connect()
    files = f"{out}/*.parquet"
    (got,) = con.sql(
        f"select count(*), count(distinct seq) from read_parquet('{files}')"
    ).fetchall()
    assert got == (rows, rows), f"published rows, distinct seqs: {got}; input rows: {rows}"
    if expected is None:  # the batch test's input: key (id * 7919) % REC_KEYS of ids 0..rows-1
        expected = dict(
            con.sql(
                f"select (range * 7919) % {REC_KEYS} as key, count(*) from range({rows}) group by 1"
            ).fetchall()
        )
    per_key = con.sql(
        f"select key, count(*), count(distinct count), min(count), max(count) "
        f"from read_parquet('{files}') group by key"
    ).fetchall()
    bad = [r for r in per_key if not (r[1] == r[2] == r[4] == expected.get(r[0]) and r[3] == 1)]
    assert not bad, f"keys whose counts are not 1..n: {bad[:5]} ({len(bad)} in all)"
    assert {r[0] for r in per_key} == set(expected)


def test_a_spark_fed_job_recovers_exactly_once_from_a_keyed_and_a_source_kill(
    spark: Any, tmp_path: Path
) -> None:
    """A Spark DataFrame of 3 partitions feeds 2 source instances; a keyed instance is killed
    while Spark pushes, then (after that recovery) a source instance. Each recovery restores the
    sources' dedupe tables and the driver re-runs the Spark job for the new attempt."""
    rows = 160_000
    df = spark.range(0, rows, numPartitions=3).selectExpr(
        f"(id * 7919) % {REC_KEYS} as key", "id as seq"
    )
    out = tmp_path / "out"
    gate = tmp_path / "gate"
    source = rs.sources.spark(df, push_rows=2_000, capacity_rows=4_000, direct=True)
    job = _start_checkpointed(
        "e2e-spark-recover",
        source,
        2,
        out,
        tmp_path,
        batch_rows=2_000,
        count=running_count_until(gate),
    )
    try:
        _wait_for(job, "rows in a checkpoint", lambda s: _checkpointed(s) > 0)
        _kill_instance(job, "count", 1)
        _wait_for(job, "recovery", lambda s: s["recoveries"] and s["state"] == "running")
        n = job.status()["checkpoints"]["completed"]
        _wait_for(job, "a checkpoint after it", lambda s: s["checkpoints"]["completed"] > n)
        # the second feed is still pushing (a feed's counts arrive when it completed): the
        # source kill must interrupt it, not come after a checkpoint that holds all the input
        assert job.feeders[0].stats["rows"] == 0, job.feeders[0].stats
        _kill_instance(job, "source", 0)
        gate.touch()
        result = job.wait(120)
    finally:
        job.cancel()
    assert result.state == "finished"
    assert [r["instance"][0] for r in result.recoveries] == ["count", "source"], result.recoveries
    assert all(r["checkpoint_id"] is not None for r in result.recoveries)
    feeder = job.feeders[0]
    assert feeder.stats["feeds"] == 3, feeder.stats  # the first feed and one per recovery
    assert_committed_exactly_once(out, rows)
    ingest = [m["ingest"] for m in result.metrics if "ingest" in m]
    # the last attempt's sources dropped the re-sent rows their checkpoint held
    assert sum(i["rows_duplicate"] for i in ingest) > 0, ingest
    # the tasks pushed straight to the keyed instances (the sources sequenced the rows)
    assert sum(i["rows_reserved"] for i in ingest) > 0, ingest
    # a writer that pushes once the job is gone is told which job and what to do
    from raystream.spark import source_handle

    deadline = time.monotonic() + 15  # ray.kill of the finished job's actors is asynchronous
    with pytest.raises(rs.SourceError, match=r"job 'e2e-spark-recover' has ended.*Start the job"):
        while time.monotonic() < deadline:
            source_handle(feeder.ctx, 0)
            time.sleep(0.05)


def test_a_structured_streaming_job_recovers_exactly_once_from_a_keyed_kill(
    spark: Any, tmp_path: Path
) -> None:
    """Spark's rate source numbers its rows 0, 1, 2, ...; a keyed instance is killed while
    micro-batches flow. Each micro-batch is let go (Spark commits it) only once a checkpoint
    holds it, and the batch a recovery interrupted is pushed again under its batch id: the
    published output holds one unbroken prefix of the values, each once, with counts 1..n."""
    import duckdb

    sdf = spark.readStream.format("rate").option("rowsPerSecond", 20_000).load()
    sdf = sdf.selectExpr(f"value % {REC_KEYS} as key", "value as seq")
    src = rs.sources.spark_stream(
        sdf, checkpoint_location=str(tmp_path / "spark-chk"), max_rows=60_000, idle_timeout_s=60
    )
    out = tmp_path / "out"
    gate = tmp_path / "gate"
    job = _start_checkpointed(
        "e2e-spark-stream-recover",
        src,
        1,
        out,
        tmp_path,
        batch_rows=5_000,
        count=running_count_until(gate),
    )
    try:
        _wait_for(job, "rows in a checkpoint", lambda s: _checkpointed(s) > 0)
        # micro-batches still flow (the feed stops once max_rows were accepted): the kill must
        # interrupt one, not come after the stream's end
        accepted = job.feeders[0].stats["accepted"]
        assert accepted < 60_000, f"the stream had ended before the kill: {job.feeders[0].stats}"
        _kill_instance(job, "count", 0)
        gate.touch()
        result = job.wait(180)
    finally:
        job.cancel()
    assert result.state == "finished"
    assert [r["instance"][0] for r in result.recoveries] == ["count"], result.recoveries
    feeder = job.feeders[0]
    assert feeder.stats["batches"] >= 2 and feeder.stats["feeds"] >= 2, feeder.stats
    (n,) = duckdb.sql(f"select max(seq) + 1 from read_parquet('{out}/*.parquet')").fetchall()[0]
    assert n >= 60_000
    # the values 0..n-1 by the rate source's definition, counted per key by DuckDB
    expected_keys = duckdb.sql(
        f"select range % {REC_KEYS} as key, count(*) from range({n}) group by 1"
    ).fetchall()
    assert_committed_exactly_once(out, n, dict(expected_keys))
