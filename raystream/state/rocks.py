"""One RocksDB (rocksdict, raw bytes mode) per keyed operator instance.

The backend speaks bytes; typed access lives in :mod:`raystream.state.handles`. Sub-groups and key
groups are contiguous key ranges (see :mod:`raystream.state.layout`), so moving state is a range
scan on the old owner, a ``WriteBatch`` on the new one and a ``delete_range`` to drop it.
"""

from __future__ import annotations

import collections
import itertools
import operator
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pyarrow as pa
from rocksdict import (
    AccessType,
    BlockBasedOptions,
    Cache,
    Checkpoint,
    IngestExternalFileOptions,
    Options,
    Rdict,
    ReadOptions,
    SstFileWriter,
    WriteBatch,
    WriteOptions,
)

from raystream.errors import StateError
from raystream.state.layout import key_group_bounds, split_prefix, sub_group_bounds

__all__ = [
    "IMPORT_METHODS",
    "STATE_CHUNK_SCHEMA",
    "RocksStateBackend",
    "chunk_payload_bytes",
    "read_snapshot_key_groups",
    "snapshot_chunks",
    "state_db_options",
]

STATE_CHUNK_SCHEMA = pa.schema([("key", pa.binary()), ("value", pa.binary())])
ROW_OVERHEAD = 8  # bytes a state chunk spends per row besides key and value (two int32 offsets)
IMPORT_METHODS = ("write_batch", "sst")


def chunk_payload_bytes(key: bytes, value: bytes) -> int:
    """What one row adds to a state chunk (its Arrow ``nbytes``): key, value, two offsets."""
    return len(key) + len(value) + ROW_OVERHEAD


INFO_LOG_BYTES = 1 << 20  # RocksDB's info LOG rolls at this size ...
INFO_LOG_FILES = 2  # ... and this many of its files are kept (the current one and one old)
MANIFEST_BYTES = 4 << 20  # the MANIFEST is rewritten (compacted) past this size


def state_db_options(block_bytes: int = 0) -> Options:
    """Options for point reads and writes of whole batches of keys, many of them new: bloom
    filters in SST files and in the memtable make a read of a key that is not there cheap (a
    key-count reads every key of a batch, new ones included); small data blocks
    (``BLOCK_BYTES``) make a point read read little. SST files written for a state DB
    (``SstFileWriter``) take these options too: the block size is the file's. ``block_bytes``:
    another data block size (0: ``BLOCK_BYTES``), for comparisons (bench.state_reads)."""
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.increase_parallelism(2)
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)  # 10 bits per key, full (not block-based) filters
    table.set_block_cache(Cache(BLOCK_CACHE_BYTES))
    table.set_block_size(block_bytes or BLOCK_BYTES)
    opts.set_block_based_table_factory(table)
    opts.set_memtable_whole_key_filtering(True)
    opts.set_memtable_prefix_bloom_ratio(0.05)  # of the write buffer, for the memtable's filter
    # RocksDB's info LOG gets ~7.5 KB per checkpoint (flush, compaction, checkpoint lines) and
    # its MANIFEST ~150 B: a checkpoint a second grew each instance's folder ~27 MB an hour
    # without bound (bench.soak); rolled and capped instead (LOG: INFO_LOG_FILES files of
    # INFO_LOG_BYTES at most; MANIFEST: rewritten past MANIFEST_BYTES)
    opts.set_max_log_file_size(INFO_LOG_BYTES)
    opts.set_keep_log_file_num(INFO_LOG_FILES)
    opts.set_max_manifest_file_size(MANIFEST_BYTES)
    return opts


def _open(path: str | Path, **kwargs: object) -> Rdict:
    """Open (or create) the RocksDB in ``path`` with :func:`state_db_options`. The options go in
    for the default column family too: given only DB options, rocksdict reopens an existing DB
    with the column-family options it loads from the DB's OPTIONS file, which cannot hold a
    block cache (so a reopened DB, e.g. a prefilled or restored one, got an 8 MB one)."""
    opts = state_db_options()
    return Rdict(str(path), opts, column_families={"default": opts}, **kwargs)


# RocksDB's data block size (RocksDB's default is 4 KiB): the 1 GB key-count's reads of 1 KB
# values past its write-back cache, replayed on a cold block cache, cost less CPU per key with
# 1 KiB blocks (bench/results/state_reads_1gb.json: python -m bench.state_reads)
BLOCK_BYTES = 1024

# RocksDB's cache of SST blocks, per instance (it fills as blocks are read): the part of a hot
# Zipf head that the write-back cache does not hold stays in it (1M keys x 1 KB, 2 -> 4: see
# bench/results/compare_1gb_meces_bc256.md against compare_1gb_meces_base.md)
BLOCK_CACHE_BYTES = 256 << 20


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


# rows an export reads before it measures them (the first run; later runs grow to the max)
_EXPORT_RUN_ROWS = 64
_EXPORT_MAX_RUN_ROWS = 4096
EXPORT_READAHEAD_BYTES = 2 << 20

# dirty entries a checkpoint thread writes at once (~1 ms of GIL-holding calls)
_SNAPSHOT_SLICE = 512
# a full write-back cache writes this fraction of max_dirty, its oldest dirty entries, at once,
# at most DIRTY_SLICE_MAX (512 entries, ~1 ms; 1/8 of 32,768 stalled a batch for 3-10 ms every
# ~0.5 s at 100k ev/s)
DIRTY_SLICE_FRACTION = 64
DIRTY_SLICE_MAX = 512
# while a checkpoint thread writes the dirty entries it took (with max_dirty = cache_entries,
# up to the whole cache: ~0.5 s for 500k entries), the cache may hold this much more than its
# bounds before a write waits for it (a full cache of dirty entries blocked a batch ~0.57 s)
PENDING_SNAPSHOT_SLACK = 0.5


class RocksStateBackend:
    """RocksDB state of one operator instance, in folder ``path``.

    The WAL is off: durability comes from snapshots (checkpoints), not from the log.

    A bounded write-back cache sits in front of point reads and writes, bounded by entries
    (``cache_entries``; 0 turns it off) and by bytes of keys and values (``cache_bytes``). Range
    operations — scan, export, drop, import — first write the dirty entries to RocksDB and empty
    the cache, so whatever is exported is in RocksDB, and a range that changed below the cache can
    never be read stale. A migration instead evicts only the sub-groups that move
    (:meth:`evict_sub_groups`) and exports them past the cache.

    A snapshot writes the dirty entries and keeps the cache (nothing changed below it). With
    :meth:`snapshot_async` the caller only swaps out the dirty entries with their values (the
    state at that moment, O(1)); writing them, the memtable flush and the RocksDB checkpoint run
    in a thread
    while the caller goes on: later writes stay in the cache until the checkpoint is taken, so
    it holds exactly the state of the moment it was asked for. Anything that must write to
    RocksDB or evict from the cache meanwhile (a cache past its bounds plus
    ``PENDING_SNAPSHOT_SLACK``, a range operation, ``write_direct``) first waits for it.
    """

    _pending: Future[Path] | None = None  # a checkpoint being taken in a thread
    _pending_dirty: dict[bytes, bytes | None] = {}  # noqa: RUF012 - what that thread writes

    def __init__(
        self,
        path: str | Path,
        *,
        cache_entries: int = 500_000,
        cache_bytes: int = 64 << 20,
        # dirty entries that coalesce before a write (hot keys: once); None: as many as the
        # cache holds, so a key is written when it leaves the cache, at a snapshot, a range
        # operation or close (32,768 made a 1M-key Zipf count write each batch's keys again:
        # bench/results/dataplane_thr_*.json)
        max_dirty: int | None = None,
        import_method: str = "write_batch",
    ) -> None:
        if import_method not in IMPORT_METHODS:
            msg = f"import_method must be one of {IMPORT_METHODS}, got {import_method!r}"
            raise StateError(msg)
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 1:
            msg = f"cache_bytes must be an int >= 1, got {cache_bytes!r}"
            raise StateError(msg)
        self.path = Path(path)
        self.cache_entries = cache_entries
        self.cache_bytes = cache_bytes
        self.max_dirty = cache_entries if max_dirty is None else max_dirty
        self.import_method = import_method
        self._cache: dict[bytes, bytes | None] = {}
        # dirty entries with their values (also in the cache): a checkpoint takes them at once
        self._dirty: dict[bytes, bytes | None] = {}
        # bytes put into the cache since it was last measured (an upper bound of its size:
        # overwrites count again); measured exactly, and evicted, when it passes cache_bytes
        self._cache_added = 0
        self._ingested = 0  # SST files ingested (names them)
        self.bytes_restored = 0  # bytes copied in by restore_key_groups
        self.db_reads = 0  # keys multi_get read from RocksDB (not found in the write-back cache)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = _open(self.path)
        # Names checkpoint files of this DB in shared storage: SST names are unique within a DB.
        self.uid = _db_uid(self.path)
        self._write_opt = WriteOptions()
        self._write_opt.disable_wal = True
        self._db.set_write_options(self._write_opt)
        self._closed = False
        # writers that hold rows for RocksDB in memory (timers): see add_pending_writer
        self._pending_writers: list[Callable[[set[bytes] | None], None]] = []

    # ---- point access -------------------------------------------------------------------
    def multi_get(self, keys: list[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        if not self.cache_entries:
            self.db_reads += len(keys)
            return self._db.get(keys)  # type: ignore[no-any-return]
        # whole-list operations in C (map, compress): no Python-level loop per key
        n = len(keys)
        cache = self._cache
        values = list(map(cache.get, keys, itertools.repeat(_MISS, n)))
        missing = list(map(operator.is_, values, itertools.repeat(_MISS, n)))
        if not all(missing):  # the hits move to the end: the cache's order is recency
            hits = list(map(operator.not_, missing))
            held = list(itertools.compress(keys, hits))
            collections.deque(map(cache.pop, held, itertools.repeat(None)), maxlen=0)
            cache.update(zip(held, itertools.compress(values, hits)))
        if any(missing):
            asked = list(itertools.compress(keys, missing))
            wanted = sorted(asked)  # cheap if keys come sorted
            fetched = self._db.get(wanted)
            self.db_reads += len(wanted)
            self._cache.update(zip(wanted, fetched, strict=True))  # misses cached too (None)
            if wanted != asked:  # keys did not come sorted: fetched values in asked order
                fetched = list(map(dict(zip(wanted, fetched, strict=True)).__getitem__, asked))
            # into the misses' places (not a second lookup of every key)
            at = itertools.compress(range(n), missing)
            collections.deque(map(values.__setitem__, at, fetched), maxlen=0)
            self._cache_added += sum(map(len, wanted)) + sum(map(len, filter(None, fetched)))
            self._bound()
        return values  # type: ignore[return-value]

    def get(self, key: bytes) -> bytes | None:
        return self.multi_get([key])[0]

    def track_writes(self) -> None:
        """From now on remember every key written or deleted (:meth:`write`,
        :meth:`write_direct`) until :meth:`take_tracked`: what changed since a snapshot taken
        at this moment (a move copies the files first, then only these keys)."""
        self._tracked = set()

    def discard_cache(self) -> None:
        """Forget the cached entries, dirty ones too, without writing them: for an instance whose
        whole state was handed over (a move), so closing it writes nothing it no longer owns."""
        self.wait_snapshot()
        self._cache.clear()
        self._dirty = {}
        self._cache_added = 0

    def take_tracked(self) -> list[bytes]:
        """The keys written or deleted since :meth:`track_writes`, sorted; tracking stops."""
        tracked, self._tracked = self._tracked, None
        if tracked is None:
            msg = "take_tracked() without track_writes() first: no writes were tracked"
            raise StateError(msg)
        return sorted(tracked)

    _tracked: set[bytes] | None = None

    def write(self, keys: list[bytes], values: list[bytes], deletes: Iterable[bytes] = ()) -> None:
        """Put ``keys[i] = values[i]`` and delete ``deletes`` (atomically in RocksDB, through the
        cache when it is on)."""
        if len(keys) != len(values):
            msg = f"write() got {len(keys)} keys and {len(values)} values; pass one value per key"
            raise ValueError(msg)
        if self._tracked is not None:
            deletes = list(deletes)
            self._tracked.update(keys)
            self._tracked.update(deletes)
        if self.cache_entries:
            # written keys move to the end (order is recency: the oldest entries leave first)
            collections.deque(map(self._cache.pop, keys, itertools.repeat(None)), maxlen=0)
            self._cache.update(zip(keys, values, strict=True))
            self._dirty.update(zip(keys, values, strict=True))
            self._cache_added += sum(map(len, keys)) + sum(map(len, values))
            if deletes:
                deletes = list(deletes)
                self._cache.update(zip(deletes, itertools.repeat(None)))
                self._dirty.update(zip(deletes, itertools.repeat(None)))
                self._cache_added += sum(map(len, deletes))
            self._bound()
            return
        self._write_through(keys, values, deletes)

    def write_direct(
        self, keys: list[bytes], values: list[bytes], deletes: Iterable[bytes] = ()
    ) -> None:
        """Write straight to RocksDB, past the cache: for key ranges that are never read or
        written through the cache (timers), so scanning them needs no cache flush."""
        if self._tracked is not None:
            deletes = list(deletes)
            self._tracked.update(keys)
            self._tracked.update(deletes)
        self._write_through(keys, values, deletes)

    def _write_through(
        self, keys: Iterable[bytes], values: Iterable[bytes | None], deletes: Iterable[bytes] = ()
    ) -> None:
        self.wait_snapshot()
        self._write_through_now(keys, values, deletes)

    def _write_through_now(
        self, keys: Iterable[bytes], values: Iterable[bytes | None], deletes: Iterable[bytes] = ()
    ) -> None:
        wb = WriteBatch(raw_mode=True)
        keys, values = list(keys), list(values)
        if None in values or len(keys) != len(values):
            for k, v in zip(keys, values, strict=True):
                if v is None:
                    wb.delete(k)
                else:
                    wb.put(k, v)
        else:  # puts only: the loop runs in C
            collections.deque(map(wb.put, keys, values), maxlen=0)
        collections.deque(map(wb.delete, deletes), maxlen=0)
        if not wb.is_empty():
            self._db.write(wb, self._write_opt)

    def _bound(self) -> None:
        """Keep the cache bounded without long stalls: dirty entries go to RocksDB in small sorted
        batches once ``max_dirty`` are dirty; when full, the least recently used entries (the
        cache's order: :meth:`multi_get` hits and :meth:`write` move keys to its end) are evicted
        down to a small slice under ``cache_entries``, the dirty ones among them written first
        (the other dirty entries stay dirty). In bytes: once the bytes put in since the last
        measurement pass ``cache_bytes``, the cache is measured, and if it holds more than half
        of ``cache_bytes`` the least recently used entries go until
        it holds half (so a measurement, O(entries), comes at most once per half bound written).
        While a checkpoint is taken in a thread, dirty entries wait in the cache, up to its
        bounds plus ``PENDING_SNAPSHOT_SLACK`` (then the write waits for the checkpoint)."""
        pending = self._pending
        slack = 1 + PENDING_SNAPSHOT_SLACK
        if (
            pending is not None
            and not pending.done()
            and len(self._cache) <= self.cache_entries * slack
            and self._cache_added <= self.cache_bytes * slack
        ):
            return
        # an entry the checkpoint thread still writes is clean here, but must not be evicted
        # before it is in RocksDB
        self.wait_snapshot()
        if len(self._dirty) >= self.max_dirty:
            # the oldest 1/DIRTY_SLICE_FRACTION goes to RocksDB: the write is spread over the
            # batches (about 1 ms each) instead of one long stall per max_dirty writes; the newer
            # entries go on coalescing
            slice_ = max(1, min(self.max_dirty // DIRTY_SLICE_FRACTION, DIRTY_SLICE_MAX))
            self._write_oldest_dirty(len(self._dirty) - self.max_dirty + slice_)
        if len(self._cache) > self.cache_entries:
            # the oldest entries leave, down to a slice under the bound (O(entries evicted));
            # of them, only the dirty ones are written
            cache = self._cache
            slice_ = max(1, min(self.cache_entries // DIRTY_SLICE_FRACTION, DIRTY_SLICE_MAX))
            old = list(itertools.islice(cache, len(cache) - self.cache_entries + slice_))
            self._write_dirty_keys(sorted(filter(self._dirty.__contains__, old)))
            collections.deque(map(cache.__delitem__, old), maxlen=0)
        if self._cache_added > self.cache_bytes:
            self._bound_bytes()

    def size_bytes(self) -> int:
        """Estimated bytes of state: RocksDB's live data and memtables, plus the write-back
        cache (an estimate, cheap to ask for: metrics read it every second)."""
        prop = self._db.property_int_value
        live = prop("rocksdb.estimate-live-data-size") or 0
        mem = prop("rocksdb.cur-size-all-mem-tables") or 0
        return int(live + mem + self.cached_bytes_estimate())

    def cached_bytes_estimate(self, sample: int = 1024) -> int:
        """Bytes of the write-back cache estimated from its first ``sample`` entries (exact when
        it holds no more): O(sample), where measuring is O(entries), tens of ms on the event
        loop for a full cache."""
        cache = self._cache
        n = len(cache)
        if n <= sample:
            return self.cached_bytes()
        head = itertools.islice(cache.items(), sample)
        measured = sum(len(k) + (len(v) if v else 0) for k, v in head)
        return measured * n // sample

    def cached_bytes(self) -> int:
        """Bytes of keys and values in the write-back cache now (measured: O(entries))."""
        cache = self._cache
        return sum(map(len, cache)) + sum(map(len, filter(None, cache.values())))

    def _bound_bytes(self) -> None:
        size = self.cached_bytes()
        half = self.cache_bytes // 2
        if size > half:
            cache = self._cache
            drop = []
            for k, v in cache.items():
                if size <= half:
                    break
                size -= len(k) + (len(v) if v else 0)
                drop.append(k)
            # of the entries that leave, only the dirty ones are written
            self._write_dirty_keys(sorted(filter(self._dirty.__contains__, drop)))
            collections.deque(map(cache.__delitem__, drop), maxlen=0)
        self._cache_added = size

    def _write_oldest_dirty(self, n: int) -> None:
        """Write the ``n`` oldest dirty entries (dicts keep insertion order) to RocksDB."""
        dirty = self._dirty
        if n >= len(dirty):
            self._write_dirty()
            return
        self._write_dirty_keys(sorted(itertools.islice(dirty, n)))

    def _write_dirty_keys(self, keys: list[bytes]) -> None:
        """Write these dirty entries (sorted keys) to RocksDB; then they are clean."""
        if not keys:
            return
        dirty = self._dirty
        self._write_through(keys, list(map(dirty.__getitem__, keys)))
        # only once written (a failed write leaves them dirty); nothing wrote them meanwhile
        collections.deque(map(dirty.pop, keys), maxlen=0)

    def _write_dirty(self) -> None:
        if self._dirty:
            dirty, self._dirty = self._dirty, {}
            keys = sorted(dirty)
            try:
                self._write_through(keys, list(map(dirty.__getitem__, keys)))
            except BaseException:
                dirty.update(self._dirty)  # (a failed checkpoint's entries, newer) still dirty
                self._dirty = dirty
                raise

    def add_pending_writer(self, write: Callable[[set[bytes] | None], None]) -> None:
        """Register ``write(prefixes)``, which writes rows held in memory outside the cache (the
        timers not written yet) to RocksDB: called with None before the whole DB is read or
        copied (cache flush, range scans, snapshots, close), with the 3-byte prefixes of
        sub-groups before they are evicted for an export."""
        self._pending_writers.append(write)

    def _write_pending(self, prefixes: set[bytes] | None) -> None:
        for write in self._pending_writers:
            write(prefixes)

    def flush_cache(self) -> None:
        """Write dirty entries to RocksDB (sorted, one WriteBatch) and empty the cache."""
        self.wait_snapshot()
        self._write_pending(None)
        self._write_dirty()
        self._cache.clear()
        self._cache_added = 0

    def evict_sub_groups(self, sub_groups: Iterable[tuple[int, int]]) -> int:
        """Write the cached dirty entries of these (key group, sub-group)s to RocksDB and evict
        their entries; the rest of the cache stays. One pass over the cache. Returns entries
        evicted. After this, and while no record of them is processed here, they can be exported
        past the cache (:meth:`export_chunk`)."""
        prefixes = {sub_group_bounds(kg, sg)[0] for kg, sg in sub_groups}
        if prefixes:
            self._write_pending(prefixes)
        if not prefixes or not self._cache:
            return 0
        self.wait_snapshot()  # entries a checkpoint thread writes are in RocksDB before they go
        cache = self._cache
        gone = [k for k in cache if k[:3] in prefixes]
        dirty = sorted(k for k in gone if k in self._dirty)
        if dirty:
            self._write_through(dirty, [cache[k] for k in dirty])
            for k in dirty:
                del self._dirty[k]
        for k in gone:
            del cache[k]
        return len(gone)

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

    def export_chunk(
        self, key_group: int, sub_group: int, start: bytes | None, max_bytes: int
    ) -> tuple[pa.RecordBatch, bytes | None]:
        """Rows of one sub-group from key ``start`` on (None: its first key), at most
        ``max_bytes`` of chunk (see :func:`chunk_payload_bytes`; a single larger row comes
        alone), read past the cache (evict the sub-group first: :meth:`evict_sub_groups`).
        Returns the chunk and the key to continue from (None: the sub-group is complete).
        One sub-group of :meth:`export_run`."""
        chunk, _, resume = self.export_run(key_group, sub_group, sub_group, start, max_bytes)
        return chunk, resume

    def export_run(
        self,
        key_group: int,
        first: int,
        last: int,
        start: bytes | None,
        max_bytes: int,
        *,
        alone: bool = True,
    ) -> tuple[pa.RecordBatch, int, bytes | None]:
        """Rows of sub-groups ``first`` .. ``last`` (inclusive) of one key group — one key range,
        read with one RocksDB iterator — from key ``start`` on (None: the first key of
        ``first``; else a key of ``first``), at most ``max_bytes`` of chunk (see
        :func:`chunk_payload_bytes`; with ``alone``, a single larger row comes alone, without
        it the chunk may be empty). Read past the cache (evict the sub-groups first:
        :meth:`evict_sub_groups`).

        Returns ``(chunk, next_sub_group, resume)``: the chunk's rows in key order; every
        sub-group of the run before ``next_sub_group`` is complete; ``resume`` None means the
        whole run is (``next_sub_group == last + 1``), else sub-group ``next_sub_group`` goes on
        from key ``resume``.

        Rows are read in runs (``itertools.islice`` over the iterator) and measured per run with
        numpy; the chunk's columns are built from one joined buffer each. Only reads, so it may
        run in another thread than the one writing other ranges."""
        if max_bytes < 1:
            msg = f"max_bytes must be >= 1, got {max_bytes}"
            raise StateError(msg)
        if not 0 <= first <= last < 256:
            msg = f"a run of sub-groups needs 0 <= first <= last < 256, got {first}..{last}"
            raise StateError(msg)
        lower = sub_group_bounds(key_group, first)[0]
        upper = sub_group_bounds(key_group, last)[1]
        if start is not None and not lower <= start < upper:
            msg = (
                f"resume key {start.hex()} is outside sub-groups {first}..{last} of key group "
                f"{key_group} [{lower.hex()}, {upper.hex()})"
            )
            raise StateError(msg)
        ro = ReadOptions()
        ro.set_iterate_upper_bound(upper)
        # a range read once, leaving: its blocks do not push the staying keys' blocks out of
        # the block cache; read ahead, it is read in order
        ro.fill_cache(False)
        ro.set_readahead_size(EXPORT_READAHEAD_BYTES)
        # rocksdict stops early if the ReadOptions is garbage-collected: `ro` lives until return
        rows = self._db.items(from_key=start or lower, read_opt=ro)
        keys: list[bytes] = []
        values: list[bytes] = []
        key_lens: list[np.ndarray] = []
        value_lens: list[np.ndarray] = []
        size = 2 * 4  # the offsets' closing entries
        run = _EXPORT_RUN_ROWS
        nxt: bytes | None = None
        while True:
            part = list(itertools.islice(rows, run))
            if not part:
                break
            ks, vs = zip(*part, strict=True)
            kl = np.fromiter(map(len, ks), np.int64, len(ks))
            vl = np.fromiter(map(len, vs), np.int64, len(vs))
            cum = np.cumsum(kl + vl + ROW_OVERHEAD)
            fit = int(np.searchsorted(cum, max_bytes - size, side="right"))
            if fit < len(part):
                if fit == 0 and not keys and alone:
                    fit = 1  # a single larger row comes alone
                keys.extend(ks[:fit])
                values.extend(vs[:fit])
                key_lens.append(kl[:fit])
                value_lens.append(vl[:fit])
                if fit < len(part):
                    nxt = ks[fit]
                else:  # the run ended exactly at the bound
                    after = next(rows, None)
                    nxt = after[0] if after is not None else None
                break
            keys.extend(ks)
            values.extend(vs)
            key_lens.append(kl)
            value_lens.append(vl)
            size += int(cum[-1])
            run = min(run * 4, _EXPORT_MAX_RUN_ROWS)
        chunk = _chunk_from(keys, key_lens, values, value_lens)
        if nxt is None:
            return chunk, last + 1, None
        return chunk, split_prefix(nxt)[1], nxt  # resume in the key's sub-group

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

    def import_chunk(self, chunk: pa.RecordBatch | pa.Table, *, method: str | None = None) -> int:
        """Write exported rows (columns key, value) into this instance. Returns the row count.

        The rows' range must not be in the cache: sub-groups arrive here only while not held
        (nothing read or wrote them through the cache since they left, which evicted them).
        ``method``: ``"write_batch"`` or ``"sst"`` (ingest an SST file; rows sorted by key, as
        exports are); default: this backend's ``import_method``."""
        if chunk.schema.names[:2] != ["key", "value"]:
            msg = f"a state chunk needs columns ['key', 'value'], got {chunk.schema.names}"
            raise StateError(msg)
        n = chunk.num_rows
        if not n:
            return 0
        keys = chunk.column(0).to_pylist()
        values = chunk.column(1).to_pylist()
        if (method or self.import_method) == "sst":
            self._ingest_sst(keys, values)
        else:
            self._write_through(keys, values)
        return n

    def _ingest_sst(self, keys: list[bytes], values: list[bytes]) -> None:
        """Write the rows (sorted, distinct keys) to an SST file and ingest it (moved in)."""
        self.wait_snapshot()  # not into a checkpoint being taken
        folder = self.path.parent / f"{self.path.name}.ingest"
        folder.mkdir(exist_ok=True)
        self._ingested += 1
        file = folder / f"{self._ingested}.sst"
        writer = SstFileWriter(options=state_db_options())
        writer.open(str(file))
        try:
            for k, v in zip(keys, values, strict=True):
                writer[k] = v
        finally:
            writer.finish()
        opts = IngestExternalFileOptions()
        opts.set_move_files(True)
        self._db.ingest_external_file([str(file)], opts)
        file.unlink(missing_ok=True)

    def drop_sub_group(self, key_group: int, sub_group: int, *, evicted: bool = False) -> None:
        """Delete one sub-group's keys. ``evicted``: its range is known not to be in the cache
        (:meth:`evict_sub_groups`), so the rest of the cache stays."""
        if not evicted:
            self.flush_cache()
        self.wait_snapshot()  # not out of a checkpoint being taken
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
        """Start a point-in-time copy of this RocksDB into ``directory`` (hard links). Here only
        the dirty entries (with their values) are swapped out, O(1); writing them, the memtable
        flush and the checkpoint run in a thread. Writes made before the future is done stay in
        the cache and are not in the copy."""
        directory = Path(directory)
        if directory.exists():
            msg = f"snapshot directory {directory} already exists; pass a new path"
            raise StateError(msg)
        self.wait_snapshot()
        directory.parent.mkdir(parents=True, exist_ok=True)
        self._write_pending(None)  # timers not written yet: straight to RocksDB, before the copy
        frozen, self._dirty = self._dirty, {}  # the state now (O(1)); the cache goes on
        future: Future[Path] = Future()
        db = self._db
        write = self._write_through_now

        def take() -> None:
            try:
                keys, values = list(frozen), list(frozen.values())
                # in small slices, letting go of the GIL after each: a single large batch is
                # one long call that holds it, and the caller's loop would stall meanwhile
                for i in range(0, len(keys), _SNAPSHOT_SLICE):
                    write(keys[i : i + _SNAPSHOT_SLICE], values[i : i + _SNAPSHOT_SLICE])
                    time.sleep(0)
                db.flush(True)
                Checkpoint(db).create_checkpoint(str(directory))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(e)
            else:
                future.set_result(directory)

        self._pending = future
        self._pending_dirty = frozen
        threading.Thread(target=take, name="rocksdb-snapshot", daemon=True).start()
        return future

    def wait_snapshot(self) -> None:
        """Block until a checkpoint taken in a thread is done (its failure is the waiter's of
        :meth:`snapshot_async`, not raised here; the entries it was to write are dirty again)."""
        pending = self._pending
        if pending is not None:
            if pending.exception() is not None:  # waits
                cache = self._cache  # holds them (nothing is evicted meanwhile), newest values
                for k, v in self._pending_dirty.items():
                    self._dirty.setdefault(k, cache.get(k, v))
            self._pending = None
            self._pending_dirty = {}

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

    def close(self, *, write: bool = True) -> None:
        """Close RocksDB, first writing what is only in memory (the cache's dirty entries, the
        pending writers' rows); ``write=False``: drop that instead (the folder is deleted next,
        e.g. by a recovery that resets the instance). Waits for a checkpoint taken in a thread."""
        if not self._closed:
            if write:
                self.wait_snapshot()
                self.flush_cache()
            else:
                self.discard_cache()  # (waits for the checkpoint thread too)
                self._pending_writers = []
            self._closed = True
            self._db.close()

    def destroy(self) -> None:
        """Close and delete this instance's state folder."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)
        shutil.rmtree(self.path.parent / f"{self.path.name}.ingest", ignore_errors=True)


def _chunk(keys: list[bytes], values: list[bytes]) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array(keys, pa.binary()), pa.array(values, pa.binary())], schema=STATE_CHUNK_SCHEMA
    )


def _binary(items: list[bytes], lens: list[np.ndarray]) -> pa.Array:
    """A binary column of ``items`` (their lengths ``lens``, in pieces): one joined buffer and
    the offsets, without a Python object per row on Arrow's side."""
    n = len(items)
    offsets = np.zeros(n + 1, np.int64)
    if n:
        np.cumsum(np.concatenate(lens), out=offsets[1:])
    if offsets[-1] >= 1 << 31:  # over 2 GiB: beyond binary's int32 offsets, let Arrow say so
        return pa.array(items, pa.binary())
    data = pa.py_buffer(b"".join(items))
    return pa.Array.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(offsets.astype(np.int32)), data]
    )


def _chunk_from(
    keys: list[bytes], key_lens: list[np.ndarray], values: list[bytes], value_lens: list[np.ndarray]
) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [_binary(keys, key_lens), _binary(values, value_lens)], schema=STATE_CHUNK_SCHEMA
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
    src = _open(snapshot_dir, access_type=AccessType.read_only())
    try:
        reader = RocksStateBackend.__new__(RocksStateBackend)
        reader._db = src  # noqa: SLF001 - a read-only view for export_ranges
        reader._cache, reader._dirty = {}, {}
        reader._pending_writers = []
        yield from reader.export_key_groups(key_groups, chunk_bytes=chunk_bytes)
    finally:
        src.close()


def read_snapshot_key_groups(
    snapshot_dir: str | Path, key_groups: Iterable[int], *, chunk_bytes: int = 4 << 20
) -> list[pa.RecordBatch]:
    """:func:`snapshot_chunks` as a list (what a restoring peer receives in one Ray call)."""
    return list(snapshot_chunks(snapshot_dir, key_groups, chunk_bytes=chunk_bytes))
