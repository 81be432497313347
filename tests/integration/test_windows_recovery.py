"""Windows held in memory survive a killed instance: checkpoints every 0.5 s, one window
instance killed with Ray's own API after two of them, the job recovers from the last one and
the exactly-once Parquet output equals DuckDB's windows over the same input (no window lost,
none twice)."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
import ray
import raystream.operators as ops
from raystream.operators import windows

import raystream as rs
from raystream.runtime.actors import NAMESPACE, instance_actor_name
from tests.integration._helpers import NOT_SCALED_OUT, wait_checkpoints
from tests.integration._window_helpers import (
    OUT_OF_ORDERNESS_MS,
    events,
    sliding_oracle,
    tumbling_oracle,
)

N = 120_000
RATE_EPS = 30_000  # ~4 s of stream
AGG = [ops.count(), ops.sum("x"), ops.max("x")]


@pytest.mark.parametrize("kind", ["sliding", "tumbling"])
def test_windows_recover_from_a_killed_instance_exactly(tmp_path: Path, kind: str) -> None:
    table = events(N, keys=150, seed=31 if kind == "sliding" else 32)
    op = windows.sliding(2_000, 500, AGG) if kind == "sliding" else windows.tumbling(1_000, AGG)
    out = tmp_path / "out"
    flow = rs.Dataflow(f"window-recovery-{kind}", num_key_groups=32, sub_groups=4)
    (
        flow.source(
            rs.sources.from_table(table, rate_eps=RATE_EPS),
            event_time="ts",
            max_out_of_orderness_ms=OUT_OF_ORDERNESS_MS,
        )
        .key_by("k")
        .apply(op, name="window")
        .sink(rs.sinks.parquet(str(out)), name="out")
    )
    job = rs.start(
        flow,
        parallelism={"window": 2},
        checkpoint_interval_s=0.5,
        checkpoint_dir=str(tmp_path / "chk"),
        restart_delay_s=0.2,
        linger_ms=10.0,
        **NOT_SCALED_OUT,
    )
    try:
        wait_checkpoints(job, 2)
        ray.kill(ray.get_actor(instance_actor_name(job.name, "window", 0), namespace=NAMESPACE))
        result = job.wait(180)
    finally:
        job.cancel()
    assert result.state == "finished"
    assert len(result.recoveries) >= 1, result.recoveries
    assert result.recoveries[0]["checkpoint_id"] is not None
    got = sorted(
        duckdb.connect()
        .sql(
            f"select k, window_start, count, x_sum, x_max from read_parquet('{out}/*.parquet')"
        )
        .fetchall()
    )
    want = sliding_oracle(table, 2_000, 500) if kind == "sliding" else tumbling_oracle(table, 1_000)
    assert len(got) == len(want)
    assert got == want
