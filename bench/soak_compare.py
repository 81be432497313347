"""Side by side: the growth per hour of two or more soak reports (``bench.soak --report``).

Run it from the repository root::

    python -m bench.soak_compare bench/results/soak_before.json bench/results/soak_after.json

Prints a Markdown table: per series, each run's first and last sample of the run's second half
and the least-squares slope per hour over it (instances: the median slope over the instances
of each step, with the min and max); then each run's state, exactness and status call size.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import click

__all__ = ["main", "rows"]

SERIES = (
    ("controller_rss_mb", "controller RSS (MB)"),
    ("status_ms", "job.status() time (ms)"),
    ("status_bytes", "job.status() size (bytes, pickled)"),
    ("checkpoint_duration_s", "checkpoint duration (s)"),
    ("checkpoint_referenced_bytes", "checkpoint size (bytes referenced)"),
    ("checkpoint_dir_bytes", "checkpoint folder (bytes)"),
    ("p99_ms", "p99 latency per sample interval (ms)"),
)


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.3g}"


def _cell(g: dict[str, Any]) -> str:
    return f"{_fmt(g.get('first'))} -> {_fmt(g.get('last'))} ({_fmt(g.get('per_hour'))}/h)"


def _by_step(instances: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for iid, g in instances.items():
        if g.get("per_hour") is not None:
            out.setdefault(iid.split("/")[0], []).append(float(g["per_hour"]))
    return out


def rows(reports: list[dict[str, Any]]) -> list[list[str]]:
    """One row per series: its name, then per report ``first -> last (slope/h)``."""
    out = [[label, *(_cell(r["growth"].get(key, {})) for r in reports)] for key, label in SERIES]
    steps = sorted({s for r in reports for s in _by_step(r["growth"]["instance_rss_mb"])})
    for step in steps:
        cells = []
        for r in reports:
            slopes = _by_step(r["growth"]["instance_rss_mb"]).get(step, [])
            cells.append(
                f"{_fmt(statistics.median(slopes))}/h ({_fmt(min(slopes))} .. {_fmt(max(slopes))})"
                if slopes
                else "-"
            )
        out.append([f"RSS of a {step} instance (MB/h: median (min .. max))", *cells])
    for step in sorted({k for r in reports for k in r["growth"]["rocksdb_bytes"]} - {"by_kind"}):
        out.append(
            [f"RocksDB folders of {step} (bytes)"]
            + [_cell(r["growth"]["rocksdb_bytes"].get(step, {})) for r in reports]
        )
    for kind in sorted({k for r in reports for k in r["growth"].get("rocksdb_bytes_by_kind", {})}):
        out.append(
            [f"RocksDB folders, {kind} files (bytes)"]
            + [_cell(r["growth"].get("rocksdb_bytes_by_kind", {}).get(kind, {})) for r in reports]
        )
    return out


@click.command()
@click.argument("reports", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
def main(reports: tuple[Path, ...]) -> None:
    data = [json.loads(p.read_text()) for p in reports]
    head = ["series (second half of the run)", *(p.stem for p in reports)]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows(data):
        print("| " + " | ".join(row) + " |")
    print()
    for p, r in zip(reports, data, strict=True):
        print(
            f"- {p.stem}: code {r.get('controller_code')}, state {r['state']}, exact "
            f"{r.get('exact')} ({r.get('rows_got')} of {r.get('rows_expected')} window rows, "
            f"{r.get('duplicate_windows')} duplicated), {r['elapsed_s']} s, "
            f"{len(r['samples'])} samples, growth from {r['growth_from_s']} s, "
            f"retained_s {r['config'].get('metrics_windows_retained_s')}"
        )


if __name__ == "__main__":
    main()
