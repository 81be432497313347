"""Metrics of a running job: per-instance counters grow while it runs, the sink's latency
appears once records reached it, and the final metrics add up."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import raystream as rs
from raystream.metrics import WindowedCounter
from tests.integration._helpers import (
    NOT_SCALED_OUT,
    HeldAt,
    assert_counts_equal,
    keycount_flow,
    last_counts,
    oracle_counts,
    step_metrics,
    stop_on_error,
)

EVENTS = 150_000
RATE_EPS = 50_000  # ~3 s


def _in(snapshot: dict[str, Any], step: str) -> list[int]:
    return [m["records_in"] for m in step_metrics(snapshot["instances"], step)]


def test_metrics_while_running(tmp_path: Path) -> None:
    gen = rs.sources.generator(events=EVENTS, keys=5_000, zipf=0.0, seed=8, rate_eps=RATE_EPS)
    # the source stops short at two thirds of the stream until the test took its readings: they
    # are of a running job however slow the machine
    gate = tmp_path / "read"
    flow = keycount_flow("live", HeldAt(gen, ((EVENTS * 2 // 3, str(gate)),)))
    job = rs.start(flow, parallelism={"count": 2}, batch_rows=5_000, **NOT_SCALED_OUT)
    try:
        with stop_on_error(job):
            deadline = time.monotonic() + 120
            while True:  # until both count instances and the sink saw records
                first = job.metrics()
                if min(_in(first, "count"), default=0) > 0 and sum(_in(first, "out")) > 0:
                    break
                assert time.monotonic() < deadline, f"no records arrived: {first}"
                time.sleep(0.05)
            time.sleep(0.5)
            second = job.metrics()
            status = job.status()
    finally:
        gate.touch()
    with stop_on_error(job):
        result = job.wait(60)

    assert first["state"] == second["state"] == "running"
    assert second["job"] == "live"
    # every count instance's records_in grew between the two calls (and never exceeds the input)
    for a, b in zip(_in(first, "count"), _in(second, "count"), strict=True):
        assert 0 < a < b <= EVENTS
    assert sum(_in(second, "count")) < EVENTS, "the throttled run must still be going"
    lat = second["latency"]
    assert lat is not None and lat["count"] > 0
    assert 0 <= lat["p50_ms"] <= lat["p99_ms"] <= lat["max_ms"]
    assert status["parallelism"] == {"source": 1, "count": 2, "out": 1}
    assert {(m["step"], m["index"]) for m in status["instances"]} == {
        ("source", 0),
        ("count", 0),
        ("count", 1),
        ("out", 0),
    }

    # the final metrics add up
    assert result.state == "finished"
    out = result.table("out")
    assert_counts_equal(last_counts(out), oracle_counts(gen.generate_all()))
    counts = step_metrics(result.metrics, "count")
    assert sum(m["records_in"] for m in counts) == EVENTS
    merged = WindowedCounter.merge_snapshots([m["throughput"] for m in counts])
    assert merged.total == EVENTS
    timeline = merged.timeline()
    span_s = timeline[-1][0] - timeline[0][0] + merged.window_ms / 1000
    assert span_s >= 0.5 * EVENTS / RATE_EPS, f"throttled input took only {span_s} s"
    final = result.latency()
    # latency is weighted per input event: every event counted once, every output row once
    assert final is not None and final.rows == out.num_rows and final.count == EVENTS
