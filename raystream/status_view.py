"""One row per operator for ``raystream status``: the controller's per-instance metrics, summed.

Plain Python over the dict that ``Job.status()`` returns, so it is tested without Ray.

Example::

    >>> st = {"parallelism": {"count": 1}, "instances": [
    ...     {"step": "count", "index": 0, "records_in": 10, "records_out": 4, "busy_s": 0.5,
    ...      "uptime_s": 2.0, "backlog": 3,
    ...      "throughput": {"origin_ns": 0, "window_ms": 1000, "counts": {0: 10}}}]}
    >>> row = operator_rows(st, now_ns=2_000_000_000)[0]
    >>> [row[k] for k in ("operator", "parallelism", "records_in", "busy_pct", "rate_in_per_s")]
    ['count', 1, 10, 25.0, 5.0]
"""

from __future__ import annotations

import time
from typing import Any

from raystream.metrics import LatencyRecorder, WindowedCounter

__all__ = [
    "RATE_WINDOW_S",
    "describe_sink_result",
    "operator_rows",
    "progress_line",
    "recent_rate",
    "summary_lines",
]

RATE_WINDOW_S = 2.0


def recent_rate(throughput: WindowedCounter, now_ns: int, span_s: float = RATE_WINDOW_S) -> float:
    """Records per second over the last ``span_s`` of *complete* windows before ``now_ns``
    (the window ``now_ns`` falls in is still filling and is left out)."""
    window_ns = throughput.window_ms * 1_000_000
    current = max(0, (now_ns - throughput.origin_ns) // window_ns)
    n_windows = max(1, round(span_s * 1000 / throughput.window_ms))
    first = max(0, current - n_windows)
    counts = throughput.snapshot()["counts"]
    total = sum(int(c) for w, c in counts.items() if first <= int(w) < current)
    covered = (current - first) * throughput.window_ms / 1000
    return total / covered if covered > 0 else 0.0


def _migration(instances: list[dict[str, Any]]) -> str:
    migs = [m["migration"] for m in instances if m.get("migration")]
    if not migs:
        return ""
    if all(m.get("done") for m in migs):
        return "done"
    arrived = sum(int(m.get("arrived", 0)) for m in migs)
    incoming = sum(int(m.get("incoming", 0)) for m in migs)
    return f"{arrived}/{incoming} sub-groups in"


def _nodes(instances: list[dict[str, Any]]) -> str:
    """Where the live instances run: ``node:count`` per node (node ids shortened to 8)."""
    where: dict[str, int] = {}
    for m in instances:
        if m.get("node_id"):
            label = f"{m.get('node_ip', '?')}/{str(m['node_id'])[:8]}"
            where[label] = where.get(label, 0) + 1
    return " ".join(f"{k}:{v}" for k, v in sorted(where.items()))


def _recent_busy(insts: list[dict[str, Any]], previous: dict[tuple[str, int], Any]) -> float | None:
    """Busy % between the previous reading and this one, over the instances in both."""
    busy = uptime = 0.0
    for m in insts:
        before = previous.get((str(m.get("step")), int(m.get("index", -1))))
        if before is None:
            continue
        busy += float(m.get("busy_s", 0.0)) - float(before.get("busy_s", 0.0))
        uptime += float(m.get("uptime_s", 0.0)) - float(before.get("uptime_s", 0.0))
    if uptime <= 0:
        return None
    return round(min(100.0, max(0.0, 100.0 * busy / uptime)), 1)


def _role(insts: list[dict[str, Any]]) -> str:
    roles = {str(m["role"]) for m in insts if m.get("role")}
    return roles.pop() if len(roles) == 1 else "operator"


def operator_rows(
    status: dict[str, Any],
    now_ns: int | None = None,
    previous: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Per operator (step): its role (source, operator, sink), parallelism, records in/out,
    recent input rate, busy % (since the instances started; ``busy_recent_pct``: since the
    ``previous`` status, None without one), backlog, sink latency p50/p99 (whole run),
    migration progress, the nodes the live instances run on, and the operator chain it runs
    in (``chain``: the steps sharing its actors, head first; '' when it runs alone)."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    before = {
        (str(m.get("step")), int(m.get("index", -1))): m
        for m in (previous or {}).get("instances", [])
        if m.get("step") is not None
    }
    by_step: dict[str, list[dict[str, Any]]] = {}
    for m in status.get("instances", []):
        if m.get("step") is not None:
            by_step.setdefault(str(m["step"]), []).append(m)
    chains = {str(g.get("step")): g.get("chain") or [] for g in status.get("graph") or []}
    order = list(status.get("parallelism", {}))
    order += sorted(s for s in by_step if s not in order)
    rows = []
    for step in order:
        insts = by_step.get(step, [])
        live = [m for m in insts if not m.get("finished")]
        thr = [m["throughput"] for m in live if m.get("throughput")]
        rate = recent_rate(WindowedCounter.merge_snapshots(thr), now_ns) if thr else 0.0
        uptime = sum(float(m.get("uptime_s", 0.0)) for m in insts)
        busy = sum(float(m.get("busy_s", 0.0)) for m in insts)
        lat = [m["latency"] for m in insts if m.get("latency")]
        summary = LatencyRecorder.merge_snapshots(lat).summary() if lat else None
        rows.append(
            {
                "operator": step,
                "role": _role(insts),
                "parallelism": int(
                    status.get("parallelism", {}).get(step, len(live) or len(insts))
                ),
                "instances_live": len(live),
                "records_in": sum(int(m.get("records_in", 0)) for m in insts),
                "records_out": sum(int(m.get("records_out", 0)) for m in insts),
                "rate_in_per_s": round(rate, 1),
                "busy_pct": round(100.0 * busy / uptime, 1) if uptime > 0 else 0.0,
                "busy_recent_pct": _recent_busy(live, before) if before else None,
                "backlog": sum(int(m.get("backlog", 0)) for m in live),
                "latency_p50_ms": summary["p50_ms"] if summary else None,
                "latency_p99_ms": summary["p99_ms"] if summary else None,
                "migration": _migration(insts),
                "nodes": _nodes(live),
                # the steps whose instances share this step's actors (an operator chain)
                "chain": " > ".join(chains.get(step, [])),
            }
        )
    return rows


def _totals(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """(records the sources emitted, records the sinks received)."""
    events_in = sum(r["records_out"] for r in rows if r["role"] == "source")
    events_out = sum(r["records_in"] for r in rows if r["role"] == "sink")
    return events_in, events_out


def progress_line(
    status: dict[str, Any],
    elapsed_s: float,
    previous: dict[str, Any] | None = None,
    interval_s: float | None = None,
) -> str:
    """One line of a running job's progress: records in (from the sources) and out (into the
    sinks) with their rates since ``previous`` (``interval_s`` before), sink latency p99 so far,
    the keyed steps' parallelism, and a running rescale's progress. Example::

        >>> st = {"parallelism": {"src": 1, "count": 2}, "instances": [
        ...     {"step": "src", "index": 0, "role": "source", "records_out": 3000},
        ...     {"step": "count", "index": 0, "role": "sink", "records_in": 1000}]}
        >>> progress_line(st, 4.0, {"instances": [
        ...     {"step": "src", "index": 0, "role": "source", "records_out": 1000}]}, 2.0)
        '4.0 s  in 3,000 (1,000/s)  out 1,000 (500/s)  parallelism src=1 count=2'
    """
    rows = operator_rows(status)
    events_in, events_out = _totals(rows)
    parts = [f"{elapsed_s:.1f} s"]
    if previous is not None and interval_s:
        prev_in, prev_out = _totals(operator_rows(previous))
        rate_in = max(0.0, (events_in - prev_in) / interval_s)
        rate_out = max(0.0, (events_out - prev_out) / interval_s)
        parts += [f"in {events_in:,} ({rate_in:,.0f}/s)", f"out {events_out:,} ({rate_out:,.0f}/s)"]
    else:
        parts += [f"in {events_in:,}", f"out {events_out:,}"]
    lat = status.get("latency")
    if lat:
        parts.append(f"p99 {lat['p99_ms']:g} ms")
    backlog = sum(r["backlog"] for r in rows)
    if backlog:
        parts.append(f"backlog {backlog:,}")
    par = " ".join(f"{k}={v}" for k, v in (status.get("parallelism") or {}).items())
    parts.append(f"parallelism {par}")
    moving = [
        f"{r['operator']} {r['migration']}" for r in rows if r["migration"] not in ("", "done")
    ]
    if status.get("rescaling") or moving:
        parts.append("rescaling" + (f" ({', '.join(moving)})" if moving else ""))
    return "  ".join(parts)


def describe_sink_result(parts: list[Any]) -> str:
    """What a sink's instances returned, in words: rows of collected tables, files written,
    row counts. Example::

        >>> import pyarrow as pa
        >>> describe_sink_result([pa.table({"k": [1, 2]}), pa.table({"k": [3]}), None])
        '3 rows collected (columns: k)'
    """
    tables = [p for p in parts if hasattr(p, "num_rows") and hasattr(p, "column_names")]
    files = [p for p in parts if hasattr(p, "paths") and hasattr(p, "rows")]
    counts = [p for p in parts if isinstance(p, int) and not isinstance(p, bool)]
    known = len(tables) + len(files) + counts.__len__() + sum(p is None for p in parts)
    out = []
    if tables:
        cols = ", ".join(tables[0].column_names)
        out.append(f"{sum(t.num_rows for t in tables):,} rows collected (columns: {cols})")
    if files:
        paths = [str(x) for f in files for x in (f.paths or ((f.path,) if f.path else ()))]
        # a long job's result lists the newest paths only; ``files`` counts every one
        count = sum(_file_count(f) for f in files)
        shown = ", ".join(paths[:3]) + (f", ... ({count} files)" if count > 3 else "")
        out.append(f"{sum(int(f.rows) for f in files):,} rows written to {shown or 'no file'}")
    if counts:
        out.append(f"{sum(counts):,} rows")
    if known < len(parts):
        others = [p for p in parts if p is not None and p not in tables + files + counts]
        out.append(", ".join(repr(p)[:120] for p in others[:3]))
    return "; ".join(out) if out else "no output"


def _file_count(written: Any) -> int:
    """The files a sink instance's result says it published (``files``; else its paths)."""
    files = getattr(written, "files", None)
    if isinstance(files, int):
        return files
    return len(written.paths or ((written.path,) if written.path else ()))


def summary_lines(result: Any) -> list[str]:
    """The end of ``raystream run``: the job's outcome, per operator its instances, records
    and busy share, latency, and what each sink produced (a ``JobResult``)."""
    lines = [f"job {result.job!r} {result.state} in {result.elapsed_s:.2f} s"]
    status = {"parallelism": {}, "instances": result.metrics}
    rows = operator_rows(status)
    width = max((len(r["operator"]) for r in rows), default=0)
    for r in rows:
        n = r["parallelism"]
        counts = []
        if r["role"] != "source":
            counts.append(f"in {r['records_in']:,}")
        if r["role"] != "sink":
            counts.append(f"out {r['records_out']:,}")
        busy = f"  busy {r['busy_pct']:.0f} %" if r["role"] == "operator" else ""
        lines.append(
            f"  {r['operator']:<{width}}  {r['role']:<8} {n} instance{'s' if n != 1 else ''}  "
            f"{'  '.join(counts)}{busy}"
        )
    lat = result.latency()
    if lat is not None:
        s = lat.summary()
        lines.append(f"latency p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms, max {s['max_ms']} ms")
    total = getattr(result, "rescales_total", None) or 0
    if total > len(result.rescales):  # a long job's result lists the newest only
        lines.append(f"{total:,} rescales; the newest {len(result.rescales)}:")
    for r in result.rescales:
        if "from" in r and "to" in r:
            lines.append(
                f"rescaled {r.get('step', r.get('operator', '?'))!r} {r['from']} -> {r['to']}"
                f" with {r.get('strategy', '?')} in {float(r.get('duration_s', 0)):.2f} s"
            )
    for sink, parts in result.results.items():
        lines.append(f"sink {sink!r}: {describe_sink_result(parts)}")
    return lines
