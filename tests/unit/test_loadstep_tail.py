"""bench.loadstep_tail: the high phase's top 1 % by ingest time, on a made-up trace."""

from __future__ import annotations

import numpy as np
import pytest

from tests._bench import put_bench_on_path

put_bench_on_path()

from bench._latency_trace import row_weights  # noqa: E402
from bench.loadstep_tail import step_from_ingest, tail_breakdown, tail_figures  # noqa: E402

ORIGIN = 1_000_000_000_000


def _report(step_est: float) -> dict:
    # the first scale-out: decided 0.1 s after the step; switch, seal and done (s from then)
    rescale = {
        "from": 1,
        "to": 3,
        "start_s": 5.1,
        "switch_s": 0.1,
        "sealed_s": 0.25,
        "done_s": 0.5,
    }
    return {
        "config": {"low_eps": 1000.0, "factor": 4.0, "low_s": 5.0},
        "offered": [[0.0, 1000], [step_est, 4000], [step_est + 4.0, 1000]],
        "per_rescale": [rescale],
    }


def _trace() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """1k events/s until 5.0 s, 4k/s until 9.0 s, 1k/s to 11 s; latency 50 ms, except events
    ingested 5.2-5.6 s, whose latency grows from 100 to 500 ms (the backlog of a move)."""
    ingest = np.concatenate(
        [np.arange(0, 5, 1 / 1000), np.arange(5, 9, 1 / 4000), np.arange(9, 11, 1 / 1000)]
    )
    lat = np.full(ingest.size, 0.05)
    hump = (ingest >= 5.2) & (ingest < 5.6)
    lat[hump] = 0.1 + (ingest[hump] - 5.2)
    to_ns = lambda s: (ORIGIN + np.round(s * 1e9)).astype(np.int64)  # noqa: E731
    index = np.where(ingest >= 5.2, 1, 0)
    return to_ns(ingest), to_ns(ingest + lat), index


def test_the_top_percent_are_put_in_the_phase_of_the_move_they_came_in() -> None:
    ingest, written, index = _trace()
    # the bench's estimate of the step is 0.2 s early: the trace's own step is used
    tail = tail_breakdown(ingest, written, index, ORIGIN, _report(4.8))
    assert tail["step_s"] == pytest.approx(5.0)
    assert tail["step_minus_bench_estimate_s"] == pytest.approx(0.2)
    assert tail["low_p99_ms"] == pytest.approx(50, abs=1)
    # the high phase (written 5.0-9.0 s) has ~16,000 events: its top 1 % are the last ~160 of
    # the hump (ingested 5.56-5.6 s, latency 460-500 ms), between the seal (5.35) and done (5.6)
    assert tail["high_p99_ms"] == pytest.approx(460, abs=2)
    b = tail["buckets"]
    assert b["seal_to_done"]["top_events"] == tail["top_events"] > 0
    assert all(b[k]["top_events"] == 0 for k in b if k != "seal_to_done")
    assert b["seal_to_done"]["by_new_owner"] == tail["top_events"]
    assert tail["by_write_time"]["top_after_done"] == tail["top_events"]
    # above 2x the low p99 (100 ms): the whole hump, 0.4 s of 4k/s, against 1 % allowed
    line = tail["line_2x"]
    assert line["events_above"] == pytest.approx(1600, abs=2)
    assert line["events_allowed_for_p99"] == pytest.approx(160, abs=2)
    assert line["ingest_span_above_s"] == pytest.approx([0.2, 0.6], abs=0.01)
    figures = tail_figures(tail)
    assert figures["top_share_ingested_seal_to_done"] == 1.0
    assert figures["done_after_step_s"] == pytest.approx(0.6)
    # all of it is the first scale-out's hump (no refill, no later rescale, no stall)
    assert tail["by_write_time"]["above_2x_by_cause"] == {
        "first_scale_out": line["events_above"],
        "refills": 0,
        "later_rescales": 0,
        "elsewhere": 0,
    }
    assert figures["above_2x_first_scale_out"] == line["events_above"]


def test_events_above_the_line_are_split_by_what_they_were_written_during() -> None:
    # the move's hump (ingested 5.2-5.6 s, written by 6.1 s; done at 5.6 s), a refill written
    # 6.2-6.7 s, a later rescale 7.0-7.1 s (+0.5 s), a stall: events ingested in each of
    # 6.0-6.4, 7.0-7.2 and 8.0-8.3 s get 300 ms of latency (4k events/s)
    ingest, written, index = _trace()
    ing_s = (ingest - ORIGIN) / 1e9
    for a, b in ((6.0, 6.4), (7.0, 7.2), (8.0, 8.3)):
        sel = (ing_s >= a) & (ing_s < b)
        written[sel] = ingest[sel] + int(0.3e9)
    report = _report(5.0)
    report["rescales"] = [{"start_s": 5.1, "end_s": 5.6}, {"start_s": 7.0, "end_s": 7.1}]
    report["standby_refills"] = [{"rescale_start_s": 5.1, "after_s": 0.6, "waves": [[1, 0.5]]}]
    tail = tail_breakdown(ingest, written, index, ORIGIN, report)
    assert tail["by_write_time"]["above_2x_by_cause"] == {
        "first_scale_out": pytest.approx(1600, abs=2),
        "refills": pytest.approx(1600, abs=2),
        "later_rescales": pytest.approx(800, abs=2),
        "elsewhere": pytest.approx(1200, abs=2),
    }
    assert sum(tail["by_write_time"]["above_2x_by_cause"].values()) == tail["line_2x"][
        "events_above"
    ]


def test_rows_that_aggregate_events_weigh_as_many() -> None:
    # two rows of key 7: counts 2 then 5 -> weights 2 and 3
    assert row_weights(np.array([7, 7, 9]), np.array([5, 2, 1])).tolist() == [3, 2, 1]
    ingest, written, index = _trace()
    heavy = np.where((ingest - ORIGIN) / 1e9 >= 5.2, 1, 1)
    heavy[(ingest - ORIGIN) / 1e9 < 1.0] = 3  # weights outside the phases change nothing
    tail = tail_breakdown(ingest, written, index, ORIGIN, _report(5.0), heavy)
    assert tail["high_p99_ms"] == pytest.approx(460, abs=2)


def test_the_step_is_where_the_rate_passes_the_middle_of_the_two() -> None:
    t = np.concatenate([np.arange(0, 3.3, 1 / 200), np.arange(3.3, 6, 1 / 800)])
    assert step_from_ingest(t, 4.0, 3.0) == pytest.approx(3.3, abs=0.05)
    assert step_from_ingest(t[:10], 4.0, 3.0) == 3.0  # nothing near the estimate: kept
