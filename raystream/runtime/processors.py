"""What an operator instance does with one record batch, per operator kind (no Ray here).

Every processor maps an input batch to a list of output batches. Records carry ``event_time``
(ms) and ``ingest_ts`` (ns): per-record operators copy them from the input record when the
output lacks them; keyed operators give each output the oldest ``ingest_ts`` and newest
``event_time`` of its key's records, so sink latency measures the oldest record behind an output.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raystream.dataflow import Step
from raystream.errors import ConfigError, SchemaError, StateError, note_context
from raystream.keys import KeySpace, key_kind, stable_hash
from raystream.runtime.channels import materialise_key
from raystream.runtime.migration import MigrationEngine
from raystream.runtime.outputs import Outputs, tag_port
from raystream.runtime.timers import (
    EVENT_TIMERS,
    MAX_FIRING_ROUNDS,
    PROCESSING_TIMERS,
    FiredTimers,
    KeyTimers,
    TimerRegistrar,
    TimerService,
    rounds,
)
from raystream.runtime.watermarks import WATERMARK_MIN
from raystream.state.handles import KeyedStates, KeySet
from raystream.state.resident import Residency
from raystream.state.rocks import RocksStateBackend

__all__ = [
    "INGEST_TS",
    "EVENT_TIME",
    "INPUT_EVENTS",
    "KeyedBatch",
    "input_events_of",
    "KeyedProcessor",
    "make_processor",
]

INGEST_TS = "ingest_ts"
EVENT_TIME = "event_time"
# how many input events an output row of a keyed step aggregates (set next to ``ingest_ts``);
# sinks weight latency by it and drop it before writing
INPUT_EVENTS = "input_events"
_META = (EVENT_TIME, INGEST_TS)
INPUT_META = b"raystream.input"  # which input of a two-input step a buffered batch came from


def input_events_of(batch: pa.RecordBatch) -> np.ndarray:
    """Each record's ``input_events`` as int64; 1 where it is missing (null: a record that came
    without one, e.g. a timer's output batched together with rows that have one)."""
    col = batch.column(INPUT_EVENTS)
    if col.null_count:
        col = pc.fill_null(col, 1)
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.int64)


def _to_batches(out: Any, step: str) -> list[pa.RecordBatch]:
    if out is None:
        return []
    if isinstance(out, Outputs):
        batches = _to_batches(out.main, step)
        for port, value in out.side.items():
            batches += [tag_port(b, port) for b in _to_batches(value, step)]
        return batches
    if isinstance(out, pa.RecordBatch):
        return [out] if out.num_rows else []
    if isinstance(out, pa.Table):
        return [b for b in out.to_batches() if b.num_rows]
    if isinstance(out, dict):
        return _to_batches(pa.RecordBatch.from_pydict(out), step)
    msg = (
        f"step {step!r} returned {type(out).__name__}; expected a pyarrow.RecordBatch, a "
        "pyarrow.Table, a dict of columns or None"
    )
    raise SchemaError(msg)


def _first_key(keys: KeySet) -> Any:
    return keys.keys[0].as_py() if len(keys) else None


def _user_fields(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in _META and k != INPUT_EVENTS}


def _rows_to_batch(rows: list[dict[str, Any]], step: str) -> list[pa.RecordBatch]:
    if not rows:
        return []
    names = list(dict.fromkeys(k for r in rows for k in r))  # every field of every row
    try:
        return [pa.RecordBatch.from_pydict({n: [r.get(n) for r in rows] for n in names})]
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        msg = f"step {step!r} produced records Arrow cannot put in one batch ({e}); first: {rows[0]!r}"
        raise SchemaError(msg) from e


class MapProcessor:
    """``@rs.map`` / ``@rs.filter`` / ``@rs.flat_map``: the function per record. An ``async def``
    function (``step.async_calls``) makes :meth:`process` return a coroutine: the instance awaits
    it (:func:`raystream.runtime.async_calls.call_all`)."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.async_stats: dict[str, list[int]] = {"calls": [0], "retries": [0]}

    def close(self) -> None:
        pass

    def process(self, batch: pa.RecordBatch) -> Any:
        fn = self.step.fn
        kind = self.step.kind
        rows = batch.to_pylist()
        if self.step.async_calls is not None:
            return self._process_async(batch, rows)
        try:
            return self._process_rows(fn, kind, batch, rows)
        except Exception as e:
            if self._current is not None:
                note_context(e, "record", _user_fields(self._current))
            raise

    _current: dict[str, Any] | None = None  # the record being processed (for error context)

    def _process_rows(
        self, fn: Any, kind: str, batch: pa.RecordBatch, rows: list[dict[str, Any]]
    ) -> list[pa.RecordBatch]:
        out: list[dict[str, Any]] = []
        if kind == "map":
            for r in rows:
                self._current = r
                o = fn(r)
                self._check_map_result(r, o)
                out.append(o)
        elif kind == "flat_map":
            for r in rows:
                self._current = r
                self._add_flat(r, fn(r), out)
        else:  # filter
            mask = np.zeros(len(rows), dtype=bool)
            for i, r in enumerate(rows):
                self._current = r
                keep = fn(r)
                self._not_awaitable(keep)
                mask[i] = bool(keep)
            self._current = None
            return [batch.filter(pa.array(mask))] if mask.any() else []
        self._current = None
        return _rows_to_batch(out, self.step.name)

    def _check_map_result(self, record: dict[str, Any], o: Any) -> None:
        if not isinstance(o, dict):
            self._not_awaitable(o)
            msg = f"map step {self.step.name!r} must return a dict per record, got {o!r}"
            raise SchemaError(msg)
        _carry_meta(record, o)

    def _not_awaitable(self, o: Any) -> None:
        """A synchronous function that returned an awaitable (a coroutine of an async function
        it called, or a lambda around one): say how to have it awaited."""
        if inspect.isawaitable(o):
            close = getattr(o, "close", None)
            if callable(close):  # never awaited: closed, so Python does not warn about it
                close()
            msg = (
                f"{self.step.kind} step {self.step.name!r}: its function returned {o!r}, an "
                "awaitable; declare the function async def (raystream awaits it, "
                "concurrency= calls at once), rather than a synchronous one around it"
            )
            raise SchemaError(msg)

    def _add_flat(self, record: dict[str, Any], got: Any, out: list[dict[str, Any]]) -> None:
        self._not_awaitable(got)
        for o in got or ():
            if not isinstance(o, dict):
                msg = f"flat_map step {self.step.name!r} must yield dicts, got {o!r}"
                raise SchemaError(msg)
            _carry_meta(record, o)
            out.append(o)

    async def _process_async(
        self, batch: pa.RecordBatch, rows: list[dict[str, Any]]
    ) -> list[pa.RecordBatch]:
        from raystream.runtime.async_calls import call_all

        step = self.step
        assert step.async_calls is not None
        results = await call_all(
            step.fn,
            rows,
            step.async_calls,
            step.name,
            lambda i: ("record", _user_fields(rows[i])),
            self.async_stats,
        )
        if step.kind == "filter":
            mask = np.fromiter((bool(x) for x in results), dtype=bool, count=len(results))
            return [batch.filter(pa.array(mask))] if mask.any() else []
        out: list[dict[str, Any]] = []
        for r, o in zip(rows, results, strict=True):
            try:
                if step.kind == "map":
                    self._check_map_result(r, o)
                    out.append(o)
                else:
                    self._add_flat(r, o, out)
            except Exception as e:
                note_context(e, "record", _user_fields(r))
                raise
        return _rows_to_batch(out, step.name)


def _carry_meta(src: dict[str, Any], dst: dict[str, Any]) -> None:
    for col in _META:
        if col in src and col not in dst:
            dst[col] = src[col]


class MapBatchesProcessor:
    """``@rs.map_batches``: the function per batch; an ``async def`` one is awaited on the batch
    cut into ``async_calls.concurrency`` parts of about equal size (one part by default)."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.async_stats: dict[str, list[int]] = {"calls": [0], "retries": [0]}

    def close(self) -> None:
        pass

    def process(self, batch: pa.RecordBatch) -> Any:
        if self.step.async_calls is not None:
            return self._process_async(batch)
        return self._outputs(batch, self.step.fn(batch))

    def _outputs(self, batch: pa.RecordBatch, got: Any) -> list[pa.RecordBatch]:
        outs = _to_batches(got, self.step.name)
        if len(outs) == 1 and outs[0].num_rows == batch.num_rows:
            o = outs[0]
            for col in _META:
                if col in batch.schema.names and col not in o.schema.names:
                    o = o.append_column(col, batch.column(col))
            outs = [o]
        return outs

    async def _process_async(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        from raystream.runtime.async_calls import call_all

        step = self.step
        assert step.async_calls is not None
        n = batch.num_rows
        parts = min(step.async_calls.concurrency, max(n, 1))
        bounds = np.linspace(0, n, parts + 1).astype(np.int64)
        pieces = [batch.slice(int(lo), int(hi - lo)) for lo, hi in zip(bounds, bounds[1:])]

        def rows(i: int) -> tuple[str, Any]:
            return "rows", _Rows(int(bounds[i]), int(bounds[i + 1]), n)

        results = await call_all(
            step.fn, pieces, step.async_calls, step.name, rows, self.async_stats
        )
        outs: list[pa.RecordBatch] = []
        for p, got in zip(pieces, results, strict=True):
            outs.extend(self._outputs(p, got))
        return outs


@dataclass(frozen=True)
class _Rows:
    """Rows ``lo .. hi - 1`` of a batch of ``n`` (an async map_batches call's part, in errors)."""

    lo: int
    hi: int
    n: int

    def __repr__(self) -> str:
        return f"{self.lo}..{self.hi - 1} (of {self.n})"


@dataclass
class KeyedBatch:
    """One batch grouped by key: the records of ``keys[i]`` are ``records[offsets[i]:offsets[i+1]]``.

    ``records`` is grouped by key (stably, so per-key order is kept); ``keys`` holds the distinct
    keys with their key groups and sub-groups, ready for vectorised state access.

    Event time: ``watermark`` is this instance's current watermark (int ms,
    ``-(2**63)`` before the first one); ``timers`` sets and deletes timers of these keys
    (:class:`raystream.runtime.timers.TimerRegistrar`, needs ``on_timer=``). With two inputs
    (``a.connect(b).apply(op)``), ``input`` says which stream the batch came from (0 or 1).
    """

    records: pa.RecordBatch
    keys: KeySet
    offsets: np.ndarray
    key_column: str
    watermark: int = WATERMARK_MIN
    timers: TimerRegistrar | None = None
    input: int = 0

    @property
    def counts(self) -> np.ndarray:
        """Number of records per distinct key."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return self.records.num_rows

    def key_index(self) -> np.ndarray:
        """For every record, the index of its key in ``keys``."""
        return np.repeat(np.arange(len(self.keys)), self.counts)

    def records_of(self, i: int) -> pa.RecordBatch:
        return self.records.slice(int(self.offsets[i]), int(self.offsets[i + 1] - self.offsets[i]))

    def reduce(self, column: str, how: str = "sum") -> np.ndarray:
        """Per-key reduction of a numeric column (``sum``, ``min``, ``max``), vectorised."""
        values = self.records.column(column).to_numpy(zero_copy_only=False)
        starts = self.offsets[:-1]
        if len(starts) == 0:
            return values[:0]
        ufunc = {"sum": np.add, "min": np.minimum, "max": np.maximum}[how]
        return ufunc.reduceat(values, starts)

    def input_events(self) -> np.ndarray:
        """Input events per distinct key: its records' ``input_events`` summed (records that
        aggregate events upstream), else its number of records."""
        if INPUT_EVENTS not in self.records.schema.names or len(self.offsets) < 2:
            return self.counts
        return np.add.reduceat(input_events_of(self.records), self.offsets[:-1])

    def output(self, columns: dict[str, Any]) -> pa.RecordBatch:
        """One output row per distinct key: the key, ``columns``, and the key's oldest
        ``ingest_ts`` / newest ``event_time``; with ``ingest_ts`` also ``input_events``, how many
        input events the row covers (see :meth:`input_events`)."""
        data: dict[str, Any] = {self.key_column: self.keys.keys}
        data.update(columns)
        names = self.records.schema.names
        if INGEST_TS in names and INGEST_TS not in data:
            data[INGEST_TS] = self.reduce(INGEST_TS, "min")
            if INPUT_EVENTS not in data:
                data[INPUT_EVENTS] = self.input_events()
        if EVENT_TIME in names and EVENT_TIME not in data:
            data[EVENT_TIME] = self.reduce(EVENT_TIME, "max")
        return pa.RecordBatch.from_pydict(data)


def group_by_key(
    batch: pa.RecordBatch, keys: pa.Array, key_space: KeySpace, key_column: str
) -> KeyedBatch:
    """Group a batch by key (stable: per-key arrival order kept) and find each distinct key's run
    of records. Distinct keys come in the order of their state keys (key group, sub-group, then
    the int key) so RocksDB reads and writes them sorted (a batch already grouped by key keeps
    its order and is not copied); each key is hashed once.

    One hash pass over the rows (Arrow's dictionary encoding) finds the distinct keys, and a
    counting sort of the rows by their key's rank (numpy's radix sort while a batch has fewer
    than 65,536 distinct keys) puts each key's records together."""
    n = batch.num_rows
    if n == 0:
        kg, sg = key_space.locate(keys)
        return KeyedBatch(batch, KeySet(keys, kg, sg), np.zeros(1, np.int64), key_column)
    enc = pc.dictionary_encode(keys)
    distinct = enc.dictionary
    idx = enc.indices.to_numpy(zero_copy_only=False)
    kg, sg = key_space.locate(distinct)
    gsg = kg.astype(np.int64) * key_space.sub_groups + sg
    d = len(distinct)
    if not (idx[1:] < idx[:-1]).any():  # already grouped: kept as it is (no copy)
        offsets = np.append(np.flatnonzero(np.r_[True, idx[1:] != idx[:-1]]), n).astype(np.int64)
        return KeyedBatch(batch, KeySet(distinct, kg, sg), offsets, key_column)
    if distinct.type == pa.int64():
        perm = _state_key_order(distinct.to_numpy(zero_copy_only=False), gsg)
    else:
        perm = np.argsort(gsg, kind="stable")
    rank = np.empty(d, np.uint16 if d <= 1 << 16 else np.int64)
    rank[perm] = np.arange(d, dtype=rank.dtype)
    row_rank = rank[idx]
    order = np.argsort(row_rank, kind="stable")  # radix sort for uint16
    offsets = np.zeros(d + 1, np.int64)
    np.cumsum(np.bincount(row_rank, minlength=d), out=offsets[1:])
    records = batch if _is_identity(order) else batch.take(pa.array(order))
    if not _is_identity(perm):
        distinct = distinct.take(pa.array(perm))
        kg, sg = kg[perm], sg[perm]
    return KeyedBatch(records, KeySet(distinct, kg, sg), offsets, key_column)


def _state_key_order(keys: np.ndarray, gsg: np.ndarray) -> np.ndarray:
    """The order of distinct int64 ``keys`` by (sub-group ``gsg``, key), as
    ``np.lexsort((keys, gsg))`` gives it: a sort of the keys (distinct, so any sort), then a
    stable one of their sub-groups (a radix sort while they fit 16 bits; 7x faster than lexsort
    for 24k keys)."""
    by_key = np.argsort(keys)
    groups = gsg[by_key]
    if len(groups) and groups.max() < 1 << 16:
        groups = groups.astype(np.uint16)
    return by_key[np.argsort(groups, kind="stable")]


def _is_identity(order: np.ndarray) -> bool:
    return bool(len(order) == 0 or (order[0] == 0 and (np.diff(order) == 1).all()))


class KeyedProcessor:
    """A keyed operator instance: its RocksDB state, the sub-groups it holds, its user function."""

    def __init__(
        self,
        step: Step,
        key_space: KeySpace,
        state_path: str | Path,
        owned: Iterable[int],
        *,
        track: bool = True,
        cache_entries: int = 500_000,
        cache_bytes: int = 64 << 20,
        max_pending_bytes: int = 64 << 20,
        heat_half_life_s: float = 10.0,
    ) -> None:
        assert step.key is not None
        self.track = track
        self.step = step
        self.key_space = key_space
        self.key_column = step.key.key_column
        self.key_specs = step.input_keys
        self.cache_entries = cache_entries
        self.cache_bytes = cache_bytes
        self.backend = RocksStateBackend(
            state_path, cache_entries=cache_entries, cache_bytes=cache_bytes
        )
        self.engine = MigrationEngine(
            self.backend,
            key_space.num_key_groups,
            key_space.sub_groups,
            owned,
            max_pending_bytes=max_pending_bytes,
            heat_half_life_s=heat_half_life_s,
        )
        self.key_kind: str | None = None
        self.watermark = WATERMARK_MIN  # set by the instance as its watermark advances
        self.residency = Residency(
            lambda: self.engine.held,
            self._firing_sub_groups,
            lambda: self.engine.task,
            lambda: self.key_kind,
            self.key_column,
        )
        self.states = KeyedStates(self.backend, step.state, key_space, self.residency)
        self.timers = TimerService(
            self.backend,
            key_space,
            lambda: self.engine.held,
            self._firing_sub_groups,
            lambda: self.engine.task,
        )

    def process(
        self, batch: pa.RecordBatch, *, count: bool = True, input: int | None = None
    ) -> list[pa.RecordBatch]:
        """Process the rows whose sub-groups are here; buffer (and fetch) the others.
        ``count=False`` for buffered records released later (their heat was counted already).
        ``input``: which input of a two-input step (None: as tagged when it was buffered)."""
        if len(self.key_specs) == 1:
            input = 0
        elif input is None:
            meta = batch.schema.metadata or {}
            input = int(meta.get(INPUT_META, b"0"))
        else:  # buffered pieces must remember their input
            meta = dict(batch.schema.metadata or {})
            meta[INPUT_META] = str(input).encode()
            batch = batch.replace_schema_metadata(meta)
        spec = self.key_specs[input]
        batch, keys = materialise_key(batch, spec)
        self.key_kind = self.key_kind or key_kind(keys)
        ks = self.key_space
        engine = self.engine
        # outputs name the key after the first input's key, whichever input the batch is
        kb = group_by_key(batch, keys, ks, self.key_column)
        gsg = kb.keys.key_group.astype(np.int64) * ks.sub_groups + kb.keys.sub_group
        if self.track and count:  # heat per distinct key, weighted by its records
            engine.heat.add(gsg, kb.counts)
        if engine.held[gsg].all():  # every key's state is here (always, unless a move runs)
            return self._run_user(kb, input)
        if not self.track:  # migration support off: nothing can be on its way; this raises
            engine.split(kb.keys.keys, gsg, count=False)
        # a migration runs: records of sub-groups not here yet wait, per record, in arrival order
        h = stable_hash(keys)
        sub_group = ks.key_group(h).astype(np.int64) * ks.sub_groups + ks.sub_group(h)
        ready = engine.split(batch, sub_group, count=False)
        if ready is None:
            return []
        keys = materialise_key(ready, spec)[1]
        kb = group_by_key(ready, keys, ks, self.key_column)
        return self._run_user(kb, input)

    def hold_back(self, batch: pa.RecordBatch, *, input: int = 0) -> pa.RecordBatch | None:
        """Old owner at a rescale switch, a batch sent before the barrier and not processed: the
        records of sub-groups this instance hands out are held back by the engine (they go with
        their state); returns the rows that stay here (None: none)."""
        if len(self.key_specs) > 1:  # handed-over pieces must remember their input
            meta = dict(batch.schema.metadata or {})
            meta[INPUT_META] = str(input).encode()
            batch = batch.replace_schema_metadata(meta)
        batch, keys = materialise_key(batch, self.key_specs[input])
        h = stable_hash(keys)
        ks = self.key_space
        sub_group = ks.key_group(h).astype(np.int64) * ks.sub_groups + ks.sub_group(h)
        return self.engine.hold_back(batch, sub_group)  # type: ignore[no-any-return]

    def _run_user(self, kb: KeyedBatch, input: int = 0) -> list[pa.RecordBatch]:
        # the instance holds its watermark while records of moving sub-groups wait, so released
        # records are never behind it (OperatorInstance._advance_watermark)
        kb.watermark = self.watermark
        kb.input = input
        kb.timers = TimerRegistrar(
            self.timers if self.step.on_timer is not None else None, kb.keys, self.step.name
        )
        if self.step.kind == "keyed_batches":
            try:
                out = (
                    self.step.fn(kb, self.states.vectorised())
                    if self.step.state
                    else self.step.fn(kb)
                )
            except Exception as e:
                note_context(e, "batch", _first_key(kb.keys))
                raise
            return _to_batches(out, self.step.name)
        return self._per_key(kb)

    def replace_step(self, step: Step, migrations: dict[str, Any]) -> int:
        """From now on run ``step``'s function (same key, states kept; see
        raystream.reconfigure). Stored values of the states in ``migrations`` are rewritten first
        (old value -> new value); returns the rows rewritten."""
        from raystream.reconfigure import migrate_state_rows

        self.states.release()  # resident states: in RocksDB before it is read; loaded again
        rows = migrate_state_rows(self.backend, self.step.state, step.state, migrations)
        self.step = step
        self.states = KeyedStates(self.backend, step.state, self.key_space, self.residency)
        return rows

    def final_state(self) -> list[pa.RecordBatch]:
        """Each key's state held here as records (a step removed with ``state="emit"``; see
        raystream.state.final)."""
        from raystream.state.final import final_state_batches

        return final_state_batches(
            self.backend,
            self.step.state,
            self.key_column,
            self.key_kind,
            held=self.engine.held,
            sub_groups=self.key_space.sub_groups,
        )

    @property
    def owned_key_groups(self) -> list[int]:
        held = self.engine.held.reshape(-1, self.key_space.sub_groups)
        return np.flatnonzero(held.any(axis=1)).tolist()

    def fresh_backend(self, state_path: str | Path) -> RocksStateBackend:
        """An empty RocksDB for a stop-and-restart restore (swapped in by :meth:`swap_backend`)."""
        return RocksStateBackend(
            state_path, cache_entries=self.cache_entries, cache_bytes=self.cache_bytes
        )

    def swap_backend(self, fresh: RocksStateBackend, key_groups: list[int]) -> None:
        """Stop-and-restart: ``fresh`` (holding exactly ``key_groups``) replaces this instance's
        RocksDB, which is deleted."""
        old = self.backend
        self.states.release(write=False)  # the old DB goes: the restore is the truth
        self.backend = fresh
        self.states = KeyedStates(fresh, self.step.state, self.key_space, self.residency)
        self.engine.backend = fresh
        held = np.zeros_like(self.engine.held)
        s = self.key_space.sub_groups
        for kg in key_groups:
            held[kg * s : (kg + 1) * s] = True
        self.engine.held = held
        self.timers.backend = fresh
        self.timers.reindex()
        old.destroy()

    # ---- timers ---------------------------------------------------------------------------
    def _firing_sub_groups(self) -> np.ndarray:
        """Held sub-groups, less those a running rescale hands out: once the switch began,
        records of those go to their new owner, so their timers fire there."""
        held = self.engine.held
        task = self.engine.task
        if task is None or not task.active or not task.outgoing:
            return held
        mask = held.copy()
        mask[np.fromiter(task.outgoing, np.int64, len(task.outgoing))] = False
        return mask

    def on_watermark(self, watermark: int) -> list[pa.RecordBatch]:
        """The instance's watermark advanced: fire every event-time timer at or before it."""
        self.watermark = watermark
        outs: list[pa.RecordBatch] = []
        if self.states.resident:
            for out in self.states.on_watermark(watermark):
                outs.extend(_to_batches(out, self.step.name))
        return outs + self._fire(EVENT_TIMERS, watermark)

    def fire_processing(self, now_ms: int) -> list[pa.RecordBatch]:
        """Fire processing-time timers at or before ``now_ms`` (wall clock)."""
        return self._fire(PROCESSING_TIMERS, now_ms)

    def next_processing_ms(self) -> int | None:
        """When the next processing-time timer is due (ms since the epoch), or None."""
        if self.step.on_timer is None:
            return None
        return self.timers.next_due(PROCESSING_TIMERS)

    def _fire(self, sid: int, limit_ms: int) -> list[pa.RecordBatch]:
        fn = self.step.on_timer
        if fn is None:
            return []
        outs: list[pa.RecordBatch] = []
        domain = "event" if sid == EVENT_TIMERS else "processing"
        for _ in range(MAX_FIRING_ROUNDS):
            due = self.timers.take_due(sid, limit_ms)
            if due is None:
                return outs
            for keys, ts, keyset in rounds(due):
                fired = FiredTimers(
                    keys,
                    ts,
                    keyset,
                    self.watermark,
                    self.key_column,
                    domain,
                    TimerRegistrar(self.timers, keyset, self.step.name),
                )
                if self.step.kind == "keyed":
                    outs.extend(self._per_key_timers(fired))
                    continue
                try:
                    out = fn(fired, self.states.vectorised()) if self.step.state else fn(fired)
                except Exception as e:
                    note_context(e, "timer", _first_key(keyset))
                    raise
                outs.extend(_to_batches(out, self.step.name))
        msg = (
            f"step {self.step.name!r}: on_timer kept registering timers at or before "
            f"{limit_ms} ({MAX_FIRING_ROUNDS} rounds); register follow-up timers later than "
            "the timer that fires"
        )
        raise StateError(msg)

    def _per_key(self, kb: KeyedBatch) -> list[pa.RecordBatch]:
        names = kb.records.schema.names
        ingest = kb.reduce(INGEST_TS, "min").tolist() if INGEST_TS in names else None
        event = kb.reduce(EVENT_TIME, "max").tolist() if EVENT_TIME in names else None
        events = kb.input_events().tolist() if INGEST_TS in names else None
        return self._per_key_calls(
            self.step.fn, kb.keys, kb.records_of, kb.timers, kb.watermark, ingest, event, events
        )

    def _per_key_timers(self, fired: FiredTimers) -> list[pa.RecordBatch]:
        """on_timer of the per-key form: ``fn(key, timestamp[, state], timers)`` per timer."""
        ts = fired.timestamps.tolist()
        now = [time.time_ns()] * len(ts)
        fn, keyset, timers, wm = self.step.on_timer, fired.keyset, fired.timers, fired.watermark
        return self._per_key_calls(fn, keyset, ts.__getitem__, timers, wm, now, ts, kind="timer")

    def _per_key_calls(
        self,
        fn: Any,
        keyset: KeySet,
        second: Any,
        timers: TimerRegistrar | None,
        watermark: int,
        ingest: list[int] | None,
        event: list[int] | None,
        events: list[int] | None = None,
        *,
        kind: str = "key",
    ) -> list[pa.RecordBatch]:
        """Call ``fn(key, second(i)[, state][, timers])`` per key, state loaded and written back
        in one go; each yielded row gets the key and, unless set, ``ingest``/``event`` times and
        ``events`` (the input events of the key in this batch: every row the key yields for
        them carries that number). An exception of ``fn`` carries the key (``kind``: "key" or
        "timer") for the job's error."""
        has_state = bool(self.step.state)
        timed = self.step.on_timer is not None
        preloaded = self.states.preload(keyset) if has_state else {}
        keys = keyset.keys.to_pylist()
        rows: list[dict[str, Any]] = []
        col = self.key_column
        key = None
        try:
            for i, key in enumerate(keys):
                args = [key, second(i)]
                if has_state:
                    args.append(self.states.handles_for(preloaded, i))
                if timed:
                    assert timers is not None
                    args.append(KeyTimers(timers, i, watermark))
                out = fn(*args)
                for o in out or ():
                    if isinstance(o, tuple) and len(o) == 2:
                        k, v = o
                        o = {col: k, **v} if isinstance(v, dict) else {col: k, "value": v}
                    elif isinstance(o, dict):
                        if col not in o:
                            o = {col: key, **o}
                    else:
                        msg = (
                            f"keyed step {self.step.name!r} must yield dicts or (key, value) "
                            f"tuples, got {type(o).__name__}: {o!r}"
                        )
                        raise SchemaError(msg)
                    if ingest is not None and INGEST_TS not in o:
                        o[INGEST_TS] = ingest[i]
                    if event is not None and EVENT_TIME not in o:
                        o[EVENT_TIME] = event[i]
                    if events is not None and INPUT_EVENTS not in o:
                        o[INPUT_EVENTS] = events[i]
                    rows.append(o)
        except Exception as e:
            note_context(e, kind, key)
            raise
        if has_state:
            self.states.write_back(keyset, preloaded)
        return _rows_to_batch(rows, self.step.name)

    def close(self) -> None:
        self.backend.close()

    def discard(self) -> None:
        """Close the state without writing what is only in memory (the cache, resident states,
        unwritten timers): a recovery that resets this instance deletes its folder next."""
        self.states.release(write=False)
        self.backend.close(write=False)


def make_processor(
    step: Step,
    key_space: KeySpace,
    state_path: str | Path | None,
    owned: Iterable[int] = (),
    *,
    track: bool = True,
    cache_entries: int = 500_000,
    cache_bytes: int = 64 << 20,
    max_pending_bytes: int = 64 << 20,
    heat_half_life_s: float = 10.0,
) -> Any:
    if step.kind in ("map", "filter", "flat_map"):
        return MapProcessor(step)
    if step.kind == "map_batches":
        return MapBatchesProcessor(step)
    if step.kind in ("keyed", "keyed_batches"):
        assert state_path is not None
        return KeyedProcessor(
            step,
            key_space,
            state_path,
            owned,
            track=track,
            cache_entries=cache_entries,
            cache_bytes=cache_bytes,
            max_pending_bytes=max_pending_bytes,
            heat_half_life_s=heat_half_life_s,
        )
    msg = f"no processor for step kind {step.kind!r}"
    raise ConfigError(msg)
