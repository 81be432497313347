"""Windows held in memory survive a killed instance: checkpoints every 0.5 s, one window
instance killed with Ray's own API after two of them, the job recovers from the last one and
the exactly-once Parquet output equals DuckDB's windows over the same input (no window lost,
none twice). The input (20 s of it at its rate) runs until the job recovered
(``_gates.EndAtGate``), then a second more: the kill lands while it flows however long the
checkpoints before it take; the oracle is DuckDB over the rows that were sent."""

from __future__ import annotations

import time
from pathlib import Path

import duckdb
import pytest
import ray
import raystream.operators as ops
from raystream.operators import windows

import raystream as rs
from raystream.runtime.actors import NAMESPACE, instance_actor_name
from tests.integration._gates import EndAtGate, end_after_checkpoint, events_sent, open_gate
from tests.integration._helpers import NOT_SCALED_OUT, wait_checkpoints
from tests.integration._window_helpers import (
    OUT_OF_ORDERNESS_MS,
    events,
    sliding_oracle,
    tumbling_oracle,
)

RATE_EPS = 30_000
N = RATE_EPS * 20  # 20 s of stream at most; the test ends it about a second after the recovery
AGG = [ops.count(), ops.sum("x"), ops.max("x")]


@pytest.mark.parametrize("kind", ["sliding", "tumbling"])
def test_windows_recover_from_a_killed_instance_exactly(tmp_path: Path, kind: str) -> None:
    table = events(N, keys=150, seed=31 if kind == "sliding" else 32)
    op = windows.sliding(2_000, 500, AGG) if kind == "sliding" else windows.tumbling(1_000, AGG)
    out, gate = tmp_path / "out", str(tmp_path / "gate")
    flow = rs.Dataflow(f"window-recovery-{kind}", num_key_groups=32, sub_groups=4)
    (
        flow.source(
            EndAtGate(rs.sources.from_table(table, rate_eps=RATE_EPS), gate),
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
        status = job.status()
        ended = [m for m in status["instances"] if m.get("role") == "source" and m["finished"]]
        assert not ended, (
            f"the input ended before the kill (it lasts {N // RATE_EPS} s): {status['checkpoints']}"
        )
        ray.kill(ray.get_actor(instance_actor_name(job.name, "window", 0), namespace=NAMESPACE))
        deadline = time.monotonic() + 60
        while not (job.status()["recoveries"] and job.status()["state"] == "running"):
            assert time.monotonic() < deadline, f"no recovery within 60 s: {job.status()['state']}"
            time.sleep(0.05)
        # past the newest checkpoint's offset: the recovered reader's rewind is never cut short
        open_gate(gate, end_after_checkpoint(job.status(), RATE_EPS))
        result = job.wait(180)
    finally:
        job.cancel()
    table = table.slice(0, events_sent(gate))  # the rows that were sent: the oracle's input
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
