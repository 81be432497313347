"""Watermark logic without Ray: source generation, per-channel tracking, idleness, definition."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import raystream as rs
from raystream.runtime.watermarks import (
    WATERMARK_MAX,
    WATERMARK_MIN,
    EventTimeSpec,
    SourceWatermarks,
    WatermarkTracker,
    event_time_ms,
)

A, B, C = ("up", 0), ("up", 1), ("other", 0)


def test_tracker_is_the_minimum_over_channels_and_only_advances() -> None:
    t = WatermarkTracker([A, B])
    assert t.on_watermark(A, 100) is None  # B has none yet
    assert t.current == WATERMARK_MIN
    assert t.on_watermark(B, 50) == 50
    assert t.on_watermark(B, 40) is None  # a channel going back is ignored
    assert t.on_watermark(B, 150) == 100
    assert t.on_watermark(A, 120) == 120
    assert t.current == 120


def test_tracker_end_of_stream_counts_as_infinity() -> None:
    t = WatermarkTracker([A, B])
    t.on_watermark(A, 10)
    assert t.on_end(B) == 10
    assert t.on_end(A) == WATERMARK_MAX


def test_tracker_excludes_idle_channels_until_they_send_again() -> None:
    t = WatermarkTracker([A, B])
    t.on_watermark(A, 10)
    t.on_watermark(B, 5)
    assert t.current == 5
    assert t.on_watermark(B, 5, idle=True) == 10  # B idle: A alone counts
    assert t.on_watermark(A, 30) == 30
    t.on_records(B)  # B active again with watermark 5: held, never backwards
    assert t.combined() == 5 and t.current == 30
    assert t.on_watermark(A, 40) is None
    assert t.on_watermark(B, 35) == 35


def test_tracker_all_idle_holds_and_reports_idle() -> None:
    t = WatermarkTracker([A, B])
    t.on_watermark(A, 7)
    t.on_watermark(B, 9)
    t.on_watermark(A, 7, idle=True)
    assert not t.all_idle
    assert t.on_watermark(B, 9, idle=True) is None
    assert t.all_idle and t.current == 9


def test_tracker_new_channel_holds_the_watermark_but_never_moves_it_back() -> None:
    t = WatermarkTracker([A])
    assert t.on_watermark(A, 100) == 100
    t.add(C)  # a rescale added an upstream instance
    assert t.on_watermark(A, 200) is None
    assert t.current == 100
    assert t.on_watermark(C, 150) == 150


def test_tracker_matches_a_brute_force_oracle_on_random_sequences() -> None:
    rng = np.random.default_rng(3)
    channels = [("s", i) for i in range(4)]
    for _ in range(50):
        t = WatermarkTracker(channels)
        last = {c: WATERMARK_MIN for c in channels}
        ended: set = set()
        expected_current = WATERMARK_MIN
        for _ in range(40):
            c = channels[int(rng.integers(4))]
            if c in ended:
                continue
            if rng.random() < 0.05:
                t.on_end(c)
                ended.add(c)
            else:
                t.on_watermark(c, int(rng.integers(0, 1000)))
                last[c] = max(last[c], t._wm[c])
            live = [last[x] for x in channels if x not in ended]
            expected_current = max(expected_current, min(live) if live else WATERMARK_MAX)
            assert t.current == expected_current


def test_source_watermark_is_max_event_time_minus_bound_minus_one() -> None:
    sw = SourceWatermarks(EventTimeSpec("ts", max_out_of_orderness_ms=10))
    b = pa.record_batch({"ts": [5]})
    assert sw.after_batch(b, np.array([100, 90, 120])) == 109
    assert sw.after_batch(b, np.array([115])) is None  # max did not grow
    assert sw.after_batch(b, np.array([200])) == 189


def test_source_user_watermark_function() -> None:
    sw = SourceWatermarks(EventTimeSpec("ts", watermark=lambda b: int(min(b["ts"].to_pylist()))))
    assert sw.after_batch(pa.record_batch({"ts": [30, 40]}), np.array([30, 40])) == 30
    assert sw.after_batch(pa.record_batch({"ts": [20]}), np.array([20])) is None


def test_source_idleness_with_a_fake_clock() -> None:
    now = [0.0]
    sw = SourceWatermarks(EventTimeSpec("ts", watermark_idle_ms=100), clock=lambda: now[0])
    sw.after_batch(pa.record_batch({"ts": [1]}), np.array([1]))
    now[0] = 0.05
    assert not sw.check_idle()
    now[0] = 0.2
    assert sw.check_idle() and sw.idle
    assert not sw.check_idle()  # reported once
    sw.after_batch(pa.record_batch({"ts": [2]}), np.array([2]))
    assert not sw.idle


def test_event_time_ms_converts_timestamp_units() -> None:
    ms = np.array([1_700_000_000_123, 5], np.int64)
    batch = pa.record_batch(
        {
            "s": pa.array(ms // 1000, pa.timestamp("s")),
            "us": pa.array(ms * 1000, pa.timestamp("us", tz="UTC")),
            "i": pa.array(ms),
        }
    )
    assert event_time_ms(batch, "us").tolist() == ms.tolist()
    assert event_time_ms(batch, "i").tolist() == ms.tolist()
    assert event_time_ms(batch, "s").tolist() == (ms // 1000 * 1000).tolist()
    with pytest.raises(rs.SchemaError, match="null"):
        event_time_ms(pa.record_batch({"i": pa.array([1, None], pa.int64())}), "i")


def test_source_event_time_checked_at_definition() -> None:
    table = pa.table({"key": [1], "ts": pa.array(["x"]), "t": pa.array([1], pa.int64())})
    flow = rs.Dataflow("wm-def")
    with pytest.raises(rs.DataflowDefinitionError, match="no column"):
        flow.source(rs.sources.from_table(table), event_time="nope")
    with pytest.raises(rs.DataflowDefinitionError, match="timestamp or int64"):
        flow.source(rs.sources.from_table(table), event_time="ts", name="s2")
    with pytest.raises(rs.DataflowDefinitionError, match="max_out_of_orderness_ms"):
        flow.source(rs.sources.from_table(table), event_time="t", max_out_of_orderness_ms=-1)
    with pytest.raises(rs.DataflowDefinitionError, match="need event_time"):
        flow.source(rs.sources.from_table(table), watermark_idle_ms=5, name="s3")
    flow.source(rs.sources.from_table(table), event_time="t", name="ok")
    assert flow.steps["ok"].event_time == EventTimeSpec("t")
