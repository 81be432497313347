"""Where a rescale's latency hump lies: the move itself or the standby refill after it.

Run it from the repository root on reports ``bench.compare_strategies`` (or ``bench.keycount``)
wrote::

    python -m bench.refill_phases bench/results/compare_refill_meces_{1,2,3,4}.json \
        --out bench/results/compare_refill_meces_phases.json

Per run, from its first rescale and its latency timeline (one row per 250 ms window:
``[t_s, records, p50_ms, p99_ms, max_ms]``, weighted per input event): the median window p99
before the request (from 2 s in), the highest window p99 over the move (from a window before
the request to one after the end), the median and highest window p99 while the standby refill's
processes start (from the rescale's end plus the refill's wait to the end of its last wave),
and the median window p99 from 0.5 to 4 s after the refill. Writes each run's figures and, per
figure, the median, minimum and maximum over the runs.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import click

__all__ = ["main", "phases", "summarize"]


def _p99s(timeline: list[list[float]], start: float, end: float) -> list[float]:
    return [row[3] for row in timeline if start <= row[0] <= end and row[3] is not None]


def phases(run: dict[str, Any]) -> dict[str, Any]:
    """The latency phases of one run's first rescale (see the module's doc)."""
    rescale = run["rescales"][0]
    timeline = run["timeline"]
    width = float(run.get("window_ms", 250)) / 1000
    start, end = float(rescale["start_s"]), float(rescale["end_s"])
    before = _p99s(timeline, 2.0, start - width)
    move = _p99s(timeline, start - width, end + width)
    out: dict[str, Any] = {
        "before_median_ms": statistics.median(before) if before else None,
        "move_max_ms": max(move) if move else None,
        "refill_s": None,
        "refill_median_ms": None,
        "refill_max_ms": None,
        "after_refill_median_ms": None,
    }
    refills = run.get("standby_refills") or []
    if refills:
        first = refills[0]
        r_start = end + float(first["after_s"])
        r_end = r_start + sum(float(seconds) for _n, seconds in first["waves"])
        during = _p99s(timeline, r_start, r_end)
        after = _p99s(timeline, r_end + 0.5, r_end + 4.0)
        out["refill_s"] = round(r_end - r_start, 3)
        out["refill_median_ms"] = statistics.median(during) if during else None
        out["refill_max_ms"] = max(during) if during else None
        out["after_refill_median_ms"] = statistics.median(after) if after else None
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: median, min and max over the runs that have it."""
    out: dict[str, Any] = {}
    for name in runs[0] if runs else []:
        values = [r[name] for r in runs if r.get(name) is not None]
        out[name] = (
            {"median": statistics.median(values), "min": min(values), "max": max(values)}
            if values
            else None
        )
    return out


def _runs_of(path: Path) -> list[dict[str, Any]]:
    report = json.loads(path.read_text())
    if "runs" in report:  # bench.compare_strategies: runs per strategy
        return [r for per in report["runs"].values() for r in per]
    return [report]


@click.command()
@click.argument("reports", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True)
def main(reports: tuple[Path, ...], out: Path) -> None:
    runs = []
    for path in reports:
        for i, run in enumerate(_runs_of(path)):
            if not run.get("rescales"):
                raise click.ClickException(f"{path}: run {i} has no rescale to break down")
            runs.append({"report": str(path), "run": i, **phases(run)})
    figures = [{k: v for k, v in r.items() if k not in ("report", "run")} for r in runs]
    result = {"runs": runs, "summary": summarize(figures)}
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name, s in result["summary"].items():
        if s:
            click.echo(f"{name}: {s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f})")


if __name__ == "__main__":
    main()
