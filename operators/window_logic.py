"""Window logic over numpy arrays: assignment, per-(key, window) accumulation, session merging,
firing and cleanup by watermark. No Ray and no state backend here; the window operators
(:mod:`raystream.operators.windows`) feed it a batch, its keys' stored windows and the watermark.

Times are int64 milliseconds. Windows are half-open ``[start, end)``; a window is *due* once the
watermark reaches ``end - 1`` (its last possible timestamp) and *closed* once the watermark
reaches ``end - 1 + allowed_lateness``. A record whose window is closed is *late*.

Example::

    >>> import numpy as np
    >>> tumbling_starts(np.array([0, 59_999, 60_000, -1]), 60_000).tolist()
    [0, 0, 60000, -60000]
    >>> rec, start = sliding_assign(np.array([25]), size=30, slide=10)
    >>> rec.tolist(), start.tolist()
    ([0, 0, 0], [20, 10, 0])
"""

from __future__ import annotations

import itertools
import json
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from raystream.operators.aggregations import Aggregation, Groups, Parts, Rows

from raystream.errors import DataflowDefinitionError

__all__ = [
    "NO_WATERMARK",
    "BatchResult",
    "FixedWindows",
    "SessionWindows",
    "WindowTable",
    "check_positive_ms",
    "sliding_assign",
    "tumbling_starts",
]

NO_WATERMARK = np.iinfo(np.int64).min  # before the first watermark: nothing is due or late


def check_positive_ms(value: Any, what: str, where: str) -> int:
    """``value`` as an int > 0, or a DataflowDefinitionError saying what came."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        msg = f"{where}: {what} must be an int number of milliseconds > 0, got {value!r}"
        raise DataflowDefinitionError(msg)
    return int(value)


def check_lateness(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        msg = f"{where}: allowed_lateness_ms must be an int >= 0 (milliseconds), got {value!r}"
        raise DataflowDefinitionError(msg)
    return int(value)


# ------------------------------------------------------------------------------------------
# assignment


def tumbling_starts(times: np.ndarray, size: int, offset: int = 0) -> np.ndarray:
    """The start of the tumbling window of every time: windows ``[offset + i*size, ...+size)``
    (epoch-aligned with ``offset=0``; negative times floor correctly)."""
    t = np.asarray(times, dtype=np.int64)
    return t - np.mod(t - offset, size)


def sliding_assign(
    times: np.ndarray, size: int, slide: int, offset: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Every (record, window start) pair of sliding windows of ``size`` every ``slide``: a time
    ``t`` belongs to every window ``[s, s + size)`` with ``s ≡ offset (mod slide)`` and
    ``s <= t < s + size`` (``size // slide`` or ``size // slide + 1`` windows).

    Returns ``(record_index, start)``, ordered by record, then latest window first."""
    t = np.asarray(times, dtype=np.int64)
    per = -(-size // slide)  # ceil
    last = t - np.mod(t - offset, slide)
    starts = last[:, None] - (np.arange(per, dtype=np.int64) * slide)[None, :]
    valid = starts + size > t[:, None]
    rec = np.broadcast_to(np.arange(len(t), dtype=np.int64)[:, None], starts.shape)
    return rec[valid], starts[valid]


# ------------------------------------------------------------------------------------------
# a table of windows


@dataclass
class WindowTable:
    """Windows of several keys as parallel arrays: ``key`` (index into the batch's distinct
    keys), ``start``, ``end``, ``fired`` (a result was emitted since the last change) and the
    aggregation's partials."""

    key: np.ndarray
    start: np.ndarray
    end: np.ndarray
    fired: np.ndarray
    parts: Parts

    def __len__(self) -> int:
        return len(self.key)

    def take(self, idx: np.ndarray) -> WindowTable:
        return WindowTable(
            self.key[idx],
            self.start[idx],
            self.end[idx],
            self.fired[idx],
            {k: v[idx] for k, v in self.parts.items()},
        )

    @staticmethod
    def concat(tables: list[WindowTable]) -> WindowTable:
        tables = [t for t in tables if len(t)]
        if not tables:
            return WindowTable.empty()
        if len(tables) == 1:
            return tables[0]
        names = list(tables[0].parts)
        return WindowTable(
            np.concatenate([t.key for t in tables]),
            np.concatenate([t.start for t in tables]),
            np.concatenate([t.end for t in tables]),
            np.concatenate([t.fired for t in tables]),
            {n: _concat_parts([t.parts[n] for t in tables]) for n in names},
        )

    @staticmethod
    def empty() -> WindowTable:
        e = np.empty(0, np.int64)
        return WindowTable(e, e, e, np.empty(0, bool), {})

    # ---- per-key state values ----------------------------------------------------------------
    # A key's windows are stored as one bytes value (``ValueState(bytes)``: no pickling). When
    # every partial is numeric: b"P", the length of the layout (u8), the layout (the partials'
    # names and dtypes), then one fixed-size record per window (start, end, fired, partials), so
    # all keys of a batch are read and written with a few numpy calls. When a partial holds
    # objects (top_k, user aggregates): b"O" and the pickled dict of arrays.

    @staticmethod
    def from_state(values: list[Any]) -> WindowTable:
        """The windows stored for every key (``values[i]`` of key ``i``; None: no windows)."""
        fast = _from_packed(values)
        if fast is not None:
            return fast
        packed: dict[bytes, tuple[list[int], list[bytes]]] = {}
        tables = []
        for i, v in enumerate(values):
            if not v:
                continue
            if v[:1] == _PACKED:
                head = _head_of(v)
                index, raws = packed.setdefault(head, ([], []))
                index.append(i)
                raws.append(v[len(head) :])
                continue
            d = pickle.loads(v[1:])
            n = len(d["start"])
            tables.append(
                WindowTable(np.full(n, i, np.int64), d["start"], d["end"], d["fired"], d["parts"])
            )
        for head, (index, raws) in packed.items():
            tables.append(_unpack(_dtype_of(head), index, raws))
        return WindowTable.concat(tables)

    def to_state(self, n_keys: int) -> list[Any]:
        """Per key its windows as a storable bytes value, or None when it has none left."""
        out: list[Any] = [None] * n_keys
        if not len(self):
            return out
        order = np.argsort(self.key, kind="stable")
        t = self.take(order)
        bounds = np.flatnonzero(np.r_[True, t.key[1:] != t.key[:-1], True])
        keys = t.key[bounds[:-1]].tolist()
        if all(v.dtype != object for v in t.parts.values()):
            head, dtype = _layout_of(t)
            rec = np.empty(len(t), dtype)
            rec["start"], rec["end"], rec["fired"] = t.start, t.end, t.fired
            for name, v in t.parts.items():
                rec["p." + name] = v
            blobs = pack_runs(head, rec.view(np.uint8).reshape(len(t), -1), np.diff(bounds))
            for k, blob in zip(keys, blobs, strict=True):
                out[k] = blob
            return out
        for k, a, b in zip(keys, bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            value = {
                "start": t.start[a:b].copy(),
                "end": t.end[a:b].copy(),
                "fired": t.fired[a:b].copy(),
                "parts": {name: v[a:b].copy() for name, v in t.parts.items()},
            }
            out[k] = _OBJECTS + pickle.dumps(value, protocol=5)
        return out


_PACKED = b"P"
_OBJECTS = b"O"
_FIXED = [("start", "<i8"), ("end", "<i8"), ("fired", "|b1")]
_LAYOUTS: dict[bytes, np.dtype] = {}


def pack_runs(head: bytes, rows: np.ndarray, counts: np.ndarray) -> list[bytes]:
    """One bytes value per run: ``head`` then the run's rows (``rows``: (n, width) uint8, runs
    of ``counts[i]`` consecutive rows). Built in one buffer with numpy, split by Arrow."""
    width = rows.shape[1]
    hl = len(head)
    sizes = hl + counts.astype(np.int64) * width
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    buf = np.empty(int(offsets[-1]), np.uint8)
    starts = offsets[:-1]
    if hl:
        buf[(starts[:, None] + np.arange(hl)).ravel()] = np.tile(
            np.frombuffer(head, np.uint8), len(counts)
        )
    run = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    at = starts[run] + hl + (np.arange(len(run)) - first[run]) * width
    buf[(at[:, None] + np.arange(width)).ravel()] = rows.ravel()
    split = pa.Array.from_buffers(
        pa.large_binary(), len(counts), [None, pa.py_buffer(offsets), pa.py_buffer(buf)]
    )
    return split.to_pylist()  # type: ignore[no-any-return]


def _layout_of(t: WindowTable) -> tuple[bytes, np.dtype]:
    """The header of packed values of ``t``'s layout (b"P", its length, the partials' names and
    dtypes as JSON; a length byte 0xFF means a 4-byte length follows) and the record dtype."""
    parts = [("p." + name, v.dtype.str) for name, v in t.parts.items()]
    text = json.dumps(parts, separators=(",", ":")).encode()
    if len(text) < 0xFF:
        head = _PACKED + bytes((len(text),)) + text
    else:
        head = _PACKED + b"\xff" + len(text).to_bytes(4, "little") + text
    if head not in _LAYOUTS:
        _LAYOUTS[head] = np.dtype(_FIXED + [tuple(f) for f in parts])
    return head, _LAYOUTS[head]


def _head_of(value: bytes) -> bytes:
    """The header (b"P", layout) of a packed value."""
    n = value[1]
    if n == 0xFF:
        return value[: 6 + int.from_bytes(value[2:6], "little")]
    return value[: 2 + n]


def _dtype_of(head: bytes) -> np.dtype:
    got = _LAYOUTS.get(head)
    if got is None:
        text = head[6:] if head[1] == 0xFF else head[2:]
        got = np.dtype(_FIXED + [tuple(f) for f in json.loads(text)])
        _LAYOUTS[head] = got
    return got


def _from_packed(values: list[Any]) -> WindowTable | None:
    """The common case of :meth:`WindowTable.from_state`, with the loops in C or numpy: every
    stored value is packed with one layout. None when it is not that case."""
    present = list(itertools.compress(range(len(values)), values))
    if not present:
        return WindowTable.empty()
    stored = [values[i] for i in present]
    first = stored[0]
    if first[:1] != _PACKED:
        return None
    head = _head_of(first)
    if not all(map(bytes.startswith, stored, itertools.repeat(head))):
        return None
    return _unpack(_dtype_of(head), present, stored, len(head))


def _unpack(dtype: np.dtype, index: list[int], raws: list[bytes], head: int = 0) -> WindowTable:
    """Windows of the keys ``index`` stored as ``raws``, whose first ``head`` bytes are a
    header."""
    lens = np.fromiter(map(len, raws), np.int64, len(raws))
    buf = np.frombuffer(b"".join(raws), np.uint8)
    if head:
        keep = np.ones(len(buf), bool)
        starts = np.cumsum(lens) - lens
        keep[(starts[:, None] + np.arange(head)).ravel()] = False
        buf = buf[keep]
    rec = buf.view(dtype)
    counts = (lens - head) // dtype.itemsize
    key = np.repeat(np.asarray(index, np.int64), counts)
    parts = {n[2:]: rec[n].copy() for n in dtype.names if n.startswith("p.")}
    return WindowTable(key, rec["start"].copy(), rec["end"].copy(), rec["fired"].copy(), parts)


def _concat_parts(arrays: list[np.ndarray]) -> np.ndarray:
    if any(a.dtype == object for a in arrays):
        out = np.empty(sum(len(a) for a in arrays), dtype=object)
        i = 0
        for a in arrays:
            for item in a:
                out[i] = item
                i += 1
        return out
    return np.concatenate(arrays)


@dataclass
class BatchResult:
    """What one batch (or one watermark advance) did to the windows of its keys.

    ``state``: per distinct key its new stored windows (None: delete); ``emit``: windows whose
    result goes out now; ``late_record``/``late_start``/``late_end``: the records (index into the
    batch) that came after their window closed, with that window; ``timer_key``/``timer_ts``:
    event-time timers to register (key index, time)."""

    state: list[Any]
    emit: WindowTable
    late_record: np.ndarray
    late_start: np.ndarray
    late_end: np.ndarray
    timer_key: np.ndarray
    timer_ts: np.ndarray


def _advance(table: WindowTable, watermark: int, lateness: int) -> tuple[WindowTable, WindowTable]:
    """Fire the due windows not fired yet and drop the closed ones: (kept, emitted)."""
    if not len(table):
        return table, table
    due = ~table.fired & (table.end - 1 <= watermark)
    emitted = table.take(np.flatnonzero(due))
    fired = table.fired | due
    table = WindowTable(table.key, table.start, table.end, fired, table.parts)
    keep = table.end - 1 + lateness > watermark
    return (table if keep.all() else table.take(np.flatnonzero(keep))), emitted


def _timers(changed: WindowTable, lateness: int) -> tuple[np.ndarray, np.ndarray]:
    """Timers of changed windows: at ``end - 1`` to fire (if not fired) and, with allowed
    lateness, at ``end - 1 + lateness`` to clean up."""
    k = [changed.key[~changed.fired]]
    t = [changed.end[~changed.fired] - 1]
    if lateness:
        k.append(changed.key)
        t.append(changed.end - 1 + lateness)
    return np.concatenate(k), np.concatenate(t)


def _fire_changed(changed: WindowTable, watermark: int) -> WindowTable:
    """Changed windows whose end already passed (allowed lateness): they go out now, again."""
    fired = changed.end - 1 <= watermark
    return WindowTable(changed.key, changed.start, changed.end, fired, changed.parts)


@dataclass(frozen=True)
class _Windows:
    agg: Aggregation
    lateness: int

    def on_timer(self, state: list[Any], watermark: int | None) -> BatchResult:
        """The watermark advanced: emit the due windows, drop the closed ones."""
        wm = NO_WATERMARK if watermark is None else int(watermark)
        kept, emitted = _advance(WindowTable.from_state(state), wm, self.lateness)
        e = np.empty(0, np.int64)
        return BatchResult(kept.to_state(len(state)), emitted, e, e, e, e, e)


# ------------------------------------------------------------------------------------------
# tumbling and sliding windows


@dataclass(frozen=True)
class FixedWindows(_Windows):
    """Tumbling (``slide == size``) or sliding windows of ``size`` ms every ``slide`` ms."""

    size: int
    slide: int
    offset: int = 0

    def assign(self, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.slide == self.size:
            return np.arange(len(times), dtype=np.int64), tumbling_starts(
                times, self.size, self.offset
            )
        return sliding_assign(times, self.size, self.slide, self.offset)

    def on_batch(
        self,
        key_index: np.ndarray,
        times: np.ndarray,
        rows: Rows,
        state: list[Any],
        watermark: int | None,
    ) -> BatchResult:
        """Add a batch: ``key_index[i]`` is the distinct key of record ``i`` (into ``state``),
        ``times[i]`` its event time, ``rows`` the records; ``state`` the stored windows."""
        wm = NO_WATERMARK if watermark is None else int(watermark)
        stored, emitted = _advance(WindowTable.from_state(state), wm, self.lateness)
        new, lrec, lstart, lend = self.partials(key_index, times, rows, wm)
        changed, opened = self._merge(stored, new)
        changed = _fire_changed(changed, wm)
        # a stored window's timers were registered when it opened (they move with its key)
        tk, tt = _timers(changed if opened is None else changed.take(opened), self.lateness)
        table = WindowTable.concat([self._untouched(stored, changed), changed])
        emit = WindowTable.concat([emitted, changed.take(np.flatnonzero(changed.fired))])
        return BatchResult(table.to_state(len(state)), emit, lrec, lstart, lend, tk, tt)

    def partials(
        self, key_index: np.ndarray, times: np.ndarray, rows: Rows, watermark: int
    ) -> tuple[WindowTable, np.ndarray, np.ndarray, np.ndarray]:
        """A batch's windows, one row per (key, window start) with the partials of its records,
        and its late records (record index, window start, window end: once per window they
        missed). ``watermark``: int (:data:`NO_WATERMARK` before the first)."""
        rec, start = self.assign(times)
        end = start + self.size
        late = end - 1 + self.lateness <= watermark
        if late.any():
            lrec, lstart, lend = rec[late], start[late], end[late]
            rec, start, end = rec[~late], start[~late], end[~late]
        else:
            lrec = lstart = lend = np.empty(0, np.int64)
        keys = key_index[rec]
        groups = Groups.by_pairs(keys, start)
        first = groups.first()
        parts = self.agg.partial(Rows(rows.batch, rec), groups)
        new = WindowTable(keys[first], start[first], end[first], np.zeros(groups.n, bool), parts)
        return new, lrec, lstart, lend

    def _merge(
        self, stored: WindowTable, new: WindowTable
    ) -> tuple[WindowTable, np.ndarray | None]:
        """The windows of ``new`` combined with the same (key, start) of ``stored``, and the
        positions among them of the windows not in ``stored`` (None: all are new)."""
        if not len(stored) or not len(new):
            return new, None
        both = WindowTable.concat([stored, new])
        groups = Groups.by_pairs(both.key, both.start)
        first = groups.first()
        merged = self.agg.merge(both.parts, groups)
        is_new = (np.arange(len(both)) >= len(stored)).astype(np.int8)
        has_new = groups.reduce(is_new, np.maximum)
        has_old = groups.reduce(1 - is_new, np.maximum)
        touched = np.flatnonzero(has_new > 0)
        out = WindowTable(
            both.key[first], both.start[first], both.end[first], np.zeros(groups.n, bool), merged
        )
        return out.take(touched), np.flatnonzero(has_old[touched] == 0)

    @staticmethod
    def _untouched(stored: WindowTable, changed: WindowTable) -> WindowTable:
        if not len(stored) or not len(changed):
            return stored
        both = Groups.by_pairs(
            np.concatenate([stored.key, changed.key]), np.concatenate([stored.start, changed.start])
        )
        ids = both.ids
        hit = np.isin(ids[: len(stored)], ids[len(stored) :])
        return stored.take(np.flatnonzero(~hit))


# ------------------------------------------------------------------------------------------
# session windows


@dataclass(frozen=True)
class SessionWindows(_Windows):
    """Session windows: a record at ``t`` opens ``[t, t + gap)``; windows of one key that overlap
    merge (records less than ``gap`` apart are in one session; exactly ``gap`` apart are not).
    A new record can bridge, and so merge, two sessions."""

    gap: int

    def on_batch(
        self,
        key_index: np.ndarray,
        times: np.ndarray,
        rows: Rows,
        state: list[Any],
        watermark: int | None,
    ) -> BatchResult:
        """As :meth:`FixedWindows.on_batch`, for sessions."""
        wm = NO_WATERMARK if watermark is None else int(watermark)
        stored, emitted = _advance(WindowTable.from_state(state), wm, self.lateness)
        n = len(times)
        t = np.asarray(times, dtype=np.int64)
        singles = Groups(np.arange(n), np.arange(n), np.arange(n))
        new = WindowTable(
            key_index.astype(np.int64),
            t,
            t + self.gap,
            np.zeros(n, bool),
            self.agg.partial(rows, singles),
        )
        both = WindowTable.concat([stored, new])
        is_new = np.arange(len(both)) >= len(stored)
        sid = _session_ids(both.key, both.start, both.end)
        groups = Groups.of(sid)
        first = groups.first()
        start = groups.reduce(both.start, np.minimum)
        end = groups.reduce(both.end, np.maximum)
        has_new = groups.reduce(is_new.astype(np.int8), np.maximum) > 0
        fired = groups.reduce(both.fired.astype(np.int8), np.minimum) > 0
        merged = WindowTable(
            both.key[first],
            start,
            end,
            fired & ~has_new,
            self.agg.merge(both.parts, groups) if len(both) else {},
        )
        closed = has_new & (end - 1 + self.lateness <= wm)
        # a closed session holds only new records: closed stored sessions were dropped above
        late_rows = np.flatnonzero(closed[sid] & is_new) - len(stored)
        lstart, lend = merged.start[sid[late_rows + len(stored)]], end[sid[late_rows + len(stored)]]
        changed = _fire_changed(merged.take(np.flatnonzero(has_new & ~closed)), wm)
        tk, tt = _timers(changed, self.lateness)
        table = WindowTable.concat([merged.take(np.flatnonzero(~has_new)), changed])
        emit = WindowTable.concat([emitted, changed.take(np.flatnonzero(changed.fired))])
        return BatchResult(table.to_state(len(state)), emit, late_rows, lstart, lend, tk, tt)


def _session_ids(key: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Dense session ids of intervals ``[start, end)``: per key, overlapping intervals (also
    through a chain) share an id. Vectorised: sort by (key, start); a row opens a new session
    when its key changes or its start is at or past every earlier end of its key."""
    n = len(key)
    if n == 0:
        return np.empty(0, np.int64)
    order = np.lexsort((start, key))
    k, s, e = key[order], start[order], end[order]
    # ranks keep the order of starts and ends but are small, so key * span + rank fits in int64
    _, inv = np.unique(np.concatenate([s, e]), return_inverse=True)
    sr, er = inv[:n].astype(np.int64), inv[n:].astype(np.int64)
    span = 2 * n + 1
    k0 = k - k.min()
    running = np.maximum.accumulate(k0 * span + er)  # per key, the largest end so far
    opens = np.ones(n, bool)
    opens[1:] = (k[1:] != k[:-1]) | (k0[1:] * span + sr[1:] >= running[:-1])
    ids = np.empty(n, np.int64)
    ids[order] = np.cumsum(opens) - 1
    return ids
