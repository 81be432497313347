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

__all__ = ["RATE_WINDOW_S", "operator_rows", "recent_rate"]

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


def operator_rows(status: dict[str, Any], now_ns: int | None = None) -> list[dict[str, Any]]:
    """Per operator (step): parallelism, records in/out, recent input rate, busy % (since the
    instances started), backlog, sink latency p50/p99 (whole run), migration progress and the
    nodes the live instances run on."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    by_step: dict[str, list[dict[str, Any]]] = {}
    for m in status.get("instances", []):
        if m.get("step") is not None:
            by_step.setdefault(str(m["step"]), []).append(m)
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
                "parallelism": int(
                    status.get("parallelism", {}).get(step, len(live) or len(insts))
                ),
                "instances_live": len(live),
                "records_in": sum(int(m.get("records_in", 0)) for m in insts),
                "records_out": sum(int(m.get("records_out", 0)) for m in insts),
                "rate_in_per_s": round(rate, 1),
                "busy_pct": round(100.0 * busy / uptime, 1) if uptime > 0 else 0.0,
                "backlog": sum(int(m.get("backlog", 0)) for m in live),
                "latency_p50_ms": summary["p50_ms"] if summary else None,
                "latency_p99_ms": summary["p99_ms"] if summary else None,
                "migration": _migration(insts),
                "nodes": _nodes(live),
            }
        )
    return rows
