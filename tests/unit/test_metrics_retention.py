"""A job that runs for days keeps bounded metrics: the per-window timelines (throughput, sink
latency per 250 ms) cover the last ``retain_s`` seconds, the whole run's totals are kept, and
``metrics()``/``status()`` do not grow with the run's length or its number of changes.

Oracles: a recorder/counter that keeps every window (``retain_s=None``) fed the same input, and
the counts fed (plain Python sums).
"""

from __future__ import annotations

import asyncio
import pickle
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raystream.controller import RECONFIGURATIONS_SHOWN, Controller
from raystream.errors import ConfigError
from raystream.metrics import DEFAULT_RETAIN_S, LatencyRecorder, WindowedCounter
from raystream.runtime.instance import RuntimeConfig
from tests.unit._plain_controller import Call, plain_controller

S = 1_000_000_000  # ns
DAY_S = 86_400
EVERY_S = 5  # one batch every 5 s: a day is 17,280 batches, each in a window of its own


def _fed_a_day(rec: LatencyRecorder, *, every_s: int = EVERY_S, rows: int = 50) -> int:
    """A day of batches (``rows`` records ``k`` ms old each, k = 1..rows); the events fed."""
    ages = np.arange(1, rows + 1, dtype=np.int64) * 1_000_000
    for t in range(0, DAY_S, every_s):
        now = t * S + 1
        rec.record(now - ages, now)
    return rows * (DAY_S // every_s)


def test_a_day_of_windows_keeps_the_last_15_minutes_and_the_whole_runs_totals() -> None:
    rec = LatencyRecorder(origin_ns=0)  # the default: as every sink records
    fed = _fed_a_day(rec)
    snap = pickle.dumps(rec.snapshot())
    # a day kept every window: 17,280 encoded histograms (~1.3 MB here, ~40 MB at 250 ms)
    assert len(snap) < 150_000, f"a day of windows is {len(snap):,} bytes pickled"
    rows = rec.timeline()
    assert len(rows) == DEFAULT_RETAIN_S // EVERY_S
    assert rows[0][0] >= DAY_S - DEFAULT_RETAIN_S - EVERY_S
    assert rec.count == fed and rec.summary()["count"] == fed  # the whole run
    assert rec.summary()["max_ms"] == pytest.approx(50.0, rel=1e-3)
    assert rec.dropped == fed - sum(r[1] for r in rows)
    assert rec.dropped_windows == DAY_S // EVERY_S - len(rows)


def test_the_kept_windows_equal_those_of_a_recorder_that_keeps_all() -> None:
    bounded, everything = LatencyRecorder(0, retain_s=60.0), LatencyRecorder(0, retain_s=None)
    rng = np.random.default_rng(3)
    for t in np.sort(rng.integers(0, 600 * S, 2_000)):
        ages = rng.integers(0, 200_000_000, 20)
        bounded.record(int(t) - ages, int(t))
        everything.record(int(t) - ages, int(t))
    kept = bounded.timeline()
    assert kept == [r for r in everything.timeline() if r[0] >= kept[0][0]]
    assert kept[0][0] >= 600 - 60 - 0.25
    assert bounded.summary() == everything.summary()
    assert bounded.summary_between(560, 600) == everything.summary_between(560, 600)


def test_a_windowed_counter_keeps_its_total_past_the_span() -> None:
    c = WindowedCounter(origin_ns=0)
    for t in range(0, DAY_S, EVERY_S):
        c.add(7, t * S)
    assert c.total == 7 * (DAY_S // EVERY_S)
    assert len(pickle.dumps(c.snapshot())) < 20_000
    assert len([n for _, n in c.timeline() if n]) == DEFAULT_RETAIN_S // EVERY_S
    merged = WindowedCounter.merge_snapshots([c.snapshot(), c.snapshot()])
    assert merged.total == 2 * c.total  # dropped windows' counts travel in the snapshot


def test_a_merge_keeps_windows_older_than_its_newest_minus_the_span_only_in_totals() -> None:
    late = WindowedCounter(0, retain_s=10.0)
    late.add(5, 100 * S)
    late.add(3, 1 * S)  # 99 s before the newest: counted, not a window
    assert late.total == 8 and late.timeline() == [(100.0, 5)]
    rec = LatencyRecorder(0, retain_s=10.0)
    rec.record(np.array([100 * S - 1_000_000]), 100 * S)
    rec.merge(LatencyRecorder(0, retain_s=None).snapshot())  # empty: nothing changes
    old = LatencyRecorder(0, retain_s=None)
    old.record(np.array([0, 0]), 1 * S)
    rec.merge(old.snapshot())
    assert rec.count == 3 and [r[1] for r in rec.timeline()] == [1] and rec.dropped == 2


def test_merging_snapshots_reads_no_window_until_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A status call merges every sink's snapshot for the whole run's summary: only the totals
    are decoded (decoding every window of every sink grew with the run)."""
    rec = LatencyRecorder(0)
    _fed_a_day(rec, every_s=1)
    snaps = [rec.snapshot(), rec.snapshot()]
    from hdrh.histogram import HdrHistogram

    decoded = []
    real = HdrHistogram.decode
    monkeypatch.setattr(
        HdrHistogram, "decode", staticmethod(lambda b: decoded.append(1) or real(b))
    )
    merged = LatencyRecorder.merge_snapshots(snaps)
    assert merged.summary()["count"] == 2 * rec.count
    assert len(decoded) == 2, f"{len(decoded)} histograms decoded for the summary"
    # the windows are still there, added up when read
    assert (
        merged.summary_between(DAY_S - 10, DAY_S)["count"]
        == 2 * rec.summary_between(DAY_S - 10, DAY_S)["count"]
    )


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "900", True])
def test_retain_s_is_checked(bad: Any) -> None:
    with pytest.raises(ConfigError, match="retain_s must be a number of seconds > 0"):
        LatencyRecorder(0, retain_s=bad)
    with pytest.raises(ConfigError, match="metrics_windows_retained_s must be"):
        RuntimeConfig(metrics_windows_retained_s=bad)


# ------------------------------------------------------------------------------------------
# the controller's metrics()/status()


class _Handle:
    def __init__(self, snap: dict[str, Any]) -> None:
        self.metrics = Call(snap)


def _controller(tmp_path: Path, sink_latency: LatencyRecorder) -> Controller:
    c = plain_controller("soak-status", tmp_path)
    snaps = {
        iid: {"step": iid[0], "index": iid[1], "records_in": 0}
        | ({"latency": sink_latency.snapshot()} if iid[0] == "out" else {})
        for iid in c.specs
    }
    c.handles = {iid: _Handle(snap) for iid, snap in snaps.items()}
    return c


def _change(i: int, at_s: float) -> dict[str, Any]:
    return {"kind": "rescale", "step": "count", "start_s": at_s, "end_s": at_s + 1.0, "n": i}


def test_status_lists_the_newest_changes_with_their_latency_settled(tmp_path: Path) -> None:
    rec = LatencyRecorder(0)
    _fed_a_day(rec)
    c = _controller(tmp_path, rec)
    # a change a minute for the whole day; only the last 15 minutes' windows are kept
    c.reconfigurations = [_change(i, 60.0 * i) for i in range(DAY_S // 60)]
    got = asyncio.run(c.metrics())
    recs = got["reconfigurations"]
    assert got["reconfigurations_total"] == DAY_S // 60
    assert [r["n"] for r in recs] == list(range(DAY_S // 60 - RECONFIGURATIONS_SHOWN, DAY_S // 60))
    assert len(pickle.dumps(got)) < 1_000_000  # every window of the day: ~40 MB
    # a change within the kept span has its figures, and keeps them once they are settled
    recent = recs[-5]
    assert recent["peak_latency_ms"] == pytest.approx(50.0, rel=1e-3)
    c.handles = {iid: _Handle({"step": iid[0], "index": iid[1]}) for iid in c.specs}
    again = asyncio.run(c.metrics())["reconfigurations"]  # the sinks' windows are gone now
    assert again[-5]["peak_latency_ms"] == recent["peak_latency_ms"]


def test_status_time_does_not_grow_with_the_length_of_the_run(tmp_path: Path) -> None:
    """The controller merges a day-long sink recorder as fast as an hour-long one (the old
    merge decoded every window: a day at 250 ms is 345,600 of them per sink)."""

    def status_s(seconds: int) -> float:
        rec = LatencyRecorder(0)
        ages = np.arange(1, 11, dtype=np.int64) * 1_000_000
        for t in range(0, seconds, 1):
            rec.record(t * S - ages, t * S)
        c = _controller(tmp_path, rec)
        t0 = time.perf_counter()
        asyncio.run(c.metrics())
        return time.perf_counter() - t0

    hour, day = status_s(3_600), status_s(DAY_S)
    assert day < max(0.5, 3 * hour), (
        f"status took {hour:.3f} s after an hour, {day:.3f} s after a day"
    )
