"""Event-time windows per key: tumbling, sliding and session windows with an aggregation.

Each function returns a keyed operator for ``stream.key_by(...).apply(op)``. It needs event time
(``flow.source(..., event_time="col", max_out_of_orderness_ms=...)``): a window ``[start, end)``
fires once the watermark reaches ``end - 1`` and emits one row per key and window::

    <key column>, window_start, window_end, <aggregate columns>, event_time (= window_end - 1)

Late records, whose window was closed (watermark >= ``end - 1 + allowed_lateness_ms``) when they
came, are never counted and never dropped silently: they go to the side output ``"late"``
(``out.side_output("late")``) with the ``window_start``/``window_end`` they missed (a sliding
window record once per window it missed; it still counts in its windows that are open).

With ``allowed_lateness_ms > 0`` a window keeps its state that much longer after it fired, and a
record that comes in that time *updates* it: the window is emitted again with the new result.
The sink then receives updates: the last row of a (key, window_start) is the final result.

Tumbling and sliding windows are kept in memory as columns for the sub-groups an instance holds
(:class:`raystream.operators.window_columns.WindowColumns`) and fire straight from them when the
watermark passes; RocksDB holds them (one value per key: the key's open windows) whenever the
state is checkpointed, moved or read, so they move with their sub-group on a rescale. Session
windows live in keyed state and fire by the runtime's timers.

Example::

    import raystream as rs
    from raystream.operators import windows, count, sum

    per_minute = (
        flow.source(src, event_time="ts", max_out_of_orderness_ms=2_000)
        .key_by("user")
        .apply(windows.tumbling(60_000, [count(), sum("amount")]))
    )
    per_minute.sink(rs.sinks.collect())
    per_minute.side_output("late").sink(rs.sinks.collect(), name="late")
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from raystream.operators._support import (
    EVENT_TIME,
    INGEST_TS,
    check_name,
    now_ns,
    outputs,
    register,
    store,
    times_ms,
)
from raystream.operators.aggregations import Rows, as_aggregation
from raystream.operators.window_columns import WindowColumns
from raystream.operators.window_logic import (
    NO_WATERMARK,
    FixedWindows,
    SessionWindows,
    WindowTable,
    check_lateness,
    check_positive_ms,
)

import raystream as rs
from raystream.errors import DataflowDefinitionError

__all__ = ["session", "sliding", "tumbling"]

LATE = "late"  # the side output of late records


def tumbling(
    size_ms: int,
    agg: Any,
    *,
    allowed_lateness_ms: int = 0,
    offset_ms: int = 0,
    time_column: str = EVENT_TIME,
    name: str | None = None,
) -> rs.Operator:
    """Tumbling windows ``[offset + i*size, offset + (i+1)*size)`` per key (epoch-aligned).

    ``agg``: an aggregation (``count()``, ``sum("x")``, ``aggregate(...)``) or a list of them.

    Example::

        >>> op = tumbling(60_000, [count(), mean("amount")], allowed_lateness_ms=5_000)
        >>> stream.key_by("user").apply(op)    # user, window_start, window_end, count, ...
    """
    where = f"tumbling({size_ms!r}, ...)"
    size = check_positive_ms(size_ms, "size_ms (the window length)", where)
    logic = FixedWindows(
        as_aggregation(agg, where),
        check_lateness(allowed_lateness_ms, where),
        size,
        size,
        _offset(offset_ms, size, where),
    )
    return _column_operator(logic, time_column, check_name(name, where) or "tumbling_window")


def sliding(
    size_ms: int,
    slide_ms: int,
    agg: Any,
    *,
    allowed_lateness_ms: int = 0,
    offset_ms: int = 0,
    time_column: str = EVENT_TIME,
    name: str | None = None,
) -> rs.Operator:
    """Sliding (hopping) windows of ``size_ms`` starting every ``slide_ms`` per key: a record at
    ``t`` counts in every window ``[s, s + size)`` with ``s <= t`` and ``s`` a multiple of
    ``slide`` (plus ``offset_ms``). ``slide_ms`` need not divide ``size_ms`` but must be at most
    ``size_ms``.

    Example::

        >>> sliding(60_000, 10_000, count())   # a one-minute count every ten seconds
    """
    where = f"sliding({size_ms!r}, {slide_ms!r}, ...)"
    size = check_positive_ms(size_ms, "size_ms (the window length)", where)
    slide = check_positive_ms(slide_ms, "slide_ms (the distance between window starts)", where)
    if slide > size:
        msg = (
            f"{where}: slide_ms must be <= size_ms (windows that leave gaps would lose records), "
            f"got slide {slide} > size {size}; use tumbling({size}) for slide == size"
        )
        raise DataflowDefinitionError(msg)
    logic = FixedWindows(
        as_aggregation(agg, where),
        check_lateness(allowed_lateness_ms, where),
        size,
        slide,
        _offset(offset_ms, slide, where),
    )
    return _column_operator(logic, time_column, check_name(name, where) or "sliding_window")


def session(
    gap_ms: int,
    agg: Any,
    *,
    allowed_lateness_ms: int = 0,
    time_column: str = EVENT_TIME,
    name: str | None = None,
) -> rs.Operator:
    """Session windows per key: records less than ``gap_ms`` apart are in one session
    ``[first record, last record + gap)``; a record can bridge two sessions into one. A session
    fires when the watermark reaches its end - 1.

    With allowed lateness, a late-but-allowed record that merges sessions emits the merged
    session; rows sent before for the sessions it absorbed are superseded (their
    ``window_start``/``window_end`` lie inside the new one).

    Example::

        >>> session(30 * 60_000, [count(), max("page")])   # 30 minutes of inactivity
    """
    where = f"session({gap_ms!r}, ...)"
    gap = check_positive_ms(gap_ms, "gap_ms (the inactivity that ends a session)", where)
    logic = SessionWindows(
        as_aggregation(agg, where), check_lateness(allowed_lateness_ms, where), gap
    )
    return _operator(logic, time_column, check_name(name, where) or "session_window")


def _offset(offset_ms: Any, modulus: int, where: str) -> int:
    if isinstance(offset_ms, bool) or not isinstance(offset_ms, (int, np.integer)):
        msg = f"{where}: offset_ms must be an int (milliseconds), got {offset_ms!r}"
        raise DataflowDefinitionError(msg)
    return int(offset_ms) % modulus


def _rows(emit: WindowTable, logic: Any, keys: pa.Array, key_column: str) -> pa.RecordBatch | None:
    if not len(emit):
        return None
    data: dict[str, Any] = {
        key_column: keys.take(pa.array(emit.key)),
        "window_start": pa.array(emit.start, pa.int64()),
        "window_end": pa.array(emit.end, pa.int64()),
    }
    data.update(logic.agg.result(emit.parts))
    data[EVENT_TIME] = pa.array(emit.end - 1, pa.int64())
    data[INGEST_TS] = pa.array(now_ns(len(emit)), pa.int64())
    return pa.RecordBatch.from_pydict(data)


def _late(records: pa.RecordBatch, res: Any) -> pa.RecordBatch | None:
    if not len(res.late_record):
        return None
    late = records.take(pa.array(res.late_record))
    late = late.append_column("window_start", pa.array(res.late_start, pa.int64()))
    return late.append_column("window_end", pa.array(res.late_end, pa.int64()))


def _operator(logic: Any, time_column: str, name: str) -> rs.Operator:
    where = f"window step {name!r}"

    def fire(timers: Any, state: Any) -> Any:
        values = state.get(timers.keyset)
        res = logic.on_timer(values, timers.watermark)
        store(state, timers.keyset, res.state)
        return _rows(res.emit, logic, timers.keys, timers.key_column)

    @rs.keyed_batches(name=name, state=rs.ValueState(bytes), on_timer=fire)
    def window(batch: rs.KeyedBatch, state: Any) -> Any:
        values = state.get(batch.keys)
        times = times_ms(batch.records, time_column, where)
        res = logic.on_batch(batch.key_index(), times, Rows(batch.records), values, batch.watermark)
        store(state, batch.keys, res.state)
        register(batch.timers, res.timer_key, res.timer_ts)
        main = _rows(res.emit, logic, batch.keys.keys, batch.key_column)
        return outputs(main, **{LATE: _late(batch.records, res)})

    return window


def _column_store(logic: FixedWindows) -> WindowColumns:
    return WindowColumns(logic, _rows)


def _column_operator(logic: FixedWindows, time_column: str, name: str) -> rs.Operator:
    """Tumbling and sliding windows over :class:`WindowColumns`: no timers, no RocksDB per
    batch; the store fires them on the watermark."""
    where = f"window step {name!r}"

    @rs.keyed_batches(name=name, state=rs.ResidentState(functools.partial(_column_store, logic)))
    def window(batch: rs.KeyedBatch, store: WindowColumns) -> Any:
        times = times_ms(batch.records, time_column, where)
        wm = NO_WATERMARK if batch.watermark is None else int(batch.watermark)
        new, lrec, lstart, lend = logic.partials(batch.key_index(), times, Rows(batch.records), wm)
        emit = store.add(batch.keys, new, wm)
        main = _rows(emit, logic, batch.keys.keys, batch.key_column)
        late = _Late(lrec, lstart, lend)
        return outputs(main, **{LATE: _late(batch.records, late)})

    return window


@dataclass
class _Late:
    late_record: np.ndarray
    late_start: np.ndarray
    late_end: np.ndarray
