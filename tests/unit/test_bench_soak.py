"""bench.soak's pieces without Ray: the input regenerates exactly, the growth is a least-squares
slope over the second half, and the sampler's p99 reads only the windows of its interval."""

from __future__ import annotations

import numpy as np
import pytest

from bench.soak import growth_per_hour, p99_between, soak_events
from raystream.metrics import LatencyRecorder

S = 1_000_000_000


def test_the_input_is_the_same_read_in_any_pieces() -> None:
    whole = soak_events(0, 10_000, keys=50, events_per_ms=20, seed=3)
    parts = [soak_events(a, min(a + 777, 10_000), 50, 20, 3) for a in range(0, 10_000, 777)]
    assert np.array_equal(np.concatenate([p["key"].to_numpy() for p in parts]), whole["key"])
    assert np.array_equal(np.concatenate([p["ts"].to_numpy() for p in parts]), whole["ts"])
    keys = whole["key"].to_numpy()
    assert keys.min() >= 0 and keys.max() < 50 and len(np.unique(keys)) == 50
    assert np.all(np.diff(whole["ts"].to_numpy()) >= 0)  # in event-time order: nothing late
    assert whole["ts"].to_numpy()[-1] == 9_999 // 20


def test_growth_is_the_slope_per_hour_over_the_samples_from_the_given_time() -> None:
    t = [0.0, 300.0, 600.0, 900.0, 1200.0]
    y = [100.0, 0.0, 10.0, 20.0, 30.0]  # a cold start, then +10 per 5 minutes
    g = growth_per_hour(t, y, from_s=600.0)
    assert g["per_hour"] == pytest.approx(120.0) and g["points"] == 3
    assert g["first"] == 10.0 and g["last"] == 30.0
    assert growth_per_hour(t, [None, None, None, 1.0, 2.0], 0.0)["per_hour"] is None


def test_p99_of_an_interval_reads_its_windows_only() -> None:
    rec = LatencyRecorder(0)
    rec.record(np.array([10 * S - 500_000_000]), 10 * S)  # 500 ms at 10 s
    rec.record(np.full(100, 20 * S - 2_000_000), 20 * S)  # 2 ms at 20 s
    snap = rec.snapshot()
    assert p99_between([snap], 15.0, 25.0) == pytest.approx(2.0, rel=1e-3)
    assert p99_between([snap], 5.0, 25.0) == pytest.approx(2.0, rel=1e-3)
    assert p99_between([snap], 9.0, 11.0) == pytest.approx(500.0, rel=1e-3)
    assert p99_between([snap], 30.0, 40.0) is None
