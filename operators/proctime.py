"""Processing-time windows per key: tumbling and sliding windows over the wall clock.

Flink's ``TumblingProcessingTimeWindows`` / SQL ``TUMBLE(p_time, ...)`` with
``p_time AS PROCTIME()``. Each function returns a keyed operator for
``stream.key_by(...).apply(op)``; no event time is needed. A record joins the window
``[start, end)`` (epoch-aligned, ms) that contains the processing time at which its batch runs
this step (the step's clock is read once per batch); the window fires when the processing clock
reaches ``end``, by a processing-time timer, and emits one row per key and window::

    <key column>, window_start, window_end, <aggregate columns>, fired_at,
    event_time (= window_end - 1), ingest_ts

``fired_at`` is the processing time (ms) at which the window fired. The windows' partial
aggregates are keyed state (RocksDB, one value per key, as the event-time session windows) and
their timers are RocksDB timers, so they move with their sub-group on a rescale and are in
every checkpoint. When the input ends, the windows still open fire at once (their
``fired_at`` is then before their ``window_end``): nothing stays uncounted.

What is and is not deterministic:

* *Which window a record joins* depends on when its batch runs: two runs over the same input
  give different windows. After a recovery the records after the restored checkpoint are
  replayed and assigned by the clock at replay, so a record may join a different window than in
  the attempt that failed: its window assignment is at-least-once (the failed attempt's rows are
  discarded by an exactly-once sink; an at-least-once sink may keep them too).
* *The aggregate over all windows of a key* is exact: with an exactly-once sink every record
  counts in exactly one emitted window (the restored windows hold exactly the records before the
  checkpoint, the replayed ones are added once), so per key the sum of ``count()`` over its
  windows is its number of records, across rescales and recoveries.
* *No (key, window) is emitted twice* as long as the processing clock of the instance holding a
  key does not go back behind the end of a window it fired: a record processed after a window
  fired has a later processing time, so it joins a later window. A restored window whose end
  passed while the job was down fires right after the restore. A key moved (rescale) to a
  machine whose clock is behind by more than the time since its last fired window could open
  that window again and emit it twice.
* *Each window fires at or after its end* by the clock of the instance that fires it (the
  runtime fires a timer once its wall clock reached it), except the windows still open when the
  input ends.

Example::

    import raystream as rs
    from raystream.operators import count, proctime

    per_10s = flow.source(src).key_by("bidder").apply(proctime.tumbling(10_000, count()))
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
from raystream.operators._support import EVENT_TIME, INGEST_TS, check_name, now_ns, store
from raystream.operators.aggregations import Rows, as_aggregation
from raystream.operators.proctime_logic import END_OF_INPUT, ProcessingTimeWindows
from raystream.operators.window_logic import WindowTable, check_positive_ms

import raystream as rs
from raystream.errors import DataflowDefinitionError

__all__ = ["FIRED_AT", "sliding", "tumbling", "wall_clock_ms"]

FIRED_AT = "fired_at"  # the processing time (ms) at which a window fired


def wall_clock_ms() -> int:
    """The processing clock: ms since the epoch (the clock the runtime's timers fire by)."""
    return time.time_ns() // 1_000_000


def tumbling(
    size_ms: int,
    agg: Any,
    *,
    offset_ms: int = 0,
    clock: Callable[[], int] = wall_clock_ms,
    name: str | None = None,
) -> rs.Operator:
    """Processing-time tumbling windows ``[offset + i*size, offset + (i+1)*size)`` per key.

    ``agg``: an aggregation (``count()``, ``sum("x")``, ...) or a list of them. ``clock``: the
    processing clock (ms since the epoch); give another one only in tests, with the harness's
    ``advance_processing_time`` driving the timers to match.

    Example::

        >>> op = tumbling(10_000, count(name="bid_count"))   # NEXMark q12
        >>> stream.key_by("bidder").apply(op)   # bidder, window_start, window_end, bid_count, ...
    """
    where = f"proctime.tumbling({size_ms!r}, ...)"
    size = check_positive_ms(size_ms, "size_ms (the window length)", where)
    logic = ProcessingTimeWindows.of(
        as_aggregation(agg, where), size=size, slide=size, offset=_offset(offset_ms, size, where)
    )
    return _operator(logic, _clock(clock, where), check_name(name, where) or "proctime_tumbling")


def sliding(
    size_ms: int,
    slide_ms: int,
    agg: Any,
    *,
    offset_ms: int = 0,
    clock: Callable[[], int] = wall_clock_ms,
    name: str | None = None,
) -> rs.Operator:
    """Processing-time sliding windows of ``size_ms`` starting every ``slide_ms`` per key: a
    record processed at ``t`` counts in every window ``[s, s + size)`` with ``s <= t`` and ``s``
    a multiple of ``slide`` (plus ``offset_ms``); ``slide_ms <= size_ms``.

    Example::

        >>> sliding(60_000, 10_000, count())   # a one-minute count every ten seconds
    """
    where = f"proctime.sliding({size_ms!r}, {slide_ms!r}, ...)"
    size = check_positive_ms(size_ms, "size_ms (the window length)", where)
    slide = check_positive_ms(slide_ms, "slide_ms (the distance between window starts)", where)
    if slide > size:
        msg = (
            f"{where}: slide_ms must be <= size_ms (windows that leave gaps would lose records), "
            f"got slide {slide} > size {size}; use proctime.tumbling({size}) for slide == size"
        )
        raise DataflowDefinitionError(msg)
    logic = ProcessingTimeWindows.of(
        as_aggregation(agg, where), size=size, slide=slide, offset=_offset(offset_ms, slide, where)
    )
    return _operator(logic, _clock(clock, where), check_name(name, where) or "proctime_sliding")


def _offset(offset_ms: Any, modulus: int, where: str) -> int:
    if isinstance(offset_ms, bool) or not isinstance(offset_ms, (int, np.integer)):
        msg = f"{where}: offset_ms must be an int (milliseconds), got {offset_ms!r}"
        raise DataflowDefinitionError(msg)
    return int(offset_ms) % modulus


def _clock(clock: Any, where: str) -> Callable[[], int]:
    if not callable(clock):
        msg = f"{where}: clock must be a function returning ms since the epoch, got {clock!r}"
        raise DataflowDefinitionError(msg)
    return clock  # type: ignore[no-any-return]


def _rows(
    fired: WindowTable, logic: ProcessingTimeWindows, keys: pa.Array, key_column: str, now: int
) -> pa.RecordBatch | None:
    if not len(fired):
        return None
    data: dict[str, Any] = {
        key_column: keys.take(pa.array(fired.key)),
        "window_start": pa.array(fired.start, pa.int64()),
        "window_end": pa.array(fired.end, pa.int64()),
    }
    data.update(logic.agg.result(fired.parts))
    data[FIRED_AT] = pa.array(np.full(len(fired), now, np.int64))
    data[EVENT_TIME] = pa.array(fired.end - 1, pa.int64())
    data[INGEST_TS] = pa.array(now_ns(len(fired)), pa.int64())
    return pa.RecordBatch.from_pydict(data)


def _operator(logic: ProcessingTimeWindows, clock: Callable[[], int], name: str) -> rs.Operator:
    def fire(timers: Any, state: Any) -> Any:
        values = state.get(timers.keyset)
        if timers.domain == "processing":
            fired, left = logic.on_timer(values, timers.timestamps)
            emptied = np.flatnonzero([v is None for v in left])
            if len(emptied):  # no window left: the end-of-input timer goes too
                timers.timers.delete_at(emptied, END_OF_INPUT)
        else:  # the end-of-input timer: the watermark reached its maximum
            fired, left = logic.at_end(values), [None] * len(values)
            if len(fired):  # their processing-time timers will not be needed
                timers.timers.delete_processing_at(fired.key, fired.end)
        store(state, timers.keyset, left)
        return _rows(fired, logic, timers.keys, timers.key_column, int(clock()))

    @rs.keyed_batches(name=name, state=rs.ValueState(bytes), on_timer=fire)
    def window(batch: rs.KeyedBatch, state: Any) -> None:
        values = state.get(batch.keys)
        res = logic.on_batch(batch.key_index(), int(clock()), Rows(batch.records), values)
        store(state, batch.keys, res.state)
        if len(res.timer_key):
            batch.timers.register_processing_at(res.timer_key, res.timer_ts)
        if len(res.first):
            batch.timers.register_at(res.first, END_OF_INPUT)

    return window
