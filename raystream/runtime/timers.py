"""Timers of a keyed operator instance: stored in RocksDB under each key's own prefix (no Ray).

A timer is the state key ``[key_group][sub_group][state id][timestamp][user key]`` (timestamp:
8 bytes big-endian, sign bit flipped), so the timers of one sub-group are one contiguous range in
time order, move with the sub-group on a rescale and are in every snapshot. Event-time timers use
state id :data:`EVENT_TIMERS`, processing-time (wall clock) timers :data:`PROCESSING_TIMERS`; user
states get ids 1..250.

An in-memory index holds, per global sub-group, the earliest timer (a lower bound: deleting a
timer leaves it low, a scan corrects it). A watermark then scans only the sub-groups with due
timers. The index follows the sub-groups the instance holds: a sub-group that arrived (migration,
restore) is indexed by one seek to its first timer; one that left is forgotten.

In the user function (``@rs.keyed_batches(..., on_timer=fire)``)::

    batch.timers.register(batch.reduce("event_time", "max") + 1000)  # one per distinct key
    batch.timers.register_at(np.array([0, 2]), 5_000)                 # keys 0 and 2 of the batch
    batch.timers.delete(ts)                                           # cancel
    batch.timers.register_processing(now_ms + 10_000)                 # wall clock

and ``fire(timers: rs.FiredTimers, state)`` gets the due ones, in timestamp order per key.
"""

from __future__ import annotations

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


def _ts_bytes(ts: int) -> bytes:
    return ((int(ts) & 0xFFFFFFFFFFFFFFFF) ^ (1 << 63)).to_bytes(8, "big")


def _prefix(key_group: int, sub_group: int, state_id: int) -> bytes:
    return key_group.to_bytes(2, "big") + bytes((sub_group, state_id))


def encode_timers(
    key_group: np.ndarray, sub_group: np.ndarray, state_id: int, keys: pa.Array, ts: np.ndarray
) -> list[bytes]:
    """One timer key per row: the state key of ``keys`` with the timestamp after the prefix."""
    if keys.type == pa.int64():  # vectorised: [kg u16][sg u8][sid u8][ts][key], big-endian
        rows = np.empty(len(keys), _INT_TIMER)
        rows["p"] = (
            (key_group.astype(np.uint32) << 16) | (sub_group.astype(np.uint32) << 8) | state_id
        )
        rows["ts"] = np.asarray(ts, np.int64).view(np.uint64) ^ _SIGN
        rows["k"] = keys.to_numpy(zero_copy_only=False).view(np.uint64) ^ _SIGN
        return rows.view("V20").tolist()  # type: ignore[no-any-return]
    plain = encode_keys(key_group, sub_group, state_id, keys)
    stamps = (np.asarray(ts, np.int64).view(np.uint64) ^ _SIGN).astype(">u8").tobytes()
    return [
        k[:PREFIX_LEN] + stamps[8 * i : 8 * i + 8] + k[PREFIX_LEN:] for i, k in enumerate(plain)
    ]


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


class TimerService:
    """Timers of one keyed instance in its RocksDB, with the per-sub-group index."""

    def __init__(
        self,
        backend: Any,
        key_space: KeySpace,
        held: Callable[[], np.ndarray],
        firing: Callable[[], np.ndarray] | None = None,
    ) -> None:
        self.backend = backend
        self.key_space = key_space
        self._held = held  # sub-groups whose state is here
        self._firing = firing or held  # sub-groups whose timers may fire now
        n = key_space.num_key_groups * key_space.sub_groups
        self.next_ts = {
            EVENT_TIMERS: np.full(n, NO_TIMER, np.int64),
            PROCESSING_TIMERS: np.full(n, NO_TIMER, np.int64),
        }
        self._indexed = np.zeros(n, bool)
        self.registered = 0
        self.fired = 0

    # ---- the index ----------------------------------------------------------------------------
    def sync(self) -> None:
        """Index sub-groups that arrived, forget those that left."""
        held = self._held()
        if len(held) != len(self._indexed):  # pragma: no cover - a key space never changes
            msg = f"held mask has {len(held)} sub-groups, the timer index {len(self._indexed)}"
            raise StateError(msg)
        gone = self._indexed & ~held
        if gone.any():
            for arr in self.next_ts.values():
                arr[gone] = NO_TIMER
        for g in np.flatnonzero(held & ~self._indexed).tolist():
            for sid in self.next_ts:
                self.next_ts[sid][g] = self._first(g, sid)
        self._indexed = held.copy()

    def reindex(self) -> None:
        """Forget the whole index (the backend was replaced by a restore); it is rebuilt on its
        next use, so steps that never use timers pay nothing."""
        self._indexed[:] = False
        for arr in self.next_ts.values():
            arr[:] = NO_TIMER

    def _first(self, g: int, sid: int) -> int:
        kg, sg = divmod(g, self.key_space.sub_groups)
        lower = _prefix(kg, sg, sid)
        upper = _prefix(kg, sg, sid + 1)
        for k, _ in self.backend.scan(lower, upper, flush=False):
            u = int.from_bytes(k[PREFIX_LEN : PREFIX_LEN + 8], "big") ^ (1 << 63)
            return u - (1 << 64) if u >= 1 << 63 else u
        return int(NO_TIMER)

    # ---- registering ----------------------------------------------------------------------------
    def register(self, sid: int, keys: KeySet, ts: np.ndarray, *, delete: bool = False) -> None:
        """Set (or delete) one timer per row of ``keys`` at ``ts`` (same length)."""
        if len(keys) == 0:
            return
        kind = _kind_of(keys.keys)
        enc = encode_timers(keys.key_group, keys.sub_group, sid, keys.keys, ts)
        if delete:
            self.backend.write_direct([], [], deletes=enc)
            return
        self.backend.write_direct(enc, [_KIND_BYTE[kind]] * len(enc))
        g = self.key_space.global_sub_group(keys.key_group, keys.sub_group)
        np.minimum.at(self.next_ts[sid], g, ts)
        self.registered += len(enc)

    # ---- firing ---------------------------------------------------------------------------------
    def next_due(self, sid: int) -> int | None:
        """The earliest timer of the sub-groups that may fire (a lower bound), or None."""
        self.sync()
        arr = self.next_ts[sid][self._firing()]
        m = int(arr.min()) if len(arr) else int(NO_TIMER)
        return None if m == NO_TIMER else m

    def take_due(self, sid: int, limit_ms: int) -> _Due | None:
        """Remove and return every timer with timestamp <= ``limit_ms`` of the sub-groups that
        may fire, sorted by timestamp (stable: sub-group, then key order)."""
        self.sync()
        index = self.next_ts[sid]
        groups = np.flatnonzero(self._firing() & (index <= limit_ms))
        if not len(groups):
            return None
        raws: list[bytes] = []
        kinds: set[bytes] = set()
        s = self.key_space.sub_groups
        end = PREFIX_LEN + 8
        for g in groups.tolist():
            # one scan per sub-group: the due timers, then the first later one (the new minimum)
            kg, sg = divmod(g, s)
            limit = _ts_bytes(limit_ms) if limit_ms < NO_TIMER else b"\xff" * 8
            nxt = int(NO_TIMER)
            for k, v in self.backend.scan(
                _prefix(kg, sg, sid), _prefix(kg, sg, sid + 1), flush=False
            ):
                if k[PREFIX_LEN:end] > limit:
                    u = int.from_bytes(k[PREFIX_LEN:end], "big") ^ (1 << 63)
                    nxt = u - (1 << 64) if u >= 1 << 63 else u
                    break
                raws.append(k)
                kinds.add(bytes(v))
            index[g] = nxt
        if raws:
            self.backend.write_direct([], [], deletes=raws)
        if not raws:
            return None
        if len(kinds) != 1:
            msg = f"timers of one operator hold keys of several types {sorted(kinds)}"
            raise StateError(msg)
        kind = _KIND_OF_BYTE[kinds.pop()]
        if kind == "int":
            rows = np.frombuffer(b"".join(raws), _INT_TIMER)
            ts = (rows["ts"].astype(np.uint64) ^ _SIGN).view(np.int64)
            keys: list[Any] = (rows["k"].astype(np.uint64) ^ _SIGN).view(np.int64)  # type: ignore[assignment]
            prefix = rows["p"].astype(np.int64)
        else:
            heads = np.frombuffer(b"".join(r[: PREFIX_LEN + 8] for r in raws), _TIMER_HEAD)
            ts = (heads["ts"].astype(np.uint64) ^ _SIGN).view(np.int64)
            keys = [_decode_key(r, kind) for r in raws]
            prefix = heads["p"].astype(np.int64)
        order = np.argsort(ts, kind="stable")
        kg = (prefix >> 16)[order]
        sg = ((prefix >> 8) & 0xFF)[order]
        keys = keys[order] if isinstance(keys, np.ndarray) else [keys[i] for i in order]
        self.fired += len(raws)
        return _Due(keys, kind, ts[order], kg, sg)


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
