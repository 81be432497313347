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
p99 before the change that used them. For moves, also the window at the barrier broken down
(``move_window``: see :func:`move_window`; fields a report does not have are null).
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import click
import numpy as np

from bench._report import write_json

__all__ = ["move_window", "summarise"]


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
    moves = [c for c in kinds.get("move", []) if c.get("phases_s")]
    if moves:
        out["move_window"] = move_window(moves)
    if refills:
        out["spare_refill"] = {
            "runs": len(refills),
            "peak_over_steady_p99": _stats(refills),
            "within_2x": sum(1 for r in refills if r <= 2.0),
        }
    return out


def _ms_between(phases: dict[str, Any], a: str, b: str) -> float | None:
    """Milliseconds from phase ``a`` to phase ``b`` of a move (None if either is missing)."""
    if phases.get(a) is None or phases.get(b) is None:
        return None
    return round((float(phases[b]) - float(phases[a])) * 1000, 1)


def _kb(n: Any) -> float | None:
    return None if n is None else round(n / 1024, 1)


def _mb(mirror: Any, rounds: Any) -> float | None:
    """Bytes of changed rows sent before the seal: pushed by the mirror, or in catch-up rounds."""
    n = mirror if mirror is not None else (sum(rounds) if rounds else None)
    return None if n is None else round(n / (1 << 20), 2)


def move_window(moves: list[dict[str, Any]]) -> dict[str, Any]:
    """The moves' window at the barrier, median (min-max) over runs, in ms: the barrier's way to
    the new actor (from its injection; from the old actor's seal, where a sender waited for the
    old actor's acknowledgement before), the seal until the new actor had the rows changed since
    the last catch-up round or mirror push (those rows: how many, the old actor's wall and CPU
    time reading them, the answer's way back; with a mirror: its pushes and the wait at the new
    actor for those still in flight), then until the new actor ran the records that waited, how
    many and how old the oldest was then."""
    rows: dict[str, list[Any]] = {}

    def add(name: str, value: Any) -> None:
        rows.setdefault(name, []).append(value)

    for c in moves:
        ph, files = c["phases_s"], c.get("files") or {}
        backlog = c.get("new_owner_backlog") or {}
        add("barrier_to_new_switch_ms", _ms_between(ph, "barrier_injected", "switched"))
        add("seal_to_new_switch_ms", _ms_between(ph, "sealed", "switched"))
        add("seal_to_state_in_ms", _ms_between(ph, "sealed", "all_arrived"))
        add("changed_rows_at_seal", files.get("changed_rows"))
        add("reading_them_ms", files.get("changes_ms"))
        add("reading_them_cpu_ms", files.get("changes_cpu_ms"))
        add("answer_in_ms", files.get("answer_in_ms"))
        # records the barrier overtook at the old actor (the rest of a batch it was working
        # through): they go with the answer, and run first at the new actor
        add("records_handed_over", files.get("handover_rows"))
        add("mirror_pushes", files.get("mirror_pushed"))
        add("mirror_largest_kb", _kb(files.get("mirror_largest_bytes")))
        add("mirror_behind_at_hand_over", files.get("mirror_behind_at_hand_over"))
        add("mirror_wait_ms", files.get("mirror_wait_ms"))
        add("catch_up_or_mirror_mb", _mb(files.get("mirror_bytes"), files.get("catch_up_bytes")))
        first = backlog.get("first_release")
        arrived = ph.get("all_arrived")
        add(
            "state_in_to_first_release_ms",
            None if first is None or arrived is None else round((first - arrived) * 1000, 1),
        )
        add("first_release_rows", backlog.get("rows"))
        add("oldest_waiting_record_ms", backlog.get("oldest_age_ms"))
        add("record_wait_p50_ms", (ph.get("record_wait_ms") or {}).get("p50"))
    return {k: _stats(v) for k, v in rows.items()}


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
            if kind == "move_window":
                parts = [f"{k} {v['median']} ({v['min']}-{v['max']})" for k, v in st.items()]
                click.echo(f"{label:10} move window: " + ", ".join(parts))
                continue
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
