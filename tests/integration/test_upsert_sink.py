"""An upsert Parquet sink under checkpoints on Ray: a keyed running count whose instance is
killed mid-stream recovers from its checkpoint, and the final table read back from the committed
files (``rs.read_upsert`` and the documented DuckDB query) equals the count of every key in the
generated stream (numpy, independent of raystream). The sink numbers the changes itself
(no ``order_by``), so its sequence must survive the restore too."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import ray

import raystream as rs
from raystream.runtime.actors import NAMESPACE, instance_actor_name
from raystream.upsert import final_table_sql
from tests.integration._gates import EndAtGate, end_after_checkpoint, events_sent, open_gate
from tests.integration._helpers import NOT_SCALED_OUT, generator_prefix

KEYS = 2_000
RATE = 40_000


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def running_count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    """Per key and batch one change: the key's count so far."""
    count = state.get(batch.keys) + batch.counts
    state.put(batch.keys, count)
    return batch.output({"count": count})


def _wait_status(job: rs.Job, what: str, check: Any, timeout_s: float = 60) -> None:
    t0 = time.monotonic()
    while not check(job.status()):
        st = job.status()
        assert time.monotonic() - t0 < timeout_s, (
            f"no {what} within {timeout_s} s: {st['state']}, {st['checkpoints']}"
        )
        time.sleep(0.05)


def test_upsert_sink_recovers_with_the_two_phase_commit(tmp_path: Path) -> None:
    """The generator runs at 40,000 events/s until the job has recovered from the kill (then to
    a second past the restored checkpoint): the kill lands mid-stream however slow the
    checkpoints are on the machine."""
    out = tmp_path / "out"
    gen = rs.sources.generator(events=RATE * 120, keys=KEYS, zipf=1.1, seed=5, rate_eps=RATE)
    gate = str(tmp_path / "gate")
    flow = rs.Dataflow("upsert-recovery", num_key_groups=64)
    (
        flow.source(EndAtGate(gen, gate), parallelism=1)
        .key_by("key")
        .apply(running_count, name="count")
        .sink(rs.sinks.parquet(out, mode="upsert", key=["key"]), name="out")
    )
    job = rs.start(
        flow,
        parallelism={"count": 2},
        checkpoint_interval_s=0.3,
        checkpoint_dir=str(tmp_path / "chk"),
        restart_delay_s=0.2,
        batch_rows=4_000,
        linger_ms=10.0,
        **NOT_SCALED_OUT,
    )
    try:
        try:
            _wait_status(job, "2 checkpoints", lambda s: s["checkpoints"]["completed"] >= 2)
            ray.kill(ray.get_actor(instance_actor_name(job.name, "count", 1), namespace=NAMESPACE))
            _wait_status(
                job, "recovery", lambda s: len(s["recoveries"]) >= 1 and s["state"] == "running"
            )
        finally:
            # past the newest checkpoint's offset: a reader rewinding to it is not cut short
            open_gate(gate, end_after_checkpoint(job.status(), RATE))
        result = job.wait(120)
    finally:
        job.cancel()
    assert result.state == "finished" and len(result.recoveries) >= 1
    events = events_sent(gate)
    keys = generator_prefix(gen, events)
    assert keys.num_rows == events >= RATE, events
    uniq, counts = np.unique(keys.column("key").to_numpy(), return_counts=True)
    want = pa.table({"key": pa.array(uniq, pa.int64()), "count": pa.array(counts, pa.int64())})
    got = rs.read_upsert(out).select(["key", "count"])
    assert got.cast(want.schema).equals(want)
    sql = duckdb.sql(final_table_sql(str(out), ["key"])).to_arrow_table()
    assert sql.select(["key", "count"]).sort_by("key").cast(want.schema).equals(want)
