"""Metrics: windowed counters, instance metrics, latency histograms and timelines.

Oracles: numpy percentiles (within HDR precision), an HdrHistogram fed value by value through
its own ``record_value``, hand-computed windows, and a single recorder fed everything.
"""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
from hdrh.histogram import HdrHistogram

from raystream.errors import ConfigError
from raystream.metrics import (
    LATENCY_HIGHEST_US,
    InstanceMetrics,
    LatencyRecorder,
    WindowedCounter,
    build_timeline,
)

MS = 1_000_000  # ns
ORIGIN = 1_700_000_000 * 10**9  # a realistic time.time_ns() origin


def latencies_ms(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(mean=2.0, sigma=1.0, size=n)  # ~7 ms median


def assert_hdr_close(hdr_ms: float, data_ms: np.ndarray, q: float) -> None:
    """HDR keeps 3 significant digits and values are rounded to 1 us."""
    lo = np.percentile(data_ms, q, method="lower")
    hi = np.percentile(data_ms, q, method="higher")
    assert lo * (1 - 1e-3) - 1e-3 <= hdr_ms <= hi * (1 + 1e-3) + 1e-3


# ------------------------------------------------------------------------------------------
# latency


def test_latency_percentiles_match_numpy_within_hdr_precision() -> None:
    lat = latencies_ms(50_000, seed=1)
    now = ORIGIN + 10_000 * MS
    rec = LatencyRecorder(ORIGIN)
    for part in np.array_split(lat, 7):
        rec.record(now - (part * MS).astype(np.int64), now)
    s = rec.summary()
    assert s["count"] == len(lat)
    assert_hdr_close(s["p50_ms"], lat, 50)
    assert_hdr_close(s["p99_ms"], lat, 99)
    assert abs(s["max_ms"] - lat.max()) <= lat.max() * 1e-3 + 1e-3


def test_latency_recorder_agrees_with_hdrhistogram_fed_one_by_one() -> None:
    values_us = np.concatenate(
        [np.arange(0, 3000), np.random.default_rng(2).integers(0, 10**9, 20_000)]
    ).astype(np.int64)
    rec = LatencyRecorder(0)
    rec.record(-values_us * 1000, now_ns=0)
    ref = HdrHistogram(1, 3_600_000_000, 3)
    for v in values_us.tolist():
        ref.record_value(v)
    assert rec.count == ref.get_total_count()
    s = rec.summary()
    assert s["p50_ms"] == ref.get_value_at_percentile(50) / 1000
    assert s["p99_ms"] == ref.get_value_at_percentile(99) / 1000
    assert s["max_ms"] == ref.get_max_value() / 1000
    merged = HdrHistogram.decode(rec.snapshot()["total"])
    for q in (1, 10, 25, 75, 90, 99.9, 100):
        assert merged.get_value_at_percentile(q) == ref.get_value_at_percentile(q)


def test_latency_of_runs_of_equal_stamps_agrees_with_hdrhistogram_fed_one_by_one() -> None:
    """Batches stamped in runs (a source stamps what it reads at once with one time) are
    recorded run by run: the histogram is the one fed every record, with and without weights;
    runs of length 1 and a batch with too many runs to collapse too."""
    rng = np.random.default_rng(5)
    stamps = rng.integers(1, 10**9, 40)
    lengths = rng.integers(1, 5000, 40)
    lengths[3] = 1
    ingest_us = np.repeat(stamps, lengths)  # neighbouring runs may share a stamp: still exact
    weights = rng.integers(0, 4, ingest_us.size)
    ragged = rng.integers(0, 10**9, 3000)  # almost every neighbour differs: not collapsed
    for w in (None, weights):
        rec = LatencyRecorder(0)
        rec.record(-ingest_us * 1000, now_ns=0, weights=w)
        rec.record(-ragged * 1000, now_ns=0)
        ref = HdrHistogram(1, 3_600_000_000, 3)
        counts = np.ones(ingest_us.size, np.int64) if w is None else w
        for v, c in zip(ingest_us.tolist(), counts.tolist(), strict=True):
            if c:
                ref.record_value(v, c)
        for v in ragged.tolist():
            ref.record_value(v)
        assert rec.count == ref.get_total_count()
        assert rec.rows == ingest_us.size + ragged.size
        merged = HdrHistogram.decode(rec.snapshot()["total"])
        for q in (1, 10, 50, 90, 99, 99.9, 100):
            assert merged.get_value_at_percentile(q) == ref.get_value_at_percentile(q)


def test_latency_windows_follow_the_write_time() -> None:
    rec = LatencyRecorder(ORIGIN, window_ms=250)
    data = {0: latencies_ms(1000, 3), 1: latencies_ms(500, 4), 4: latencies_ms(10, 5)}
    for w, lat in data.items():
        now = ORIGIN + w * 250 * MS + 100 * MS  # inside window w
        rec.record(now - (lat * MS).astype(np.int64), now)
    rows = rec.timeline()
    assert [r[0] for r in rows] == [0.0, 0.25, 1.0]
    assert [r[1] for r in rows] == [1000, 500, 10]
    for row, lat in zip(rows, data.values(), strict=True):
        assert_hdr_close(row[2], lat, 50)
        assert_hdr_close(row[3], lat, 99)


def test_latency_clips_negative_and_huge_values() -> None:
    rec = LatencyRecorder(0)
    now = 10 * 3600 * 10**9
    rec.record(np.array([now + 5 * MS, 0]), now)  # ingest in the future; 10 hours old
    s = rec.summary()
    assert s["count"] == 2
    assert s["p50_ms"] == 0.0
    assert abs(s["max_ms"] - LATENCY_HIGHEST_US / 1000) <= LATENCY_HIGHEST_US / 1000 * 1e-3


def test_latency_empty_recorder() -> None:
    rec = LatencyRecorder(0)
    rec.record(np.array([], dtype=np.int64), 5)
    assert rec.summary() == {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    assert rec.timeline() == []
    assert LatencyRecorder.merge_snapshots([]).summary()["count"] == 0


def feed(recorders: list[LatencyRecorder], seed: int) -> None:
    """Random batches over 12 windows, dealt round robin to the recorders."""
    rng = np.random.default_rng(seed)
    for i in range(60):
        now = ORIGIN + int(rng.integers(0, 3000)) * MS
        lat = rng.lognormal(1.0, 1.5, size=int(rng.integers(1, 400)))
        recorders[i % len(recorders)].record(now - (lat * MS).astype(np.int64), now)


def test_merge_of_recorders_equals_one_recorder_fed_everything() -> None:
    single = LatencyRecorder(ORIGIN, live_windows=100)
    feed([single], seed=6)
    parts = [LatencyRecorder(ORIGIN, live_windows=2) for _ in range(3)]
    feed(parts, seed=6)
    snapshots = [pickle.loads(pickle.dumps(p.snapshot())) for p in parts]
    merged = LatencyRecorder.merge_snapshots(snapshots)
    assert merged.summary() == single.summary()
    assert merged.timeline() == single.timeline()
    assert sum(p.count for p in parts) == single.count


def test_sealed_windows_reopen_correctly() -> None:
    sealing = LatencyRecorder(ORIGIN, live_windows=1)
    expanded = LatencyRecorder(ORIGIN, live_windows=100)
    for w in [0, 1, 2, 0, 1, 0]:  # windows come back after being sealed
        now = ORIGIN + w * 250 * MS
        lat = latencies_ms(100, seed=w + 10)
        for rec in (sealing, expanded):
            rec.record(now - (lat * MS).astype(np.int64), now)
    assert len(sealing._live) == 1
    assert sealing.timeline() == expanded.timeline()
    assert sealing.summary() == expanded.summary()


def test_merge_rebins_another_origin_and_rejects_another_window() -> None:
    a = LatencyRecorder(ORIGIN)
    b = LatencyRecorder(ORIGIN + 250 * MS)
    now = ORIGIN + 260 * MS  # a's window 1, b's window 0
    b.record(np.array([now - MS]), now)
    a.merge(b.snapshot())
    assert [row[:2] for row in a.timeline()] == [[0.25, 1]]
    with pytest.raises(ConfigError, match="window_ms=100"):
        a.merge(LatencyRecorder(ORIGIN, window_ms=100).snapshot())


def test_latency_snapshot_is_compact() -> None:
    rec = LatencyRecorder(ORIGIN)
    feed([rec], seed=8)
    assert len(pickle.dumps(rec.snapshot())) < 200_000  # 12 windows, not 12 x 190 KB


# ------------------------------------------------------------------------------------------
# windowed counter and instance metrics


def test_windowed_counter_timeline_and_merge() -> None:
    a = WindowedCounter(ORIGIN, window_ms=100)
    a.add(5, ORIGIN + 10 * MS)
    a.add(7, ORIGIN + 99 * MS)
    a.add(1, ORIGIN + 350 * MS)
    a.add(2, ORIGIN - 5 * MS)  # before the origin: window 0
    assert a.timeline() == [(0.0, 14), (0.1, 0), (0.2, 0), (0.3, 1)]
    b = WindowedCounter(ORIGIN + 100 * MS, window_ms=100)
    b.add(3, ORIGIN + 150 * MS)  # b's window 0 = a's window 1
    a.merge(pickle.loads(pickle.dumps(b.snapshot())))
    assert a.timeline() == [(0.0, 14), (0.1, 3), (0.2, 0), (0.3, 1)]
    assert a.total == 18
    merged = WindowedCounter.merge_snapshots([a.snapshot(), a.snapshot()])
    assert merged.timeline() == [(t, 2 * n) for t, n in a.timeline()]
    with pytest.raises(ConfigError, match="window_ms"):
        a.merge(WindowedCounter(ORIGIN, window_ms=250))
    with pytest.raises(ConfigError, match="window_ms"):
        WindowedCounter(ORIGIN, window_ms=0)


def test_instance_metrics_counts_and_busy_time() -> None:
    m = InstanceMetrics(origin_ns=ORIGIN, window_ms=250)
    m.record_in(100, now_ns=ORIGIN + 10 * MS)
    m.record_in(50, now_ns=ORIGIN + 300 * MS)
    m.record_out(120)
    m.backlog = 7
    with m.busy():
        time.sleep(0.02)
    with pytest.raises(ZeroDivisionError), m.busy():
        1 / 0  # noqa: B018 - busy time counts even when processing fails
    snap = pickle.loads(pickle.dumps(m.snapshot()))
    assert (snap["records_in"], snap["batches_in"], snap["records_out"], snap["backlog"]) == (
        150,
        2,
        120,
        7,
    )
    assert 0.02 <= snap["busy_s"] < 1.0
    assert snap["uptime_s"] >= snap["busy_s"]
    assert WindowedCounter.from_snapshot(snap["throughput"]).timeline() == [(0.0, 100), (0.25, 50)]


# ------------------------------------------------------------------------------------------
# timeline


def test_build_timeline_covers_every_window() -> None:
    throughput = [(0.0, 100), (0.25, 50), (1.0, 25)]
    latency = [[0.25, 50, 1.0, 2.0, 3.0], [0.75, 10, 4.0, 5.0, 6.0]]
    rows = build_timeline(throughput, latency, window_ms=250)
    assert rows == [
        [0.0, 400.0, None, None, None],
        [0.25, 200.0, 1.0, 2.0, 3.0],
        [0.5, 0.0, None, None, None],
        [0.75, 0.0, 4.0, 5.0, 6.0],
        [1.0, 100.0, None, None, None],
    ]
    assert build_timeline([], [], window_ms=250) == []


def test_build_timeline_from_recorders() -> None:
    counter = WindowedCounter(ORIGIN)
    rec = LatencyRecorder(ORIGIN)
    for w in range(8):
        now = ORIGIN + w * 250 * MS + MS
        counter.add(1000, now)
        if w % 2:
            rec.record(np.full(10, now - 2 * MS), now)  # 2000 us: exact in HDR
    rows = build_timeline(counter.timeline(), rec.timeline(), window_ms=250)
    assert [r[0] for r in rows] == [w * 0.25 for w in range(8)]
    assert all(r[1] == 4000.0 for r in rows)
    assert [r[2] for r in rows] == [None, 2.0] * 4


def test_attempt_totals_add_up_over_attempts() -> None:
    """Per-step totals of each attempt, and their sum, against sums computed here."""
    from raystream.metrics import step_totals, sum_totals

    rng = np.random.default_rng(4)
    attempts = [
        [
            {"step": s, "index": i, "records_in": int(rng.integers(0, 1000)),
             "records_out": int(rng.integers(0, 1000)), "busy_s": float(rng.random())}
            for s in ("src", "count") for i in range(3)
        ]
        + [{}]  # an instance that died without reporting
        for _ in range(3)
    ]
    per = [step_totals(a) for a in attempts]
    total = sum_totals(per)
    for step in ("src", "count"):
        snaps = [m for a in attempts for m in a if m.get("step") == step]
        assert total[step]["records_in"] == sum(m["records_in"] for m in snaps)
        assert total[step]["records_out"] == sum(m["records_out"] for m in snaps)
        assert total[step]["busy_s"] == pytest.approx(sum(m["busy_s"] for m in snaps))
        assert total[step]["instances"] == 9
        assert per[0][step]["instances"] == 3


def test_weighted_recording_adds_the_same_counts_as_record_value_per_bucket() -> None:
    """The vectorised recording (bucket counts added to the counts array with numpy) leaves
    each histogram exactly as HdrHistogram's own record_value of each value, weight times:
    counts array, total, min and max; batches add up."""
    rng = np.random.default_rng(7)
    rec = LatencyRecorder(0)
    ref = HdrHistogram(1, 3_600_000_000, 3)
    for _ in range(5):
        values_us = rng.integers(0, 10**7, 300).astype(np.int64)
        weights = rng.integers(0, 4, 300)
        rec.record(-values_us * 1000, now_ns=0, weights=weights)
        for v, w in zip(values_us.tolist(), weights.tolist(), strict=True):
            if w:
                ref.record_value(v, w)
    got = rec.total_histogram()
    n = ref.counts_len
    assert np.array_equal(np.ctypeslib.as_array(got.counts)[:n], np.ctypeslib.as_array(ref.counts)[:n])
    assert got.get_total_count() == ref.get_total_count()
    assert got.get_min_value() == ref.get_min_value()
    assert got.get_max_value() == ref.get_max_value()
    assert HdrHistogram.decode(rec.snapshot()["total"]).get_total_count() == ref.get_total_count()
