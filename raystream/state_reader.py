"""A checkpoint's or savepoint's keyed state, read as Arrow tables (no job, no Ray).

As Flink's State Processor API reads a savepoint with the job's state descriptors,
:func:`read_state` takes the dataflow: the step's declared states say how each stored value is
decoded, and the dataflow must fit the checkpoint
(:func:`raystream.checkpoint.storage.check_compatible`). Each instance's RocksDB of the step is
rebuilt from the manifest in a temporary folder (SST files hard-linked on a local disk, copied
from anywhere else), opened read-only, and its rows of the key groups that instance held at the
checkpoint are read by range (``[key_group][sub_group][state_id][user key]``,
:mod:`raystream.state.layout`) and decoded with numpy: int64 keys are fixed width; string and
binary keys are length-prefixed; int/float values are 8 bytes. Every key is checked to hash to
the key group and sub-group it is stored under (a damaged checkpoint, or one of another key
space, is refused). The temporary folders are removed afterwards.

What is read: every declared state (ValueState, ListState, MapState, ResidentState), so the
state of the built-in windows and joins (``raystream.operators``) too, as those operators declare
it (a window's ``ValueState(bytes)`` or ``ResidentState`` comes out as the stored bytes, their
own encoding). Timers (state ids 253 and 254) are read into :attr:`StateTables.timers`: one row
per pending timer (key, ``domain`` ``"event"`` or ``"processing"``, ``timestamp``), as Flink's
reader lists a key's registered event- and processing-time timers. A keyed instance that had
finished before the checkpoint holds no state for its key groups (listed in
:attr:`StateTables.finished_key_groups`); a final checkpoint (taken at the end of input) holds
no keyed state at all and is refused with the ids of the ones that do.
"""

from __future__ import annotations

import itertools
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raystream.errors import CheckpointError, ConfigError, SchemaError
from raystream.keys import KeySpace
from raystream.state.layout import PREFIX_LEN, encode_one, key_group_bounds, sub_group_bounds
from raystream.state.spec import ListState, MapState, StateSpec

__all__ = ["KEY_TYPES", "StateTables", "read_state", "state_tables_of"]

KEY_TYPES = {"int": pa.int64(), "str": pa.string(), "bytes": pa.binary()}
# raystream.runtime.timers' state ids: EVENT_TIMERS, PROCESSING_TIMERS (not imported: the
# reader needs no runtime); a timer's stored key is [prefix][timestamp, 8 bytes][user key]
TIMER_DOMAINS = {254: "event", 253: "processing"}
TIMER_STATE_IDS = frozenset(TIMER_DOMAINS)
_TIMESTAMP_LEN = 8
_SIGN = np.uint64(1 << 63)
_PICKLE_START = 0x80  # pickle protocol 2+ starts with PROTO (0x80): a map key follows a user key
_SCAN_RUN = 4096  # rows taken from a RocksDB iterator at once


@dataclass(frozen=True)
class StateTables(Mapping[str, pa.Table]):
    """The keyed state of one step at one checkpoint: state name -> Arrow table.

    The name is the declared one (``"state"`` for ``state=rs.ValueState(...)``, a single
    unnamed state). Columns: the step's key column (int64, string or binary, as the step's keys),
    then ``value`` for a value, list or resident state (one row per key), or ``map_key`` and
    ``value`` for a map state (one row per key and map key); rows ordered by key (then map key).
    With ``decode=False`` the values (and map keys) are the stored bytes.

    ``timers``: the pending timers, one row each: the key column, ``domain`` (``"event"`` or
    ``"processing"``) and ``timestamp`` (int64 ms), ordered by key, domain and timestamp (a timer
    that had fired before the checkpoint is not there)."""

    step: str
    key_column: str
    checkpoint_id: int
    where: str  # what was read: "checkpoint 7 of job 'x' under /tmp/chk", "savepoint /sp"
    tables: dict[str, pa.Table]
    finished_key_groups: tuple[int, ...] = ()  # held by instances that had ended: no state
    timers: pa.Table | None = None

    def __getitem__(self, name: str) -> pa.Table:
        try:
            return self.tables[name]
        except KeyError:
            msg = f"step {self.step!r} has states {list(self.tables)}, not {name!r}"
            raise KeyError(msg) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self.tables)

    def __repr__(self) -> str:
        rows = ", ".join(f"{n}: {t.num_rows} rows" for n, t in self.tables.items())
        timers = f", timers: {self.timers.num_rows} rows" if self.timers is not None else ""
        return f"StateTables(step={self.step!r}, {self.where}, {rows}{timers})"


def read_state(
    flow: Any,
    step: str,
    *,
    checkpoint_dir: str | None = None,
    checkpoint: int | str = "latest",
    savepoint: str | None = None,
    key: Any = None,
    key_type: str | None = None,
    decode: bool = True,
    work_dir: str | None = None,
) -> StateTables:
    """The keyed state step ``step`` of ``flow`` held at a checkpoint or in a savepoint.

    ``checkpoint_dir``: the job's checkpoint storage (a path or a ``pyarrow.fs`` URI; default:
    where a job without ``checkpoint_dir`` keeps them); ``checkpoint``: ``"latest"`` (the newest
    complete, intact one) or an id. ``savepoint``: a savepoint's folder or URI instead.
    ``key``: read only this key (only its sub-group is scanned, in the one instance that held
    it). ``key_type``: ``"int"``, ``"str"`` or ``"bytes"``; by default it is found from the stored
    keys (the encoding that hashes every key to its stored key group; str if the bytes are all
    UTF-8). ``decode=False``: values and map keys as the stored bytes (for values Arrow cannot
    hold). ``work_dir``: where the temporary RocksDB folders go (default: the system's temp).

    Raises CheckpointError when there is no such checkpoint (saying where it looked), when it
    does not fit the dataflow or is damaged; ConfigError for a step that is not a keyed step
    with state; SchemaError when stored values do not fit the declared states. See the module
    doc for what is and is not read. Example::

        tables = rs.read_state(flow, "count", checkpoint_dir="s3://bucket/chk")
        tables["state"]          # pyarrow.Table: key, value
    """
    st = _keyed_step(flow, step)
    if key_type is not None and key_type not in KEY_TYPES:
        msg = (
            f"key_type must be one of {sorted(KEY_TYPES)} or None (found from the stored keys), "
            f"got {key_type!r}"
        )
        raise ConfigError(msg)
    if key is not None:
        key, key_type = _check_key(key, key_type)
    reader, manifest, where = _open(flow, checkpoint_dir, checkpoint, savepoint)
    from raystream.checkpoint.storage import check_compatible

    check_compatible(
        manifest,
        flow.name,
        {n: s.kind for n, s in flow.steps.items()},
        flow.key_space.num_key_groups,
        flow.key_space.sub_groups,
    )
    kept = getattr(reader, "checkpoints", None)  # a savepoint has one checkpoint only
    parts, finished = _state_parts(
        manifest, step, flow.key_space.num_key_groups, where, kept if callable(kept) else None
    )
    rows = _read_parts(reader, parts, flow.key_space, key, where, work_dir)
    key_column = st.input_keys[0].key_column
    tables, timers = _decode(
        rows,
        st.state,
        flow.key_space,
        key_column,
        key_type=key_type,
        decode=decode,
        key=key,
        where=where,
    )
    return StateTables(
        step=step,
        key_column=key_column,
        checkpoint_id=int(manifest["checkpoint_id"]),
        where=where,
        tables=tables,
        finished_key_groups=tuple(finished),
        timers=timers,
    )


# ---- the step and the checkpoint -----------------------------------------------------------
def _keyed_step(flow: Any, step: str) -> Any:
    from raystream.dataflow import Dataflow

    if not isinstance(flow, Dataflow):
        msg = f"read_state expects the job's rs.Dataflow, got {type(flow).__name__}: {flow!r:.80}"
        raise ConfigError(msg)
    with_state = sorted(n for n, s in flow.steps.items() if s.is_keyed and s.state)
    st = flow.steps.get(step)
    if st is None:
        msg = (
            f"dataflow {flow.name!r} has no step {step!r}; its keyed steps with state: "
            f"{with_state or 'none'}"
        )
        raise ConfigError(msg)
    if not st.is_keyed or not st.state:
        what = f"a {st.kind} step" if not st.is_keyed else "a keyed step without state="
        msg = (
            f"step {step!r} of dataflow {flow.name!r} is {what}: it holds no keyed state; "
            f"keyed steps with state: {with_state or 'none'}"
        )
        raise ConfigError(msg)
    return st


def _check_key(key: Any, key_type: str | None) -> tuple[Any, str]:
    kind = {int: "int", np.int64: "int", str: "str", bytes: "bytes"}.get(type(key))
    if kind is None or (key_type is not None and key_type != kind):
        want = f"a {key_type} key" if key_type else "an int, str or bytes key"
        msg = f"key= expects {want}, got {type(key).__name__}: {key!r:.80}"
        raise ConfigError(msg)
    return (int(key) if kind == "int" else key), kind


def _open(
    flow: Any, checkpoint_dir: str | None, checkpoint: int | str, savepoint: str | None
) -> tuple[Any, dict[str, Any], str]:
    """(reader, manifest, what it is) of the checkpoint or savepoint asked for."""
    from raystream.checkpoint.storage import CheckpointStorage, open_savepoint

    if savepoint is not None:
        if checkpoint_dir is not None or checkpoint not in ("latest", None):
            msg = (
                f"pass either savepoint= ({savepoint!r}) or checkpoint_dir=/checkpoint= "
                f"({checkpoint_dir!r}, {checkpoint!r}), not both"
            )
            raise ConfigError(msg)
        reader, manifest = open_savepoint(savepoint)
        return reader, manifest, f"savepoint {savepoint} (checkpoint {manifest['checkpoint_id']})"
    if checkpoint_dir is None:
        from raystream.checkpointing import default_checkpoint_dir

        checkpoint_dir = default_checkpoint_dir()
    storage = CheckpointStorage(checkpoint_dir, flow.name, probe=False)
    if checkpoint in ("latest", None):
        manifest = storage.latest()
        if manifest is None:
            msg = (
                f"no complete checkpoint of job {flow.name!r} under {storage.root} (looked for "
                f"chk-<id>/_MANIFEST.json there); pass the checkpoint_dir the job used"
            )
            raise CheckpointError(msg)
    else:
        text = str(checkpoint)
        if not text.isdigit():
            msg = f"checkpoint= takes 'latest' or a checkpoint id (an int), got {checkpoint!r}"
            raise ConfigError(msg)
        manifest = storage.load(int(text))
    where = f"checkpoint {manifest['checkpoint_id']} of job {flow.name!r} under {storage.root}"
    return storage, manifest, where


def _state_parts(
    manifest: dict[str, Any],
    step: str,
    num_key_groups: int,
    where: str,
    kept: Callable[[], list[int]] | None = None,
) -> tuple[list[tuple[str, dict[str, Any], list[int]]], list[int]]:
    """The instances of ``step`` with state: (instance, state files, key groups held); and the
    key groups of instances that had finished (no state). Every key group exactly once."""
    parts: list[tuple[str, dict[str, Any], list[int]]] = []
    finished: list[int] = []
    for name, entry in sorted(manifest.get("instances", {}).items()):
        if name.rpartition("/")[0] != step or not isinstance(entry, dict):
            continue
        groups = [int(g) for g in entry.get("key_groups", [])]
        if "state" in entry:
            parts.append((name, entry["state"], groups))
        elif entry.get("finished"):
            finished.extend(groups)
    if not parts and not finished and manifest.get("final"):
        earlier = [c for c in kept() if c < int(manifest["checkpoint_id"])] if kept else []
        msg = (
            f"{where} was taken at the end of input (a final checkpoint): it holds the sinks' "
            "output and no keyed state; read an earlier checkpoint (checkpoint=<id>"
            + (f"; complete ones there: {earlier}" if earlier else "")
            + ")"
        )
        raise CheckpointError(msg)
    covered = sorted(itertools.chain(finished, *(g for _, _, g in parts)))
    if covered != list(range(num_key_groups)):
        missing = sorted(set(range(num_key_groups)) - set(covered))
        twice = sorted({g for g in covered if covered.count(g) > 1})
        msg = (
            f"{where} is damaged: the key groups of step {step!r} are not each held once by its "
            f"instances (missing {missing[:8]}, held twice {twice[:8]}, of {num_key_groups}); "
            "read another checkpoint"
        )
        raise CheckpointError(msg)
    return parts, finished


# ---- reading RocksDB --------------------------------------------------------------------------
def _ranges(groups: list[int], key: Any, key_space: KeySpace) -> list[tuple[bytes, bytes]]:
    """Key ranges to scan: runs of consecutive key groups, or the one sub-group of ``key``."""
    if key is not None:
        kg, sg = key_space.locate(pa.array([key]))
        g, s = int(kg[0]), int(sg[0])
        return [sub_group_bounds(g, s)] if g in set(groups) else []
    out: list[tuple[bytes, bytes]] = []
    for _, run in itertools.groupby(enumerate(sorted(groups)), lambda p: p[1] - p[0]):
        gs = [g for _, g in run]
        out.append((key_group_bounds(gs[0])[0], key_group_bounds(gs[-1])[1]))
    return out


def _read_parts(
    reader: Any,
    parts: list[tuple[str, dict[str, Any], list[int]]],
    key_space: KeySpace,
    key: Any,
    where: str,
    work_dir: str | None,
) -> tuple[pa.Array, pa.Array]:
    """(stored keys, values) of every part's rows in the key groups it held (large_binary)."""
    keys: list[pa.Array] = []
    values: list[pa.Array] = []
    for instance, state, groups in parts:
        ranges = _ranges(groups, key, key_space)
        if not ranges:
            continue
        tmp = Path(tempfile.mkdtemp(prefix="raystream-read-state-", dir=work_dir))
        try:
            path = reader.materialize_state(state, str(tmp / "db"))
            k, v = _scan(path, ranges, f"{where}, instance {instance}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        keys.append(k)
        values.append(v)
    if not keys:
        return pa.array([], pa.large_binary()), pa.array([], pa.large_binary())
    return pa.concat_arrays(keys), pa.concat_arrays(values)


def _scan(path: str, ranges: list[tuple[bytes, bytes]], what: str) -> tuple[pa.Array, pa.Array]:
    from rocksdict import AccessType, ReadOptions

    from raystream.state.rocks import _open as open_db

    try:
        db = open_db(path, access_type=AccessType.read_only())
    except Exception as exc:  # rocksdict raises plain exceptions for a corrupt DB
        msg = f"{what}: its RocksDB cannot be opened ({exc}); the checkpoint is damaged"
        raise CheckpointError(msg) from exc
    keys: list[bytes] = []
    values: list[bytes] = []
    try:
        for lower, upper in ranges:
            ro = ReadOptions()
            ro.set_iterate_upper_bound(upper)
            ro.fill_cache(False)
            # rocksdict stops early if the ReadOptions is garbage-collected: `ro` lives on here
            rows = db.items(from_key=lower, read_opt=ro)
            while part := list(itertools.islice(rows, _SCAN_RUN)):
                ks, vs = zip(*part, strict=True)
                keys.extend(ks)
                values.extend(vs)
            del rows, ro
    except CheckpointError:
        raise
    except Exception as exc:
        msg = f"{what}: reading its RocksDB failed ({exc}); the checkpoint is damaged"
        raise CheckpointError(msg) from exc
    finally:
        db.close()
    return pa.array(keys, pa.large_binary()), pa.array(values, pa.large_binary())


# ---- decoding (no RocksDB, no storage: testable on its own) --------------------------------
def _buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(data bytes, offsets int64) of a large_binary array (offset-free: offsets from 0)."""
    arr = pa.concat_arrays([arr]) if arr.offset else arr  # a slice: copied to start at 0
    offsets = np.frombuffer(arr.buffers()[1], np.int64)[: len(arr) + 1]
    data_buf = arr.buffers()[2]
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.empty(0, np.uint8)
    return data, offsets


def _gather(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """A large_binary array of ``data[starts[i] : starts[i] + lengths[i]]``, vectorised."""
    n = len(starts)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    idx = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    out = data[idx] if len(idx) else np.empty(0, np.uint8)
    return pa.Array.from_buffers(
        pa.large_binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(out.tobytes())]
    )


def _u32(data: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Big-endian u32 at each offset ``at`` (callers check it is in bounds)."""
    b = data[at[:, None] + np.arange(4)].astype(np.int64)
    return (b[:, 0] << 24) | (b[:, 1] << 16) | (b[:, 2] << 8) | b[:, 3]


def _int_keys(data: np.ndarray, starts: np.ndarray) -> np.ndarray:
    raw = data[starts[:, None] + PREFIX_LEN + np.arange(8)] if len(starts) else np.empty((0, 8))
    u = np.ascontiguousarray(raw, np.uint8).view(">u8").ravel().astype(np.uint64)
    return (u ^ _SIGN).view(np.int64)


@dataclass
class _Rows:
    """The stored rows of one state, split into their parts (vectorised)."""

    data: np.ndarray  # the keys' bytes
    starts: np.ndarray  # where each row's key starts in data
    lengths: np.ndarray  # each row's key length
    key_group: np.ndarray
    sub_group: np.ndarray
    values: pa.Array  # large_binary
    is_map: bool

    def take(self, mask: np.ndarray) -> _Rows:
        return _Rows(
            self.data,
            self.starts[mask],
            self.lengths[mask],
            self.key_group[mask],
            self.sub_group[mask],
            self.values.filter(pa.array(mask)),
            self.is_map,
        )

    def fits(self, kind: str) -> np.ndarray:
        """Per row: whether its key can be a user key of ``kind`` ('int' or 'str')."""
        body = self.lengths - PREFIX_LEN
        if kind == "int":
            if not self.is_map:
                return body == 8
            ok = body > 8
            ok[ok] = self.data[self.starts[ok] + PREFIX_LEN + 8] == _PICKLE_START
            return ok
        ok = body >= 4
        end = np.zeros(len(body), np.int64)
        end[ok] = 4 + _u32(self.data, self.starts[ok] + PREFIX_LEN)
        if not self.is_map:
            return ok & (end == body)
        ok &= end < body
        ok[ok] = self.data[self.starts[ok] + PREFIX_LEN + end[ok]] == _PICKLE_START
        return ok

    def user_keys(self, kind: str) -> tuple[pa.Array, np.ndarray]:
        """(the keys as Arrow, where each key ends in its row: the map key follows); decoded
        once per kind."""
        cache = self.__dict__.setdefault("_decoded", {})
        if kind not in cache:
            cache[kind] = self._user_keys(kind)
        return cache[kind]  # type: ignore[no-any-return]

    def _user_keys(self, kind: str) -> tuple[pa.Array, np.ndarray]:
        if kind == "int":
            return pa.array(_int_keys(self.data, self.starts)), np.full(
                len(self.starts), PREFIX_LEN + 8, np.int64
            )
        n = _u32(self.data, self.starts + PREFIX_LEN) if len(self.starts) else np.zeros(0, np.int64)
        arr = _gather(self.data, self.starts + PREFIX_LEN + 4, n)
        return arr, PREFIX_LEN + 4 + n  # the bytes (a str key's UTF-8): see _as_kind

    def hashes_match(self, keys: pa.Array, key_space: KeySpace) -> np.ndarray:
        from raystream.keys import to_key_array

        if not len(keys):
            return np.zeros(0, bool)
        arr = keys.cast(pa.binary()) if pa.types.is_large_binary(keys.type) else keys
        if pa.types.is_large_string(arr.type):
            arr = arr.cast(pa.string())
        kg, sg = key_space.locate(to_key_array(arr))
        return (kg == self.key_group) & (sg == self.sub_group)  # type: ignore[no-any-return]


def _split(keys: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    data, offsets = _buffers(keys)
    starts = offsets[:-1]
    lengths = np.diff(offsets)
    return data, starts, lengths


def _kind_of(
    states: list[_Rows], key_type: str | None, key_space: KeySpace, where: str
) -> str:
    """The user keys' encoding: ``key_type`` if given (checked), else the one every row fits
    and whose hash gives every row's key group and sub-group (strings and binaries hash alike:
    str if every key is UTF-8)."""
    rows = [r for r in states if len(r.starts)]
    if not rows:
        return key_type or "int"
    families = [key_type if key_type != "bytes" else "str"] if key_type else ["int", "str"]
    for family in families:
        if not all(r.fits(family).all() for r in rows):
            continue
        decoded = [r.user_keys(family)[0] for r in rows]
        if all(r.hashes_match(k, key_space).all() for r, k in zip(rows, decoded, strict=True)):
            if family == "int":
                return "int"
            if key_type is not None:
                return key_type
            return "str" if all(_utf8(k) for k in decoded) else "bytes"
    what = f"{key_type} keys" if key_type else "int64 keys nor as string or binary keys"
    msg = (
        f"{where}: its stored keys do not decode as {what} that hash to the key groups they are "
        "stored under; the checkpoint is damaged, it was taken with another num_key_groups/"
        "sub_groups, or the step's states differ from the job's (a MapState where it had a "
        "ValueState, or the reverse)"
    )
    raise CheckpointError(msg)


def _utf8(arr: pa.Array) -> bool:
    try:
        arr.cast(pa.large_string())
    except pa.ArrowInvalid:
        return False
    return True


def _as_kind(keys: pa.Array, kind: str, where: str) -> pa.Array:
    try:
        return keys.cast(KEY_TYPES[kind])
    except pa.ArrowInvalid as exc:
        msg = f"{where}: stored keys are not valid {kind} keys ({exc}); pass key_type='bytes'"
        raise SchemaError(msg) from exc


def _only_key(rows: _Rows, key: Any, kind: str, state_id: int, key_space: KeySpace) -> _Rows:
    """The rows of ``key`` alone: its exact stored key (a map state's entries: that key, then
    the pickled map key)."""
    kg, sg = key_space.locate(pa.array([key], KEY_TYPES[kind]))
    enc = np.frombuffer(encode_one(int(kg[0]), int(sg[0]), state_id, key), np.uint8)
    ok = rows.lengths > len(enc) if rows.is_map else rows.lengths == len(enc)
    idx = np.flatnonzero(ok)
    if len(idx):
        ok[idx] = (rows.data[rows.starts[idx, None] + np.arange(len(enc))] == enc).all(axis=1)
    return rows.take(ok)


def _rows_of(values: pa.Array, data_split: Any, mask: np.ndarray, is_map: bool) -> _Rows:
    data, starts, lengths = data_split
    kg = (data[starts[mask]].astype(np.int64) << 8) | data[starts[mask] + 1]
    return _Rows(
        data=data,
        starts=starts[mask],
        lengths=lengths[mask],
        key_group=kg.astype(np.uint16),
        sub_group=data[starts[mask] + 2],
        values=values.filter(pa.array(mask)),
        is_map=is_map,
    )


def state_tables_of(
    rows: tuple[pa.Array, pa.Array],
    specs: dict[str, StateSpec],
    key_space: KeySpace,
    key_column: str,
    *,
    key_type: str | None = None,
    decode: bool = True,
    key: Any = None,
    where: str = "the state",
) -> dict[str, pa.Table]:
    """Decode stored rows (keys, values: large_binary) of one keyed step into one table per
    declared state (see :class:`StateTables`). Rows of timers are left out (:func:`read_state`
    reads them into ``StateTables.timers``); a row of a state id the step does not declare is an
    error (the dataflow declares other states than the job's)."""
    return _decode(
        rows,
        specs,
        key_space,
        key_column,
        key_type=key_type,
        decode=decode,
        key=key,
        where=where,
    )[0]


def _decode(
    rows: tuple[pa.Array, pa.Array],
    specs: dict[str, StateSpec],
    key_space: KeySpace,
    key_column: str,
    *,
    key_type: str | None,
    decode: bool,
    key: Any,
    where: str,
) -> tuple[dict[str, pa.Table], pa.Table]:
    """The declared states' tables and the timers' table (see :class:`StateTables`)."""
    keys, values = rows
    split = _split(keys)
    data, starts, lengths = split
    if len(lengths) and int(lengths.min()) < PREFIX_LEN:
        msg = f"{where} is damaged: a stored key of {int(lengths.min())} bytes has no prefix"
        raise CheckpointError(msg)
    sid = data[starts + 3] if len(starts) else np.zeros(0, np.uint8)
    ids = {name: i + 1 for i, name in enumerate(specs)}
    stray = set(np.unique(sid).tolist()) - set(ids.values()) - TIMER_STATE_IDS
    if stray:
        msg = (
            f"{where} holds rows of state ids {sorted(stray)} and the step declares "
            f"{len(specs)} state(s) {list(ids)} (ids 1..{len(specs)}, in declaration order); "
            "read it with the dataflow the job ran (the same state= declarations)"
        )
        raise SchemaError(msg)
    per_state = {
        name: _rows_of(values, split, sid == i, isinstance(specs[name], MapState))
        for name, i in ids.items()
    }
    if key is not None:
        if key_type is None:
            msg = "state_tables_of(key=...) needs key_type= ('int', 'str' or 'bytes')"
            raise ConfigError(msg)
        per_state = {
            name: _only_key(r, key, key_type, ids[name], key_space)
            for name, r in per_state.items()
        }
    timer_rows = {sid_: _timer_rows(values, split, sid == sid_, where) for sid_ in TIMER_DOMAINS}
    kind = _kind_of([*per_state.values(), *timer_rows.values()], key_type, key_space, where)
    out: dict[str, pa.Table] = {}
    for name, spec in specs.items():
        r = per_state[name]
        user_keys, ends = r.user_keys(kind)
        user_keys = _as_kind(user_keys, kind, where)
        columns: dict[str, pa.Array] = {key_column: user_keys}
        value_col = "value" if key_column not in ("value", "map_key") else "state_value"
        if isinstance(spec, MapState):
            map_col = "map_key" if key_column != "map_key" else "state_map_key"
            rest = r.lengths - ends
            stored = _gather(r.data, r.starts + ends, rest).cast(pa.binary())
            columns[map_col] = stored if not decode else _objects(stored, name, where, "map key")
        columns[value_col] = _values(r.values, spec, decode, name, where)
        table = pa.table(columns)
        out[name or "state"] = _sorted(table, key_column)
    return out, _timers_table(timer_rows, kind, key_column, key, where)


def _timer_rows(values: pa.Array, data_split: Any, mask: np.ndarray, where: str) -> _Rows:
    """The rows of one timer domain, their starts moved past the timestamp (so the user key
    decodes as a state row's does; the key group and sub-group are read before the move)."""
    r = _rows_of(values, data_split, mask, is_map=False)
    if len(r.lengths) and int(r.lengths.min()) < PREFIX_LEN + _TIMESTAMP_LEN:
        msg = f"{where} is damaged: a stored timer of {int(r.lengths.min())} bytes has no timestamp"
        raise CheckpointError(msg)
    return _Rows(
        r.data,
        r.starts + _TIMESTAMP_LEN,
        r.lengths - _TIMESTAMP_LEN,
        r.key_group,
        r.sub_group,
        r.values,
        is_map=False,
    )


def _timers_table(
    timer_rows: dict[int, _Rows], kind: str, key_column: str, key: Any, where: str
) -> pa.Table:
    """One row per stored timer: key, domain, timestamp (ordered by them; ``timer_domain`` and
    ``timer_timestamp`` when the key column has one of those names)."""
    clash = key_column in ("domain", "timestamp")
    dom_col, ts_col = ("timer_domain", "timer_timestamp") if clash else ("domain", "timestamp")
    parts = []
    for sid, r in timer_rows.items():
        user_keys, _ = r.user_keys(kind)
        # the timestamp: the 8 bytes right after the prefix (before the move in _timer_rows)
        ts = _int_keys(r.data, r.starts - _TIMESTAMP_LEN)
        domain = pa.array([TIMER_DOMAINS[sid]] * len(ts), pa.string())
        parts.append(
            pa.table(
                {key_column: _as_kind(user_keys, kind, where), dom_col: domain, ts_col: ts}
            )
        )
    table = pa.concat_tables(parts)
    if key is not None:
        table = table.filter(pc.equal(table.column(key_column), pa.scalar(key, KEY_TYPES[kind])))
    return table.sort_by([(key_column, "ascending"), (dom_col, "ascending"), (ts_col, "ascending")])


def _values(stored: pa.Array, spec: StateSpec, decode: bool, name: str, where: str) -> pa.Array:
    stored_bin = stored.cast(pa.binary())
    if not decode:
        return stored_bin
    codec = spec.codec
    if codec.raw:  # ValueState(bytes), ResidentState: the stored bytes are the value
        return stored_bin
    if codec.numpy_dtype is not None:
        data, offsets = _buffers(stored)
        sizes = np.diff(offsets)
        if len(sizes) and not (sizes == 8).all():
            bad = int(sizes[sizes != 8][0])
            msg = (
                f"{where}: state {name or 'state'!r} is declared {spec!r} (8-byte values) and "
                f"holds a value of {bad} bytes; read it with the state declarations the job ran "
                "(or decode=False for the stored bytes)"
            )
            raise SchemaError(msg)
        return pa.array(data[offsets[0] : offsets[-1]].view(codec.numpy_dtype))
    what = "list" if isinstance(spec, ListState) else "value"
    return _objects(stored_bin, name, where, what)


def _objects(stored: pa.Array, name: str, where: str, what: str) -> pa.Array:
    """Pickled values (one call per row) as one Arrow column."""
    try:
        objs = list(map(pickle.loads, stored.to_pylist()))
    except Exception as exc:
        msg = (
            f"{where}: a stored {what} of state {name or 'state'!r} cannot be unpickled ({exc}); "
            "read it where its classes import, or with decode=False for the stored bytes"
        )
        raise SchemaError(msg) from exc
    try:
        return pa.array(objs)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        first = objs[0] if objs else None
        msg = (
            f"{where}: the {what}s of state {name or 'state'!r} do not fit one Arrow column "
            f"({exc}; first: {first!r:.80}); read them with decode=False (the pickled bytes)"
        )
        raise SchemaError(msg) from exc


def _sorted(table: pa.Table, key_column: str) -> pa.Table:
    if not table.num_rows:
        return table
    order = [(key_column, "ascending")]
    if "map_key" in table.column_names:
        t = table.schema.field("map_key").type
        if pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_floating(t):
            order.append(("map_key", "ascending"))
    return table.sort_by(order)

