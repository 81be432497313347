"""Median and range of the first scale-out over several ``bench.loadstep`` runs.

Run it from the repository root on the JSON files the runs wrote::

    python -m bench.loadstep_runs bench/results/loadstep_backlog_prepare_threshold_{1,2,3}.json \
        --out bench/results/loadstep_backlog_prepare_threshold_runs.json

Per run it takes the first scale-out after the step (the rescale the targets are about): seconds
from the autoscaler's decision to done, to the routing switch, to the last old owner's seal and
to the first on-demand chunk served; the preparation before the barrier; the on-demand serve wait
p99 (old owner, from its seal or the request to the chunk) and the record wait p50/p99 (new
owner, from a record's arrival to its state's); the backlog at the decision; the sink p99 of the
low and high phases and their ratio, the highest window p99 after the step and how long after
the step the window p99 was last above 2x the low phase's; whether the final counts were exact. Writes each run's
figures and, per figure, the median, minimum and maximum over the runs.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import click

__all__ = ["first_scale_out", "main", "summarize"]


def latency_recovery(report: dict[str, Any], factor: float = 2.0) -> dict[str, Any]:
    """How the sink latency came back after the step, from the report's timeline (one row per
    latency window: ``[t_s, records, p50_ms, p99_ms, max_ms]``): the highest window p99 of the
    high phase, and seconds from the step to the end of the last high-phase window whose p99
    is above ``factor`` x the low phase's p99 (0: none was; None: no timeline)."""
    timeline = report.get("timeline")
    low = (report["phases"]["low"]["latency"] or {}).get("p99_ms")
    if not timeline or not low:
        return {"peak_window_p99_ms": None, "back_within_2x_s": None}
    step_at, down_at = report["offered"][1][0], report["offered"][2][0]
    width = (
        min(b[0] - a[0] for a, b in zip(timeline, timeline[1:], strict=False))
        if len(timeline) > 1
        else 0.25
    )
    high = [row for row in timeline if step_at <= row[0] < down_at and row[3] is not None]
    over = [row[0] + width - step_at for row in high if row[3] > factor * low]
    return {
        "peak_window_p99_ms": max((row[3] for row in high), default=None),
        "back_within_2x_s": round(max(over), 3) if over else 0.0,
    }


def first_scale_out(report: dict[str, Any]) -> dict[str, Any]:
    """The figures of one loadstep report's first scale-out after the step (None: there was
    none)."""
    phases = report["phases"]
    low = (phases["low"]["latency"] or {}).get("p99_ms")
    high = (phases["high"]["latency"] or {}).get("p99_ms")
    step_at = report["offered"][1][0]
    outs = [r for r in report["per_rescale"] if r["to"] > r["from"] and r["start_s"] >= step_at - 1]
    row: dict[str, Any] = {
        "exact": report["exact"],
        "low_p99_ms": low,
        "high_p99_ms": high,
        "high_over_low_p99": (high / low) if low and high else None,
        "within_2x": (high / low) <= 2.0 if low and high else None,
        # the machine's 1-minute load average when the run started (None: not recorded)
        "load_at_start": ((report.get("machine_load") or {}).get("start") or [None])[0],
        "decision_after_step_s": report["reaction_s"]["first_scale_out_after_step"],
        **latency_recovery(report),
    }
    if not outs:
        return {**row, "rescale": None}
    r = outs[0]
    move = r.get("move_phases_s") or {}
    injected = move.get("barrier_injected")
    # the old owners' switches (routing index < from): the barrier waits there behind what the
    # busy instance is doing (its slice in progress, its queue)
    old_switch = [t for t in (move.get("switched") or [])[: r["from"]] if t is not None]
    spawn = r.get("spawn_phases_s") or {}
    return {
        **row,
        "rescale": f"{r['from']} -> {r['to']}",
        "done_s": r["done_s"],
        "done_after_step_s": row["decision_after_step_s"] + r["done_s"],
        "spawn_s": (r.get("prepare_phases_s") or {}).get("spawn"),
        "prepared_standbys": spawn.get("prepared_standbys", 0.0),
        "old_owner_switch_after_barrier_s": (
            max(old_switch) - injected if old_switch and injected is not None else None
        ),
        "switch_s": r["switch_s"],
        "sealed_s": r["sealed_s"],
        "first_on_demand_served_s": r["first_on_demand_served_s"],
        "barrier_injected_s": move.get("barrier_injected"),
        "all_arrived_s": max(
            (t for t in move.get("all_arrived", []) if t is not None), default=None
        ),
        "prepare_phases_s": r.get("prepare_phases_s"),
        "serve_wait_p99_ms": r["serve_wait_p99_ms"],
        "record_wait_p50_ms": r["fetch_wait_p50_ms"],
        "record_wait_p99_ms": r["fetch_wait_p99_ms"],
        "backlog_work_s": r["backlog_work_s"],
        "handover_rows": r["handover_rows"],
        # seconds after the move's end the warm standbys' refill began (it waits for the catch-up)
        "standby_refill_after_s": (r.get("standby_refill") or {}).get("after_s"),
        **later_scale_outs(outs),
        "all_rescales": [
            f"{x['from']}->{x['to']} done {x['done_s']:.2f} s" for x in report["per_rescale"]
        ],
    }


def later_scale_outs(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """The scale-outs after the first (threshold doubles: 2 -> 4 -> 8): the longest of them
    (seconds from the decision to done), the longest any scale-out spent starting or
    configuring instances (``prepare_phases_s.spawn``), and the highest record wait p99 of any
    (records of moved sub-groups waiting for their state on demand)."""
    later = outs[1:]
    spawn = [(r.get("prepare_phases_s") or {}).get("spawn") for r in outs]
    waits = [r.get("fetch_wait_p99_ms") for r in outs]
    return {
        "scale_outs": len(outs),
        "later_done_s_max": max((r["done_s"] for r in later), default=None),
        "spawn_s_max": max((x for x in spawn if x is not None), default=None),
        "record_wait_p99_ms_max": max((x for x in waits if x is not None), default=None),
        "later": [
            f"{r['from']}->{r['to']} done {r['done_s']:.2f} s, spawn "
            f"{(r.get('prepare_phases_s') or {}).get('spawn', float('nan')):.2f} s"
            for r in later
        ],
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, minimum and maximum of every numeric figure over the runs."""
    out: dict[str, Any] = {}
    for key in rows[0]:
        values = [r.get(key) for r in rows]
        nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if nums and len(nums) == len(values):
            out[key] = {
                "median": statistics.median(nums),
                "min": min(nums),
                "max": max(nums),
            }
    out["exact_runs"] = sum(bool(r.get("exact")) for r in rows)
    out["runs_within_2x"] = sum(r.get("within_2x") is True for r in rows)
    out["runs"] = len(rows)
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("reports", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The JSON to write.")
def main(reports: tuple[Path, ...], out: Path) -> None:
    """Median and range of the first scale-out over the loadstep REPORTS (JSON files)."""
    rows = []
    for path in reports:
        rep = json.loads(path.read_text())
        rows.append(
            {"report": str(path), "policy": rep["config"]["policy"], **first_scale_out(rep)}
        )
    summary = summarize([{k: v for k, v in r.items() if k != "report"} for r in rows])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": rows, "summary": summary}, indent=1))
    for key, s in summary.items():
        if isinstance(s, dict):
            click.echo(f"  {key}: median {s['median']:.3f} (range {s['min']:.3f} - {s['max']:.3f})")
    click.echo(f"  exact: {summary['exact_runs']} of {summary['runs']} runs")
    click.echo(f"  high p99 within 2x of low: {summary['runs_within_2x']} of {summary['runs']} runs")
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
