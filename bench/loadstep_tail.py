"""Where the high phase's sink p99 comes from: the records above it, by when they came in.

``bench.loadstep --trace`` keeps every row's ingest and write time (``bench._latency_trace``) and
calls ``tail_breakdown`` on them; the result is the report's ``tail``. It can also be run again
on a report and its trace folder::

    python -m bench.loadstep_tail bench/results/loadstep_x.json   # trace in loadstep_x_trace/

The records written in the high phase (from the step to the step down, by write time) are
ranked by latency; the top 1 % (latency above the phase's p99) are put in buckets by *ingest*
time against the first scale-out's milestones: before the step; from the step to the decision;
decision to routing switch; switch to the last old owner's seal; seal to done; after done. Each
bucket says how many of the top records it has, how many of them the new owners wrote (their
sub-group moved), and their latency range. ``line_2x`` counts the high-phase records above 2x
the low phase's p99 against the 1 % that a p99 within 2x allows, and ``profile`` gives the
latency (p50, max) of the records by 50 ms of ingest time around the step. ``by_write_time``
splits the top 1 % and the events above the 2x line by when they were written: before the first
scale-out was done, or after (while the backlog it left was worked off).

Several runs' tails side by side (median, min, max per figure)::

    python -m bench.loadstep_tail --runs bench/results/loadstep_x_{1,2,3}.json --out bench/results/loadstep_x_tail.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import numpy as np

__all__ = [
    "BUCKETS",
    "step_from_ingest",
    "tail_breakdown",
    "tail_figures",
    "trace_weights",
    "weighted_percentile",
]

BUCKETS = (
    "before_step",
    "step_to_decision",
    "decision_to_switch",
    "switch_to_seal",
    "seal_to_done",
    "after_done",
)
PROFILE_BIN_S = 0.05
HUMP_AFTER_DONE_S = 1.0  # the first scale-out's hump: from the step to this long after done
RESCALE_TAIL_S = 0.5  # a later rescale's own: from its start to this long after its end


def step_from_ingest(
    ingest_s: np.ndarray, factor: float, near_s: float, weights: np.ndarray | None = None
) -> float:
    """When the input rate stepped up: the start of the first 50 ms bin of ingest times (events,
    with ``weights``), within 2 s of ``near_s`` (the bench's estimate), whose rate is above the
    middle of the rate measured in the first second of that span and ``factor`` x it (relative:
    a trace of aggregated rows undercounts both rates alike).

    >>> t = np.concatenate([np.arange(0, 1.2, 1 / 100), np.arange(1.2, 3, 1 / 400)])
    >>> round(step_from_ingest(t, 4, 2.0), 2)
    1.2
    """
    lo, hi = near_s - 2.0, near_s + 2.0
    sel = (ingest_s >= lo) & (ingest_s < hi)
    t = ingest_s[sel]
    if t.size == 0:
        return near_s
    w = None if weights is None else np.asarray(weights)[sel]
    edges = lo + PROFILE_BIN_S * np.arange(int(round((hi - lo) / PROFILE_BIN_S)) + 1)
    counts, _ = np.histogram(t, edges, weights=w)
    base = float(np.median(counts[: int(round(1.0 / PROFILE_BIN_S))]))
    over = np.flatnonzero(counts > base * (1 + factor) / 2)
    return float(edges[over[0]]) if over.size and base > 0 else near_s


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The smallest value with at least ``q`` % of the weight at or below it.

    >>> weighted_percentile(np.array([5.0, 1.0, 3.0]), np.array([1, 1, 98]), 99)
    3.0
    """
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(np.asarray(weights, np.int64)[order])
    i = int(np.searchsorted(cum, q / 100 * cum[-1], side="left"))
    return float(np.asarray(values)[order][min(i, cum.size - 1)])


def _milestones(rescale: dict[str, Any], step_s: float) -> list[float]:
    """Bucket edges (seconds since the origin) for ``BUCKETS``."""
    start = float(rescale["start_s"])

    def at(key: str) -> float:
        v = rescale.get(key)
        return start + float(v) if v is not None else start

    return [step_s, start, at("switch_s"), at("sealed_s"), at("done_s")]


def tail_breakdown(
    ingest_ns: np.ndarray,
    written_ns: np.ndarray,
    sink_index: np.ndarray,
    origin_ns: int,
    report: dict[str, Any],
    weights: np.ndarray | None = None,
) -> dict[str, Any]:
    """The high phase's top 1 % by ingest time (see the module's doc). ``report`` is a
    ``bench.loadstep`` report (``config``, ``offered``, ``per_rescale``); ``weights``: input
    events per row (``bench._latency_trace.row_weights``; default 1). Counts are of events."""
    cfg = report["config"]
    ingest = (np.asarray(ingest_ns, np.int64) - origin_ns) / 1e9
    written = (np.asarray(written_ns, np.int64) - origin_ns) / 1e9
    index = np.asarray(sink_index, np.int64)
    latency_ms = (written - ingest) * 1e3
    wts = np.ones(ingest.size, np.int64) if weights is None else np.asarray(weights, np.int64)
    high_eps = float(cfg["low_eps"]) * float(cfg["factor"])
    step_est, down_est = float(report["offered"][1][0]), float(report["offered"][2][0])
    step_s = step_from_ingest(ingest, float(cfg["factor"]), step_est, wts)
    shift = step_s - step_est  # the bench's phases are on its estimate; follow the ingest's step
    down_s = down_est + shift
    low = (written >= step_s - (float(cfg["low_s"]) - 2)) & (written < step_s)
    high = (written >= step_s) & (written < down_s)
    if not high.any() or not low.any():
        return {"error": f"no rows in the low ({int(low.sum())}) or high ({int(high.sum())}) phase"}
    low_p99 = weighted_percentile(latency_ms[low], wts[low], 99)
    high_p99 = weighted_percentile(latency_ms[high], wts[high], 99)
    outs = [
        r
        for r in report.get("per_rescale", [])
        if r["to"] > r["from"] and r["start_s"] >= step_s - 1 and r["start_s"] < down_s
    ]
    out: dict[str, Any] = {
        "step_s": round(step_s, 3),
        "step_minus_bench_estimate_s": round(shift, 3),
        "events_high": int(wts[high].sum()),
        "low_p99_ms": round(low_p99, 1),
        "high_p99_ms": round(high_p99, 1),
        "high_over_low": round(high_p99 / low_p99, 2) if low_p99 else None,
    }
    h_lat, h_ing, h_idx, h_w = latency_ms[high], ingest[high], index[high], wts[high]
    top = h_lat > high_p99
    line = 2 * low_p99
    over_line = h_lat > line
    allowed = int(0.01 * h_w.sum())
    out["line_2x"] = {
        "line_ms": round(line, 1),
        "events_above": int(h_w[over_line].sum()),
        "events_allowed_for_p99": allowed,
        "ingest_span_above_s": (
            [round(float(h_ing[over_line].min()) - step_s, 3), round(float(h_ing[over_line].max()) - step_s, 3)]
            if over_line.any()
            else None
        ),
        "seconds_of_high_input_above": round(int(h_w[over_line].sum()) / high_eps, 3),
    }
    if not outs:
        out["buckets"] = None
        return out
    r = outs[0]
    edges = _milestones(r, step_s)
    out["first_scale_out"] = {
        "rescale": f"{r['from']} -> {r['to']}",
        "decision_after_step_s": round(edges[1] - step_s, 3),
        "switch_after_step_s": round(edges[2] - step_s, 3),
        "sealed_after_step_s": round(edges[3] - step_s, 3),
        "done_after_step_s": round(edges[4] - step_s, 3),
    }
    which = np.searchsorted(np.asarray(edges), h_ing, side="right")  # 0: before the step
    buckets: dict[str, Any] = {}
    for b, name in enumerate(BUCKETS):
        sel = top & (which == b)
        n = int(h_w[sel].sum())
        buckets[name] = {
            "top_events": n,
            "share": round(n / max(int(h_w[top].sum()), 1), 3),
            "by_new_owner": int(h_w[sel & (h_idx >= int(r["from"]))].sum()),
            "latency_ms": [round(float(h_lat[sel].min()), 1), round(float(h_lat[sel].max()), 1)]
            if n
            else None,
            "events_ingested": int(h_w[which == b].sum()),
            "above_2x_line": int(h_w[over_line & (which == b)].sum()),
        }
    out["top_events"] = int(h_w[top].sum())
    out["buckets"] = buckets
    # when the top 1 % and the events above the 2x line were *written*: while the move ran, or
    # after it, while the step worked off what queued meanwhile
    h_wr = written[high]
    done_at = edges[4]
    out["by_write_time"] = {
        "top_before_done": int(h_w[top & (h_wr < done_at)].sum()),
        "top_after_done": int(h_w[top & (h_wr >= done_at)].sum()),
        "above_2x_before_done": int(h_w[over_line & (h_wr < done_at)].sum()),
        "above_2x_after_done": int(h_w[over_line & (h_wr >= done_at)].sum()),
        "last_above_2x_written_after_step_s": round(float(h_wr[over_line].max()) - step_s, 3)
        if over_line.any()
        else None,
    }
    # ... and while warm standby processes started (the refill after a scale-out: from its
    # start to its last wave's end)
    refilling = np.zeros(h_wr.size, dtype=bool)
    spans = []
    ends = {x["start_s"]: x.get("end_s") for x in report.get("rescales", [])}
    for f in report.get("standby_refills", []):
        end = ends.get(f.get("rescale_start_s"))
        if end is None or f.get("after_s") is None:
            continue
        a = float(end) + float(f["after_s"])
        b = a + sum(float(w[1]) for w in f.get("waves", []))
        spans.append([round(a - step_s, 3), round(b - step_s, 3)])
        refilling |= (h_wr >= a) & (h_wr < b)
    out["by_write_time"]["refill_spans_after_step_s"] = spans
    # the scale-out's own bump: what went above the line before the first refill started
    first_refill = min((a for a, _ in spans), default=None)
    before_refill = (
        over_line
        if first_refill is None
        else over_line & (h_wr < step_s + first_refill)
    )
    out["by_write_time"]["above_2x_before_refill"] = int(h_w[before_refill].sum())
    out["by_write_time"]["top_during_refill"] = int(h_w[top & refilling].sum())
    out["by_write_time"]["above_2x_during_refill"] = int(h_w[over_line & refilling].sum())
    # the events above the line by what they were written during, each counted once: the first
    # scale-out's hump (from the step until HUMP_AFTER_DONE_S after it was done, refills
    # apart), refills, later rescales in the high phase, anything else (a stall of the machine)
    hump = (h_wr < done_at + HUMP_AFTER_DONE_S) & ~refilling
    rescaling = np.zeros(h_wr.size, dtype=bool)
    for x in report.get("rescales", []):
        if x.get("end_s") is not None and float(x["start_s"]) > edges[1] + 1e-6:
            rescaling |= (h_wr >= float(x["start_s"])) & (
                h_wr < float(x["end_s"]) + RESCALE_TAIL_S
            )
    later = rescaling & ~hump & ~refilling
    out["by_write_time"]["above_2x_by_cause"] = {
        "first_scale_out": int(h_w[over_line & hump].sum()),
        "refills": int(h_w[over_line & refilling].sum()),
        "later_rescales": int(h_w[over_line & later].sum()),
        "elsewhere": int(h_w[over_line & ~hump & ~refilling & ~later].sum()),
    }
    # latency by ingest time, 50 ms bins, from 0.25 s before the step to 1.5 s after done
    lo, hi = step_s - 0.25, edges[4] + 1.5
    bins = np.arange(lo, hi + PROFILE_BIN_S, PROFILE_BIN_S)
    prof = []
    where = np.digitize(h_ing, bins) - 1
    for i in range(len(bins) - 1):
        sel = where == i
        if sel.any():
            moved = sel & (h_idx >= int(r["from"]))
            prof.append(
                [
                    round(float(bins[i]) - step_s, 3),
                    int(h_w[sel].sum()),
                    round(weighted_percentile(h_lat[sel], h_w[sel], 50), 1),
                    round(float(h_lat[sel].max()), 1),
                    int(h_w[moved].sum()),
                ]
            )
    out["profile_columns"] = [
        "ingest_after_step_s",
        "events",
        "p50_ms",
        "max_ms",
        "events_new_owner",
    ]
    out["profile"] = prof
    return out


def trace_weights(trace: Any) -> np.ndarray | None:
    """Input events per row of a trace table (None: a trace without counts, weight 1)."""
    from bench._latency_trace import row_weights

    if "count" not in trace.column_names:
        return None
    return row_weights(trace["key"].to_numpy(), trace["count"].to_numpy())


def tail_figures(tail: dict[str, Any]) -> dict[str, Any]:
    """One run's tail as flat figures (for a side-by-side of runs)."""
    fs = tail.get("first_scale_out") or {}
    buckets = tail.get("buckets") or {}
    wt = tail.get("by_write_time") or {}
    line = tail.get("line_2x") or {}
    top = max(int(tail.get("top_events") or 0), 1)
    row: dict[str, Any] = {
        "low_p99_ms": tail.get("low_p99_ms"),
        "high_p99_ms": tail.get("high_p99_ms"),
        "high_over_low": tail.get("high_over_low"),
        "decision_after_step_s": fs.get("decision_after_step_s"),
        "switch_after_step_s": fs.get("switch_after_step_s"),
        "sealed_after_step_s": fs.get("sealed_after_step_s"),
        "done_after_step_s": fs.get("done_after_step_s"),
        "above_2x_events": line.get("events_above"),
        "above_2x_allowed": line.get("events_allowed_for_p99"),
        "above_2x_written_after_done_share": (
            round(wt["above_2x_after_done"] / max(line.get("events_above") or 0, 1), 3)
            if wt
            else None
        ),
        "top_written_after_done_share": round(wt["top_after_done"] / top, 3) if wt else None,
        "top_written_during_refill_share": round(wt.get("top_during_refill", 0) / top, 3)
        if wt
        else None,
        "above_2x_written_during_refill_share": (
            round(wt.get("above_2x_during_refill", 0) / max(line.get("events_above") or 0, 1), 3)
            if wt
            else None
        ),
        "last_above_2x_written_after_step_s": wt.get("last_above_2x_written_after_step_s"),
        "above_2x_before_refill": wt.get("above_2x_before_refill"),
    }
    for cause, n in (wt.get("above_2x_by_cause") or {}).items():
        row[f"above_2x_{cause}"] = n
    for name in BUCKETS:
        b = buckets.get(name)
        row[f"top_share_ingested_{name}"] = b["share"] if b else None
    return row


def _median_range(values: list[Any]) -> dict[str, Any] | None:
    xs = [float(v) for v in values if isinstance(v, (int, float))]
    if not xs:
        return None
    return {"median": float(np.median(xs)), "min": min(xs), "max": max(xs), "n": len(xs)}


@click.command()
@click.argument("report_json", type=click.Path(exists=True, path_type=Path), nargs=-1)
@click.option("--trace", type=click.Path(exists=True, path_type=Path), default=None)
@click.option("--runs", is_flag=True, help="Summarise the reports' tails (median, min, max).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="With --runs.")
def main(report_json: tuple[Path, ...], trace: Path | None, runs: bool, out: Path | None) -> None:
    """Recompute a report's ``tail`` from its trace folder (default: <report>_trace), or with
    ``--runs`` put several reports' tails side by side."""
    from bench._latency_trace import read_trace

    if runs:
        per_run = {}
        for path in report_json:
            rep = json.loads(path.read_text())
            per_run[path.name] = {"exact": rep.get("exact"), **tail_figures(rep.get("tail") or {})}
        keys = next(iter(per_run.values())).keys() if per_run else []
        summary = {
            "runs": per_run,
            "summary": {k: _median_range([r[k] for r in per_run.values()]) for k in keys},
        }
        text = json.dumps(summary, indent=1)
        if out is not None:
            out.write_text(text)
        click.echo(text)
        return
    if len(report_json) != 1:
        raise click.UsageError("give one report (or --runs and several)")
    path = report_json[0]
    report = json.loads(path.read_text())
    folder = trace or path.with_name(path.stem + "_trace")
    t = read_trace(folder)
    tail = tail_breakdown(
        t["ingest_ns"].to_numpy(),
        t["written_ns"].to_numpy(),
        t["sink_index"].to_numpy(),
        int(report["origin_ns"]),
        report,
        trace_weights(t),
    )
    report["tail"] = tail
    path.write_text(json.dumps(report, indent=1, default=str))
    click.echo(json.dumps({k: v for k, v in tail.items() if k != "profile"}, indent=1))


if __name__ == "__main__":
    main()
