"""A latest-count sink that also records every row's latency, for looking into a tail.

``TracedLatestCountSink(folder)`` is ``LatestCountSink`` plus, per written row, its ``key``, ``count``,
ingest time (``ingest_ns``, stamped by the source), when the sink wrote it (``written_ns``) and
which sink instance wrote it (``sink_index``; the sink is chained to the keyed step, so it is the
keyed instance that processed the row). A row of the count aggregates the key's records of
one batch (its ingest time is their earliest); how many is the difference to the key's previous
count (``row_weights``). Each writer keeps its rows in memory (five int64 columns; ~40 bytes a
row) and writes them as one Parquet file into ``folder`` when it closes; the folder
must be readable by the driver (one machine, or a shared folder). ``read_trace(folder)`` gives
them back as one table.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench._latest import LatestCountSink, _LatestWriter

__all__ = ["TRACE_COLUMNS", "TracedLatestCountSink", "read_trace", "row_weights"]

INGEST_TS = "ingest_ts"  # raystream.runtime.processors.INGEST_TS (the source's stamp)
TRACE_COLUMNS = ("key", "count", "ingest_ns", "written_ns", "sink_index")


@dataclass(frozen=True)
class TracedLatestCountSink(LatestCountSink):
    """Keeps the latest ``count`` per ``key`` and writes a per-row latency trace to ``folder``."""

    folder: str = ""

    def open(self, index: int, parallelism: int) -> _TracedWriter:
        if not self.folder:
            msg = "TracedLatestCountSink needs a folder for its trace files, got ''"
            raise ValueError(msg)
        return _TracedWriter(self.min_compact_rows, Path(self.folder), index)

    def describe(self) -> str:
        return f"latest_count(trace={self.folder})"


class _TracedWriter(_LatestWriter):
    def __init__(self, min_compact_rows: int, folder: Path, index: int) -> None:
        super().__init__(min_compact_rows)
        self._folder = folder
        self._index = index
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = []

    def write(self, batch: pa.RecordBatch) -> None:
        now = time.time_ns()
        if INGEST_TS not in batch.schema.names:
            msg = f"a traced sink needs the {INGEST_TS!r} column; the batch has {batch.schema.names}"
            raise ValueError(msg)
        keys = batch.column("key").to_numpy(zero_copy_only=False).astype(np.int64, copy=True)
        counts = batch.column("count").to_numpy(zero_copy_only=False).astype(np.int64, copy=True)
        ingest = batch.column(INGEST_TS).to_numpy(zero_copy_only=False).astype(np.int64, copy=True)
        self._parts.append((keys, counts, ingest, now))
        super().write(batch)

    def trace(self) -> pa.Table:
        """The rows written so far: key, count, ingest_ns, written_ns, sink_index."""
        if not self._parts:
            empty = pa.array([], pa.int64())
            return pa.table(dict.fromkeys(TRACE_COLUMNS, empty))
        keys = np.concatenate([p[0] for p in self._parts])
        counts = np.concatenate([p[1] for p in self._parts])
        ingest = np.concatenate([p[2] for p in self._parts])
        written = np.concatenate([np.full(p[0].size, p[3], np.int64) for p in self._parts])
        index = np.full(keys.size, self._index, np.int64)
        return pa.table(
            {
                "key": keys,
                "count": counts,
                "ingest_ns": ingest,
                "written_ns": written,
                "sink_index": index,
            }
        )

    def close(self) -> pa.Table | None:
        table = super().close()
        self._folder.mkdir(parents=True, exist_ok=True)
        name = f"sink-{self._index}-{uuid.uuid4().hex[:8]}.parquet"
        pq.write_table(self.trace(), self._folder / name)
        self._parts = []
        return table


def read_trace(folder: Path | str) -> pa.Table:
    """Every trace file in ``folder`` as one table (columns ``TRACE_COLUMNS``)."""
    files = sorted(Path(folder).glob("sink-*.parquet"))
    if not files:
        msg = f"no trace files (sink-*.parquet) in {folder}"
        raise FileNotFoundError(msg)
    return pa.concat_tables([pq.read_table(f) for f in files])


def row_weights(keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """How many input events each row of a key-count aggregates: its count minus the key's
    previous count (the counts of a key only grow, whichever instance wrote them).

    >>> row_weights(np.array([7, 3, 7, 3]), np.array([2, 1, 5, 4])).tolist()
    [2, 1, 3, 3]
    """
    keys, counts = np.asarray(keys, np.int64), np.asarray(counts, np.int64)
    order = np.lexsort((counts, keys))
    k, c = keys[order], counts[order]
    prev = np.empty_like(c)
    prev[0] = 0
    prev[1:] = np.where(k[1:] == k[:-1], c[:-1], 0)
    w = np.empty_like(c)
    w[order] = c - prev
    return w
