"""A partitioned Parquet sink (``partition_by``, two folder levels, a small cap on open parts)
in a checkpointed job, one of its two instances killed mid-stream: the job restores the sink
from its checkpoint and the published folders hold every input record exactly once, each in
the folder of its values. Oracle: DuckDB over the output (hive partitioning) and the generator's
stream. The generator runs until the job recovered (``_gates.EndAtGate``), then a second more:
the kill lands while the input flows however long the checkpoints before it take."""

from __future__ import annotations

import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import ray

import raystream as rs
from raystream.runtime.actors import NAMESPACE, instance_actor_name
from tests.integration._gates import EndAtGate, end_after_checkpoint, events_sent, open_gate
from tests.integration._helpers import NOT_SCALED_OUT, generator_prefix, wait_checkpoints

RATE = 20_000  # events/s
BUCKETS = 6


def tag(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Partition columns: ``bucket`` = key % 6 (int), ``half`` = 'even'/'odd' by seq."""
    even = pc.equal(pc.bit_wise_and(batch.column("seq"), 1), 0)
    return pa.RecordBatch.from_pydict(
        {
            "key": batch.column("key"),
            "seq": batch.column("seq"),
            "bucket": pc.remainder(batch.column("key"), BUCKETS),
            "half": pc.if_else(even, "even", "odd"),
        }
    )


def test_killed_partitioned_sink_instance_is_exactly_once(tmp_path: Path) -> None:
    out, gate = tmp_path / "out", str(tmp_path / "gate")
    gen = rs.sources.generator(events=RATE * 1200, keys=500, seed=3, rate_eps=RATE)
    flow = rs.Dataflow("partsink-rec", num_key_groups=16)
    (
        flow.source(EndAtGate(gen, gate), parallelism=1)
        .key_by("key")
        .apply(rs.map_batches(tag, name="tag"), name="tag")
        .options(chain=False)
        .sink(
            rs.sinks.parquet(out, partition_by=["bucket", "half"], max_open_partitions=4),
            name="out",
            parallelism=2,
        )
    )
    flow.options("out", chain=False)
    job = rs.start(
        flow,
        parallelism={"tag": 2},
        checkpoint_interval_s=0.4,
        checkpoint_dir=str(tmp_path / "chk"),
        restart_delay_s=0.2,
        linger_ms=10.0,
        **NOT_SCALED_OUT,
    )
    try:
        wait_checkpoints(job, 2)
        actor = instance_actor_name(job.name, "out", 0)
        ray.kill(ray.get_actor(actor, namespace=NAMESPACE))
        deadline = time.monotonic() + 60
        while not (job.status()["recoveries"] and job.status()["state"] == "running"):
            assert time.monotonic() < deadline, f"no recovery within 60 s: {job.status()['state']}"
            time.sleep(0.05)
        # past the newest checkpoint's offset: the recovered reader's rewind is never cut short
        open_gate(gate, end_after_checkpoint(job.status(), RATE))
        result = job.wait(120)
    finally:
        job.cancel()
    events = events_sent(gate)
    want = generator_prefix(gen, events).select(["key", "seq"])
    assert want.num_rows == events > 0
    assert result.state == "finished"
    assert [r["instance"][0] for r in result.recoveries] == ["out"]
    assert result.recoveries[0]["checkpoint_id"] is not None  # restored, not started over

    con = duckdb.connect()
    con.register("want", want)
    got = (
        f"read_parquet('{out}/*/*/*.parquet', hive_partitioning=true, "
        "hive_types={'bucket': BIGINT, 'half': VARCHAR})"
    )
    dup = con.sql(f"select key, seq from {got} group by 1, 2 having count(*) > 1").fetchall()
    assert dup == []
    misplaced = con.sql(
        f"select key, seq, bucket, half from {got} where bucket != key % {BUCKETS} "
        "or half != (case when seq % 2 = 0 then 'even' else 'odd' end) limit 5"
    ).fetchall()
    assert misplaced == []
    diff = con.sql(
        f"(select key, seq from want except select key, seq from {got}) union all "
        f"(select key, seq from {got} except select key, seq from want)"
    ).fetchall()
    assert diff == []
    assert con.sql(f"select count(*) from {got}").fetchall() == [(events,)]
    assert not [p for p in out.rglob(".*") if p.is_file()], "hidden files left behind"
