"""Tumbling and sliding windows kept in memory as columns for the sub-groups an instance holds
(an ``rs.ResidentStore``): a batch appends its partial windows, the watermark fires the due ones
straight from the columns; no RocksDB read or write and no timer per window.

Rows are kept in chunks of parallel arrays (``g``: global sub-group, and a
:class:`WindowTable` whose ``key`` is the key's id: the int64 key itself, or an index into
the distinct keys seen for string and binary keys). A (key, window) may have several rows (the
partials of several batches) until it fires, or until the chunks are compacted, which merges
them once the rows appended since the last compaction outnumber the rows after it (and at
least :data:`COMPACT_ROWS`): amortised, a row is merged a few times. Every chunk is sorted by
window end, so the rows a watermark reaches are a prefix of each chunk (a binary search; the
rest stays as it is, not copied).

RocksDB keeps the windows as before, one packed value per key (:meth:`WindowTable.to_state`):
they are written when the runtime asks (checkpoints, flushes, moves; see
:mod:`raystream.state.resident`) and read when a sub-group arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from raystream.operators.aggregations import Groups
from raystream.operators.window_logic import FixedWindows, WindowTable

import raystream as rs

__all__ = ["COMPACT_ROWS", "WindowColumns"]

COMPACT_ROWS = 65_536  # appended rows that are merged at once at the least


@dataclass
class _Chunk:
    g: np.ndarray  # global sub-group of every row
    w: WindowTable  # key = key id
    _next: int | None = None

    def __len__(self) -> int:
        return len(self.g)

    def next_ms(self, lateness: int) -> int:
        """The earliest watermark at which a row fires or closes (cached: chunks only shrink
        by being replaced)."""
        if self._next is None:
            w = self.w
            due = w.end[~w.fired]
            nxt = int(due.min()) - 1 if len(due) else np.iinfo(np.int64).max
            if len(w):
                nxt = min(nxt, int(w.end.min()) - 1 + lateness)
            self._next = nxt
        return self._next

    def take(self, idx: np.ndarray | slice) -> _Chunk:
        return _Chunk(self.g[idx], self.w.take(idx))  # type: ignore[arg-type]

    def by_end(self) -> _Chunk:
        """This chunk sorted by window end (stable: arrival order among equal ends)."""
        end = self.w.end
        if len(end) < 2 or not (end[1:] < end[:-1]).any():
            return self
        return self.take(np.argsort(end, kind="stable"))


def _concat(chunks: list[_Chunk]) -> _Chunk:
    chunks = [c for c in chunks if len(c)]
    if not chunks:
        return _Chunk(np.empty(0, np.int64), WindowTable.empty())
    if len(chunks) == 1:
        return chunks[0]
    return _Chunk(
        np.concatenate([c.g for c in chunks]), WindowTable.concat([c.w for c in chunks])
    )


class WindowColumns(rs.ResidentStore):
    """The open windows of a tumbling or sliding window step on one instance (see module doc).

    ``rows(emit, logic, keys, key_column)`` builds the output batch of emitted windows
    (``emit.key`` indexes ``keys``)."""

    def __init__(self, logic: FixedWindows, rows: Callable[..., pa.RecordBatch | None]) -> None:
        self.logic = logic
        self._rows = rows
        self.chunks: list[_Chunk] = []
        self._fresh = 0  # rows appended since the last compaction
        self._merged = 0  # rows right after it
        self.key_type: pa.DataType | None = None
        self._ids: dict[Any, int] = {}  # string/binary keys: key -> id
        self._names: list[Any] = []  # id -> key
        self.fired = 0  # windows emitted

    def __len__(self) -> int:
        return sum(map(len, self.chunks))

    # ---- keys ----------------------------------------------------------------------------
    def _kids(self, keys: pa.Array) -> np.ndarray:
        if self.key_type is None:
            self.key_type = keys.type
        if keys.type == pa.int64():
            return np.asarray(keys.to_numpy(zero_copy_only=False), np.int64)
        ids = self._ids
        names = self._names
        out = np.empty(len(keys), np.int64)
        for i, k in enumerate(keys.to_pylist()):
            got = ids.get(k)
            if got is None:
                got = ids[k] = len(names)
                names.append(k)
            out[i] = got
        return out

    def _keys_of(self, kids: np.ndarray) -> pa.Array:
        if self.key_type is None or self.key_type == pa.int64():
            return pa.array(kids, pa.int64())
        names = self._names
        return pa.array([names[i] for i in kids.tolist()], self.key_type)

    # ---- batches -------------------------------------------------------------------------
    def add(self, keys: rs.KeySet, new: WindowTable, watermark: int) -> WindowTable:
        """Add the partial windows ``new`` of a batch (``new.key`` indexes ``keys``). Returns
        the windows to emit now (``key`` indexes ``keys``): with allowed lateness, windows
        that fired already and got records again."""
        self.sync()
        if not len(new):
            return WindowTable.empty()
        kids = self._kids(keys.keys)
        g = self.key_space.global_sub_group(keys.key_group, keys.sub_group).astype(np.int64)
        rows = WindowTable(kids[new.key], new.start, new.end, new.fired, new.parts)
        chunk = _Chunk(g[new.key], rows)
        self.touch(chunk.g)
        emitted = WindowTable.empty()
        if self.logic.lateness:
            due = chunk.w.end - 1 <= watermark  # not late: its window fired and is still kept
            if due.any():
                emitted = self._update(chunk.take(np.flatnonzero(due)))
                chunk = chunk.take(np.flatnonzero(~due))
        if len(chunk):
            self.chunks.append(chunk.by_end())
            self._fresh += len(chunk)
            if self._fresh >= max(COMPACT_ROWS, self._merged):
                self.compact()
        if not len(emitted):
            return emitted
        # back to indexes into ``keys``: each emitted key is one of them
        pos = {k: i for i, k in enumerate(kids.tolist())}
        index = np.fromiter(map(pos.__getitem__, emitted.key.tolist()), np.int64, len(emitted))
        return WindowTable(index, emitted.start, emitted.end, emitted.fired, emitted.parts)

    def _update(self, late: _Chunk) -> WindowTable:
        """Windows that fired already, kept for allowed lateness, got the records ``late``:
        merged into them and emitted again (fired)."""
        stored = []
        for i, c in enumerate(self.chunks):
            cand = np.flatnonzero(c.w.end - 1 <= late.w.end.max())
            if not len(cand):
                continue
            both = Groups.by_pairs(
                np.concatenate([c.w.key[cand], late.w.key]),
                np.concatenate([c.w.start[cand], late.w.start]),
            )
            hit = np.isin(both.ids[: len(cand)], both.ids[len(cand) :])
            if hit.any():
                stored.append(c.take(cand[hit]))
                keep = np.ones(len(c), bool)
                keep[cand[hit]] = False
                self.chunks[i] = c.take(np.flatnonzero(keep))
        merged = self._merge(_concat([*stored, late])).by_end()
        merged.w.fired[:] = True
        merged._next = None
        self.chunks.insert(0, merged)
        return merged.w

    def _merge(self, c: _Chunk) -> _Chunk:
        """One row per (key, window start)."""
        if not len(c):
            return c
        groups = Groups.by_pairs(c.w.key, c.w.start)
        if groups.n == len(c):
            return c
        first = groups.first()
        fired = groups.reduce(c.w.fired.astype(np.int8), np.maximum) > 0
        parts = self.logic.agg.merge(c.w.parts, groups)
        w = WindowTable(c.w.key[first], c.w.start[first], c.w.end[first], fired, parts)
        return _Chunk(c.g[first], w)

    def compact(self) -> None:
        """Merge every chunk into one (a row per window)."""
        merged = self._merge(_concat(self.chunks)).by_end()
        self.chunks = [merged] if len(merged) else []
        self._fresh = 0
        self._merged = len(merged)
        if self._names and len(self._names) > 2 * len(merged) + 1024:
            self._renumber()

    def _renumber(self) -> None:
        """Forget string/binary keys without windows (ids are numbered afresh)."""
        live = np.unique(np.concatenate([c.w.key for c in self.chunks] or [np.empty(0, np.int64)]))
        names = [self._names[i] for i in live.tolist()]
        remap = np.zeros(len(self._names), np.int64)
        remap[live] = np.arange(len(live))
        for c in self.chunks:
            c.w.key = remap[c.w.key]
        self._names = names
        self._ids = {k: i for i, k in enumerate(names)}

    # ---- the watermark -------------------------------------------------------------------
    def on_watermark(self, watermark: int) -> pa.RecordBatch | None:
        """Emit the windows due at ``watermark`` (end - 1 <= watermark, not fired) of the
        sub-groups that may fire, and drop the closed ones (end - 1 + lateness <= watermark)."""
        self.sync()
        if not self.chunks:
            return None
        due = self._take_due(watermark)
        if due is None:
            return None
        emit = self._merge(due)
        lateness = self.logic.lateness
        if lateness and len(emit):
            emit.w.fired[:] = True
            emit._next = None
            open_ = emit.w.end - 1 + lateness > watermark
            if open_.any():  # kept (fired) for records allowed late
                self.chunks.insert(0, emit.take(np.flatnonzero(open_)))
        if not len(emit):
            return None
        self.fired += len(emit)
        order = np.lexsort((emit.w.key, emit.g, emit.w.end))
        emit = emit.take(order)
        kids, index = np.unique(emit.w.key, return_inverse=True)
        w = emit.w
        table = WindowTable(index.astype(np.int64), w.start, w.end, w.fired, w.parts)
        return self._rows(table, self.logic, self._keys_of(kids), self.residency.key_column)

    def _take_due(self, watermark: int) -> _Chunk | None:
        """Remove the due and the closed rows of the firing sub-groups; the due ones (not
        merged), or None when no row is due or closed."""
        firing = self.residency.firing()
        lateness = self.logic.lateness
        due_parts: list[_Chunk] = []
        kept: list[_Chunk] = []
        changed = False
        for c in self.chunks:
            if c.next_ms(lateness) > watermark:
                kept.append(c)
                continue
            # sorted by end: the rows with end - 1 <= watermark are a prefix
            n = int(np.searchsorted(c.w.end, watermark + 1, side="right"))
            head = c.take(slice(0, n))
            here = firing[head.g]
            end = head.w.end - 1
            due = here & ~head.w.fired & (end <= watermark)
            closed = here & (end + lateness <= watermark)
            gone = due | closed
            if not gone.any():
                kept.append(c)
                continue
            changed = True
            self.touch(head.g[gone])
            if due.any():
                due_parts.append(head.take(np.flatnonzero(due)))
            stay = [c.take(slice(n, None))]
            if not gone.all():
                stay.insert(0, head.take(np.flatnonzero(~gone)))
            rest = _concat(stay)
            if len(rest):
                kept.append(rest)
        if not changed:
            return None
        self.chunks = kept
        return _concat(due_parts)

    # ---- RocksDB (see raystream.state.resident) ------------------------------------------
    def _values(self, groups: np.ndarray) -> tuple[np.ndarray, pa.Array, list[bytes]]:
        mine: list[_Chunk] = []
        rest: list[_Chunk] = []
        for c in self.chunks:
            sel = groups[c.g]
            if sel.any():
                mine.append(c.take(np.flatnonzero(sel)))
                if not sel.all():
                    rest.append(c.take(np.flatnonzero(~sel)))
            else:
                rest.append(c)
        merged = self._merge(_concat(mine)).by_end()
        # the merged rows go first: every row of their windows is in them (arrival order kept)
        self.chunks = [merged, *rest] if len(merged) else rest
        if not len(merged):
            return np.empty(0, np.int64), pa.array([], self.key_type or pa.int64()), []
        kids, first, index = np.unique(merged.w.key, return_index=True, return_inverse=True)
        w = merged.w
        table = WindowTable(index.astype(np.int64), w.start, w.end, w.fired, w.parts)
        values = table.to_state(len(kids))
        return merged.g[first], self._keys_of(kids), values

    def _load(self, group: int, keys: list[Any], values: list[bytes]) -> None:
        kind = self.residency.key_kind()
        if self.key_type is None:
            self.key_type = {"int": pa.int64(), "str": pa.string(), "bytes": pa.binary()}.get(
                kind or "", _type_of(keys)
            )
        table = WindowTable.from_state(values)
        kids = self._kids(pa.array(keys, self.key_type))
        w = WindowTable(kids[table.key], table.start, table.end, table.fired, table.parts)
        chunk = _Chunk(np.full(len(w), group, np.int64), w).by_end()
        if len(chunk):
            self.chunks.insert(0, chunk)  # older than anything appended since
            self._fresh += len(chunk)

    def _drop(self, gone: np.ndarray) -> None:
        kept = []
        for c in self.chunks:
            sel = gone[c.g]
            if not sel.any():
                kept.append(c)
            elif not sel.all():
                kept.append(c.take(np.flatnonzero(~sel)))
        self.chunks = kept


def _type_of(keys: list[Any]) -> pa.DataType:
    if keys and isinstance(keys[0], int):
        return pa.int64()
    if keys and isinstance(keys[0], str):
        return pa.string()
    return pa.binary()
