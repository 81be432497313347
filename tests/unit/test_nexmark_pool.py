"""bench.nexmark.pool: the pooled percentiles are those of every run's rows together."""

from __future__ import annotations

import click
import numpy as np
import pytest


from tests._bench import put_bench_on_path

put_bench_on_path()

from bench.nexmark.pool import pool  # noqa: E402


def _report(values: list[float]) -> dict:
    v = np.asarray(values)
    return {
        "throughput_eps": 1.0,
        "oracle_equal": True,
        "watermark_lag_ms": {
            "rows": len(v),
            "p50": float(np.percentile(v, 50)),
            "p99": float(np.percentile(v, 99)),
            "max": float(v.max()),
            "values": values,
        },
    }


def test_pooled_percentiles_are_over_all_rows() -> None:
    rng = np.random.default_rng(0)
    runs = [rng.exponential(50, n).round(3).tolist() for n in (30, 40, 35)]
    out = pool([_report(r) for r in runs], ["a", "b", "c"])
    every = np.concatenate(runs)
    assert out["pooled"]["rows"] == 105
    assert out["pooled"]["p99"] == round(float(np.percentile(every, 99)), 3)
    assert out["pooled"]["max"] == round(float(every.max()), 3)
    assert out["per_run"]["p99"]["max"] == max(float(np.percentile(r, 99)) for r in runs)


def test_a_report_without_row_values_is_refused() -> None:
    bad = _report([1.0])
    del bad["watermark_lag_ms"]["values"]
    with pytest.raises(click.ClickException, match="watermark_lag_ms.values"):
        pool([bad], ["old.json"])
