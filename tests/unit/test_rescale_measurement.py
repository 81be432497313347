"""How rescales are measured, without Ray: latency weighted per input event, the rescale window
until latency recovered, and the strategy comparison's aggregation and exactness check.
Oracles are hand-computed on small synthetic series (or numpy on repeated values)."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import raystream as rs
from tests._bench import put_bench_on_path

put_bench_on_path()

from bench import compare_strategies as cs  # noqa: E402
from raystream.errors import ConfigError  # noqa: E402
from raystream.metrics import LatencyRecorder, recovery_point, rescale_impact  # noqa: E402

MS = 1_000_000  # ns per ms
W = 250  # window ms


def _recorder(series: dict[int, list[tuple[float, int]]]) -> LatencyRecorder:
    """Window index -> [(latency_ms, weight), ...], recorded in that window (origin 0)."""
    rec = LatencyRecorder(origin_ns=0, window_ms=W)
    for w, rows in series.items():
        now = w * W * MS + 100 * MS  # inside window w
        lat = np.array([r[0] for r in rows])
        rec.record(now - (lat * MS).astype(np.int64), now, np.array([r[1] for r in rows]))
    return rec


# --------------------------------------------------------------------------------------------
# weighted percentiles


def test_a_row_counts_once_per_input_event_it_aggregates() -> None:
    # latencies below 2.048 ms, which HDR keeps to the microsecond
    now = 10_000 * MS
    ingest = now - np.array([1000, 1500, 2000]) * 1000
    plain = LatencyRecorder(origin_ns=0)
    plain.record(ingest, now)
    assert plain.summary() == {"count": 3, "p50_ms": 1.5, "p99_ms": 2.0, "max_ms": 2.0}
    # the 2 ms row aggregates 98 events: half the events (and 99 %) waited 2 ms
    hot = LatencyRecorder(origin_ns=0)
    hot.record(ingest, now, np.array([1, 1, 98]))
    assert hot.summary() == {"count": 100, "p50_ms": 2.0, "p99_ms": 2.0, "max_ms": 2.0}
    assert hot.rows == 3
    # 50 events at 1 ms, 49 at 1.5 ms, 1 at 2 ms: p50 is the 50th event, p99 the 99th
    cold = LatencyRecorder(origin_ns=0)
    cold.record(ingest, now, np.array([50, 49, 1]))
    assert cold.summary() == {"count": 100, "p50_ms": 1.0, "p99_ms": 1.5, "max_ms": 2.0}
    # weight 0 counts nowhere (nor in the window counts), but the row is seen
    zero = LatencyRecorder(origin_ns=0)
    zero.record(ingest, now, np.array([3, 0, 0]))
    assert zero.summary() == {"count": 3, "p50_ms": 1.0, "p99_ms": 1.0, "max_ms": 1.0}
    assert zero.timeline()[0][1] == 3 and zero.rows == 3


def test_weighted_percentiles_equal_those_of_repeated_values() -> None:
    """Below 2048 us HDR keeps every us exactly: the weighted histogram's percentiles equal
    HDR's rule (the ceil(p * n)-th smallest, rounded half up) over every value repeated."""
    rng = np.random.default_rng(3)
    lat_us = rng.integers(1, 2000, 300)
    weights = rng.integers(0, 50, 300)
    now = 5_000 * MS
    rec = LatencyRecorder(origin_ns=0)
    for part in np.array_split(np.arange(300), 7):  # several batches
        rec.record(now - lat_us[part] * 1000, now, weights[part])
    repeated = np.sort(np.repeat(lat_us, weights))
    n = len(repeated)

    def at(p: float) -> float:
        return float(repeated[max(int(p * n / 100 + 0.5), 1) - 1]) / 1000

    s = rec.summary()
    assert s["count"] == n == int(weights.sum())
    assert (s["p50_ms"], s["p99_ms"], s["max_ms"]) == (at(50), at(99), repeated[-1] / 1000)
    merged = LatencyRecorder.merge_snapshots([rec.snapshot(), rec.snapshot()])
    assert merged.summary()["count"] == 2 * n and merged.rows == 600
    assert merged.summary()["p99_ms"] == at(99)


def test_bad_weights_are_refused() -> None:
    rec = LatencyRecorder(origin_ns=0)
    with pytest.raises(ConfigError, match="one int >= 0 per record"):
        rec.record(np.array([0, 0]), 5 * MS, np.array([1]))
    with pytest.raises(ConfigError, match="one int >= 0 per record"):
        rec.record(np.array([0, 0]), 5 * MS, np.array([1, -1]))
    assert rec.summary()["count"] == 0


def test_keyed_output_rows_carry_their_input_events(tmp_path: Path) -> None:
    """A key-count row covers the key's events of one batch; rows of an upstream keyed step
    bring their own input_events, which add up. The sink reads them as weights."""
    import pyarrow as pa

    from raystream.runtime.processors import (
        INGEST_TS,
        INPUT_EVENTS,
        input_events_of,
        make_processor,
    )

    @rs.keyed_batches(state=rs.ValueState(int, default=0))
    def count(batch: Any, state: Any) -> Any:
        new = state.get(batch.keys) + batch.counts
        state.put(batch.keys, new)
        return batch.output({"count": new})

    keys = ["a", "b", "a", "a", "c", "b"]
    tbl = pa.table({"key": keys, INGEST_TS: np.arange(6, dtype=np.int64)})
    flow = rs.Dataflow("t")
    flow.source(rs.sources.from_table(tbl)).key_by("key").apply(count, name="count")
    p = make_processor(flow.steps["count"], flow.key_space, tmp_path / "p", owned=range(128))
    out = p.process(tbl.to_batches()[0])[0].to_pydict()
    assert dict(zip(out["key"], out[INPUT_EVENTS], strict=True)) == collections.Counter(keys)
    p.close()
    # a null (a row that came without a count, batched with rows that have one) counts 1
    upstream = tbl.append_column(INPUT_EVENTS, pa.array([10, None, 5, 0, 2, 3], pa.int64()))
    p = make_processor(flow.steps["count"], flow.key_space, tmp_path / "q", owned=range(128))
    out = p.process(upstream.to_batches()[0])[0].to_pydict()
    assert dict(zip(out["key"], out[INPUT_EVENTS], strict=True)) == {"a": 15, "b": 4, "c": 2}
    p.close()
    assert input_events_of(upstream.to_batches()[0]).tolist() == [10, 1, 5, 0, 2, 3]


# --------------------------------------------------------------------------------------------
# the rescale window


def test_recovery_point_needs_the_whole_run_within_the_bound() -> None:
    p99 = {0: 1.0, 1: 1.0, 2: 9.0, 3: 1.0, 4: 1.0, 5: 1.0, 6: 9.0, 7: 1.0, 8: 1.0, 9: 1.0}
    assert recovery_point(p99, 0, 9, 2.0, 2) == 0
    assert recovery_point(p99, 1, 9, 2.0, 3) == 3
    assert recovery_point(p99, 4, 9, 2.0, 3) == 7
    assert recovery_point(p99, 4, 9, 2.0, 4) is None  # the run ends first
    assert recovery_point(p99, 7, 8, 2.0, 3) is None  # window 9 is after the run's last
    gap = {0: 1.0, 1: 1.0, 3: 1.0, 4: 1.0}  # nothing reached the sinks in window 2
    assert recovery_point(gap, 0, 4, 2.0, 3) is None
    assert recovery_point({0: 2.0, 1: 2.0}, 0, 1, 2.0, 2) == 0  # at the bound is within


def _series() -> dict[int, list[tuple[float, int]]]:
    """10 ms steady (windows 0..19); 100 ms for windows 20..23 (window 22 also one 300 ms row);
    12 ms in 24, 40 ms in 25 (above 1.5 x 10), 14 ms from 26 to 39."""
    s: dict[int, list[tuple[float, int]]] = {w: [(10.0, 10)] for w in range(20)}
    s.update({w: [(100.0, 10)] for w in range(20, 24)})
    s[22].append((300.0, 1))
    s[24] = [(12.0, 10)]
    s[25] = [(40.0, 10)]
    s.update({w: [(14.0, 10)] for w in range(26, 40)})
    return s


def test_rescale_window_lasts_until_latency_is_back_for_two_seconds() -> None:
    rec = _recorder(_series())
    throughput = [(w * W / 1000, 30 if w == 21 else 100) for w in range(40)]
    r = rescale_impact(rec, throughput, 5.1, 5.6, window_ms=W)
    # steady: windows 4..19 (after the first second, before the request's window 20): 10 ms;
    # the bound is 15 ms; from window 22 (the state settled at 5.6 s) the first 8 windows in
    # a row within it start at window 26 (6.5 s): 24 is in, 25 (40 ms) breaks the run
    assert r["steady_p99_ms"] == pytest.approx(10.0, rel=1e-3)
    assert r["recovered_s"] == pytest.approx(6.5 - 5.1)
    assert r["window_end_s"] == pytest.approx(6.5)
    # the window is windows 20..25: 40 events at 100 ms, one at 300 ms, 10 at 12 ms, 10 at 40
    # ms; the 60th of 61 events (p99) is at 100 ms, the peak 300 ms
    assert r["window_peak_latency_ms"] == pytest.approx(300.0, rel=1e-3)
    assert r["window_p99_latency_ms"] == pytest.approx(100.0, rel=1e-3)
    assert r["window_throughput_dip"] == pytest.approx(0.3)
    assert r["steady_throughput_eps"] == pytest.approx(400.0)


def test_a_rescale_not_recovered_when_the_run_ends_has_no_recovered_s() -> None:
    s = _series()
    s.update({w: [(14.0, 10)] for w in range(26, 33)})  # 7 calm windows: 1.75 s, then the end
    for w in range(33, 40):
        del s[w]
    r = rescale_impact(_recorder(s), [], 5.1, 5.6, window_ms=W)
    assert r["recovered_s"] is None
    assert r["window_end_s"] == pytest.approx(33 * W / 1000)  # the end of the last window
    assert r["window_p99_latency_ms"] == pytest.approx(100.0, rel=1e-3)  # 61 + 90 events
    assert r["window_throughput_dip"] is None  # no throughput series


def test_no_rescale_recovers_before_its_state_settled() -> None:
    """Latency never left the band, but state moved until 8.3 s: the window lasts until then."""
    s: dict[int, list[tuple[float, int]]] = {w: [(10.0, 1)] for w in range(60)}
    s[30] = [(12.0, 1)]
    r = rescale_impact(_recorder(s), [], 5.1, 8.3, window_ms=W)
    assert r["recovered_s"] == pytest.approx(8.3 - 5.1)
    assert r["window_end_s"] == pytest.approx(8.3)
    assert r["window_peak_latency_ms"] == pytest.approx(12.0, rel=1e-3)  # windows 20..33


def test_steady_span_starts_after_the_previous_window_and_at_zero_when_early() -> None:
    s: dict[int, list[tuple[float, int]]] = {w: [(10.0, 1)] for w in range(4)}
    s.update({w: [(50.0, 1)] for w in range(4, 30)})
    # requested at 0.6 s (window 2): the first second is all there is, so it is the steady span
    early = rescale_impact(_recorder(s), [], 0.6, 0.6, window_ms=W)
    assert early["steady_p99_ms"] == pytest.approx(10.0, rel=1e-3)
    # from 3 s on only: 50 ms steady, so latency is back at once (at the request's window)
    late = rescale_impact(_recorder(s), [], 4.1, 4.1, window_ms=W, steady_from_s=3.0)
    assert late["steady_p99_ms"] == pytest.approx(50.0, rel=1e-3)
    assert late["recovered_s"] == 0.0


# --------------------------------------------------------------------------------------------
# the comparison: aggregation over repeats, exactness


def test_aggregate_median_and_spread() -> None:
    assert cs.aggregate([3.0, 1.0, 2.0]) == {
        "median": 2.0,
        "min": 1.0,
        "max": 3.0,
        "runs": 3,
        "missing": 0,
    }
    assert cs.aggregate([4, 1, 3, 2])["median"] == 2.5
    # not recovered ranks above every number
    one = cs.aggregate([1.0, None, 3.0])
    assert (one["median"], one["min"], one["max"], one["missing"]) == (3.0, 1.0, None, 1)
    two = cs.aggregate([None, 1.0, None])
    assert (two["median"], two["min"], two["max"]) == (None, 1.0, None)
    assert cs.aggregate([])["median"] is None


def _report(peak: float | None, recovered: float | None, differing: int = 0) -> dict[str, Any]:
    rescale = {
        "recovered_s": recovered,
        "window_peak_latency_ms": peak,
        "window_p99_latency_ms": peak,
        "steady_p99_ms": 10.0,
        "window_throughput_dip": 0.5,
        "duration_s": 1.0,
        "moved_key_groups": 19,
        "moved_bytes": 2_000_000,
        "on_demand_fetches": 0,
        "fetch_wait_ms": {"p50": 1.0, "p99": 2.0},
        "start_s": 8.0,
    }
    return {
        "rescales": [rescale] if peak is not None else [],
        "latency_ms": {"p50": 1.0, "p99": 50.0, "max": 60.0},
        "rescale_errors": [] if peak is not None else ["rescale to 4 at 8 s: refused"],
        "exact": {
            "keys_expected": 100,
            "keys_differing": differing,
            "events_expected": 1000,
            "events_counted": 1000 - differing,
        },
        "timeline": [[0.0, 1.0, 1.0, 2.0, 3.0]],
        "throughput_eps": 1000.0,
    }


def test_summary_and_table_show_median_and_spread() -> None:
    runs = {
        "meces": [_report(300.0, 2.0), _report(100.0, None), _report(200.0, 1.0)],
        "lazy": [_report(50.0, 1.0), _report(None, None), _report(70.0, 3.0)],
    }
    summary = cs.summarise(runs)
    m = summary["meces"]["figures"]
    assert (m["window_peak_latency_ms"]["median"], m["window_peak_latency_ms"]["min"]) == (
        200.0,
        100.0,
    )
    assert m["recovered_s"] == {"median": 2.0, "min": 1.0, "max": None, "runs": 3, "missing": 1}
    assert m["moved_mb"]["median"] == 2.0
    assert summary["lazy"]["failed_rescales"] == 1 and summary["lazy"]["exact_runs"] == 3
    lines = cs.table(summary).splitlines()
    assert len(lines) == 4 and lines[0].count("|") == len(cs.FIGURES) + 3
    assert lines[2].startswith("| meces | 2.00 (1.00–none) | 200 (100–300) |")
    assert "(1 rescales failed)" in lines[3]


def test_count_mismatch_counts_keys_that_differ_either_way() -> None:
    expected = (np.array([1, 2, 3]), np.array([2, 1, 1]))
    assert cs.count_mismatch(expected, expected) == 0
    # 2: 1 vs 2; 3: missing; 4: extra
    assert cs.count_mismatch(expected, (np.array([1, 2, 4]), np.array([2, 2, 1]))) == 3
    s = (np.array(["a", "b"]), np.array([1, 5]))
    assert cs.count_mismatch(s, (np.array(["b"]), np.array([5]))) == 1
    with pytest.raises(ValueError, match="one per key"):
        cs.count_mismatch(expected, (np.array([1, 1]), np.array([1, 1])))


def test_independent_counts_equal_a_counter_over_the_stream() -> None:
    gen = rs.sources.generator(events=5000, keys=300, zipf=1.1, seed=4, chunk_rows=700)
    keys = gen.generate_all()["key"].to_pylist()
    distinct, counts = cs.independent_counts(np.array(keys))
    assert dict(zip(distinct.tolist(), counts.tolist(), strict=True)) == collections.Counter(keys)


def test_an_inexact_run_fails_loudly_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command itself: the second batched run counted 7 keys wrong -> exit 1, the message
    names the run, and no result file is written."""
    calls: list[str] = []

    def fake_one(strategy: str | None, *args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(strategy or "overhead")
        bad = strategy == "batched" and calls.count("batched") == 2
        return _report(100.0, 1.0, differing=7 if bad else 0)

    monkeypatch.setattr(cs, "_one", fake_one)
    monkeypatch.setattr(cs, "_connect_ray", lambda: False)
    args = ["--events", "1000", "--keys", "50", "--strategies", "meces,batched", "--out"]
    res = CliRunner().invoke(cs.main, [*args, str(tmp_path)])
    assert res.exit_code == 1, res.output
    assert "batched run 2: 7 of 100 keys have another final count" in res.output
    assert "not writing results" in res.output
    assert calls == ["meces", "batched"] * 3  # --repeats defaults to 3
    assert list(tmp_path.iterdir()) == []
    # all exact: the files are written, with the summary over 3 runs each
    monkeypatch.setattr(cs, "_one", lambda *a, **k: _report(100.0, 1.0))
    res = CliRunner().invoke(cs.main, [*args, str(tmp_path), "--repeats", "3"])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["summary"]["meces"]["runs"] == 3 and len(data["runs"]["batched"]) == 3
    assert "weighted per input event" in (tmp_path / "compare.md").read_text()


def test_placement_lines_count_instances_per_node_in_node_order() -> None:
    runs = {
        "meces": [{"placements": [{"0": "a", "1": "b"}, {"0": "a", "1": "b", "2": "c", "3": "a"}]}],
        "lazy": [{}],
    }
    text = cs.placement_lines(runs, ["a", "b", "c"])
    assert "- meces: 1/1/0 -> 2/1/1" in text
    assert "- lazy: not recorded" in text
