"""Small pieces the built-in operators share: event times out of a batch, keyed state stored or
deleted per key, output batches, side outputs. Public API only."""

from __future__ import annotations

import itertools
import operator
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import raystream as rs
from raystream.errors import DataflowDefinitionError, SchemaError

EVENT_TIME = "event_time"
INGEST_TS = "ingest_ts"


def check_name(name: Any, where: str) -> str | None:
    if name is not None and (not isinstance(name, str) or not name):
        msg = f"{where}: name must be a non-empty str, got {name!r}"
        raise DataflowDefinitionError(msg)
    return name


def times_ms(batch: pa.RecordBatch, column: str, where: str) -> np.ndarray:
    """The int64 ms event times of ``column`` (int64 ms or a timestamp column)."""
    if column not in batch.schema.names:
        msg = (
            f"{where}: no time column {column!r} in the records (columns {batch.schema.names}); "
            "give time_column=... or read the source with event_time=..."
        )
        raise SchemaError(msg)
    col = batch.column(column)
    if col.null_count:
        msg = f"{where}: time column {column!r} holds {col.null_count} null(s)"
        raise SchemaError(msg)
    if pa.types.is_timestamp(col.type):
        col = pc.cast(pc.cast(col, pa.timestamp("ms", col.type.tz)), pa.int64())
    elif not pa.types.is_integer(col.type):
        msg = f"{where}: time column {column!r} must be int64 ms or a timestamp, got {col.type}"
        raise SchemaError(msg)
    return col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def store(state: Any, keys: rs.KeySet, values: list[Any]) -> None:
    """Write ``values[i]`` for ``keys[i]``; None deletes the key's state."""
    present = np.fromiter(map(operator.is_not, values, itertools.repeat(None)), bool, len(values))
    if present.all():
        state.put(keys, values)
        return
    if present.any():
        idx = np.flatnonzero(present)
        state.put(keys.take(idx), [values[i] for i in idx.tolist()])
    state.delete(keys.take(np.flatnonzero(~present)))


def register(timers: Any, index: np.ndarray, ts: np.ndarray) -> None:
    """Event-time timers for ``keys[index]`` at ``ts`` (a time before 0 fires at 0)."""
    if len(index):
        timers.register_at(index, np.maximum(ts, 0))


def outputs(main: pa.RecordBatch | None, **side: pa.RecordBatch | None) -> Any:
    """``main`` alone, or an ``rs.Outputs`` when a side output has rows."""
    side = {k: v for k, v in side.items() if v is not None and v.num_rows}
    if not side:
        return main
    return rs.Outputs(main=main, **side)


def now_ns(n: int) -> np.ndarray:
    return np.full(n, time.time_ns(), np.int64)
