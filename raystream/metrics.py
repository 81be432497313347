"""Metrics: per-instance counters and busy time, windowed throughput, latency histograms, timelines.

Everything here is plain Python (no Ray): instances keep an :class:`InstanceMetrics` and a sink a
:class:`LatencyRecorder`; the controller pulls their ``snapshot()`` dicts (small, picklable) and
merges them. Time stamps are nanoseconds on the ``time.time_ns()`` clock, which every process of
one machine shares; a window is ``window_ms`` long and window ``w`` starts at
``origin_ns + w * window_ms`` (the origin is the job start, the same for every instance).
Instants before the origin count in window 0.

Windows are kept for a bounded span (``retain_s``, :data:`DEFAULT_RETAIN_S` = 15 minutes, the
``RuntimeConfig.metrics_windows_retained_s`` of a job): a job that runs for days keeps the last
15 minutes of its timelines (3,600 windows of 250 ms), not all of them; the whole run's totals
(events, the latency histogram of every record) are kept. ``retain_s=None`` keeps every window
(merges of snapshots, which are bounded already).

Latency is recorded in HDR histograms (1 us .. 1 hour, 3 significant digits, values in us), one per
window plus one for the whole run, so percentiles merge exactly across sinks. Each record may carry
a weight (the number of input events it aggregates): a histogram then counts a record of weight
``k`` ``k`` times, so its percentiles are weighted per input event, at no extra memory.

Example::

    >>> import numpy as np
    >>> rec = LatencyRecorder(origin_ns=0)
    >>> rec.record(np.array([0, 0, 0]), now_ns=2_000_000)      # three records, 2 ms old
    >>> rec.summary()
    {'count': 3, 'p50_ms': 2.0, 'p99_ms': 2.0, 'max_ms': 2.0}
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from hdrh.histogram import HdrHistogram

from raystream.errors import ConfigError

__all__ = [
    "DEFAULT_RETAIN_S",
    "DEFAULT_WINDOW_MS",
    "LATENCY_HIGHEST_US",
    "InstanceMetrics",
    "LatencyRecorder",
    "WindowedCounter",
    "build_timeline",
    "check_retain_s",
    "recovery_point",
    "rescale_impact",
    "step_totals",
    "sum_totals",
]

DEFAULT_WINDOW_MS = 250
DEFAULT_RETAIN_S = 900.0  # windows of the last 15 minutes are kept (a day: 86,400 s)
LATENCY_LOWEST_US = 1
LATENCY_HIGHEST_US = 3_600_000_000  # one hour; longer latencies are recorded as one hour
LATENCY_SIGNIFICANT_DIGITS = 3


def _check_window_ms(window_ms: int) -> None:
    if not isinstance(window_ms, int) or isinstance(window_ms, bool) or window_ms < 1:
        msg = f"window_ms must be an int >= 1 (milliseconds), got {window_ms!r}; 250 is the default"
        raise ConfigError(msg)


def check_retain_s(retain_s: float | None, what: str = "retain_s") -> None:
    """``retain_s`` is None (keep every window) or a number of seconds > 0."""
    if retain_s is None:
        return
    if (
        isinstance(retain_s, bool)
        or not isinstance(retain_s, (int, float, np.integer, np.floating))
        or not np.isfinite(retain_s)
        or retain_s <= 0
    ):
        msg = (
            f"{what} must be a number of seconds > 0 (windows older than that are dropped), "
            f"got {retain_s!r}; {DEFAULT_RETAIN_S:g} (15 minutes) is the default"
        )
        raise ConfigError(msg)


def _retained_windows(retain_s: float | None, window_ms: int) -> int | None:
    """How many windows a span of ``retain_s`` seconds holds (at least one); None: all."""
    if retain_s is None:
        return None
    return max(1, int(np.ceil(retain_s * 1000 / window_ms - 1e-9)))


def _expired(order: list[int], newest: int, keep: int | None) -> list[int]:
    """Pop from the heap ``order`` the windows older than the ``keep`` windows up to ``newest``."""
    out: list[int] = []
    if keep is None:
        return out
    cutoff = newest - keep
    while order and order[0] <= cutoff:
        out.append(heapq.heappop(order))
    return out


def _window_of(now_ns: int, origin_ns: int, window_ns: int) -> int:
    return max(0, (now_ns - origin_ns) // window_ns)


def _rebin(index: int, from_origin_ns: int, to_origin_ns: int, window_ns: int) -> int:
    """Window (on ``to_origin_ns``) holding the start of window ``index`` on ``from_origin_ns``."""
    if from_origin_ns == to_origin_ns:
        return index
    return _window_of(from_origin_ns + index * window_ns, to_origin_ns, window_ns)


def _check_same_window(ours: int, theirs: int, what: str) -> None:
    if ours != theirs:
        msg = (
            f"cannot merge a {what} snapshot with window_ms={theirs} into one with "
            f"window_ms={ours}; expected the same window length. Use one window_ms for the job."
        )
        raise ConfigError(msg)


# --------------------------------------------------------------------------------------------
# windowed counter


class WindowedCounter:
    """A count per time window (e.g. records in per 250 ms), mergeable across instances.

    Memory is one dict entry per window that saw something, of the last ``retain_s`` seconds
    (default 15 minutes: <= 3,600 windows of 250 ms, however long the job runs); the counts of
    older windows are dropped from the timeline and kept in :attr:`total`.
    """

    def __init__(
        self,
        origin_ns: int,
        window_ms: int = DEFAULT_WINDOW_MS,
        retain_s: float | None = DEFAULT_RETAIN_S,
    ) -> None:
        _check_window_ms(window_ms)
        check_retain_s(retain_s)
        self.origin_ns = int(origin_ns)
        self.window_ms = window_ms
        self.retain_s = retain_s
        self._window_ns = window_ms * 1_000_000
        self._keep = _retained_windows(retain_s, window_ms)
        self._counts: dict[int, int] = {}
        self._order: list[int] = []  # heap of the windows kept: the oldest first
        self._newest = -1
        self.dropped = 0  # the counts of the windows dropped (older than retain_s)
        self.dropped_windows = 0

    def add(self, n: int, now_ns: int) -> None:
        w = _window_of(now_ns, self.origin_ns, self._window_ns)
        self._put(w, int(n))

    def _put(self, w: int, n: int) -> None:
        if self._keep is not None and w <= self._newest - self._keep:
            self.dropped += n  # older than the span (a late merge): counted, not kept
            return
        if w not in self._counts:
            self._counts[w] = 0
            if self._keep is not None:
                heapq.heappush(self._order, w)
        self._counts[w] += n
        if w > self._newest:
            self._newest = w
            for old in _expired(self._order, w, self._keep):
                self.dropped += self._counts.pop(old)
                self.dropped_windows += 1

    @property
    def total(self) -> int:
        """Everything counted, the dropped windows included."""
        return self.dropped + sum(self._counts.values())

    def timeline(self) -> list[tuple[float, int]]:
        """``(t_s, count)`` for every window from the first to the last that saw something
        (windows in between that saw nothing count 0); ``t_s`` is the window start after origin."""
        if not self._counts:
            return []
        first, last = min(self._counts), max(self._counts)
        return [(w * self.window_ms / 1000, self._counts.get(w, 0)) for w in range(first, last + 1)]

    def snapshot(self) -> dict[str, Any]:
        return {
            "origin_ns": self.origin_ns,
            "window_ms": self.window_ms,
            "counts": dict(self._counts),
            "dropped": self.dropped,
            "dropped_windows": self.dropped_windows,
        }

    def merge(self, other: dict[str, Any] | WindowedCounter) -> None:
        """Add another counter (or its snapshot). Windows of another origin are re-binned by their
        start time into this counter's windows."""
        snap = other.snapshot() if isinstance(other, WindowedCounter) else other
        _check_same_window(self.window_ms, snap["window_ms"], "WindowedCounter")
        self.dropped += int(snap.get("dropped", 0))
        self.dropped_windows += int(snap.get("dropped_windows", 0))
        for w, n in snap["counts"].items():
            mine = _rebin(int(w), snap["origin_ns"], self.origin_ns, self._window_ns)
            self._put(mine, int(n))

    @classmethod
    def from_snapshot(
        cls, snapshot: dict[str, Any], retain_s: float | None = None
    ) -> WindowedCounter:
        counter = cls(snapshot["origin_ns"], snapshot["window_ms"], retain_s)
        counter.merge(snapshot)
        return counter

    @classmethod
    def merge_snapshots(
        cls, snapshots: Sequence[dict[str, Any]], retain_s: float | None = None
    ) -> WindowedCounter:
        """One counter summing several (on the first snapshot's origin); empty -> origin 0.
        Every window the snapshots hold is kept unless ``retain_s`` is given."""
        if not snapshots:
            return cls(0, retain_s=retain_s)
        counter = cls(snapshots[0]["origin_ns"], snapshots[0]["window_ms"], retain_s)
        for s in snapshots:
            counter.merge(s)
        return counter


# --------------------------------------------------------------------------------------------
# instance metrics


class InstanceMetrics:
    """Counters of one operator instance.

    ``records_in``/``batches_in`` and the throughput windows grow with :meth:`record_in`,
    ``records_out`` with :meth:`record_out`; ``busy_s`` accumulates the time spent inside
    ``with metrics.busy():`` (``time.perf_counter``); ``backlog`` is set by the runtime.
    ``records_in / busy_s`` is the instance's true processing rate (what DS2 needs).
    """

    def __init__(
        self,
        origin_ns: int | None = None,
        window_ms: int = DEFAULT_WINDOW_MS,
        retain_s: float | None = DEFAULT_RETAIN_S,
    ) -> None:
        self.records_in = 0
        self.records_out = 0
        self.batches_in = 0
        self.busy_s = 0.0
        self.backlog = 0
        self.throughput = WindowedCounter(
            time.time_ns() if origin_ns is None else origin_ns, window_ms, retain_s
        )
        self._started = time.perf_counter()

    def record_in(self, n: int, now_ns: int | None = None) -> None:
        """One input batch of ``n`` records arrived (at ``now_ns``, default now)."""
        self.records_in += n
        self.batches_in += 1
        self.throughput.add(n, time.time_ns() if now_ns is None else now_ns)

    def record_out(self, n: int) -> None:
        self.records_out += n

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Time spent inside counts as busy: ``with metrics.busy(): process(batch)``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - start

    def snapshot(self) -> dict[str, Any]:
        """Plain, picklable values; ``throughput`` is a :class:`WindowedCounter` snapshot."""
        return {
            "records_in": self.records_in,
            "records_out": self.records_out,
            "batches_in": self.batches_in,
            "busy_s": self.busy_s,
            "backlog": self.backlog,
            "uptime_s": time.perf_counter() - self._started,
            "throughput": self.throughput.snapshot(),
        }


# --------------------------------------------------------------------------------------------
# latency


def _new_histogram() -> HdrHistogram:
    return HdrHistogram(LATENCY_LOWEST_US, LATENCY_HIGHEST_US, LATENCY_SIGNIFICANT_DIGITS)


def _counts_index(h: HdrHistogram, values: np.ndarray) -> np.ndarray:
    """HdrHistogram's counts index of every value, vectorised (``h._counts_index_for`` per value).

    ``values`` are int64 in ``[0, highest trackable]`` (< 2**53, so float64 bit lengths are exact).
    """
    masked = values | np.int64(h.sub_bucket_mask)
    _, bit_length = np.frexp(masked.astype(np.float64))
    bucket = (
        bit_length.astype(np.int64) - h.unit_magnitude - (h.sub_bucket_half_count_magnitude + 1)
    )
    sub_bucket = values >> (bucket + h.unit_magnitude)
    return (
        ((bucket + 1) << h.sub_bucket_half_count_magnitude) + sub_bucket - h.sub_bucket_half_count
    )


RUNS_MIN_ROWS = 64  # shorter arrays are bucketed as they are
RUNS_MAX_FRACTION = 8  # collapse runs when there are fewer than size / 8 of them


def _runs(values: np.ndarray, weights: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Equal neighbours of ``values`` as one value each, weighted by the run's length (or the
    sum of its ``weights``), when that makes the array much shorter; else both unchanged. A
    source stamps all rows it reads at once with one ingest time, so a sink's batch is a few
    runs: bucketing a run costs one value instead of one per row, with the same histogram."""
    if values.size < RUNS_MIN_ROWS:
        return values, weights
    starts = np.flatnonzero(values[1:] != values[:-1]) + 1
    if starts.size + 1 > values.size // RUNS_MAX_FRACTION:
        return values, weights
    starts = np.concatenate((np.zeros(1, np.int64), starts))
    if weights is None:
        counts = np.diff(np.append(starts, values.size)).astype(np.int64)
    else:
        counts = np.add.reduceat(weights, starts)
    return values[starts], counts


def _record_us(
    histograms: Iterable[HdrHistogram], values_us: np.ndarray, weights: np.ndarray | None = None
) -> None:
    """Record int64 microsecond values (value ``i`` ``weights[i]`` times, default once): bucket
    them with numpy and add the bucket counts to each histogram's counts array in one numpy
    operation; the same counts, total, min and max as HdrHistogram's ``record_value`` of each
    bucket's value (a Python call per bucket cost ~0.5 ms per batch of a few hundred records)."""
    hists = list(histograms)
    first = hists[0]
    index = _counts_index(first, values_us)
    if weights is None:
        per_bucket = np.bincount(index)
    else:  # float sums of int64 weights: exact below 2**53
        per_bucket = np.rint(np.bincount(index, weights=weights)).astype(np.int64)
    nonzero = np.flatnonzero(per_bucket)
    if nonzero.size == 0:
        return
    if int(nonzero[-1]) >= first.counts_len:
        msg = f"latency index {int(nonzero[-1])} outside the histogram ({first.counts_len} counts)"
        raise ConfigError(msg)
    counts = per_bucket[nonzero]
    total = int(counts.sum())
    lowest = first.get_value_from_index(int(nonzero[0]))
    highest = first.get_value_from_index(int(nonzero[-1]))
    for h in hists:
        view = np.ctypeslib.as_array(h.counts)[: h.counts_len]
        view[nonzero] += counts.astype(view.dtype)
        h.total_count += total
        h.min_value = min(h.min_value, lowest)
        h.max_value = max(h.max_value, highest)


def _percentiles_us(h: HdrHistogram, percentiles: Sequence[float]) -> list[int]:
    """HdrHistogram's ``get_value_at_percentile`` for each percentile (> 0), with numpy."""
    cumulative = np.cumsum(np.ctypeslib.as_array(h.counts)[: h.counts_len])
    total = int(cumulative[-1])
    out = []
    for p in percentiles:
        target = max(int(min(p, 100.0) * total / 100 + 0.5), 1)
        i = int(np.searchsorted(cumulative, target, side="left"))
        out.append(h.get_highest_equivalent_value(h.get_value_from_index(i)))
    return out


def _stats_ms(h: HdrHistogram) -> tuple[float | None, float | None, float | None]:
    if h.get_total_count() == 0:
        return None, None, None
    p50, p99 = _percentiles_us(h, (50.0, 99.0))
    return p50 / 1000, p99 / 1000, h.get_max_value() / 1000


class LatencyRecorder:
    """End-to-end latency of the records reaching one sink, per window and for the whole run.

    ``record(ingest_ns, now_ns, weights)`` takes the ingest time stamps of one batch, the time it
    is written and optionally each record's weight (how many input events it aggregates; default
    1); latency ``now - ingest`` is rounded to us (negative -> 0, over an hour -> an hour) and
    falls in the window of ``now_ns``. Percentiles are HDR's (within 0.1 %), weighted: ``count``
    and the per-window counts are sums of weights (events), ``rows`` counts records.

    Memory stays bounded: only the ``live_windows`` most recent window histograms stay expanded
    (~190 KB each); older ones are kept encoded (compressed, usually a few hundred bytes), for
    the last ``retain_s`` seconds (default 15 minutes: 3,600 windows of 250 ms); older windows
    are dropped (their records stay in the whole run's histogram: :meth:`summary` and
    :attr:`count` cover the whole run, :meth:`timeline` and :meth:`summary_between` the span).
    A merge keeps other recorders' windows encoded and adds them up only when one is read, so
    merging many snapshots for :meth:`summary` (``job.status()``) decodes only their totals.
    """

    def __init__(
        self,
        origin_ns: int,
        window_ms: int = DEFAULT_WINDOW_MS,
        live_windows: int = 4,
        retain_s: float | None = DEFAULT_RETAIN_S,
    ) -> None:
        _check_window_ms(window_ms)
        if not isinstance(live_windows, int) or live_windows < 1:
            msg = f"live_windows must be an int >= 1, got {live_windows!r}"
            raise ConfigError(msg)
        check_retain_s(retain_s)
        self.origin_ns = int(origin_ns)
        self.window_ms = window_ms
        self.live_windows = live_windows
        self.retain_s = retain_s
        self._window_ns = window_ms * 1_000_000
        self._keep = _retained_windows(retain_s, window_ms)
        self._total = _new_histogram()
        self._live: dict[int, HdrHistogram] = {}
        self._sealed: dict[int, list[bytes]] = {}  # encoded parts, added up when read
        self._counts: dict[int, int] = {}
        self._order: list[int] = []  # heap of the windows kept: the oldest first
        self._newest = -1
        self.rows = 0
        self.dropped_windows = 0  # windows older than retain_s, dropped
        self.dropped = 0  # ... and the events they held (still in the whole run's histogram)

    # -- recording ---------------------------------------------------------------------------

    def record(self, ingest_ns: np.ndarray, now_ns: int, weights: np.ndarray | None = None) -> None:
        """One batch: its records' ingest times, when it is written, and (optionally) each
        record's weight, an int >= 0 (records of weight 0 are not counted)."""
        ingest = np.asarray(ingest_ns, dtype=np.int64)
        if ingest.size == 0:
            return
        w_arr = None
        total = int(ingest.size)
        if weights is not None:
            w_arr = np.asarray(weights, dtype=np.int64)
            if w_arr.shape != ingest.shape or (w_arr.size and int(w_arr.min()) < 0):
                msg = (
                    f"latency weights must be one int >= 0 per record: got {w_arr.size} weights "
                    f"(min {int(w_arr.min()) if w_arr.size else None}) for {ingest.size} records"
                )
                raise ConfigError(msg)
            total = int(w_arr.sum())
        self.rows += int(ingest.size)
        if total == 0:
            return
        ingest, w_arr = _runs(ingest, w_arr)
        latency_us = (np.int64(now_ns) - ingest + 500) // 1000
        np.clip(latency_us, 0, LATENCY_HIGHEST_US, out=latency_us)
        w = _window_of(now_ns, self.origin_ns, self._window_ns)
        if self._too_old(w):  # a clock step back past the span: the whole run's only
            _record_us((self._total,), latency_us, w_arr)
            self.dropped += total
            return
        _record_us((self._window(w), self._total), latency_us, w_arr)
        self._count(w, total)

    def _count(self, w: int, n: int) -> None:
        if w not in self._counts:
            self._counts[w] = 0
            if self._keep is not None:
                heapq.heappush(self._order, w)
        self._counts[w] += n
        self._advance(w)

    def _too_old(self, w: int) -> bool:
        return self._keep is not None and w <= self._newest - self._keep

    def _advance(self, w: int) -> None:
        """``w`` holds records: when it is the newest, drop the windows older than the span."""
        if w <= self._newest:
            return
        self._newest = w
        for old in _expired(self._order, w, self._keep):
            self.dropped += self._counts.pop(old)
            self._live.pop(old, None)
            self._sealed.pop(old, None)
            self.dropped_windows += 1

    def _window(self, w: int) -> HdrHistogram:
        """The expanded histogram of window ``w`` (reopened if sealed); seals the oldest."""
        h = self._live.get(w)
        if h is None:
            parts = self._sealed.pop(w, None)
            h = _new_histogram() if parts is None else _decoded(parts)
            self._live[w] = h
            while len(self._live) > self.live_windows:
                oldest = min(k for k in self._live if k != w)
                self._sealed[oldest] = [self._live.pop(oldest).encode()]
        return h

    @property
    def count(self) -> int:
        return int(self._total.get_total_count())

    @property
    def newest_s(self) -> float | None:
        """Where the newest window with records ends (seconds since the origin); None if none."""
        if self._newest < 0:
            return None
        return (self._newest + 1) * self.window_ms / 1000

    @property
    def retained_from_s(self) -> float | None:
        """Where the kept windows start (seconds since the origin); None before any record."""
        if not self._counts:
            return None
        return min(self._counts) * self.window_ms / 1000

    def total_histogram(self) -> HdrHistogram:
        """The histogram of the whole run (latencies in us; read it, do not change it)."""
        return self._total

    # -- reading -----------------------------------------------------------------------------

    def _histogram_of(self, w: int) -> HdrHistogram:
        h = self._live.get(w)
        return h if h is not None else _decoded(self._sealed[w])

    def summary(self) -> dict[str, Any]:
        """``{"count", "p50_ms", "p99_ms", "max_ms"}`` over the whole run (None when empty)."""
        p50, p99, mx = _stats_ms(self._total)
        return {"count": self.count, "p50_ms": p50, "p99_ms": p99, "max_ms": mx}

    def summary_between(self, start_s: float, end_s: float) -> dict[str, Any]:
        """{count, p50_ms, p99_ms, max_ms} over the windows from ``start_s`` to ``end_s``
        (seconds since the origin): the latency of the records that reached a sink then.
        Only windows still kept count (the last ``retain_s`` seconds)."""
        first = int(start_s * 1000 // self.window_ms)
        last = int(end_s * 1000 // self.window_ms)
        return self.summary_of_windows(first, last)

    def summary_of_windows(self, first: int, last: int) -> dict[str, Any]:
        """{count, p50_ms, p99_ms, max_ms} over windows ``first .. last`` (indexes, inclusive)."""
        merged = _new_histogram()
        for w in self._counts:
            if first <= w <= last:
                merged.add(self._histogram_of(w))
        p50, p99, mx = _stats_ms(merged)
        return {"count": int(merged.get_total_count()), "p50_ms": p50, "p99_ms": p99, "max_ms": mx}

    def timeline(self) -> list[list[Any]]:
        """``[t_s, count, p50_ms, p99_ms, max_ms]`` per window that saw records, in time order
        (the windows kept: the last ``retain_s`` seconds)."""
        rows: list[list[Any]] = []
        for w in sorted(self._counts):
            p50, p99, mx = _stats_ms(self._histogram_of(w))
            rows.append([w * self.window_ms / 1000, self._counts[w], p50, p99, mx])
        return rows

    # -- snapshots and merging ---------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Picklable and compact: encoded histograms (HdrHistogram.encode) and window counts."""
        windows = {
            w: parts[0] if len(parts) == 1 else _decoded(parts).encode()
            for w, parts in self._sealed.items()
        }
        windows.update({w: h.encode() for w, h in self._live.items()})
        return {
            "origin_ns": self.origin_ns,
            "window_ms": self.window_ms,
            "total": self._total.encode(),
            "windows": windows,
            "counts": dict(self._counts),
            "rows": self.rows,
            "dropped_windows": self.dropped_windows,
            "dropped": self.dropped,
        }

    def merge(self, snapshot: dict[str, Any]) -> None:
        """Add another recorder's snapshot (windows of another origin are re-binned by start).
        Its windows stay encoded until read (:meth:`timeline`, :meth:`summary_between`)."""
        _check_same_window(self.window_ms, snapshot["window_ms"], "LatencyRecorder")
        self._total.add(HdrHistogram.decode(snapshot["total"]))
        self.rows += int(snapshot.get("rows", 0))
        self.dropped_windows += int(snapshot.get("dropped_windows", 0))
        self.dropped += int(snapshot.get("dropped", 0))
        counts = snapshot["counts"]
        for w in sorted(snapshot["windows"], key=int):
            encoded = snapshot["windows"][w]
            mine = _rebin(int(w), snapshot["origin_ns"], self.origin_ns, self._window_ns)
            n = int(counts[w])
            if self._too_old(mine):
                self.dropped += n
                continue
            live = self._live.get(mine)
            if live is not None:
                live.add(HdrHistogram.decode(encoded))
            else:
                self._sealed.setdefault(mine, []).append(encoded)
            self._count(mine, n)

    @classmethod
    def from_snapshot(
        cls, snapshot: dict[str, Any], retain_s: float | None = None
    ) -> LatencyRecorder:
        recorder = cls(snapshot["origin_ns"], snapshot["window_ms"], retain_s=retain_s)
        recorder.merge(snapshot)
        return recorder

    @classmethod
    def merge_snapshots(
        cls, snapshots: Sequence[dict[str, Any]], retain_s: float | None = None
    ) -> LatencyRecorder:
        """One recorder holding several sinks' latencies (on the first snapshot's origin), e.g.
        ``LatencyRecorder.merge_snapshots(snaps).summary()``; empty -> an empty recorder. Every
        window the snapshots hold is kept unless ``retain_s`` is given."""
        if not snapshots:
            return cls(0, retain_s=retain_s)
        recorder = cls(snapshots[0]["origin_ns"], snapshots[0]["window_ms"], retain_s=retain_s)
        for s in snapshots:
            recorder.merge(s)
        return recorder


def _decoded(parts: list[bytes]) -> HdrHistogram:
    """One histogram adding up encoded parts (a window merged from several recorders)."""
    h = HdrHistogram.decode(parts[0])
    for more in parts[1:]:
        h.add(HdrHistogram.decode(more))
    return h


# --------------------------------------------------------------------------------------------
# timeline


def build_timeline(
    throughput: Iterable[Sequence[Any]],
    latency: Iterable[Sequence[Any]],
    window_ms: int = DEFAULT_WINDOW_MS,
) -> list[list[Any]]:
    """Join a throughput timeline (``(t_s, count)`` rows, e.g. :meth:`WindowedCounter.timeline`)
    and a latency timeline (``[t_s, count, p50_ms, p99_ms, max_ms]``, e.g.
    :meth:`LatencyRecorder.timeline`) into ``[t_s, throughput_eps, p50_ms, p99_ms, max_ms]`` rows,
    one for every window from the first to the last of either. A window without throughput has
    0 events/s; one without latency has ``None`` percentiles.

    Example::

        >>> build_timeline([(0.0, 10), (0.5, 30)], [[0.25, 5, 1.0, 2.0, 3.0]], window_ms=250)
        [[0.0, 40.0, None, None, None], [0.25, 0.0, 1.0, 2.0, 3.0], [0.5, 120.0, None, None, None]]
    """
    _check_window_ms(window_ms)
    step_s = window_ms / 1000

    def index(t_s: float) -> int:
        return round(t_s / step_s)

    counts: dict[int, int] = {}
    for row in throughput:
        w = index(row[0])
        counts[w] = counts.get(w, 0) + int(row[1])
    stats = {index(row[0]): (row[2], row[3], row[4]) for row in latency}
    windows = counts.keys() | stats.keys()
    if not windows:
        return []
    rows = []
    for w in range(min(windows), max(windows) + 1):
        p50, p99, mx = stats.get(w, (None, None, None))
        rows.append([w * window_ms / 1000, counts.get(w, 0) / step_s, p50, p99, mx])
    return rows


def recovery_point(
    p99_by_window: dict[int, float],
    first: int,
    last: int,
    bound_ms: float,
    hold_windows: int,
) -> int | None:
    """The first window ``w >= first`` that starts ``hold_windows`` consecutive windows whose p99
    is at most ``bound_ms``, all of them at or before ``last`` (the run's last window); None if
    there is none. A window without records (missing from ``p99_by_window``) is not within the
    bound: nothing reached the sinks then.

    Example: windows 3 and 4 calm, 5 high, 6..8 calm, from window 4, 3 in a row::

        >>> recovery_point({3: 1.0, 4: 1.0, 5: 9.0, 6: 1.0, 7: 1.0, 8: 1.0}, 4, 8, 2.0, 3)
        6
    """
    run = 0
    for w in range(first, last + 1):
        p99 = p99_by_window.get(w)
        run = run + 1 if p99 is not None and p99 <= bound_ms else 0
        if run == hold_windows:
            return w - hold_windows + 1
    return None


def rescale_impact(
    latency: LatencyRecorder,
    throughput: list[tuple[float, int]],
    start_s: float,
    end_s: float,
    *,
    window_ms: int = DEFAULT_WINDOW_MS,
    steady_from_s: float = 1.0,
    band: float = 1.5,
    hold_s: float = 2.0,
) -> dict[str, Any]:
    """How a rescale requested at ``start_s`` (its state settled at ``end_s``) showed at the sinks.

    ``steady_p99_ms``: the (weighted) p99 of the records that reached the sinks from
    ``steady_from_s`` up to the window holding ``start_s`` (from 0 if that span holds no window).
    The rescale's window runs from the request until latency is back: from the window holding
    ``end_s`` on (no rescale recovers before its state settled), the first span of ``hold_s``
    seconds of windows whose p99 is within ``band`` x the steady p99; the window ends where that
    span starts, or at the run's last window if there is none. Reported:

    - ``recovered_s``: from the request to the later of ``end_s`` and the start of that span;
      None if latency was not back before the run ended (or there was no steady p99)
    - ``window_end_s``: where the window ends (seconds since the origin)
    - ``window_peak_latency_ms``, ``window_p99_latency_ms``: max and p99 of the records that
      reached the sinks in the window (from the request's window to the last before the span,
      at least up to the window holding ``end_s``)
    - ``window_throughput_dip``: the lowest window throughput in the window over the steady
      throughput (median of the windows of the steady span); ``steady_throughput_eps``
    """
    _check_window_ms(window_ms)
    step_s = window_ms / 1000
    ws = int(start_s * 1000 // window_ms)
    we = max(ws, int(end_s * 1000 // window_ms))
    lo = int(np.ceil(steady_from_s * 1000 / window_ms))
    if lo >= ws:
        lo = 0
    steady = latency.summary_of_windows(lo, ws - 1) if ws > 0 else {"p99_ms": None}
    steady_p99 = steady["p99_ms"]
    rows = latency.timeline()
    p99_by_window = {round(r[0] / step_s): r[3] for r in rows}
    last_window = max([we, *p99_by_window])
    hold = max(1, int(np.ceil(hold_s / step_s - 1e-9)))
    point = None
    if steady_p99 is not None:
        point = recovery_point(p99_by_window, we, last_window, band * steady_p99, hold)
    window_last = last_window if point is None else max(we, point - 1)
    during = latency.summary_of_windows(ws, window_last)
    per_window = {round(t / step_s): n for t, n in throughput}
    steady_tp = [n for w, n in per_window.items() if lo <= w < ws]
    inside = [per_window.get(w, 0) for w in range(ws, window_last + 1)]
    base = float(np.median(steady_tp)) if steady_tp else 0.0
    dip = (min(inside) / base) if base and inside else None
    recovered = None if point is None else max(point * step_s, end_s) - start_s
    return {
        "steady_p99_ms": steady_p99,
        "recovered_s": None if recovered is None else max(0.0, recovered),
        "window_end_s": (window_last + 1) * step_s if point is None else max(point * step_s, end_s),
        "window_peak_latency_ms": during["max_ms"],
        "window_p99_latency_ms": during["p99_ms"],
        "window_throughput_dip": dip,
        "steady_throughput_eps": base / step_s,
    }


# --------------------------------------------------------------------------------------------
# attempts (a job that recovered ran more than once)


def step_totals(
    snapshots: Sequence[dict[str, Any]], start: dict[str, dict[str, float]] | None = None
) -> dict[str, dict[str, float]]:
    """Per step, the sum over its instances' snapshots of ``records_in``, ``records_out`` and
    ``busy_s`` (snapshots without a step, e.g. of an actor that died first, are left out).
    ``start``: totals of earlier snapshots to go on from (not changed): ``step_totals(b,
    step_totals(a))`` is ``step_totals(a + b)``, the same additions in the same order.

    Example::

        >>> step_totals([{"step": "count", "records_in": 5, "records_out": 5, "busy_s": 0.5},
        ...              {"step": "count", "records_in": 3, "records_out": 2, "busy_s": 0.25}])
        {'count': {'records_in': 8, 'records_out': 7, 'busy_s': 0.75, 'instances': 2}}
    """
    out: dict[str, dict[str, float]] = {step: dict(t) for step, t in (start or {}).items()}
    for snap in snapshots:
        step = snap.get("step")
        if step is None:
            continue
        t = out.setdefault(
            str(step), {"records_in": 0, "records_out": 0, "busy_s": 0.0, "instances": 0}
        )
        t["records_in"] += int(snap.get("records_in", 0))
        t["records_out"] += int(snap.get("records_out", 0))
        t["busy_s"] += float(snap.get("busy_s", 0.0))
        t["instances"] += 1
    return out


def sum_totals(parts: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Add :func:`step_totals` of several attempts (what the job did in all, replays included)."""
    out: dict[str, dict[str, float]] = {}
    for part in parts:
        for step, t in part.items():
            acc = out.setdefault(step, dict.fromkeys(t, 0))
            for k, v in t.items():
                acc[k] = acc.get(k, 0) + v
    return out
