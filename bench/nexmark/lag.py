"""How far the output of a windowed query lags its watermark, in wall-clock time.

For every result row of a window ``[start, end)``: the wall-clock time the row reached the sink
minus the wall-clock time at which the window closed, i.e. at which the last of the query's
sources sent a watermark ``>= end - 1`` (from then on no record of the window can come: the
moment Flink would fire it). So it is the time from "the window is complete at the sources" to
"its result is out": watermark propagation, firing, the steps after the window and the sink.
Each source keeps the times of its watermarks (``watermark_timeline`` in its final metrics);
:class:`WindowEndSink`, a second sink on the query's result stream, keeps every row's arrival
time and window end.

A row emitted before its window closed (q8 emits a new seller as soon as both records of a window
are in) has a negative lag.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from bench.nexmark.queries import QUERIES, result_rows

__all__ = ["LAG_SINK", "WindowEndSink", "window_close_ns", "watermark_lag"]

LAG_SINK = "window_lag"


@dataclass(frozen=True)
class WindowEndSink:
    """Keeps, per result row, its arrival (wall-clock ns) and its window's end (ms);
    ``close()`` returns them as a table (``arrival_ns``, ``window_end``)."""

    query: str

    def open(self, index: int, parallelism: int) -> Any:
        return _WindowEnds(self.query)

    def describe(self) -> str:
        return f"window_ends({self.query})"


class _WindowEnds:
    def __init__(self, query: str) -> None:
        end = QUERIES[query].window_end
        if end is None:
            msg = f"{query} is not a windowed query; it has no window ends to keep"
            raise ValueError(msg)
        self._query = query
        self._end = end
        self._arrival: list[np.ndarray] = []
        self._ends: list[np.ndarray] = []

    def write(self, batch: pa.RecordBatch) -> None:
        now = time.time_ns()
        rows = result_rows(self._query, pa.Table.from_batches([batch]))
        ends = np.asarray(self._end(rows), dtype=np.int64)
        self._ends.append(ends)
        self._arrival.append(np.full(len(ends), now, np.int64))

    def pre_commit(self, checkpoint_id: int) -> dict[str, Any]:
        return {}

    def commit(self, checkpoint_id: int) -> None:
        pass

    def restore(self, state: dict[str, Any] | None) -> None:
        pass

    def close(self) -> pa.Table:
        cat = np.concatenate
        return pa.table(
            {
                "arrival_ns": cat(self._arrival) if self._arrival else np.empty(0, np.int64),
                "window_end": cat(self._ends) if self._ends else np.empty(0, np.int64),
            }
        )

    def abort(self) -> None:
        self._arrival, self._ends = [], []


def window_close_ns(timelines: list[list[list[int]]], window_end_ms: np.ndarray) -> np.ndarray:
    """Per window end, the wall-clock ns at which every source's watermark had reached
    ``end - 1`` (the latest of the sources' first such watermark); ``timelines``: per source
    instance, its ``[ns, watermark]`` points in sending order."""
    close = np.full(len(window_end_ms), np.iinfo(np.int64).min, np.int64)
    for points in timelines:
        arr = np.asarray(points, np.int64).reshape(-1, 2)
        wm = np.maximum.accumulate(arr[:, 1])
        i = np.searchsorted(wm, window_end_ms - 1, side="left")
        reached = arr[np.minimum(i, len(arr) - 1), 0]
        reached = np.where(i < len(arr), reached, np.iinfo(np.int64).max)
        close = np.maximum(close, reached)
    return close


def watermark_lag(result: Any, sources: tuple[str, ...]) -> dict[str, Any] | None:
    """The lag summary of a finished job (None if it had no :class:`WindowEndSink`)."""
    parts = [t for t in result.results.get(LAG_SINK, []) if isinstance(t, pa.Table)]
    if not parts:
        return None
    rows = pa.concat_tables(parts)
    timelines = [
        m["watermark_timeline"]
        for s in sources
        for m in result.step_metrics(s)
        if m.get("watermark_timeline")
    ]
    if rows.num_rows == 0 or len(timelines) < sum(len(result.step_metrics(s)) for s in sources):
        return {"rows": rows.num_rows, "p50": None, "p99": None, "max": None}
    ends = rows.column("window_end").to_numpy()
    close = window_close_ns(timelines, ends)
    lag_ms = (rows.column("arrival_ns").to_numpy() - close) / 1e6
    lag_ms = lag_ms[close < np.iinfo(np.int64).max]
    if not len(lag_ms):
        return {"rows": 0, "p50": None, "p99": None, "max": None}
    return {
        "rows": int(len(lag_ms)),
        "p50": round(float(np.percentile(lag_ms, 50)), 3),
        "p99": round(float(np.percentile(lag_ms, 99)), 3),
        "max": round(float(lag_ms.max()), 3),
        "min": round(float(lag_ms.min()), 3),
        "values": [round(float(v), 3) for v in np.sort(lag_ms)],  # pooled by bench.nexmark.pool
        "definition": (
            "per window result row: wall-clock arrival at the sink minus the wall-clock time at "
            "which the last source sent a watermark >= window_end - 1 (the window closed)"
        ),
    }
