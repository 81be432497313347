"""A hive-partitioned Parquet folder in, a rolling Parquet sink out, a source instance killed
mid-stream: the job rewinds the file source to its checkpointed (unit, row) and the published
files hold every input record exactly once. Oracle: DuckDB over the input folder and the output.
"""

from __future__ import annotations

import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import ray

import raystream as rs
from raystream.runtime.actors import NAMESPACE, instance_actor_name
from tests.integration._helpers import (
    NOT_SCALED_OUT,
    HeldAt,
    running_count_carrying,
    wait_checkpoints,
)

EVENTS = 120_000
RATE = 30_000  # ~4 s of stream


running_count = running_count_carrying("day")


def _write_input(root: Path) -> None:
    """The generator's stream in order, cut into 6 files over day=1..3 folders."""
    table = rs.sources.generator(events=EVENTS, keys=2_000, seed=5).generate_all()
    bounds = np.linspace(0, EVENTS, 7).astype(int)
    for i in range(6):
        d = root / f"day={i // 2 + 1}"
        d.mkdir(parents=True, exist_ok=True)
        part = table.slice(bounds[i], bounds[i + 1] - bounds[i])
        pq.write_table(part, d / f"f{i}.parquet", row_group_size=7_000)


def test_file_source_rewinds_and_rolling_sink_is_exactly_once(tmp_path: Path) -> None:
    data, out = tmp_path / "in", tmp_path / "out"
    _write_input(data)
    # the source stops short at two thirds of its rows until the job recovered from the kill:
    # the kill lands mid-stream however long the checkpoints take
    gate = tmp_path / "recovered"
    source = HeldAt(
        rs.sources.parquet(data, rate_eps=RATE, batch_rows=2_000), ((EVENTS * 2 // 3, str(gate)),)
    )
    flow = rs.Dataflow("file-io-rec", num_key_groups=32, sub_groups=4)
    (
        flow.source(source, parallelism=1)
        .key_by("key")
        .apply(running_count, name="count")
        .sink(rs.sinks.parquet(out, max_file_bytes=64_000), name="out")
    )
    job = rs.start(
        flow,
        parallelism={"count": 2},
        checkpoint_interval_s=0.5,
        checkpoint_dir=str(tmp_path / "chk"),
        restart_delay_s=0.2,
        linger_ms=10.0,
        **NOT_SCALED_OUT,
    )
    try:
        wait_checkpoints(job, 2)
        (src,) = [m for m in job.status()["instances"] if m.get("step") == "source"]
        assert not src["finished"], f"the source ended before the kill: {src}"
        actor = instance_actor_name(job.name, "source", 0)
        ray.kill(ray.get_actor(actor, namespace=NAMESPACE))
        deadline = time.monotonic() + 120
        while not ((st := job.status())["recoveries"] and st["state"] == "running"):
            assert st["state"] in ("running", "recovering"), f"the job is {st['state']}"
            assert time.monotonic() < deadline, "no recovery within 120 s of the kill"
            time.sleep(0.05)
        gate.touch()
        result = job.wait(120)
    finally:
        gate.touch()
        job.cancel()
    assert result.state == "finished"
    assert [r["instance"][0] for r in result.recoveries] == ["source"]
    assert result.recoveries[0]["checkpoint_id"] is not None  # rewound, not started over
    assert any("-r" in p.name for p in out.glob("part-*.parquet"))  # the sink rolled

    con = duckdb.connect()
    got = f"read_parquet('{out}/*.parquet')"
    want = f"read_parquet('{data}/*/*.parquet', hive_partitioning=true)"
    dup = con.sql(f"select key, seq from {got} group by 1, 2 having count(*) > 1").fetchall()
    assert dup == []
    wrong = con.sql(f"select key, seq, count from {got} where count != seq + 1 limit 5").fetchall()
    assert wrong == []
    diff = con.sql(
        f"(select key, seq, day from {want} except select key, seq, day from {got}) union all "
        f"(select key, seq, day from {got} except select key, seq, day from {want})"
    ).fetchall()
    assert diff == []
    assert con.sql(f"select count(*) from {got}").fetchall() == [(EVENTS,)]
