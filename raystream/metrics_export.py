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
``ray_raystream_sink_latency_ms_total``       counter  sinks: events with latency <= ``le`` ms, per
                                                       bucket (tag ``le``, cumulative, ``+Inf``
                                                       included): a Prometheus histogram
``ray_raystream_sink_latency_ms_sum_total``   counter  sinks: sum of the events' latencies (ms)
``ray_raystream_state_bytes``                 gauge    keyed steps: RocksDB's estimate of the live
                                                       state plus memtables and write-back cache
``ray_raystream_instance_up``                 gauge    1 per live instance: ``count by (step)`` is
                                                       the parallelism
============================================  =======  =============================================

Tags: ``job``, ``step``, ``index``. Ray reports to its agent every ``metrics_report_interval_ms``
(10 s by default; ``RAY_metrics_report_interval_ms=1000`` for ``ray start`` makes it 1 s).

The latency histogram is exported as cumulative bucket counters with an ``le`` tag rather than
through ``ray.util.metrics.Histogram``: that one takes one ``observe`` call per event (a few us
each, a large share of a core at 100k events/s), while the buckets here are read from the sink's
HDR histogram once a period, whatever the rate. Prometheus computes quantiles over any instances
and steps from them as from a native histogram::

    histogram_quantile(0.99, sum by (le) (rate(ray_raystream_sink_latency_ms_total[1m])))

Job events (tag ``job``, from the controller): ``raystream_checkpoints_total``,
``raystream_checkpoint_seconds_total`` and ``raystream_checkpoint_duration_s`` (the last one),
the same for ``rescales`` / ``rescale`` and ``recoveries`` / ``recovery`` (downtime).
A Grafana dashboard over all of these is ``deploy/grafana/raystream.json``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from raystream.metrics import InstanceMetrics, LatencyRecorder

__all__ = [
    "LATENCY_BOUNDARIES_MS",
    "METRIC_PREFIX",
    "RayMetricsExporter",
    "cumulative_bucket_counts",
    "export_job_event",
]

METRIC_PREFIX = "raystream_"
_TAG_KEYS = ("job", "step", "index")
# upper bounds (ms) of the latency buckets; a "+Inf" bucket follows
LATENCY_BOUNDARIES_MS: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 300, 500, 750)
LATENCY_BOUNDARIES_MS += (1000, 2000, 5000, 10000, 30000, 60000)


def _le(bound_ms: float) -> str:
    return "+Inf" if bound_ms == float("inf") else f"{bound_ms:g}"


def cumulative_bucket_counts(
    histogram: Any, boundaries_ms: tuple[float, ...] = LATENCY_BOUNDARIES_MS
) -> tuple[list[int], float]:
    """From an HDR histogram of latencies in us: per boundary (and a last ``+Inf``) the count of
    values <= it, and the sum of all values in ms. Vectorised over the histogram's counts array
    (each counted index stands for the highest value it covers, as HDR's recorded iterator
    reports it): a few ms at most, since the export runs on the instance's event loop."""
    counts = np.ctypeslib.as_array(histogram.counts)[: histogram.counts_len]
    recorded = np.flatnonzero(counts)
    n = counts[recorded].astype(np.int64)
    values_us = _index_values(histogram)[recorded]
    bounds_us = np.asarray([b * 1000 for b in boundaries_ms], np.float64)
    bucket = np.searchsorted(bounds_us, values_us, side="left")
    per = np.bincount(bucket, weights=n, minlength=len(bounds_us) + 1)
    out = np.cumsum(per.astype(np.int64)).tolist()
    total_us = float((values_us.astype(np.float64) * n).sum())
    return out, total_us / 1000


_INDEX_VALUES: dict[tuple[int, ...], np.ndarray] = {}


def _index_values(histogram: Any) -> np.ndarray:
    """Per counts index of an HDR histogram's layout, the highest value it stands for (made
    once per layout with the histogram's own arithmetic)."""
    h = histogram
    layout = (h.counts_len, h.unit_magnitude, h.sub_bucket_half_count_magnitude)
    got = _INDEX_VALUES.get(layout)
    if got is None:
        got = np.fromiter(
            (
                h.get_highest_equivalent_value(h.get_value_from_index(i))
                for i in range(h.counts_len)
            ),
            np.int64,
            h.counts_len,
        )
        _INDEX_VALUES[layout] = got
    return got


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
    latency_buckets: Any
    latency_sum: Any
    state_bytes: Any
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
            latency_buckets=Counter(
                f"{p}sink_latency_ms",
                "sink end-to-end latency: events <= le ms (cumulative buckets)",
                tag_keys=(*_TAG_KEYS, "le"),
            ),
            latency_sum=Counter(
                f"{p}sink_latency_ms_sum", "sum of end-to-end latencies (ms)", tag_keys=_TAG_KEYS
            ),
            state_bytes=Gauge(
                f"{p}state_bytes", "estimated bytes of keyed state", tag_keys=_TAG_KEYS
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
        self._sent_buckets = [0] * (len(LATENCY_BOUNDARIES_MS) + 1)
        self._sent_latency_ms = 0.0
        self._last_ns: int | None = None

    def export(
        self,
        metrics: InstanceMetrics,
        backlog: int,
        latency: LatencyRecorder | None = None,
        *,
        up: bool = True,
        now_ns: int | None = None,
        state_bytes: int | None = None,
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
        if state_bytes is not None:
            m.state_bytes.set(state_bytes, tags=self.tags)
        if latency is not None:
            self._export_buckets(m, latency)
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

    def _export_buckets(self, m: _RayMetrics, latency: LatencyRecorder) -> None:
        """Add each bucket's growth since the last call (the recorder's totals only grow)."""
        counts, total_ms = cumulative_bucket_counts(latency.total_histogram())
        bounds = (*LATENCY_BOUNDARIES_MS, float("inf"))
        for i, (bound, n) in enumerate(zip(bounds, counts, strict=True)):
            grown = n - self._sent_buckets[i]
            if grown > 0:
                m.latency_buckets.inc(grown, tags={**self.tags, "le": _le(bound)})
                self._sent_buckets[i] = n
        if total_ms > self._sent_latency_ms:
            m.latency_sum.inc(total_ms - self._sent_latency_ms, tags=self.tags)
            self._sent_latency_ms = total_ms


_job_metrics: dict[str, Any] = {}


# event -> (plural for the count, what its seconds are, gauge name of the last one)
JOB_EVENTS: dict[str, tuple[str, str, str]] = {
    "checkpoint": ("checkpoints", "completed checkpoints", "checkpoint_duration_s"),
    "rescale": ("rescales", "completed rescales", "rescale_duration_s"),
    "recovery": ("recoveries", "recoveries from a checkpoint", "recovery_downtime_s"),
}


def export_job_event(job: str, event: str, seconds: float) -> None:
    """A controller event in Ray's metrics (tag ``job``): ``raystream_<plural>_total`` counts
    them, ``raystream_<event>_seconds_total`` adds their durations (``rate`` of one over the
    other is the mean duration), and a gauge holds the last one's duration
    (``raystream_checkpoint_duration_s``, ``raystream_rescale_duration_s``,
    ``raystream_recovery_downtime_s``)."""
    from ray.util.metrics import Counter, Gauge

    if not _job_metrics:
        p = METRIC_PREFIX
        for name, (plural, what, last) in JOB_EVENTS.items():
            _job_metrics[name] = Counter(f"{p}{plural}", what, tag_keys=("job",))
            _job_metrics[f"{name}_seconds"] = Counter(
                f"{p}{name}_seconds", f"seconds of {what}", tag_keys=("job",)
            )
            _job_metrics[f"{name}_s"] = Gauge(
                f"{p}{last}", f"the last of {what}", tag_keys=("job",)
            )
    tags = {"job": job}
    _job_metrics[event].inc(1, tags=tags)
    if seconds > 0:
        _job_metrics[f"{event}_seconds"].inc(seconds, tags=tags)
    _job_metrics[f"{event}_s"].set(seconds, tags=tags)
