"""What the Ray metrics export sends, without Ray's metrics agent or Prometheus: the latency
histogram's cumulative buckets against numpy, the exporter's increments adding up to the
recorder's totals, job events, and RocksDB's state size estimate against the bytes written."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raystream import metrics_export as mx
from raystream.metrics import InstanceMetrics, LatencyRecorder
from raystream.state.rocks import RocksStateBackend

BOUNDS = mx.LATENCY_BOUNDARIES_MS


class FakeMetric:
    """Records what a Ray Counter / Gauge would get, per tag set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.name = args[0] if args else kwargs.get("name")
        self.total: dict[tuple[tuple[str, str], ...], float] = defaultdict(float)
        self.value: dict[tuple[tuple[str, str], ...], float] = {}

    def inc(self, value: float, tags: dict[str, str]) -> None:
        assert value > 0, "Ray counters only take positive increments"
        self.total[tuple(sorted(tags.items()))] += value

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.value[tuple(sorted(tags.items()))] = value


def latencies_ms(rng: np.random.Generator, n: int) -> np.ndarray:
    """Log-normal latencies in whole us, none within 0.5 % of a bucket bound (HDR keeps 3
    significant digits, so a value that close could fall on either side)."""
    lat = np.round(rng.lognormal(np.log(40), 1.4, n) * 1000) / 1000
    near = np.zeros(n, dtype=bool)
    for b in BOUNDS:
        near |= np.abs(lat - b) <= b * 0.005
    return lat[~near & (lat < 3_600_000)]


def numpy_buckets(lat_ms: np.ndarray, weights: np.ndarray) -> list[float]:
    return [float(weights[lat_ms <= b].sum()) for b in BOUNDS] + [float(weights.sum())]


def record(recorder: LatencyRecorder, lat_ms: np.ndarray, weights: np.ndarray, now: int) -> None:
    ingest = now - np.round(lat_ms * 1e6).astype(np.int64)
    recorder.record(ingest, now, weights)


def test_cumulative_buckets_match_numpy() -> None:
    rng = np.random.default_rng(1)
    lat = latencies_ms(rng, 50_000)
    weights = rng.integers(1, 5, lat.size)
    rec = LatencyRecorder(origin_ns=0)
    record(rec, lat, weights, now=10**13)
    counts, total_ms = mx.cumulative_bucket_counts(rec.total_histogram())
    assert counts == numpy_buckets(lat, weights)
    assert total_ms == pytest.approx(float((lat * weights).sum()), rel=1e-3)


@pytest.fixture
def fake_ray_metrics(monkeypatch: pytest.MonkeyPatch) -> mx._RayMetrics:
    fields = mx._RayMetrics.__dataclass_fields__
    fake = mx._RayMetrics(**{name: FakeMetric(name) for name in fields})
    monkeypatch.setattr(mx, "_metrics", fake)
    return fake


def test_exporter_adds_bucket_growth_per_period(fake_ray_metrics: mx._RayMetrics) -> None:
    rng = np.random.default_rng(2)
    exporter = mx.RayMetricsExporter("job", "out", 3)
    rec = LatencyRecorder(origin_ns=0)
    all_lat, all_w = [], []
    now = 10**12
    for _period in range(4):
        lat = latencies_ms(rng, 5_000)
        w = rng.integers(1, 3, lat.size)
        record(rec, lat, w, now)
        all_lat.append(lat)
        all_w.append(w)
        now += 10**9
        exporter.export(InstanceMetrics(), 0, rec, now_ns=now, state_bytes=12345)
    lat, w = np.concatenate(all_lat), np.concatenate(all_w)
    buckets = fake_ray_metrics.latency_buckets.total  # type: ignore[attr-defined]
    tags = {"job": "job", "step": "out", "index": "3"}
    got = [
        buckets.get(tuple(sorted({**tags, "le": mx._le(b)}.items())), 0.0)
        for b in (*BOUNDS, float("inf"))
    ]
    assert got == numpy_buckets(lat, w)
    latency_sum = fake_ray_metrics.latency_sum.total[tuple(sorted(tags.items()))]  # type: ignore[attr-defined]
    assert latency_sum == pytest.approx(float((lat * w).sum()), rel=1e-3)
    state = fake_ray_metrics.state_bytes.value  # type: ignore[attr-defined]
    assert state == {tuple(sorted(tags.items())): 12345}


def test_job_events_count_and_add_durations(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.util.metrics

    monkeypatch.setattr(ray.util.metrics, "Counter", FakeMetric)
    monkeypatch.setattr(ray.util.metrics, "Gauge", FakeMetric)
    monkeypatch.setattr(mx, "_job_metrics", {})
    events = [("checkpoint", 0.2), ("rescale", 3.5), ("checkpoint", 0.4), ("recovery", 1.25)]
    for event, seconds in events:
        mx.export_job_event("j", event, seconds)
    tag = (("job", "j"),)
    for event in mx.JOB_EVENTS:
        mine = [s for e, s in events if e == event]
        assert mx._job_metrics[event].total[tag] == len(mine)
        assert mx._job_metrics[f"{event}_seconds"].total[tag] == pytest.approx(sum(mine))
        assert mx._job_metrics[f"{event}_s"].value[tag] == mine[-1]
    names = {m.name for m in mx._job_metrics.values()}
    assert {
        "raystream_rescales",
        "raystream_rescale_seconds",
        "raystream_rescale_duration_s",
    } <= names


def test_state_size_estimate_follows_the_bytes_written(tmp_path: Path) -> None:
    backend = RocksStateBackend(tmp_path / "db", cache_entries=1000)
    try:
        empty = backend.size_bytes()
        keys = [f"key-{i:08d}".encode() for i in range(4000)]
        values = [os.urandom(1000) for _ in keys]  # incompressible
        backend.write(keys, values)
        backend.flush()
        raw = sum(map(len, keys)) + sum(map(len, values))
        size = backend.size_bytes() - empty
        assert 0.8 * raw <= size <= 1.6 * raw, (size, raw)
    finally:
        backend.close()


def exported_series(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Every Prometheus series name the exporter defines (Ray prefixes ``ray_``; counters get
    ``_total``)."""
    import ray.util.metrics

    class Counter(FakeMetric):
        kind = "counter"

    class Gauge(FakeMetric):
        kind = "gauge"

    monkeypatch.setattr(ray.util.metrics, "Counter", Counter)
    monkeypatch.setattr(ray.util.metrics, "Gauge", Gauge)
    monkeypatch.setattr(mx, "_metrics", None)
    monkeypatch.setattr(mx, "_job_metrics", {})
    mx.export_job_event("j", "checkpoint", 1.0)
    metrics = [*vars(mx._ray_metrics()).values(), *mx._job_metrics.values()]
    return {
        f"ray_{m.name}" + ("_total" if m.kind == "counter" else "")  # type: ignore[attr-defined]
        for m in metrics
    }


def test_grafana_dashboard_queries_only_exported_series(monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import re

    root = Path(__file__).resolve().parents[2]
    dashboard = json.loads((root / "deploy" / "grafana" / "raystream.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\bray_raystream_\w+", e)}
    series = exported_series(monkeypatch)
    assert used <= series, f"the dashboard queries series nobody exports: {used - series}"
    must = {"ray_raystream_sink_latency_ms_total", "ray_raystream_state_bytes"}
    must |= {f"ray_raystream_{n}_total" for n in ("checkpoints", "rescales", "recoveries")}
    assert must <= used
    assert any("histogram_quantile(0.99, sum by (le)" in e for e in exprs)


def test_cumulative_buckets_equal_the_recorded_iterator() -> None:
    """The vectorised buckets against HDR's own iteration over recorded values (edges: 0,
    sub-ms, exactly on a boundary, beyond the last one)."""
    import bisect

    rng = np.random.default_rng(3)
    lat = np.concatenate([rng.exponential(40, 5_000), [0.0, 0.0004, 1.0, 5.0, 750.0, 90_000.0]])
    rec = LatencyRecorder(origin_ns=0)
    record(rec, lat, rng.integers(1, 4, lat.size), now=10**13)
    hist = rec.total_histogram()
    bounds_us = [b * 1000 for b in mx.LATENCY_BOUNDARIES_MS]
    want = [0] * (len(bounds_us) + 1)
    total_us = 0.0
    for item in hist.get_recorded_iterator():
        want[bisect.bisect_left(bounds_us, item.value_iterated_to)] += (
            item.count_at_value_iterated_to
        )
        total_us += float(item.value_iterated_to) * item.count_at_value_iterated_to
    counts, total_ms = mx.cumulative_bucket_counts(hist)
    assert counts == np.cumsum(want).tolist()
    assert total_ms == pytest.approx(total_us / 1000, rel=1e-12)


def test_cache_size_estimate_is_close_to_the_measured_size(tmp_path: Path) -> None:
    backend = RocksStateBackend(tmp_path / "db", cache_entries=100_000)
    try:
        keys = [f"key-{i:08d}".encode() for i in range(20_000)]
        values = [b"v" * (50 + i % 100) for i in range(len(keys))]
        backend.write(keys, values)
        exact = backend.cached_bytes()
        assert exact == sum(map(len, keys)) + sum(map(len, values))
        assert abs(backend.cached_bytes_estimate() - exact) <= 0.05 * exact
        assert backend.cached_bytes_estimate(sample=len(keys)) == exact
    finally:
        backend.close()
