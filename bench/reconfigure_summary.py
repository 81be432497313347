"""Medians (min-max) over repeated ``bench.reconfigure`` reports, per set and change.

    python -m bench.reconfigure_summary \\
        --set "before=bench/results/reconfigure_100mb_base_run*.json" \\
        --set "after=bench/results/reconfigure_100mb_final_run*.json" \\
        --report bench/results/reconfigure_100mb_summary.json

For each set (a label and a glob of reports of the same command) and each change kind: the
number of runs, and the median, min and max over them of the change's duration, the steady p99
before it, its peak (max sink latency from its start to 2 s after its end), the peak over the
steady p99, and how many runs were within 2x; for sets with warm spares, the same for the peak
while the spares were refilled (``spare_refills`` other than the job's start) over the steady
p99 before the change that used them.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import click
import numpy as np

from bench._report import write_json

__all__ = ["summarise"]


def _stats(values: list[float]) -> dict[str, Any]:
    v = [x for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None}
    return {
        "median": round(float(np.median(v)), 3),
        "min": round(float(min(v)), 3),
        "max": round(float(max(v)), 3),
    }


def summarise(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Per change kind (in the reports' order): runs, duration, steady p99, peak, their ratio."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    refills: list[float] = []
    for rep in reports:
        changes = rep["changes"]
        for c in changes:
            kinds.setdefault(c["kind"], []).append(c)
        for r in rep.get("spare_refills", []):
            if r["why"] == "start" or r.get("max_ms") is None:
                continue
            # the change that used the spares: the last one that started before the refill
            before = [c for c in changes if c["start_s"] <= r["start_s"]]
            steady = before[-1]["before"]["p99_ms"] if before else None
            if steady:
                refills.append(r["max_ms"] / steady)
    out: dict[str, Any] = {}
    for kind, cs in kinds.items():
        ratios = [c["peak_over_steady_p99"] for c in cs]
        out[kind] = {
            "runs": len(cs),
            "duration_s": _stats([c["duration_s"] for c in cs]),
            "steady_p99_ms": _stats([c["before"]["p99_ms"] for c in cs]),
            "peak_ms": _stats([c["during"]["max_ms"] for c in cs]),
            "peak_over_steady_p99": _stats(ratios),
            "within_2x": sum(1 for r in ratios if r is not None and r <= 2.0),
        }
    if refills:
        out["spare_refill"] = {
            "runs": len(refills),
            "peak_over_steady_p99": _stats(refills),
            "within_2x": sum(1 for r in refills if r <= 2.0),
        }
    return out


@click.command()
@click.option("--set", "sets", multiple=True, required=True, help="LABEL=GLOB of reports")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(sets: tuple[str, ...], report: Path | None) -> None:
    data: dict[str, Any] = {"benchmark": "reconfigure_summary", "sets": {}}
    for s in sets:
        label, sep, pattern = s.partition("=")
        files = sorted(glob.glob(pattern))
        if not sep or not files:
            msg = f"expected LABEL=GLOB matching bench.reconfigure reports, got {s!r}"
            raise click.BadParameter(msg, param_hint="'--set'")
        reports = [json.loads(Path(f).read_text()) for f in files]
        data["sets"][label] = {"files": files, "changes": summarise(reports)}
        for kind, st in data["sets"][label]["changes"].items():
            r = st["peak_over_steady_p99"]
            d = st.get("duration_s", {})
            click.echo(
                f"{label:10} {kind:12} runs {st['runs']}  "
                + (f"duration {d['median']} s ({d['min']}-{d['max']})  " if d else "")
                + f"peak/steady p99 {r['median']}x ({r['min']}-{r['max']}), "
                f"{st['within_2x']} of {st['runs']} within 2x"
            )
    if report is not None:
        write_json(report, data)


if __name__ == "__main__":
    main()
