"""Turning a finished job's metrics into a benchmark report (JSON) and a short summary."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import ray

import raystream as rs
from raystream.metrics import (
    DEFAULT_WINDOW_MS,
    LatencyRecorder,
    WindowedCounter,
    build_timeline,
    rescale_impact,
)

__all__ = [
    "LATENCY_WEIGHTING",
    "RESCALE_WINDOW",
    "build_report",
    "imported_from",
    "print_summary",
    "write_atomically",
]

LATENCY_WEIGHTING = (
    "per input event: an output row counts once for every input event it aggregates (its "
    "input_events; a key-count row covers the key's events of one batch), and its latency is the "
    "age of its oldest input event when it reaches the sink"
)
RESCALE_WINDOW = (
    "from the request until latency is back: the first 2 s of 250 ms windows whose p99 is within "
    "1.5x the steady p99 (the p99 before the request, first second left out), not before the "
    "state settled; or until the run ended (recovered_s null)"
)


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(float(x), digits)


def build_report(
    result: rs.JobResult,
    *,
    step: str,
    config: dict[str, Any],
    extra: dict[str, Any] | None = None,
    steady_from_s: float = 1.0,
) -> dict[str, Any]:
    """The report of one run: throughput of ``step`` (the keyed count), sink latency, timeline.

    ``timeline`` rows are ``[t_s, throughput_eps, p50_ms, p99_ms, max_ms]`` per 250 ms window
    since the job started: records into ``step`` per window (all instances merged) and the
    latency of the records reaching the sinks in that window, weighted per input event
    (``LATENCY_WEIGHTING``). Each rescale gets its window's figures (``RESCALE_WINDOW``, see
    :func:`raystream.metrics.rescale_impact`); the first rescale's steady span starts
    ``steady_from_s`` after the job's start (later: a cold start is not steady), a later one's
    after the previous rescale's window.
    """
    insts = result.step_metrics(step)
    events_in = sum(int(m.get("records_in", 0)) for m in insts)
    events_out = sum(int(m.get("records_out", 0)) for m in insts)
    elapsed = float(result.elapsed_s)
    counter = WindowedCounter.merge_snapshots(
        [m["throughput"] for m in insts if m.get("throughput")]
    )
    lat = result.latency() or LatencyRecorder(result.origin_ns)
    window_ms = counter.window_ms if insts else DEFAULT_WINDOW_MS
    timeline = [
        [_r(t, 3), _r(eps, 1), _r(p50), _r(p99), _r(mx)]
        for t, eps, p50, p99, mx in build_timeline(counter.timeline(), lat.timeline(), window_ms)
    ]
    summary = lat.summary()
    throughput = counter.timeline()
    rescales = []
    steady_from = steady_from_s
    for r in result.rescales:
        impact = rescale_impact(
            lat,
            throughput,
            r["start_s"],
            r["end_s"],
            window_ms=window_ms,
            steady_from_s=steady_from,
        )
        steady_from = impact["window_end_s"]
        rescales.append(
            {
                **{
                    k: r[k]
                    for k in (
                        "from",
                        "to",
                        "strategy",
                        "start_s",
                        "end_s",
                        "duration_s",
                        "moved_key_groups",
                        "moved_bytes",
                        "moved_rows",
                        "on_demand_fetches",
                        "fetch_wait_ms",
                        "steps",
                    )
                },
                **{
                    k: r.get(k)
                    for k in (
                        "fence_ms",
                        "max_rss_growth_mb",
                        "max_rss_peak_mb",
                        "switch_s",
                        "sealed_s",
                        "first_on_demand_served_s",
                        "on_demand_serve_wait_ms",
                        "prepare_phases_s",
                        "chunks",
                        "max_chunk_bytes",
                        "max_inflight_chunks",
                        "transfer",
                        # per instance: when it switched, sealed, served its first on-demand
                        # chunk, had all state in, finished; every serve call's times
                        "move_phases_s",
                    )
                },
                **impact,
            }
        )
    final_parallelism = rescales[-1]["to"] if rescales else config.get("parallelism", len(insts))
    report: dict[str, Any] = {
        "benchmark": "keycount",
        "job": result.job,
        "state": result.state,
        "events_in": events_in,
        "events_out": events_out,
        "elapsed_s": _r(elapsed, 4),
        "throughput_eps": _r(events_in / elapsed if elapsed > 0 else 0.0, 1),
        "latency_ms": {
            "p50": _r(summary["p50_ms"]),
            "p99": _r(summary["p99_ms"]),
            "max": _r(summary["max_ms"]),
        },
        "latency_weighting": LATENCY_WEIGHTING,
        "latency_events": summary["count"],
        "latency_rows": lat.rows,
        "rescale_window": RESCALE_WINDOW,
        "window_ms": window_ms,
        "timeline": timeline,
        "parallelism": final_parallelism,
        "rescales": rescales,
        # warm standbys started again after a scale-out: when (after the rescale ended) and
        # how long their processes took to come up (they share the machine with the job)
        "standby_refills": list(getattr(result, "standby_refills", []) or []),
        "state_backend": "rocksdb",
        "instances": [
            {
                "step": m.get("step"),
                "index": m.get("index"),
                "records_in": m.get("records_in"),
                "records_out": m.get("records_out"),
                "busy_s": _r(m.get("busy_s"), 4),
                "max_backlog_seen": m.get("max_backlog_seen"),
                "max_inflight_seen": m.get("max_inflight_seen"),
            }
            for m in sorted(result.metrics, key=lambda m: (str(m.get("step")), m.get("index", 0)))
            if m
        ],
        "config": config,
        "environment": {
            "raystream": rs.__version__,
            "ray": ray.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
    }
    report.update(extra or {})
    return report


def write_atomically(path: Path, write: Any) -> None:
    """``write(tmp_path)`` into a temporary file beside ``path``, then rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def imported_from(module: Any) -> str:
    """Which checkout a result came from: the package folder of ``module``, relative to the
    current folder when it lies inside it (so results run from the repository's root name no
    machine paths), else absolute (an older checkout run for comparison)."""
    folder = Path(module.__file__).resolve().parent
    try:
        return str(folder.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(folder)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1) + "\n"))


def print_summary(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    lat = report["latency_ms"]
    cfg = report["config"]
    table = Table(
        title=f"key-count ({cfg['form']}, parallelism {report['parallelism']}, RocksDB state)",
        show_header=False,
        title_justify="left",
    )
    table.add_column(style="bold")
    table.add_column(justify="right")
    source = cfg["input"] or (
        f"generator: {cfg['events']:,} events, {cfg['keys']:,} keys, zipf {cfg['zipf']}, "
        f"{cfg['key_type']} keys"
        + (f", hot key {cfg['hot_key_fraction']:.0%}" if cfg["hot_key_fraction"] else "")
    )
    table.add_row("input", source)
    table.add_row("rate", f"{cfg['rate']:,.0f} ev/s" if cfg["rate"] else "unthrottled")
    table.add_row("events in / out", f"{report['events_in']:,} / {report['events_out']:,}")
    if "keys_out" in report:
        table.add_row("distinct keys", f"{report['keys_out']:,}")
    table.add_row("elapsed", f"{report['elapsed_s']:.2f} s")
    table.add_row("throughput", f"{report['throughput_eps']:,.0f} ev/s")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f} ms"

    table.add_row(
        "latency p50 / p99 / max (per input event)",
        f"{ms(lat['p50'])} / {ms(lat['p99'])} / {ms(lat['max'])}",
    )
    peak = max((row[1] for row in report["timeline"]), default=0.0)
    table.add_row("peak throughput (250 ms window)", f"{peak:,.0f} ev/s")
    for r in report.get("rescales", []):
        dip = r.get("window_throughput_dip")
        rec = r.get("recovered_s")
        table.add_row(
            f"rescale {r['from']} -> {r['to']} ({r['strategy']}) at {r['start_s']:.1f} s",
            f"moved in {r['duration_s']:.2f} s, {r['moved_key_groups']} key groups, "
            f"{r['moved_bytes']:,} B, {r['on_demand_fetches']} on-demand; "
            f"{'not recovered' if rec is None else f'recovered after {rec:.2f} s'} "
            f"(steady p99 {ms(r['steady_p99_ms'])}); until then latency peak "
            f"{ms(r['window_peak_latency_ms'])}, p99 {ms(r['window_p99_latency_ms'])}; "
            f"throughput dip {'-' if dip is None else f'{dip:.2f}'}",
        )
    for e in report.get("rescale_errors", []):
        table.add_row("[red]rescale or kill failed[/]", e)
    ck = report.get("checkpoints") or {}
    if ck.get("completed") or ck.get("failed"):
        last = ck.get("last") or {}
        table.add_row(
            "checkpoints",
            f"{ck['completed']} completed, {ck['failed']} failed; last took "
            f"{last.get('duration_s', 0):.2f} s",
        )
    for r in report.get("recoveries", []):
        table.add_row(
            f"recovery at {r['at_s']:.1f} s ({'/'.join(map(str, r['instance']))} failed)",
            f"from checkpoint {r['checkpoint_id']}, down {r['downtime_s']:.2f} s, "
            f"{r['records_replayed']:,} records replayed",
        )
    if "exact" in report:
        table.add_row("final counts equal the input", str(report["exact"]))
    Console(stderr=False).print(table)
