"""Column helpers shared by the NEXMark dataflows: the runtime's columns carried along, ms
timestamps, and the changelog's column names."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

import raystream as rs

__all__ = ["KIND", "META", "VERSION", "carry_meta", "ms", "ts", "with_meta"]

VERSION = "_version"
KIND = "_kind"  # Flink's RowKind of a change: "+I" (insert or update) or "-D" (delete)
META = ("event_time", "ingest_ts")


def with_meta(batch: pa.RecordBatch, columns: dict[str, pa.Array]) -> pa.RecordBatch:
    """``columns`` plus the runtime's event_time / ingest_ts columns of ``batch`` (same rows)."""
    out = dict(columns)
    for col in META:
        if col in batch.schema.names:
            out[col] = batch.column(col)
    return pa.RecordBatch.from_pydict(out)


def ms(column: pa.Array) -> np.ndarray:
    """int64 ms since the epoch of a timestamp[ms] (or int64) column."""
    if pa.types.is_timestamp(column.type):
        column = column.cast(pa.int64())
    return column.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def ts(values: Any) -> pa.Array:
    """timestamp[ms] of int64 ms since the epoch."""
    return pa.array(np.asarray(values, dtype=np.int64), pa.int64()).cast(pa.timestamp("ms"))


def carry_meta(batch: rs.KeyedBatch, idx: np.ndarray, out: dict[str, Any]) -> None:
    """Into ``out``: the oldest ingest_ts and newest event_time of the keys ``idx`` of this
    batch (one output row per entry of ``idx``)."""
    names = batch.records.schema.names
    if "ingest_ts" in names:
        out["ingest_ts"] = pa.array(batch.reduce("ingest_ts", "min")[idx], pa.int64())
    if "event_time" in names:
        out["event_time"] = pa.array(batch.reduce("event_time", "max")[idx], pa.int64())
