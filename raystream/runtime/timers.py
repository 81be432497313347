"""Timers of a keyed operator instance: stored in RocksDB under each key's own prefix (no Ray).

A timer is the state key ``[key_group][sub_group][state id][timestamp][user key]`` (timestamp:
8 bytes big-endian, sign bit flipped), so the timers of one sub-group are one contiguous range in
time order, move with the sub-group on a rescale and are in every snapshot. Event-time timers use
state id :data:`EVENT_TIMERS`, processing-time (wall clock) timers :data:`PROCESSING_TIMERS`; user
states get ids 1..250.

RocksDB is the truth; the instance also keeps the timers of the sub-groups it holds in memory,
per domain sorted by timestamp (:class:`_Queue`: timestamp, sub-group, RocksDB key). A watermark
takes the due timers from there with a binary search (numpy, no RocksDB scan, so no walking past
the tombstones of fired timers) and deletes them from RocksDB with point deletes in one write.
The copy follows the sub-groups the instance holds: a sub-group that arrived (migration, restore,
or one a new migration task brings in) is read from RocksDB by one range scan; one that left is
forgotten. Memory: about 40 bytes per pending timer of int64 keys, more for string keys.

In the user function (``@rs.keyed_batches(..., on_timer=fire)``)::

    batch.timers.register(batch.reduce("event_time", "max") + 1000)  # one per distinct key
    batch.timers.register_at(np.array([0, 2]), 5_000)                 # keys 0 and 2 of the batch
    batch.timers.delete(ts)                                           # cancel
    batch.timers.register_processing(now_ms + 10_000)                 # wall clock

and ``fire(timers: rs.FiredTimers, state)`` gets the due ones, in timestamp order per key.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from raystream.errors import SchemaError, StateError
from raystream.keys import KeySpace
from raystream.state.handles import KeySet
from raystream.state.layout import PREFIX_LEN, encode_keys
from raystream.state.resident import stale_sub_groups

__all__ = [
    "EVENT_TIMERS",
    "PROCESSING_TIMERS",
    "FiredTimers",
    "KeyTimers",
    "TimerRegistrar",
    "TimerService",
]

EVENT_TIMERS = 254
PROCESSING_TIMERS = 253
NO_TIMER = np.iinfo(np.int64).max
_SIGN = np.uint64(1 << 63)
_KIND_BYTE = {"int": b"i", "str": b"s", "bytes": b"b"}
_KIND_OF_BYTE = {v: k for k, v in _KIND_BYTE.items()}
_INT_TIMER = np.dtype([("p", ">u4"), ("ts", ">u8"), ("k", ">u8")])
_TIMER_HEAD = np.dtype([("p", ">u4"), ("ts", ">u8")])
MAX_FIRING_ROUNDS = 1000
MAX_UNWRITTEN = 1_000_000  # new timers held back from RocksDB at most (then all are written)


def _ts_bytes(ts: int) -> bytes:
    return ((int(ts) & 0xFFFFFFFFFFFFFFFF) ^ (1 << 63)).to_bytes(8, "big")


def _prefix(key_group: int, sub_group: int, state_id: int) -> bytes:
    return key_group.to_bytes(2, "big") + bytes((sub_group, state_id))


def encode_timers(
    key_group: np.ndarray, sub_group: np.ndarray, state_id: int, keys: pa.Array, ts: np.ndarray
) -> list[bytes]:
    """One timer key per row: the state key of ``keys`` with the timestamp after the prefix."""
    return encode_timer_rows(key_group, sub_group, state_id, keys, ts)[0]


def encode_timer_rows(
    key_group: np.ndarray, sub_group: np.ndarray, state_id: int, keys: pa.Array, ts: np.ndarray
) -> tuple[list[bytes], np.ndarray]:
    """The timer keys as bytes (for RocksDB) and as an array (``V20`` for int64 keys, else an
    object array of the same bytes)."""
    if keys.type == pa.int64():  # vectorised: [kg u16][sg u8][sid u8][ts][key], big-endian
        rows = np.empty(len(keys), _INT_TIMER)
        rows["p"] = (
            (key_group.astype(np.uint32) << 16) | (sub_group.astype(np.uint32) << 8) | state_id
        )
        rows["ts"] = np.asarray(ts, np.int64).view(np.uint64) ^ _SIGN
        rows["k"] = keys.to_numpy(zero_copy_only=False).view(np.uint64) ^ _SIGN
        raw = rows.view("V20")
        return raw.tolist(), raw
    plain = encode_keys(key_group, sub_group, state_id, keys)
    stamps = (np.asarray(ts, np.int64).view(np.uint64) ^ _SIGN).astype(">u8").tobytes()
    enc = [k[:PREFIX_LEN] + stamps[8 * i : 8 * i + 8] + k[PREFIX_LEN:] for i, k in enumerate(plain)]
    return enc, _objects(enc)


def _objects(items: list[bytes]) -> np.ndarray:
    out = np.empty(len(items), object)
    out[:] = items
    return out


def _as_bytes(raw: np.ndarray) -> list[bytes]:
    return raw.tolist()  # type: ignore[no-any-return]  # V20 and object rows: whole bytes


def _distinct(raw: np.ndarray) -> np.ndarray:
    """Index of the first of each distinct timer key, in key order."""
    if raw.dtype == object:
        return np.unique(raw, return_index=True)[1]  # type: ignore[no-any-return]
    rows = raw.view(_INT_TIMER)
    p = rows["p"].astype(np.uint32)
    ts = rows["ts"].astype(np.uint64)
    k = rows["k"].astype(np.uint64)
    order = np.lexsort((k, ts, p))
    p, ts, k = p[order], ts[order], k[order]
    new = np.ones(len(order), bool)
    new[1:] = (p[1:] != p[:-1]) | (ts[1:] != ts[:-1]) | (k[1:] != k[:-1])
    return order[new]  # type: ignore[no-any-return]


def _decode_key(raw: bytes, kind: str) -> Any:
    body = raw[PREFIX_LEN + 8 :]
    if kind == "int":
        u = int.from_bytes(body[:8], "big") ^ (1 << 63)
        return u - (1 << 64) if u >= 1 << 63 else u
    value = body[4 : 4 + int.from_bytes(body[:4], "big")]
    return value.decode() if kind == "str" else value


@dataclass
class _Due:
    """Timers taken out of RocksDB, sorted by timestamp."""

    keys: list[Any]
    kind: str
    ts: np.ndarray
    key_group: np.ndarray
    sub_group: np.ndarray


@dataclass
class FiredTimers:
    """Due timers handed to ``on_timer``: ``keys[i]`` fires at ``timestamps[i]``.

    Timestamps are non-decreasing, and a key appears at most once per call (a key with several
    due timers gets them in later calls, in timestamp order). ``keyset`` reads and writes state
    as ``batch.keys`` does; ``timers`` registers follow-up timers (``timers.timers.register``).
    ``domain`` is ``"event"`` or ``"processing"``. Example::

        def fire(timers, state):
            totals = state.get(timers.keyset)
            state.delete(timers.keyset)
            return timers.output({"total": totals})   # key, total, event_time = timestamp
    """

    keys: pa.Array
    timestamps: np.ndarray
    keyset: KeySet
    watermark: int
    key_column: str
    domain: str = "event"
    timers: TimerRegistrar | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def output(self, columns: dict[str, Any]) -> pa.RecordBatch:
        """One row per fired timer: the key, ``columns``, ``event_time`` = the timer's timestamp
        (unless given) and ``ingest_ts`` = now."""
        from raystream.runtime.processors import EVENT_TIME, INGEST_TS

        data: dict[str, Any] = {self.key_column: self.keys}
        data.update(columns)
        data.setdefault(EVENT_TIME, pa.array(self.timestamps, pa.int64()))
        data.setdefault(INGEST_TS, pa.array(np.full(len(self.keys), time.time_ns(), np.int64)))
        return pa.RecordBatch.from_pydict(data)


class _Queue:
    """The timers of one domain (event or processing time) of the indexed sub-groups, in memory:
    ``ts`` (sorted), ``g`` (global sub-group) and ``raw`` (the RocksDB key: ``V20`` for int keys,
    bytes objects otherwise), plus a young part of recent registrations (unsorted) that is
    merged in once it holds a quarter as many (so a registration costs O(log n) amortised). A
    timer registered twice is in RocksDB once; here duplicates are dropped when timers fire and
    when they pile up."""

    def __init__(self) -> None:
        self.ts = np.empty(0, np.int64)
        self.g = np.empty(0, np.int64)
        self.raw: np.ndarray | None = None
        self.kind: str | None = None
        self._new: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._unmerged = 0
        self._since_dedupe = 0

    def __len__(self) -> int:
        return len(self.ts) + self._unmerged

    def add(self, kind: str, ts: np.ndarray, g: np.ndarray, raw: np.ndarray) -> None:
        if not len(ts):
            return
        if self.kind is None or not len(self):
            self.kind = kind
        elif kind != self.kind:
            msg = (
                f"timers of one operator hold keys of several types ({self.kind!r} and "
                f"{kind!r}); key every input of the step by the same type"
            )
            raise StateError(msg)
        self._new.append((ts, g, raw))
        self._unmerged += len(ts)
        if self._unmerged > max(len(self.ts) // 4, 4096):
            self.merge()

    def _young(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The young part as one chunk."""
        if not self._new:
            return None
        if len(self._new) > 1:
            parts = self._new
            self._new = [
                (
                    np.concatenate([p[0] for p in parts]),
                    np.concatenate([p[1] for p in parts]),
                    np.concatenate([p[2] for p in parts]),
                )
            ]
        return self._new[0]

    def merge(self) -> None:
        """Merge the young part in (stable: timestamp order, then arrival)."""
        young = self._young()
        if young is None:
            return
        self._new = []
        self._unmerged = 0
        added = len(young[0])
        parts = [young]
        if self.raw is not None and len(self.ts):
            parts = [(self.ts, self.g, self.raw), young]
        ts = np.concatenate([p[0] for p in parts])
        order = np.argsort(ts, kind="stable")  # a sorted run and a short one: timsort
        self.ts = ts[order]
        self.g = np.concatenate([p[1] for p in parts])[order]
        self.raw = np.concatenate([p[2] for p in parts])[order]
        self._since_dedupe += added
        if self._since_dedupe > max(len(self.ts) // 2, 4096):
            self._keep(np.sort(_distinct(self.raw)))
            self._since_dedupe = 0

    def _keep(self, idx: np.ndarray) -> None:
        self.ts, self.g = self.ts[idx], self.g[idx]
        assert self.raw is not None
        self.raw = self.raw[idx]

    def remove(self, raw: np.ndarray) -> None:
        """Forget the timers ``raw`` (deleted by the user)."""
        self.merge()
        if self.raw is None or not len(self.ts) or not len(raw):
            return
        gone = set(_as_bytes(raw))
        hit = np.fromiter(map(gone.__contains__, _as_bytes(self.raw)), bool, len(self.raw))
        self._keep(np.flatnonzero(~hit))

    def forget(self, gone: np.ndarray) -> None:
        """Drop the timers of sub-groups (bool mask over global sub-groups) that left."""
        self.merge()
        if len(self.ts):
            self._keep(np.flatnonzero(~gone[self.g]))

    def first(self, firing: np.ndarray) -> int | None:
        best: int | None = None
        if len(self.ts):
            if firing[self.g[0]]:
                best = int(self.ts[0])
            else:
                ok = firing[self.g]
                best = int(self.ts[int(np.argmax(ok))]) if ok.any() else None
        young = self._young()
        if young is not None:
            ok = firing[young[1]]
            if ok.any():
                m = int(young[0][ok].min())
                best = m if best is None else min(best, m)
        return best

    def take(self, limit_ms: int, firing: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Remove the timers at or before ``limit_ms`` of the firing sub-groups: their raw keys
        (distinct, in key order) and sub-groups."""
        raws: list[np.ndarray] = []
        groups: list[np.ndarray] = []
        n = int(np.searchsorted(self.ts, limit_ms, side="right"))
        if n:
            ok = firing[self.g[:n]]
            if ok.any():
                assert self.raw is not None
                raws.append(self.raw[:n][ok])
                groups.append(self.g[:n][ok])
                self._keep(np.r_[np.flatnonzero(~ok), np.arange(n, len(self.ts))])
        young = self._young()
        if young is not None:
            ts, g, raw = young
            due = (ts <= limit_ms) & firing[g]
            if due.any():
                raws.append(raw[due])
                groups.append(g[due])
                stay = ~due
                self._new = [(ts[stay], g[stay], raw[stay])] if stay.any() else []
                self._unmerged = int(stay.sum())
        if not raws:
            return None
        due_raw = raws[0] if len(raws) == 1 else np.concatenate(raws)
        due_g = groups[0] if len(groups) == 1 else np.concatenate(groups)
        first = _distinct(due_raw)
        return due_raw[first], due_g[first]


class TimerService:
    """Timers of one keyed instance: in RocksDB (the truth: checkpoints, moves) and, for the
    sub-groups held here, in memory per domain (:class:`_Queue`), so that firing reads no
    RocksDB range and walks past no tombstones.

    Writes to RocksDB are deferred like the state's write-back cache: a new timer is put only
    when the backend is about to be read or copied as a whole (snapshot, flush, close) or its
    sub-group is evicted for a move (:meth:`RocksStateBackend.add_pending_writer`), or when
    :data:`MAX_UNWRITTEN` are waiting. A timer that fires before that is never written, so
    most short-lived timers (a window's end) cost RocksDB nothing; one that was written is
    deleted (a point delete) when it fires.
    """

    def __init__(
        self,
        backend: Any,
        key_space: KeySpace,
        held: Callable[[], np.ndarray],
        firing: Callable[[], np.ndarray] | None = None,
        task: Callable[[], Any] | None = None,
    ) -> None:
        self._unwritten: dict[bytes, bytes] = {}  # timer key -> kind byte, not in RocksDB yet
        self._written: set[bytes] = set()  # timer keys of the queues that are in RocksDB
        self._backend: Any = None
        self.backend = backend
        self.key_space = key_space
        self._held = held  # sub-groups whose state is here
        self._firing = firing or held  # sub-groups whose timers may fire now
        self._task = task or (lambda: None)  # the migration task (its ``incoming`` sub-groups)
        self._last_task: Any = None
        n = key_space.num_key_groups * key_space.sub_groups
        self.queues = {EVENT_TIMERS: _Queue(), PROCESSING_TIMERS: _Queue()}
        self._indexed = np.zeros(n, bool)
        self.registered = 0
        self.fired = 0
        self.loaded = 0  # timers read from RocksDB into memory (sub-groups that arrived)

    @property
    def backend(self) -> Any:
        return self._backend

    @backend.setter
    def backend(self, backend: Any) -> None:
        self._backend = backend
        if hasattr(backend, "add_pending_writer"):
            backend.add_pending_writer(lambda prefixes: self._write_unwritten(backend, prefixes))

    def _write_unwritten(self, backend: Any, prefixes: set[bytes] | None) -> None:
        """Put the timers not written yet (of the sub-groups with these 3-byte prefixes; None:
        all) into RocksDB."""
        if backend is not self._backend or not self._unwritten:
            return
        pending = self._unwritten
        if prefixes is None:
            items = sorted(pending.items())
            self._unwritten = {}
        else:
            items = sorted((k, v) for k, v in pending.items() if k[:3] in prefixes)
            for k, _ in items:
                del pending[k]
        if items:
            keys = [k for k, _ in items]
            backend.write_direct(keys, [v for _, v in items])
            self._written.update(keys)

    # ---- the in-memory copy -----------------------------------------------------------------
    def sync(self) -> None:
        """Load the timers of sub-groups that arrived, forget those of sub-groups that left.
        A sub-group that a new migration task brings in is loaded again, even if it was here
        before (it may have left and come back in between)."""
        held = self._held()
        if len(held) != len(self._indexed):  # pragma: no cover - a key space never changes
            msg = f"held mask has {len(held)} sub-groups, the timer index {len(self._indexed)}"
            raise StateError(msg)
        task = self._task()
        if task is self._last_task and np.array_equal(held, self._indexed):
            return  # nothing arrived or left (the common case: checked on every use)
        stale = stale_sub_groups(self._indexed, held, task, self._last_task)
        if task is not None:
            self._last_task = task
        if stale.any():
            s = self.key_space.sub_groups
            prefixes = {_prefix(*divmod(g, s), 0)[:3] for g in np.flatnonzero(stale).tolist()}
            back = {p for p in prefixes if held[int.from_bytes(p[:2], "big") * s + p[2]]}
            if back:  # loaded again below: RocksDB must have all of them
                self._write_unwritten(self._backend, back)
            gone = prefixes - back
            if gone and self._unwritten:  # written when they were evicted; nothing left
                self._unwritten = {k: v for k, v in self._unwritten.items() if k[:3] not in gone}
            self._written = {k for k in self._written if k[:3] not in prefixes}
            for q in self.queues.values():
                q.forget(stale)
            self._indexed &= ~stale
        arrived = np.flatnonzero(held & ~self._indexed)
        if len(arrived):
            for sid, q in self.queues.items():
                self._load(q, sid, arrived)
            self._indexed |= held

    def reindex(self) -> None:
        """Forget the whole copy (the backend was replaced by a restore); it is loaded again on
        its next use, so steps that never use timers pay nothing."""
        self._indexed[:] = False
        self.queues = {EVENT_TIMERS: _Queue(), PROCESSING_TIMERS: _Queue()}
        self._unwritten = {}
        self._written = set()

    def _load(self, q: _Queue, sid: int, groups: np.ndarray) -> None:
        s = self.key_space.sub_groups
        for g in groups.tolist():
            kg, sg = divmod(g, s)
            raws: list[bytes] = []
            kinds: set[bytes] = set()
            lower, upper = _prefix(kg, sg, sid), _prefix(kg, sg, sid + 1)
            for k, v in self.backend.scan(lower, upper, flush=False):
                raws.append(k)
                kinds.add(bytes(v))
            if not raws:
                continue
            if len(kinds) != 1:
                msg = f"timers of one operator hold keys of several types {sorted(kinds)}"
                raise StateError(msg)
            kind = _KIND_OF_BYTE[kinds.pop()]
            heads = np.frombuffer(b"".join(r[: PREFIX_LEN + 8] for r in raws), _TIMER_HEAD)
            ts = (heads["ts"].astype(np.uint64) ^ _SIGN).view(np.int64)
            raw = np.frombuffer(b"".join(raws), "V20") if kind == "int" else _objects(raws)
            q.add(kind, ts, np.full(len(raws), g, np.int64), raw)
            self._written.update(raws)
            self.loaded += len(raws)

    # ---- registering ----------------------------------------------------------------------------
    def register(self, sid: int, keys: KeySet, ts: np.ndarray, *, delete: bool = False) -> None:
        """Set (or delete) one timer per row of ``keys`` at ``ts`` (same length)."""
        if len(keys) == 0:
            return
        self.sync()
        kind = _kind_of(keys.keys)
        enc, raw = encode_timer_rows(keys.key_group, keys.sub_group, sid, keys.keys, ts)
        g = self.key_space.global_sub_group(keys.key_group, keys.sub_group)
        here = self._indexed[g]
        every = bool(here.all())
        q = self.queues[sid]
        if delete:
            self.backend.write_direct([], [], deletes=enc)
            q.remove(raw if every else raw[here])
            for k in enc:
                self._unwritten.pop(k, None)
            self._written.difference_update(enc)
            return
        ts = np.asarray(ts, np.int64)
        kind_byte = _KIND_BYTE[kind]
        if every:
            q.add(kind, ts, g, raw)
            self._unwritten.update(zip(enc, itertools.repeat(kind_byte)))
        else:  # sub-groups not held here (yet): straight to RocksDB, loaded when they arrive
            q.add(kind, ts[here], g[here], raw[here])
            self._unwritten.update(
                (k, kind_byte) for k, h in zip(enc, here.tolist(), strict=True) if h
            )
            away = [k for k, h in zip(enc, here.tolist(), strict=True) if not h]
            self.backend.write_direct(away, [kind_byte] * len(away))
        self.registered += len(enc)
        if len(self._unwritten) > MAX_UNWRITTEN:
            self._write_unwritten(self._backend, None)

    # ---- firing ---------------------------------------------------------------------------------
    def next_due(self, sid: int) -> int | None:
        """The earliest timer of the sub-groups that may fire, or None."""
        self.sync()
        return self.queues[sid].first(self._firing())

    def take_due(self, sid: int, limit_ms: int) -> _Due | None:
        """Remove and return every timer with timestamp <= ``limit_ms`` of the sub-groups that
        may fire, sorted by timestamp (stable: sub-group, then key order); each is deleted from
        RocksDB (point deletes: range tombstones would slow every read of the instance)."""
        self.sync()
        q = self.queues[sid]
        got = q.take(limit_ms, self._firing())
        if got is None:
            return None
        raw, _ = got
        fired = _as_bytes(raw)
        unwritten = self._unwritten
        collections.deque(map(unwritten.pop, fired, itertools.repeat(None)), maxlen=0)
        written = self._written
        if written:
            stored = list(filter(written.__contains__, fired))
            if stored:
                written.difference_update(stored)
                self.backend.write_direct([], [], deletes=stored)
        if q.kind == "int":
            rows = raw.view(_INT_TIMER)
            ts = (rows["ts"].astype(np.uint64) ^ _SIGN).view(np.int64)
            keys: list[Any] = (rows["k"].astype(np.uint64) ^ _SIGN).view(np.int64)  # type: ignore[assignment]
            prefix = rows["p"].astype(np.int64)
        else:
            raws = raw.tolist()
            heads = np.frombuffer(b"".join(r[: PREFIX_LEN + 8] for r in raws), _TIMER_HEAD)
            ts = (heads["ts"].astype(np.uint64) ^ _SIGN).view(np.int64)
            keys = [_decode_key(r, q.kind or "bytes") for r in raws]
            prefix = heads["p"].astype(np.int64)
        order = np.argsort(ts, kind="stable")
        kg = (prefix >> 16)[order]
        sg = ((prefix >> 8) & 0xFF)[order]
        keys = keys[order] if isinstance(keys, np.ndarray) else [keys[i] for i in order]
        self.fired += len(raw)
        return _Due(keys, q.kind or "bytes", ts[order], kg, sg)


def rounds(due: _Due) -> list[tuple[pa.Array, np.ndarray, KeySet]]:
    """Split due timers into calls where each key appears once; per key in timestamp order."""
    n = len(due.ts)
    if due.kind == "int":
        arr = np.asarray(due.keys, np.int64)
        _, inverse = np.unique(arr, return_inverse=True)
        keys_arr: pa.Array = pa.array(arr, pa.int64())
    else:
        index: dict[Any, int] = {}
        inverse = np.fromiter((index.setdefault(k, len(index)) for k in due.keys), np.int64, n)
        keys_arr = pa.array(due.keys, pa.string() if due.kind == "str" else pa.binary())
    # rank of each timer among its key's timers (they are in timestamp order already)
    order = np.argsort(inverse, kind="stable")
    sorted_inv = inverse[order]
    starts = np.r_[True, sorted_inv[1:] != sorted_inv[:-1]]
    run_start = np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n) - run_start
    out = []
    for r in range(int(rank.max()) + 1 if n else 0):
        sel = np.flatnonzero(rank == r)
        idx = pa.array(sel)
        ks = KeySet(keys_arr.take(idx), due.key_group[sel], due.sub_group[sel])
        out.append((ks.keys, due.ts[sel], ks))
    return out


def _kind_of(keys: pa.Array) -> str:
    t = keys.type
    if t == pa.int64():
        return "int"
    if pa.types.is_string(t):
        return "str"
    return "bytes"


@dataclass
class TimerRegistrar:
    """``batch.timers``: set and delete timers for the distinct keys of a batch (vectorised).

    ``ts`` is one int64 per key, aligned with ``batch.keys`` (a scalar applies to every key); a
    negative or masked (null) entry sets no timer. ``register_at(index, ts)`` works on the keys
    ``batch.keys[index]`` only. Event-time timers fire when the watermark passes ``ts``;
    processing-time ones when the wall clock (ms since the epoch) does.
    """

    service: TimerService | None
    keys: KeySet
    step: str = ""

    def _svc(self) -> TimerService:
        if self.service is None:
            msg = (
                f"step {self.step!r} sets timers but has no on_timer function; declare it with "
                "@rs.keyed_batches(..., on_timer=fire)"
            )
            raise StateError(msg)
        return self.service

    def _apply(self, sid: int, index: Any, ts: Any, delete: bool) -> None:
        svc = self._svc()
        n = len(self.keys)
        idx = None if index is None else np.asarray(index, np.int64).reshape(-1)
        m = n if idx is None else len(idx)
        mask = np.ones(m, bool)
        if isinstance(ts, (pa.Array, pa.ChunkedArray)):
            mask &= ~np.asarray(ts.is_null().to_numpy(zero_copy_only=False), bool)
            ts = ts.fill_null(-1).to_numpy(zero_copy_only=False)
        if np.ma.isMaskedArray(ts):
            mask &= ~np.ma.getmaskarray(ts)
            ts = np.ma.getdata(ts)
        arr = np.asarray(ts)
        if arr.dtype.kind not in "iu":
            msg = f"timer timestamps must be int64 milliseconds, got dtype {arr.dtype}"
            raise SchemaError(msg)
        if arr.ndim and arr.shape != (m,):
            msg = (
                f"{arr.shape[0]} timer timestamps for {m} keys; pass one per key "
                "(aligned with batch.keys, or with index for *_at) or a scalar"
            )
            raise SchemaError(msg)
        arr = np.broadcast_to(arr.astype(np.int64), (m,))
        mask &= arr >= 0
        sel = np.flatnonzero(mask)
        rows = sel if idx is None else idx[sel]
        if len(rows) == 0:
            return
        keys = self.keys if len(rows) == n and idx is None and mask.all() else self.keys.take(rows)
        svc.register(sid, keys, np.ascontiguousarray(arr[sel]), delete=delete)

    def register(self, ts: Any) -> None:
        """One event-time timer per distinct key of the batch at ``ts[i]``."""
        self._apply(EVENT_TIMERS, None, ts, False)

    def register_at(self, index: Any, ts: Any) -> None:
        """Event-time timers for the keys ``batch.keys[index]`` at ``ts``."""
        self._apply(EVENT_TIMERS, index, ts, False)

    def delete(self, ts: Any) -> None:
        """Delete the event-time timer of each key at ``ts[i]`` (if set)."""
        self._apply(EVENT_TIMERS, None, ts, True)

    def delete_at(self, index: Any, ts: Any) -> None:
        self._apply(EVENT_TIMERS, index, ts, True)

    def register_processing(self, ts: Any) -> None:
        """One processing-time timer per distinct key at wall-clock ``ts[i]`` (ms since epoch)."""
        self._apply(PROCESSING_TIMERS, None, ts, False)

    def register_processing_at(self, index: Any, ts: Any) -> None:
        self._apply(PROCESSING_TIMERS, index, ts, False)

    def delete_processing(self, ts: Any) -> None:
        self._apply(PROCESSING_TIMERS, None, ts, True)

    def delete_processing_at(self, index: Any, ts: Any) -> None:
        self._apply(PROCESSING_TIMERS, index, ts, True)


class KeyTimers:
    """``timers`` of the per-key form (``@rs.keyed(..., on_timer=fire)``): one key's timers.

    Example::

        @rs.keyed(state=rs.ValueState(int, default=0), on_timer=flush)
        def count(key, records, state, timers):
            state.value += len(records)
            timers.register(records.column("event_time")[0].as_py() // 1000 * 1000 + 999)
            return ()

        def flush(key, timestamp, state, timers):
            yield {"key": key, "second": timestamp // 1000, "count": state.value}
            state.value = 0
    """

    __slots__ = ("_registrar", "_index", "watermark")

    def __init__(self, registrar: TimerRegistrar, index: int, watermark: int) -> None:
        self._registrar = registrar
        self._index = np.array([index], np.int64)
        self.watermark = watermark  # the instance's event-time watermark (int ms)

    def register(self, ts: int) -> None:
        """An event-time timer for this key at ``ts`` (ms)."""
        self._registrar.register_at(self._index, int(ts))

    def delete(self, ts: int) -> None:
        self._registrar.delete_at(self._index, int(ts))

    def register_processing(self, ts: int) -> None:
        """A processing-time timer for this key at wall-clock ``ts`` (ms since the epoch)."""
        self._registrar.register_processing_at(self._index, int(ts))

    def delete_processing(self, ts: int) -> None:
        self._registrar.delete_processing_at(self._index, int(ts))
