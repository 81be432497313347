"""bench.loadstep_runs: the first scale-out after the step of each run, and the median and range
over runs; hand-made reports, hand-computed expectations."""

from __future__ import annotations

from typing import Any

import pytest

from tests._bench import put_bench_on_path

put_bench_on_path()

from bench.loadstep_runs import first_scale_out, summarize  # noqa: E402


def _report(done_s: float, high_p99: float, exact: bool = True) -> dict[str, Any]:
    def rescale(a: int, b: int, start: float, done: float) -> dict[str, Any]:
        return {
            "from": a,
            "to": b,
            "start_s": start,
            "done_s": done,
            "switch_s": 0.1,
            "sealed_s": 0.2,
            "first_on_demand_served_s": 0.25,
            "serve_wait_p99_ms": 20.0,
            "fetch_wait_p50_ms": 100.0,
            "fetch_wait_p99_ms": 300.0,
            "backlog_work_s": 1.0,
            "handover_rows": 500,
            "move_phases_s": {
                "barrier_injected": 0.05,
                "switched": [0.2, 0.08, 0.09][: max(a, b)],
                "all_arrived": [None, 0.6, 0.7],
            },
            "spawn_phases_s": {"prepared_standbys": 2.0} if b == 3 else {},
        }

    return {
        "exact": exact,
        "offered": [[2.0, 5000], [10.0, 20000], [30.0, 5000]],
        "phases": {
            "low": {"latency": {"p99_ms": 100.0}},
            "high": {"latency": {"p99_ms": high_p99}},
        },
        "reaction_s": {"first_scale_out_after_step": 0.5},
        # a scale-in before the step does not count; the first scale-out after it does
        "per_rescale": [rescale(2, 1, 5.0, 0.3), rescale(1, 3, 10.5, done_s), rescale(3, 4, 20, 9)],
    }


def test_the_first_scale_out_after_the_step_and_the_median_and_range_over_runs() -> None:
    rows = [first_scale_out(_report(d, h)) for d, h in [(0.9, 300.0), (1.5, 200.0), (0.7, 900.0)]]
    assert [r["rescale"] for r in rows] == ["1 -> 3"] * 3
    assert rows[0]["all_arrived_s"] == 0.7
    # the old owner (index 0) switched 0.15 s after the barrier was injected; both new
    # instances came from prepared standbys; done 0.5 + 0.9 s after the step
    assert rows[0]["old_owner_switch_after_barrier_s"] == pytest.approx(0.15)
    assert rows[0]["prepared_standbys"] == 2.0
    assert rows[0]["done_after_step_s"] == pytest.approx(1.4)
    assert rows[0]["high_over_low_p99"] == 3.0
    s = summarize(rows)
    assert s["done_s"] == {"median": 0.9, "min": 0.7, "max": 1.5}
    assert s["high_p99_ms"] == {"median": 300.0, "min": 200.0, "max": 900.0}
    assert s["exact_runs"] == 3 and s["runs"] == 3
    assert "rescale" not in s  # not a number
    # high p99 200 ms against 100 ms low: the one run within 2x
    assert [r["within_2x"] for r in rows] == [False, True, False]
    assert s["runs_within_2x"] == 1
    assert rows[0]["load_at_start"] is None  # the report recorded no machine load
    loaded = {**_report(0.9, 300.0), "machine_load": {"start": [2.5, 3.0, 3.1], "end": [1, 1, 1]}}
    assert first_scale_out(loaded)["load_at_start"] == 2.5


def test_a_run_without_a_scale_out_after_the_step_has_no_rescale_figures() -> None:
    rep = _report(1.0, 300.0, exact=False)
    rep["per_rescale"] = rep["per_rescale"][:1]
    row = first_scale_out(rep)
    assert row["rescale"] is None and row["exact"] is False
    assert summarize([row])["exact_runs"] == 0


def test_latency_recovery_is_the_last_high_window_above_twice_the_low_p99() -> None:
    rep = _report(0.9, 300.0)
    # windows of 0.25 s: low p99 100 ms, so above 200 ms counts; the step is at 10.0, the
    # step down at 30.0 (a window after it does not count)
    rep["timeline"] = [
        [9.75, 100, 50.0, 90.0, 95.0],
        [10.0, 100, 150.0, 250.0, 260.0],
        [10.25, 100, 400.0, 900.0, 950.0],
        [10.5, 100, 150.0, 180.0, 210.0],  # back within 2x ...
        [10.75, 100, 200.0, 201.0, 230.0],  # ... not yet: this one ends at 11.0
        [11.0, 100, 50.0, 80.0, 90.0],
        [30.0, 100, 500.0, 5000.0, 5000.0],
    ]
    row = first_scale_out(rep)
    assert row["peak_window_p99_ms"] == 900.0
    assert row["back_within_2x_s"] == 1.0
    assert first_scale_out(_report(0.9, 300.0))["back_within_2x_s"] is None  # no timeline


def test_the_scale_outs_after_the_first_give_the_longest_move_spawn_and_record_wait() -> None:
    rep = _report(0.9, 300.0)
    rep["per_rescale"][1]["prepare_phases_s"] = {"spawn": 0.1}
    rep["per_rescale"][2]["prepare_phases_s"] = {"spawn": 2.6}
    rep["per_rescale"][2]["fetch_wait_p99_ms"] = 450.0
    row = first_scale_out(rep)
    assert row["scale_outs"] == 2
    assert row["later_done_s_max"] == 9  # 3 -> 4, not the first (0.9 s) nor the scale-in
    assert row["spawn_s_max"] == 2.6
    assert row["record_wait_p99_ms_max"] == 450.0
    assert row["later"] == ["3->4 done 9.00 s, spawn 2.60 s"]
    rep["per_rescale"] = rep["per_rescale"][:2]  # one scale-out only
    row = first_scale_out(rep)
    assert row["later_done_s_max"] is None and row["later"] == []
    assert row["spawn_s_max"] == 0.1
