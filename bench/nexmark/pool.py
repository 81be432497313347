"""Pool the watermark lag of several NEXMark runs into one distribution.

A short q5 run has 30-40 window result rows, so its p99 is its slowest row. Pooling the rows of
several runs (each report's ``watermark_lag_ms.values``) gives a p99 over hundreds of rows::

    python -m bench.nexmark.pool bench/results/nexmark_q5_lag_after_{1,2,3}.json \\
        --report bench/results/nexmark_q5_lag_after_pooled.json

The report gives the pooled rows' p50/p99/max and, per run, its rows, p50, p99 and throughput,
with the median and min-max of the per-run figures.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import click
import numpy as np


def pool(reports: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The pooled lag of ``reports`` (bench.nexmark reports with per-row lag values)."""
    values: list[float] = []
    runs = []
    for name, r in zip(names, reports, strict=True):
        lag = r.get("watermark_lag_ms") or {}
        if "values" not in lag:
            msg = (
                f"{name}: expected a bench.nexmark report with watermark_lag_ms.values (per-row "
                f"lags), got watermark_lag_ms keys {sorted(lag)}"
            )
            raise click.ClickException(msg)
        values += lag["values"]
        runs.append(
            {
                "file": name,
                "rows": lag["rows"],
                "p50": lag["p50"],
                "p99": lag["p99"],
                "max": lag["max"],
                "throughput_eps": r.get("throughput_eps"),
                "oracle_equal": r.get("oracle_equal"),
            }
        )
    v = np.asarray(values, np.float64)

    def spread(key: str) -> dict[str, Any]:
        xs = [x[key] for x in runs if x[key] is not None]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {}

    return {
        "benchmark": "nexmark-watermark-lag-pooled",
        "definition": (
            "per window result row: wall-clock arrival at the sink minus the wall-clock time at "
            "which the last source sent a watermark >= window_end - 1; rows of every run pooled"
        ),
        "runs": runs,
        "pooled": {
            "rows": len(v),
            "p50": round(float(np.percentile(v, 50)), 3),
            "p90": round(float(np.percentile(v, 90)), 3),
            "p99": round(float(np.percentile(v, 99)), 3),
            "max": round(float(v.max()), 3),
        },
        "per_run": {k: spread(k) for k in ("p50", "p99", "max", "throughput_eps")},
    }


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(files: tuple[Path, ...], report: Path | None) -> None:
    reports = [json.loads(f.read_text()) for f in files]
    out = pool(reports, [str(f) for f in files])
    p = out["pooled"]
    click.echo(
        f"{len(files)} runs, {p['rows']} rows pooled: p50 {p['p50']} ms, p90 {p['p90']} ms, "
        f"p99 {p['p99']} ms, max {p['max']} ms"
    )
    for r in out["runs"]:
        click.echo(
            f"  {r['file']}: {r['rows']} rows, p50 {r['p50']} ms, p99 {r['p99']} ms, "
            f"{r['throughput_eps']} events/s, oracle equal: {r['oracle_equal']}"
        )
    if report is not None:
        from bench._report import write_json

        write_json(report, out)


if __name__ == "__main__":
    main()
