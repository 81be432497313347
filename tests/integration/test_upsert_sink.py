"""An upsert Parquet sink under checkpoints on Ray: a keyed running count whose instance is
killed mid-stream recovers from its checkpoint, and the final table read back from the committed
files (``rs.read_upsert`` and the documented DuckDB query) equals the count of every key in the
generated stream (numpy, independent of raystream). The sink numbers the changes itself
(no ``order_by``), so its sequence must survive the restore too."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import ray

import raystream as rs
from raystream.runtime.actors import NAMESPACE, instance_actor_name
from raystream.upsert import final_table_sql
from tests.integration._helpers import NOT_SCALED_OUT, generator_prefix

KEYS = 2_000
RATE = 40_000


@dataclass(frozen=True)
class EndAtGate:
    """The rate-limited generator ``gen`` (one instance) until the file ``gate`` exists, then up
    to the event number written in it, then the end. The reader writes how many events it sent
    to ``gate + ".events"`` when it closes. A recovery's reader reads the same events again up to
    the checkpoint's offset (raystream's rewind), which the test keeps below that number: a gate
    opened while a reader rewinds cannot end the stream short of the checkpoint."""

    gen: Any
    gate: str

    def schema(self) -> pa.Schema:
        return self.gen.schema()  # type: ignore[no-any-return]

    @property
    def rate_eps(self) -> float:
        return float(self.gen.rate_eps)

    def describe(self) -> str:
        return f"end_at_gate({self.gen.describe()})"

    def open(self, index: int, parallelism: int) -> Any:
        assert parallelism == 1, "one source instance: the gate holds one event number"
        return _EndAtGateReader(self, self.gen.open(index, parallelism))


class _EndAtGateReader:
    def __init__(self, spec: EndAtGate, inner: Any) -> None:
        self.spec, self.inner = spec, inner
        self.emitted = 0
        self.end: int | None = None

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        if self.end is None and os.path.exists(self.spec.gate):
            with open(self.spec.gate) as f:
                self.end = int(f.read())
        if self.end is not None:
            max_rows = min(max_rows, self.end - self.emitted)
            if max_rows <= 0:
                return None
        batch = self.inner.read(max_rows)
        if batch is not None:
            self.emitted += batch.num_rows
        return batch

    def close(self) -> None:
        self.inner.close()
        tmp = self.spec.gate + ".events.tmp"
        with open(tmp, "w") as f:
            f.write(str(self.emitted))
        os.replace(tmp, self.spec.gate + ".events")


def _open_gate(gate: str, end: int) -> None:
    with open(gate + ".tmp", "w") as f:
        f.write(str(end))
    os.replace(gate + ".tmp", gate)  # appears whole


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
            last = job.status()["checkpoints"]["last"] or {}
            offsets = (last.get("source_offsets") or {}).values()
            _open_gate(gate, max((int(v or 0) for v in offsets), default=0) + RATE)
        result = job.wait(120)
    finally:
        job.cancel()
    assert result.state == "finished" and len(result.recoveries) >= 1
    # the events the source sent (its reader writes the count when it closes at the end)
    events = int(Path(gate + ".events").read_text())
    keys = generator_prefix(gen, events)
    assert keys.num_rows == events >= RATE, events
    uniq, counts = np.unique(keys.column("key").to_numpy(), return_counts=True)
    want = pa.table({"key": pa.array(uniq, pa.int64()), "count": pa.array(counts, pa.int64())})
    got = rs.read_upsert(out).select(["key", "count"])
    assert got.cast(want.schema).equals(want)
    sql = duckdb.sql(final_table_sql(str(out), ["key"])).to_arrow_table()
    assert sql.select(["key", "count"]).sort_by("key").cast(want.schema).equals(want)
