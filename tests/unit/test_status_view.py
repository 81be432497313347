"""``raystream status`` rows: per-instance metrics summed per operator (no Ray)."""

from __future__ import annotations

import numpy as np

from raystream.metrics import InstanceMetrics, LatencyRecorder, WindowedCounter
from raystream.status_view import operator_rows, recent_rate

S = 1_000_000_000


def _instance(step: str, index: int, n_in: int, at_s: list[float], **extra: object) -> dict:
    m = InstanceMetrics(origin_ns=0)
    for t in at_s:
        m.record_in(n_in, now_ns=int(t * S))
    m.record_out(n_in * len(at_s) // 2)
    snap = m.snapshot()
    snap.update(step=step, index=index, busy_s=1.0, uptime_s=4.0, backlog=2, **extra)
    return snap


def test_rows_sum_instances_per_operator_in_plan_order() -> None:
    sink_lat = LatencyRecorder(origin_ns=0)
    sink_lat.record(np.array([0, 0, 0, 0]), now_ns=int(0.010 * S))  # four records 10 ms old
    status = {
        "parallelism": {"source": 1, "count": 2, "out": 1},
        "instances": [
            _instance("count", 1, 100, [0.1, 3.1]),
            _instance("count", 0, 100, [0.1, 2.6, 3.6]),
            _instance("source", 0, 0, []),
            _instance("out", 0, 10, [1.0], latency=sink_lat.snapshot()),
            _instance("count", 2, 50, [0.5], finished=True, migration={"done": True}),
        ],
    }
    rows = {r["operator"]: r for r in operator_rows(status, now_ns=4 * S + S // 10)}
    assert list(rows) == ["source", "count", "out"]
    count = rows["count"]
    assert count["parallelism"] == 2 and count["instances_live"] == 2
    assert count["records_in"] == 200 + 300 + 50
    # last 2 s of complete 250 ms windows before 4.1 s: [2.0, 4.0): 100 + 100 + 100 from live ones
    assert count["rate_in_per_s"] == 150.0
    assert count["busy_pct"] == 25.0
    assert count["backlog"] == 4  # the finished instance's backlog is left out
    assert count["migration"] == "done"
    assert abs(rows["out"]["latency_p50_ms"] - 10.0) <= 0.01  # HDR: within 0.1 %
    assert rows["count"]["latency_p50_ms"] is None


def test_recent_rate_leaves_out_the_window_still_filling() -> None:
    c = WindowedCounter(origin_ns=0, window_ms=1000)
    c.add(10, now_ns=0)
    c.add(20, now_ns=1 * S)
    c.add(999, now_ns=2 * S + 1)  # the current window
    assert recent_rate(c, now_ns=2 * S + 500, span_s=2.0) == 15.0
    assert recent_rate(WindowedCounter(origin_ns=0), now_ns=0) == 0.0
