"""One RocksDB (rocksdict, raw bytes mode) per keyed operator instance.

The backend speaks bytes; typed access lives in :mod:`raystream.state.handles`. Sub-groups and key
groups are contiguous key ranges (see :mod:`raystream.state.layout`), so moving state is a range
scan on the old owner, a ``WriteBatch`` on the new one and a ``delete_range`` to drop it.
"""

from __future__ import annotations

import itertools
import shutil
import threading
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pyarrow as pa
from rocksdict import AccessType, Checkpoint, Options, Rdict, ReadOptions, WriteBatch, WriteOptions

from raystream.errors import StateError
from raystream.state.layout import key_group_bounds, sub_group_bounds

__all__ = ["STATE_CHUNK_SCHEMA", "RocksStateBackend", "read_snapshot_key_groups", "snapshot_chunks"]

STATE_CHUNK_SCHEMA = pa.schema([("key", pa.binary()), ("value", pa.binary())])


def _options() -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.increase_parallelism(2)
    return opts


_MISS = object()

UID_FILE = "RAYSTREAM-UID"  # inside the DB folder; RocksDB ignores files it does not know


def _db_uid(path: Path) -> str:
    """The stable id of the DB in ``path``: made (uuid4 hex) when the DB is created, then read."""
    file = path / UID_FILE
    try:
        uid = file.read_text().strip()
    except FileNotFoundError:
        uid = ""
    if len(uid) != 32:
        uid = uuid.uuid4().hex
        tmp = file.with_name(UID_FILE + ".tmp")
        tmp.write_text(uid)
        tmp.replace(file)
    return uid


class RocksStateBackend:
    """RocksDB state of one operator instance, in folder ``path``.

    The WAL is off: durability comes from snapshots (checkpoints), not from the log.

    A bounded write-back cache sits in front of point reads and writes (``cache_entries``; 0 turns
    it off). Every range operation — scan, export, drop, import — first writes the dirty entries
    to RocksDB and empties the cache, so whatever is exported is in RocksDB, and a range that
    changed below the cache can never be read stale.

    A snapshot writes the dirty entries and keeps the cache (nothing changed below it). With
    :meth:`snapshot_async` the memtable flush and the RocksDB checkpoint run in a thread (RocksDB
    releases the GIL) while the caller goes on: writes stay in the cache until the checkpoint is
    taken, so it holds exactly the state of the moment it was asked for. Anything that must write
    to RocksDB meanwhile (a full cache, a range operation, ``write_direct``) first waits for it.
    """

    _pending: Future[Path] | None = None  # a checkpoint being taken in a thread

    def __init__(
        self, path: str | Path, *, cache_entries: int = 500_000, max_dirty: int = 8192
    ) -> None:
        self.path = Path(path)
        self.cache_entries = cache_entries
        self.max_dirty = max_dirty
        self._cache: dict[bytes, bytes | None] = {}
        self._dirty: set[bytes] = set()
        self.bytes_restored = 0  # bytes copied in by restore_key_groups
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = Rdict(str(self.path), _options())
        # Names checkpoint files of this DB in shared storage: SST names are unique within a DB.
        self.uid = _db_uid(self.path)
        self._write_opt = WriteOptions()
        self._write_opt.disable_wal = True
        self._db.set_write_options(self._write_opt)
        self._closed = False

    # ---- point access -------------------------------------------------------------------
    def multi_get(self, keys: list[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        if not self.cache_entries:
            return self._db.get(keys)  # type: ignore[no-any-return]
        cache = self._cache
        values = [cache.get(k, _MISS) for k in keys]
        missing = [i for i, v in enumerate(values) if v is _MISS]
        if missing:
            fetched = self._db.get(sorted(keys[i] for i in missing))
            found = dict(zip(sorted(keys[i] for i in missing), fetched, strict=True))
            for i in missing:
                values[i] = found[keys[i]]
            cache.update(found)  # misses are cached too (as None)
            self._bound()
        return values  # type: ignore[return-value]

    def get(self, key: bytes) -> bytes | None:
        return self.multi_get([key])[0]

    def write(self, keys: list[bytes], values: list[bytes], deletes: Iterable[bytes] = ()) -> None:
        """Put ``keys[i] = values[i]`` and delete ``deletes`` (atomically in RocksDB, through the
        cache when it is on)."""
        if len(keys) != len(values):
            msg = f"write() got {len(keys)} keys and {len(values)} values; pass one value per key"
            raise ValueError(msg)
        if self.cache_entries:
            self._cache.update(zip(keys, values, strict=True))
            self._dirty.update(keys)
            for k in deletes:
                self._cache[k] = None
                self._dirty.add(k)
            self._bound()
            return
        self._write_through(keys, values, deletes)

    def write_direct(
        self, keys: list[bytes], values: list[bytes], deletes: Iterable[bytes] = ()
    ) -> None:
        """Write straight to RocksDB, past the cache: for key ranges that are never read or
        written through the cache (timers), so scanning them needs no cache flush."""
        self._write_through(keys, values, deletes)

    def _write_through(
        self, keys: Iterable[bytes], values: Iterable[bytes | None], deletes: Iterable[bytes] = ()
    ) -> None:
        self.wait_snapshot()
        wb = WriteBatch(raw_mode=True)
        for k, v in zip(keys, values, strict=True):
            if v is None:
                wb.delete(k)
            else:
                wb.put(k, v)
        for k in deletes:
            wb.delete(k)
        if not wb.is_empty():
            self._db.write(wb, self._write_opt)

    def _bound(self) -> None:
        """Keep the cache bounded without long stalls: dirty entries go to RocksDB in small sorted
        batches; when full, the oldest quarter (dicts keep insertion order) is evicted. While a
        checkpoint is taken in a thread, dirty entries wait in the cache (up to its size)."""
        pending = self._pending
        if pending is not None and not pending.done() and len(self._cache) <= self.cache_entries:
            return
        if len(self._dirty) >= self.max_dirty:
            self._write_dirty()
        if len(self._cache) > self.cache_entries:
            self._write_dirty()
            cache = self._cache
            for k in list(itertools.islice(cache, len(cache) - self.cache_entries * 3 // 4)):
                del cache[k]

    def _write_dirty(self) -> None:
        if self._dirty:
            keys = sorted(self._dirty)
            cache = self._cache
            self._write_through(keys, [cache[k] for k in keys])
            self._dirty.clear()

    def flush_cache(self) -> None:
        """Write dirty entries to RocksDB (sorted, one WriteBatch) and empty the cache."""
        self.wait_snapshot()
        self._write_dirty()
        self._cache.clear()

    def scan(
        self, lower: bytes, upper: bytes, *, flush: bool = True
    ) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) with lower <= key < upper, in key order. ``flush=False`` keeps the
        cache: only for ranges never written through it (see :meth:`write_direct`)."""
        if flush:
            self.flush_cache()
        ro = ReadOptions()
        ro.set_iterate_upper_bound(upper)
        # rocksdict ignores the lower bound unless from_key is given, and stops early if the
        # ReadOptions is garbage-collected: keep `ro` alive in this generator's frame.
        for k, v in self._db.items(from_key=lower, read_opt=ro):
            yield k, v
        del ro

    def scan_prefix(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        upper = _prefix_upper_bound(prefix)
        return self.scan(prefix, upper)

    # ---- sub-groups and key groups ------------------------------------------------------
    def export_ranges(
        self, ranges: Iterable[tuple[bytes, bytes]], *, chunk_bytes: int = 4 << 20
    ) -> Iterator[pa.RecordBatch]:
        """Rows of the given ranges as Arrow chunks of about ``chunk_bytes`` each (bounded)."""
        keys: list[bytes] = []
        values: list[bytes] = []
        size = 0
        for lower, upper in ranges:
            for k, v in self.scan(lower, upper):
                keys.append(k)
                values.append(v)
                size += len(k) + len(v)
                if size >= chunk_bytes:
                    yield _chunk(keys, values)
                    keys, values, size = [], [], 0
        if keys:
            yield _chunk(keys, values)

    def export_sub_group(self, key_group: int, sub_group: int) -> pa.RecordBatch:
        chunks = list(
            self.export_ranges([sub_group_bounds(key_group, sub_group)], chunk_bytes=1 << 62)
        )
        return chunks[0] if chunks else _chunk([], [])

    def export_key_groups(
        self, key_groups: Iterable[int], *, chunk_bytes: int = 4 << 20
    ) -> Iterator[pa.RecordBatch]:
        return self.export_ranges(
            (key_group_bounds(int(g)) for g in key_groups), chunk_bytes=chunk_bytes
        )

    def import_chunk(self, chunk: pa.RecordBatch | pa.Table) -> int:
        """Write exported rows (columns key, value) into this instance. Returns the row count."""
        if chunk.schema.names[:2] != ["key", "value"]:
            msg = f"a state chunk needs columns ['key', 'value'], got {chunk.schema.names}"
            raise StateError(msg)
        self.flush_cache()
        keys = chunk.column(0).to_pylist()
        values = chunk.column(1).to_pylist()
        self._write_through(keys, values)
        return len(keys)

    def drop_sub_group(self, key_group: int, sub_group: int) -> None:
        self.flush_cache()
        lower, upper = sub_group_bounds(key_group, sub_group)
        self._db.delete_range(lower, upper, self._write_opt)

    def drop_key_group(self, key_group: int) -> None:
        self.flush_cache()
        lower, upper = key_group_bounds(key_group)
        self._db.delete_range(lower, upper, self._write_opt)

    def count_rows(self, lower: bytes = b"", upper: bytes = b"\xff\xff\xff\xff") -> int:
        return sum(1 for _ in self.scan(lower, upper))

    # ---- snapshots -------------------------------------------------------------------------
    def snapshot(self, directory: str | Path) -> Path:
        """A consistent point-in-time copy of this instance's RocksDB (hard links, fast)."""
        return self.snapshot_async(directory).result()

    def snapshot_async(self, directory: str | Path) -> Future[Path]:
        """Start a point-in-time copy of this RocksDB into ``directory`` (hard links): the dirty
        entries are written now, the memtable flush and the checkpoint run in a thread. Writes
        made before the future is done stay in the cache and are not in the copy."""
        directory = Path(directory)
        if directory.exists():
            msg = f"snapshot directory {directory} already exists; pass a new path"
            raise StateError(msg)
        self.wait_snapshot()
        directory.parent.mkdir(parents=True, exist_ok=True)
        self._write_dirty()
        future: Future[Path] = Future()
        db = self._db

        def take() -> None:
            try:
                db.flush(True)
                Checkpoint(db).create_checkpoint(str(directory))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(e)
            else:
                future.set_result(directory)

        self._pending = future
        threading.Thread(target=take, name="rocksdb-snapshot", daemon=True).start()
        return future

    def wait_snapshot(self) -> None:
        """Block until a checkpoint taken in a thread is done (its failure is the waiter's of
        :meth:`snapshot_async`, not raised here)."""
        pending = self._pending
        if pending is not None:
            pending.exception()  # waits
            self._pending = None

    def restore_key_groups(self, snapshot_dir: str | Path, key_groups: Iterable[int]) -> int:
        """Copy the given key groups from a snapshot into this instance. Returns rows copied."""
        rows = 0
        for chunk in snapshot_chunks(snapshot_dir, key_groups):
            rows += self.import_chunk(chunk)
            self.bytes_restored += chunk.nbytes
        return rows

    # ---- lifecycle ----------------------------------------------------------------------
    def flush(self) -> None:
        self.flush_cache()
        self._db.flush(True)

    def close(self) -> None:
        if not self._closed:
            self.wait_snapshot()
            self.flush_cache()
            self._closed = True
            self._db.close()

    def destroy(self) -> None:
        """Close and delete this instance's state folder."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)


def _chunk(keys: list[bytes], values: list[bytes]) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array(keys, pa.binary()), pa.array(values, pa.binary())], schema=STATE_CHUNK_SCHEMA
    )


def _prefix_upper_bound(prefix: bytes) -> bytes:
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\xff" * (len(prefix) + 8)
    b[-1] += 1
    return bytes(b)


def snapshot_chunks(
    snapshot_dir: str | Path, key_groups: Iterable[int], *, chunk_bytes: int = 4 << 20
) -> Iterator[pa.RecordBatch]:
    """The rows of ``key_groups`` in a snapshot (opened read-only), as bounded state chunks."""
    snapshot_dir = Path(snapshot_dir)
    if not (snapshot_dir / "CURRENT").exists():
        msg = f"{snapshot_dir} is not a raystream state snapshot (no RocksDB CURRENT file)"
        raise StateError(msg)
    src = Rdict(str(snapshot_dir), _options(), access_type=AccessType.read_only())
    try:
        reader = RocksStateBackend.__new__(RocksStateBackend)
        reader._db = src  # noqa: SLF001 - a read-only view for export_ranges
        reader._cache, reader._dirty = {}, set()
        yield from reader.export_key_groups(key_groups, chunk_bytes=chunk_bytes)
    finally:
        src.close()


def read_snapshot_key_groups(
    snapshot_dir: str | Path, key_groups: Iterable[int], *, chunk_bytes: int = 4 << 20
) -> list[pa.RecordBatch]:
    """:func:`snapshot_chunks` as a list (what a restoring peer receives in one Ray call)."""
    return list(snapshot_chunks(snapshot_dir, key_groups, chunk_bytes=chunk_bytes))
