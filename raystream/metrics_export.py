"""Operator metrics in Ray's metrics system, so Prometheus and the Ray Dashboard see them.

Every operator instance actor runs a small background task (``RuntimeConfig.metrics_export_s``,
default every second) that reads its counters and hands them to :class:`RayMetricsExporter`;
nothing is done per record. Ray exposes the series on each node's metrics export port
(``ray start --metrics-export-port``) in the Prometheus text format, with Ray's ``ray_`` prefix:

============================================  =======  =============================================
series                                        type     meaning
============================================  =======  =============================================
``ray_raystream_records_in_total``            counter  records received (sources: 0)
``ray_raystream_records_out_total``           counter  records emitted
``ray_raystream_busy_seconds_total``          counter  time spent processing
``ray_raystream_backlog_batches``             gauge    batches queued in the instance's inbox
``ray_raystream_throughput_in_per_s``         gauge    records in per second over the last period
``ray_raystream_throughput_out_per_s``        gauge    records out per second over the last period
``ray_raystream_sink_latency_p50_ms``         gauge    sinks: end-to-end latency of the last period
``ray_raystream_sink_latency_p99_ms``         gauge    (absent while a period saw no record)
``ray_raystream_instance_up``                 gauge    1 per live instance: ``count by (step)`` is
                                                       the parallelism
============================================  =======  =============================================

Tags: ``job``, ``step``, ``index``. Ray reports to its agent every ``metrics_report_interval_ms``
(10 s by default; ``RAY_metrics_report_interval_ms=1000`` for ``ray start`` makes it 1 s).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from raystream.metrics import InstanceMetrics, LatencyRecorder

__all__ = ["METRIC_PREFIX", "RayMetricsExporter"]

METRIC_PREFIX = "raystream_"
_TAG_KEYS = ("job", "step", "index")


@dataclass
class _RayMetrics:
    records_in: Any
    records_out: Any
    busy_seconds: Any
    backlog: Any
    throughput_in: Any
    throughput_out: Any
    latency_p50: Any
    latency_p99: Any
    up: Any


_metrics: _RayMetrics | None = None


def _ray_metrics() -> _RayMetrics:
    """The metric objects, made once per process (Ray wants one definition per name)."""
    global _metrics
    if _metrics is None:
        from ray.util.metrics import Counter, Gauge

        p = METRIC_PREFIX
        _metrics = _RayMetrics(
            records_in=Counter(f"{p}records_in", "records received", tag_keys=_TAG_KEYS),
            records_out=Counter(f"{p}records_out", "records emitted", tag_keys=_TAG_KEYS),
            busy_seconds=Counter(
                f"{p}busy_seconds", "seconds spent processing", tag_keys=_TAG_KEYS
            ),
            backlog=Gauge(f"{p}backlog_batches", "batches queued in the inbox", tag_keys=_TAG_KEYS),
            throughput_in=Gauge(
                f"{p}throughput_in_per_s", "records in per second", tag_keys=_TAG_KEYS
            ),
            throughput_out=Gauge(
                f"{p}throughput_out_per_s", "records out per second", tag_keys=_TAG_KEYS
            ),
            latency_p50=Gauge(
                f"{p}sink_latency_p50_ms", "sink end-to-end latency p50", tag_keys=_TAG_KEYS
            ),
            latency_p99=Gauge(
                f"{p}sink_latency_p99_ms", "sink end-to-end latency p99", tag_keys=_TAG_KEYS
            ),
            up=Gauge(f"{p}instance_up", "1 per live operator instance", tag_keys=_TAG_KEYS),
        )
    return _metrics


class RayMetricsExporter:
    """Exports one operator instance's counters; call :meth:`export` periodically.

    Counters are cumulative in raystream and incremental in Ray: each call adds the growth since
    the previous call, so the Ray totals equal raystream's after the last call.
    """

    def __init__(self, job: str, step: str, index: int) -> None:
        self.tags = {"job": job, "step": step, "index": str(index)}
        self._sent_in = 0
        self._sent_out = 0
        self._sent_busy_s = 0.0
        self._last_ns: int | None = None

    def export(
        self,
        metrics: InstanceMetrics,
        backlog: int,
        latency: LatencyRecorder | None = None,
        *,
        up: bool = True,
        now_ns: int | None = None,
    ) -> None:
        m = _ray_metrics()
        now_ns = time.time_ns() if now_ns is None else now_ns
        d_in = metrics.records_in - self._sent_in
        d_out = metrics.records_out - self._sent_out
        d_busy = metrics.busy_s - self._sent_busy_s
        if d_in > 0:
            m.records_in.inc(d_in, tags=self.tags)
            self._sent_in = metrics.records_in
        if d_out > 0:
            m.records_out.inc(d_out, tags=self.tags)
            self._sent_out = metrics.records_out
        if d_busy > 0:
            m.busy_seconds.inc(d_busy, tags=self.tags)
            self._sent_busy_s = metrics.busy_s
        m.backlog.set(backlog, tags=self.tags)
        m.up.set(1 if up else 0, tags=self.tags)
        if self._last_ns is not None and now_ns > self._last_ns:
            dt_s = (now_ns - self._last_ns) / 1e9
            m.throughput_in.set(max(d_in, 0) / dt_s, tags=self.tags)
            m.throughput_out.set(max(d_out, 0) / dt_s, tags=self.tags)
            if latency is not None:
                start_s = (self._last_ns - latency.origin_ns) / 1e9
                end_s = (now_ns - latency.origin_ns) / 1e9
                s = latency.summary_between(start_s, end_s)
                if s["count"]:
                    m.latency_p50.set(s["p50_ms"], tags=self.tags)
                    m.latency_p99.set(s["p99_ms"], tags=self.tags)
        self._last_ns = now_ns


_job_metrics: dict[str, Any] = {}


def export_job_event(job: str, event: str, seconds: float) -> None:
    """The controller's events in Ray's metrics: ``raystream_checkpoints_total`` with
    ``raystream_checkpoint_duration_s``, ``raystream_recoveries_total`` with
    ``raystream_recovery_downtime_s`` (tag ``job``)."""
    from ray.util.metrics import Counter, Gauge

    if not _job_metrics:
        p = METRIC_PREFIX
        _job_metrics.update(
            checkpoint=Counter(f"{p}checkpoints", "completed checkpoints", tag_keys=("job",)),
            checkpoint_s=Gauge(
                f"{p}checkpoint_duration_s", "the last checkpoint's duration", tag_keys=("job",)
            ),
            recovery=Counter(f"{p}recoveries", "recoveries from a checkpoint", tag_keys=("job",)),
            recovery_s=Gauge(
                f"{p}recovery_downtime_s", "the last recovery's downtime", tag_keys=("job",)
            ),
        )
    tags = {"job": job}
    _job_metrics[event].inc(1, tags=tags)
    _job_metrics[f"{event}_s"].set(seconds, tags=tags)
