"""bench.reconfigure's latency spans around one change, on a hand-made latency record: the
oracle is numpy's percentile over the latencies that fall in each span. No Ray."""

from __future__ import annotations

import numpy as np

from tests._bench import put_bench_on_path

put_bench_on_path()

from bench.reconfigure import change_spans  # noqa: E402
from raystream.metrics import LatencyRecorder  # noqa: E402

S = 1_000_000_000  # ns per second


def test_before_during_and_after_cover_their_windows() -> None:
    rng = np.random.default_rng(3)
    rec = LatencyRecorder(origin_ns=0)
    lat_ms: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    peak = (0.0, 0.0)  # the highest latency during the change, and when it was recorded
    # one batch of 50 records every 100 ms over 14 s; the change runs from 5 s to 6 s and
    # latency is high from its start until 2 s after its end
    for t in np.arange(0.05, 14.0, 0.1):
        high = 5.0 <= t < 8.0
        ms = rng.uniform(40, 90, 50) if high else rng.uniform(5, 10, 50)
        now = int(t * S)
        rec.record(now - (ms * 1e6).astype(np.int64), now)
        if 2.0 <= t < 5.0:
            lat_ms["before"].extend(ms)
        elif 5.0 <= t < 8.25:  # the window holding the end of "during" is part of it
            lat_ms["during"].extend(ms)
            peak = max(peak, (float(ms.max()), float(t)))
        elif 8.25 <= t < 11.5:
            lat_ms["after"].extend(ms)
    spans = change_spans(rec, {"start_s": 5.0, "end_s": 6.0}, window_s=3.0)
    for name, values in lat_ms.items():
        got = spans[name]
        assert got["p99_ms"] == np.float64(got["p99_ms"])
        assert abs(got["p99_ms"] - np.percentile(values, 99)) <= 0.5, (name, got)
        assert abs(got["max_ms"] - max(values)) <= 0.1, (name, got)
    assert spans["during"]["max_ms"] > 40 > spans["before"]["max_ms"]
    assert spans["peak_over_steady_p99"] == round(
        spans["during"]["max_ms"] / spans["before"]["p99_ms"], 2
    )
    # when the highest latency came: its window's start, from the change's start
    window_s = rec.window_ms / 1000
    assert spans["peak_window_at_s"] == round(peak[1] // window_s * window_s - 5.0, 3)



def test_a_refill_span_covers_its_process_starts_and_one_second_more() -> None:
    from bench.reconfigure import refill_span

    rec = LatencyRecorder(origin_ns=0)
    # 20 ms everywhere, 700 ms at 11.9 s (inside the span), 5 s at 13 s (after it)
    for t, ms in ((10.6, 20.0), (11.9, 700.0), (12.2, 20.0), (13.0, 5000.0)):
        now = int(t * S)
        rec.record(np.full(5, now - int(ms * 1e6), dtype=np.int64), now)
    span = refill_span(rec, {"why": "insert", "start_s": 10.5, "process_starts_s": [0.5, 0.5]})
    assert span["to_s"] == 12.5 and span["why"] == "insert"
    assert 690 <= span["max_ms"] <= 710
