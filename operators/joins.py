"""Keyed joins of two streams: interval join, tumbling-window join, and a regular (updating) join.

Every join is a keyed operator for two connected streams::

    left.key_by("user").connect(right.key_by("user")).apply(joins.interval_join(-5_000, 5_000))

A joined row holds the left key column, the other columns of both sides (a column name present
on both sides gets the suffix ``_left`` / ``_right``, see ``suffixes=``), ``event_time`` = the
later of the two records and ``ingest_ts`` = the earlier. The event-time joins need watermarks
(``flow.source(..., event_time=...)``); records that come after the watermark passed them go
to the side outputs ``"late_left"`` / ``"late_right"``, never silently dropped.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa
from raystream.operators._support import (
    EVENT_TIME,
    check_name,
    outputs,
    register,
    store,
    times_ms,
)
from raystream.operators.aggregations import Groups
from raystream.operators.join_logic import Buffers, equal_pairs, joined_rows, range_pairs
from raystream.operators.window_logic import (
    NO_WATERMARK,
    check_positive_ms,
    tumbling_starts,
)

import raystream as rs
from raystream.errors import DataflowDefinitionError

__all__ = ["interval_join", "join", "window_join"]

LATE = ("late_left", "late_right")
_STATE = {"left": rs.ValueState(object), "right": rs.ValueState(object)}


def _suffixes(suffixes: Any, where: str) -> tuple[str, str]:
    if (
        not isinstance(suffixes, (tuple, list))
        or len(suffixes) != 2
        or not all(isinstance(s, str) and s for s in suffixes)
        or suffixes[0] == suffixes[1]
    ):
        msg = f"{where}: suffixes must be two different non-empty strings, got {suffixes!r}"
        raise DataflowDefinitionError(msg)
    return (suffixes[0], suffixes[1])


def _ms(value: Any, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        msg = f"{where}: {what} must be an int number of milliseconds, got {value!r}"
        raise DataflowDefinitionError(msg)
    return int(value)


def _sides(batch: rs.KeyedBatch, state: Any) -> tuple[Any, Any]:
    """(this side's state, the other side's state) for the batch's input."""
    return (state.left, state.right) if batch.input == 0 else (state.right, state.left)


def _pairs_output(
    side: int,
    mine: pa.RecordBatch,
    my_key: str,
    im: np.ndarray,
    other: Buffers,
    io: np.ndarray,
    suffixes: tuple[str, str],
    extra: dict[str, Any] | None = None,
) -> pa.RecordBatch | None:
    if not len(im):
        return None
    assert other.records is not None
    if side == 0:
        return joined_rows(mine, my_key, im, other.records, other.key_column, io, suffixes, extra)
    return joined_rows(other.records, other.key_column, io, mine, my_key, im, suffixes, extra)


def _split_late(
    batch: rs.KeyedBatch, late: np.ndarray
) -> tuple[pa.RecordBatch, np.ndarray, pa.RecordBatch | None]:
    """(on-time records, their key index, late records or None)."""
    key_index = batch.key_index()
    if not late.any():
        return batch.records, key_index, None
    keep = np.flatnonzero(~late)
    return (
        batch.records.take(pa.array(keep)),
        key_index[keep],
        batch.records.take(pa.array(np.flatnonzero(late))),
    )


# ------------------------------------------------------------------------------------------
# interval join


def interval_join(
    lower_ms: int,
    upper_ms: int,
    *,
    time_column: str = EVENT_TIME,
    suffixes: tuple[str, str] = ("_left", "_right"),
    name: str | None = None,
) -> rs.Operator:
    """Join every left record ``a`` with every right record ``b`` of the same key whose time
    lies in ``[a.time + lower_ms, a.time + upper_ms]`` (both ends included). Each pair is
    emitted once, as soon as its second record arrives. A record stays buffered until the
    watermark passes the last time a partner could have (left: ``time + upper``, right:
    ``time - lower``); a record at or behind the watermark when it comes is late.

    Example::

        >>> views.key_by("user").connect(clicks.key_by("user")).apply(
        ...     interval_join(0, 60_000))      # clicks within a minute after the view
    """
    where = f"interval_join({lower_ms!r}, {upper_ms!r})"
    lower = _ms(lower_ms, "lower_ms", where)
    upper = _ms(upper_ms, "upper_ms", where)
    if lower > upper:
        msg = f"{where}: lower_ms must be <= upper_ms, got lower {lower} > upper {upper}"
        raise DataflowDefinitionError(msg)
    sfx = _suffixes(suffixes, where)
    step = check_name(name, where) or "interval_join"

    def expiry(side: int, t: np.ndarray) -> np.ndarray:
        """The watermark after which a record of ``side`` at ``t`` can match nothing more."""
        return t + upper if side == 0 else t - lower

    def prune(buf: Buffers, side: int, watermark: int) -> None:
        if len(buf) and watermark != NO_WATERMARK:
            assert buf.records is not None
            buf.keep(expiry(side, times_ms(buf.records, time_column, where)) > watermark)

    def fire(timers: Any, state: Any) -> None:
        for side, st in ((0, state.left), (1, state.right)):
            buf = Buffers(st.get(timers.keyset))
            prune(buf, side, timers.watermark)
            if buf.changed:
                store(st, timers.keyset, buf.values(len(timers.keyset)))

    @rs.keyed_batches(name=step, state=_STATE, on_timer=fire)
    def interval(batch: rs.KeyedBatch, state: Any) -> Any:
        side = batch.input
        mine_state, other_state = _sides(batch, state)
        wm = batch.watermark
        t = times_ms(batch.records, time_column, where)
        late = t <= wm if wm != NO_WATERMARK else np.zeros(len(t), bool)
        records, key_index, late_rows = _split_late(batch, late)
        t = t[~late]
        other = Buffers(other_state.get(batch.keys))
        prune(other, 1 - side, wm)
        if other.records is not None and len(other):
            ot = times_ms(other.records, time_column, where)
            if side == 0:
                im, io = range_pairs(key_index, t + lower, t + upper, other.key, ot)
            else:
                im, io = range_pairs(key_index, t - upper, t - lower, other.key, ot)
        else:
            im = io = np.empty(0, np.int64)
        main = _pairs_output(side, records, batch.key_column, im, other, io, sfx)
        if other.changed:
            store(other_state, batch.keys, other.values(len(batch.keys)))
        # buffer what can still match: until the watermark passes its expiry
        exp = expiry(side, t)
        alive = exp > wm
        mine = Buffers(mine_state.get(batch.keys))
        prune(mine, side, wm)
        if alive.any() or mine.changed:
            sel = np.flatnonzero(alive)
            new = records.take(pa.array(sel)) if not alive.all() else records
            store(
                mine_state,
                batch.keys,
                mine.values(len(batch.keys), new, key_index[sel], batch.key_column),
            )
            if len(sel):  # one cleanup timer per key: when its newest rows expire
                k, e = key_index[sel], exp[sel]
                last = np.full(len(batch.keys), np.iinfo(np.int64).min)
                np.maximum.at(last, k, e)
                has = np.flatnonzero(last > np.iinfo(np.int64).min)
                register(batch.timers, has, last[has])
        return outputs(main, **{LATE[side]: late_rows})

    return interval


# ------------------------------------------------------------------------------------------
# window join


def window_join(
    size_ms: int,
    *,
    offset_ms: int = 0,
    time_column: str = EVENT_TIME,
    suffixes: tuple[str, str] = ("_left", "_right"),
    name: str | None = None,
) -> rs.Operator:
    """Join the left and right records of a key that fall into the same tumbling window of
    ``size_ms``: every pair is emitted when the window fires (the watermark reaches its
    ``end - 1``), with ``window_start`` and ``window_end``. Records whose window already fired
    are late.

    Example::

        >>> orders.key_by("sku").connect(shipments.key_by("sku")).apply(window_join(3_600_000))
    """
    where = f"window_join({size_ms!r})"
    size = check_positive_ms(size_ms, "size_ms (the window length)", where)
    offset = _ms(offset_ms, "offset_ms", where) % size
    sfx = _suffixes(suffixes, where)
    step = check_name(name, where) or "window_join"

    def fire(timers: Any, state: Any) -> Any:
        wm = timers.watermark
        n = len(timers.keyset)
        left = Buffers(state.left.get(timers.keyset))
        right = Buffers(state.right.get(timers.keyset))
        starts = []
        for buf in (left, right):
            starts.append(
                tumbling_starts(times_ms(buf.records, time_column, where), size, offset)
                if buf.records is not None
                else np.empty(0, np.int64)
            )
        due = [s + size - 1 <= wm for s in starts]
        out = None
        if due[0].any() and due[1].any():
            li, ri = np.flatnonzero(due[0]), np.flatnonzero(due[1])
            ia, ib = equal_pairs(left.key[li], starts[0][li], right.key[ri], starts[1][ri])
            if len(ia):
                ws = starts[0][li[ia]]
                extra = {"window_start": ws, "window_end": ws + size}
                assert left.records is not None and right.records is not None
                out = joined_rows(
                    left.records, left.key_column, li[ia],
                    right.records, right.key_column, ri[ib], sfx, extra,
                )  # fmt: skip
        for buf, d, st in ((left, due[0], state.left), (right, due[1], state.right)):
            if d.any():
                buf.keep(~d)
                store(st, timers.keyset, buf.values(n))
        return out

    @rs.keyed_batches(name=step, state=_STATE, on_timer=fire)
    def window(batch: rs.KeyedBatch, state: Any) -> Any:
        side = batch.input
        mine_state, _ = _sides(batch, state)
        wm = batch.watermark
        t = times_ms(batch.records, time_column, where)
        start = tumbling_starts(t, size, offset)
        late = start + size - 1 <= wm if wm != NO_WATERMARK else np.zeros(len(t), bool)
        records, key_index, late_rows = _split_late(batch, late)
        start = start[~late]
        if records.num_rows:
            mine = Buffers(mine_state.get(batch.keys))
            store(
                mine_state,
                batch.keys,
                mine.values(len(batch.keys), records, key_index, batch.key_column),
            )
            pairs = Groups.by_pairs(key_index, start)  # one timer per (key, window)
            first = pairs.first()
            register(batch.timers, key_index[first], start[first] + size - 1)
        late_out = None
        if late_rows is not None:
            ls = tumbling_starts(times_ms(late_rows, time_column, where), size, offset)
            late_out = late_rows.append_column("window_start", pa.array(ls, pa.int64()))
            late_out = late_out.append_column("window_end", pa.array(ls + size, pa.int64()))
        return outputs(None, **{LATE[side]: late_out})

    return window


# ------------------------------------------------------------------------------------------
# regular join


def join(
    *,
    keep: str = "all",
    suffixes: tuple[str, str] = ("_left", "_right"),
    name: str | None = None,
    state_ttl_ms: int | None = None,
) -> rs.Operator:
    """A regular inner join on the key, without time bounds; the output updates as records come.

    ``keep="all"``: every record of both sides is kept; a new record emits one row per
    matching record of the other side seen so far (each pair exactly once). State grows with
    the input: use it for bounded streams or few records per key, or set ``state_ttl_ms``.

    ``keep="latest"``: each side is a table with one row per key, the latest record (a
    changelog). A new record replaces its side's row and, if the other side has a row for the
    key, emits the joined row. Read the output as upserts by key: the last row per key is the
    current join result.

    ``state_ttl_ms`` (as Flink's ``table.exec.state.ttl``): a side's rows of a key expire once
    that side got no record of the key for this long in processing (wall-clock) time; expired
    rows never match again and are deleted by a processing-time timer. The result is then no
    longer the full join: a record matches only the other side's records of the last
    ``state_ttl_ms`` of activity of its key. None (the default): state is kept forever.

    Example::

        >>> orders.key_by("customer").connect(customers.key_by("id")).apply(join(keep="latest"))
    """
    where = f"join(keep={keep!r})"
    if keep not in ("all", "latest"):
        msg = f"{where}: keep must be 'all' or 'latest', got {keep!r}"
        raise DataflowDefinitionError(msg)
    sfx = _suffixes(suffixes, where)
    step = check_name(name, where) or "join"
    ttl = None
    if state_ttl_ms is not None:
        ttl = check_positive_ms(state_ttl_ms, "state_ttl_ms (the state retention)", where)
    state_spec = _STATE if ttl is None else {**_STATE, "touched": rs.ValueState(object)}

    def expire(timers: Any, state: Any) -> None:
        """Processing-time timers: drop the sides of the fired keys idle for ``ttl``."""
        assert ttl is not None
        now = _now_ms()
        touched = state.touched.get(timers.keyset)
        left, right = _last_write(touched)
        for last, handle in ((left, state.left), (right, state.right)):
            gone = (last >= 0) & (last + ttl <= now)
            if gone.any():
                handle.delete(timers.keyset.take(np.flatnonzero(gone)))
                last[gone] = -1
        store(state.touched, timers.keyset, _touched_values(left, right))

    @rs.keyed_batches(name=step, state=state_spec, on_timer=expire if ttl is not None else None)
    def regular(batch: rs.KeyedBatch, state: Any) -> Any:
        side = batch.input
        mine_state, other_state = _sides(batch, state)
        n = len(batch.keys)
        records, key_index = batch.records, batch.key_index()
        other_values = other_state.get(batch.keys)
        mine_values: list[Any] | None = None
        if ttl is not None:  # expired rows are never read, even before their timer fired
            now = _now_ms()
            last = _last_write(state.touched.get(batch.keys))
            mine_last, other_last = (last[0], last[1]) if side == 0 else (last[1], last[0])
            other_gone = (other_last >= 0) & (other_last + ttl <= now)
            other_values = [None if g else v for v, g in zip(other_values, other_gone, strict=True)]
            if keep == "all":
                mine_gone = (mine_last >= 0) & (mine_last + ttl <= now)
                mine_values = [
                    None if g else v
                    for v, g in zip(mine_state.get(batch.keys), mine_gone, strict=True)
                ]
            if other_gone.any():  # its timer has not fired yet: delete now
                other_state.delete(batch.keys.take(np.flatnonzero(other_gone)))
            mine_last[:] = now
            other_last[other_gone] = -1
            store(state.touched, batch.keys, _touched_values(*last))
            batch.timers.register_processing(np.full(n, now + ttl, np.int64))
        other = Buffers(other_values)
        if keep == "latest":  # the last record of every key in this batch
            last_row = batch.offsets[1:] - 1
            records, key_index = records.take(pa.array(last_row)), np.arange(n, dtype=np.int64)
            store(mine_state, batch.keys, Buffers([None] * n).values(
                n, records, key_index, batch.key_column
            ))  # fmt: skip
        else:
            mine = Buffers(mine_values if mine_values is not None else mine_state.get(batch.keys))
            store(mine_state, batch.keys, mine.values(n, records, key_index, batch.key_column))
        zeros = np.zeros(len(key_index), np.int64)
        im, io = equal_pairs(key_index, zeros, other.key, np.zeros(len(other), np.int64))
        return _pairs_output(side, records, batch.key_column, im, other, io, sfx)

    return regular


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _last_write(touched: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Per key the wall-clock ms of the last record of the left and of the right side (-1:
    none kept)."""
    pairs = np.array([t if t is not None else (-1, -1) for t in touched], np.int64).reshape(-1, 2)
    return pairs[:, 0].copy(), pairs[:, 1].copy()


def _touched_values(left: np.ndarray, right: np.ndarray) -> list[Any]:
    return [
        None if a < 0 and b < 0 else (a, b)
        for a, b in zip(left.tolist(), right.tolist(), strict=True)
    ]
