"""bench.reconfigure_summary: medians and ranges over hand-made reports (no Ray)."""

from __future__ import annotations

from typing import Any

from tests._bench import put_bench_on_path

put_bench_on_path()

from bench.reconfigure_summary import summarise  # noqa: E402


def _change(kind: str, start: float, steady: float, peak: float) -> dict[str, Any]:
    return {
        "kind": kind,
        "start_s": start,
        "duration_s": 0.5,
        "before": {"p99_ms": steady},
        "during": {"max_ms": peak},
        "peak_over_steady_p99": round(peak / steady, 2),
    }


def test_median_range_and_runs_within_2x_per_change_kind() -> None:
    reports = [
        {"changes": [_change("move", 10, 50, 100)], "spare_refills": []},
        {"changes": [_change("move", 10, 50, 150)], "spare_refills": []},
        {"changes": [_change("move", 10, 40, 40)], "spare_refills": []},
    ]
    move = summarise(reports)["move"]
    assert move["runs"] == 3 and move["within_2x"] == 2
    assert move["peak_over_steady_p99"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert move["peak_ms"] == {"median": 100.0, "min": 40.0, "max": 150.0}


def test_a_refill_is_set_against_the_steady_p99_of_the_change_that_used_the_spares() -> None:
    refills = [
        {"why": "start", "start_s": 1.0, "max_ms": 900.0},  # the job's start: not a change's
        {"why": "insert", "start_s": 16.0, "max_ms": 120.0},
    ]
    changes = [_change("insert", 10, 60, 70), _change("remove", 20, 30, 30)]
    out = summarise([{"changes": changes, "spare_refills": refills}])
    assert out["spare_refill"]["runs"] == 1
    assert out["spare_refill"]["peak_over_steady_p99"]["median"] == 2.0
    assert out["spare_refill"]["within_2x"] == 1
