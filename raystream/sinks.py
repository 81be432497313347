"""Sinks: where records leave a dataflow.

A sink is a frozen, picklable spec. The runtime calls ``open(index, parallelism)`` in every sink
instance, feeds the writer record batches, and at the end calls ``close()``, whose small
picklable result goes back to the driver (``abort()`` instead when the job fails).

Built-in sinks: :func:`collect` (batches back to the driver as one table), :func:`parquet`
(Parquet part files per instance, published atomically; ``mode="upsert"`` for updating
results, read back with :func:`raystream.read_upsert`) and :func:`null` (counts rows).

With checkpoints, writers commit in two phases (:class:`CommittingSinkWriter`): ``pre_commit`` at
a checkpoint barrier returns a small state the checkpoint keeps, ``commit`` once that checkpoint is
complete publishes, and ``restore`` after a failure publishes what the restored checkpoint had
pre-committed and drops the rest (it is written again when the sources replay).

Example::

    >>> import pyarrow as pa
    >>> writer = collect().open(0, 1)
    >>> writer.write(pa.record_batch({"key": [1, 2]}))
    >>> writer.close().num_rows
    2
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raystream.errors import CheckpointError, ConfigError, SchemaError
from raystream.history import PublishedFiles
from raystream.part_store import PartStore, check_uri, redact
from raystream.partition_commit import PartitionCommit, partition_commit
from raystream.partitioned_sink import (
    PartitionedParquetWriter,
    check_partition_names,
    check_partition_schema,
)
from raystream.upsert import UpsertWriter, check_upsert_spec

__all__ = [
    "CollectSink",
    "CommittingSinkWriter",
    "NullSink",
    "ParquetSink",
    "Sink",
    "SinkWriter",
    "WrittenFile",
    "collect",
    "null",
    "parquet",
    "partition_commit",
]


@runtime_checkable
class SinkWriter(Protocol):
    """Writes the output of one sink instance."""

    def write(self, batch: pa.RecordBatch) -> None: ...

    def close(self) -> Any:
        """Finish; returns a small picklable result for the driver."""
        ...

    def abort(self) -> None:
        """Give up; leaves nothing half-written."""
        ...


@runtime_checkable
class CommittingSinkWriter(SinkWriter, Protocol):
    """A sink writer taking part in checkpoints (two-phase commit). Every built-in writer is one.

    ``pre_commit(checkpoint_id)`` at the barrier: make what was written so far durable but not yet
    visible, and return a small state for the checkpoint. ``commit(checkpoint_id)`` when that
    checkpoint is complete: make visible everything pre-committed at it or before (idempotent).
    ``restore(state)`` right after ``open`` on recovery, with the state of the latest complete
    checkpoint (None if there is none).

    A writer that keeps its output in memory (as :func:`collect`) returns ``{"rows": table}``
    from ``pre_commit``: the rows since its previous pre-commit, which the checkpoint stores;
    ``restore`` then gets ``{"tables": [...]}``. ``{"rows": fn}`` defers building that table:
    ``fn()`` runs in a thread after the barrier went on, while ``write`` goes on, so it must
    only read what later writes leave alone.
    """

    def pre_commit(self, checkpoint_id: int) -> dict[str, Any]: ...

    def commit(self, checkpoint_id: int) -> None: ...

    def restore(self, state: dict[str, Any] | None) -> None: ...


@runtime_checkable
class Sink(Protocol):
    """A frozen, picklable sink spec."""

    def open(self, index: int, parallelism: int) -> SinkWriter: ...

    def describe(self) -> str: ...


def _check_partition(index: int, parallelism: int) -> None:
    if not isinstance(parallelism, int) or isinstance(parallelism, bool) or parallelism < 1:
        msg = f"sink parallelism must be an int >= 1, got {parallelism!r}"
        raise ConfigError(msg)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < parallelism:
        msg = f"sink instance index must be an int in [0, {parallelism}), got {index!r}"
        raise ConfigError(msg)


def _closed_error(what: str) -> RuntimeError:
    return RuntimeError(f"{what} was called on a sink writer that is already closed or aborted")


# --------------------------------------------------------------------------------------------
# collect


@dataclass(frozen=True)
class CollectSink:
    """Keeps every batch; ``close()`` returns them as one :class:`pyarrow.Table`."""

    def open(self, index: int, parallelism: int) -> SinkWriter:
        _check_partition(index, parallelism)
        return _CollectWriter()

    def describe(self) -> str:
        return "collect()"


class _CollectWriter:
    def __init__(self) -> None:
        self._batches: list[pa.RecordBatch] | None = []
        self._restored: list[pa.Table] = []
        self._since = 0  # batches before this index were returned by pre_commit

    def write(self, batch: pa.RecordBatch) -> None:
        if self._batches is None:
            raise _closed_error("write")
        self._batches.append(batch)

    def pre_commit(self, checkpoint_id: int) -> dict[str, Any]:
        """``{"rows": table}``: the rows written since the previous pre-commit (the checkpoint
        stores them; an empty table if none came)."""
        if self._batches is None:
            raise _closed_error("pre_commit")
        new, self._since = self._batches[self._since :], len(self._batches)
        if new:
            return {"rows": _concat_batches(new)}
        schema = self._batches[-1].schema if self._batches else pa.schema([])
        return {"rows": schema.empty_table()}

    def commit(self, checkpoint_id: int) -> None:
        """Nothing to publish: the rows go back to the driver at ``close()``."""

    def restore(self, state: dict[str, Any] | None) -> None:
        """``state = {"tables": [...]}``: the rows of every pre-commit up to the restored
        checkpoint; ``close()`` returns them before the rows written after ``restore``."""
        if self._batches is None:
            raise _closed_error("restore")
        if self._batches or self._restored:
            msg = "restore() must come right after open(), before any write or restore"
            raise RuntimeError(msg)
        tables = (state or {}).get("tables", [])
        self._restored = [t for t in tables if t.num_columns]

    def close(self) -> pa.Table | None:
        """All rows as one table (an empty one if only empty batches came); None if no batch."""
        if self._batches is None:
            raise _closed_error("close")
        batches, self._batches = self._batches, None
        parts = list(self._restored)
        if batches:
            parts.append(_concat_batches(batches))
        if not parts:
            return None
        try:
            return pa.concat_tables(parts)
        except pa.ArrowInvalid as exc:
            msg = (
                f"collect() restored rows with another schema than the new ones ({exc}); "
                "expected one schema. Restore into the dataflow the checkpoint was taken from."
            )
            raise SchemaError(msg) from exc

    def abort(self) -> None:
        self._batches = None


def _concat_batches(batches: list[pa.RecordBatch]) -> pa.Table:
    try:
        return pa.Table.from_batches(batches)
    except pa.ArrowInvalid as exc:
        msg = (
            f"collect() received batches with different schemas ({exc}); expected one schema "
            f"(the first was {batches[0].schema}). Cast the stream before the sink."
        )
        raise SchemaError(msg) from exc


def collect() -> CollectSink:
    """Collect every record; each instance's ``close()`` returns a table (None if it saw no batch).

    Example::

        >>> import pyarrow as pa
        >>> w = collect().open(0, 1)
        >>> w.write(pa.record_batch({"x": [1]})); w.write(pa.record_batch({"x": [2]}))
        >>> w.close().to_pydict()
        {'x': [1, 2]}
    """
    return CollectSink()


# --------------------------------------------------------------------------------------------
# parquet


@dataclass(frozen=True)
class WrittenFile:
    """What a Parquet sink instance published: ``files``, how many files; ``rows``, the rows
    in all of them; ``paths``, the newest ``PUBLISHED_PATHS_KEPT`` (1,000) of those files in
    publishing order (checkpoint parts, then the last part written at ``close()``: every file
    unless a long job published more); ``path``, the last of them (None if it published
    none); ``partitions``, the folders a partitioned sink wrote rows into (relative,
    ``dt=…/hm=…``). ``files`` left out is ``len(paths)``."""

    path: str | None
    rows: int
    paths: tuple[str, ...] = ()
    partitions: tuple[str, ...] = ()
    files: int | None = None

    def __post_init__(self) -> None:
        if self.files is None:
            object.__setattr__(self, "files", len(self.paths))


def _is_string_like(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_binary_like(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)


_KINDS = (
    ("int", pa.types.is_integer),
    ("float", pa.types.is_floating),
    ("decimal", pa.types.is_decimal),
    ("string", _is_string_like),
    ("binary", _is_binary_like),
    ("bool", pa.types.is_boolean),
    ("timestamp", pa.types.is_timestamp),
    ("date", pa.types.is_date),
    ("duration", pa.types.is_duration),
)


def _kind(t: pa.DataType) -> str:
    """A coarse type family: values of one family may be cast into each other, safely."""
    for name, check in _KINDS:
        if check(t):
            return name
    return str(t)


def _conform(batch: pa.RecordBatch, schema: pa.Schema, where: str) -> pa.RecordBatch:
    """``batch`` in ``schema`` (columns reordered by name, types cast within their family)."""
    if batch.schema.equals(schema, check_metadata=False):
        return batch
    expected = schema.names
    if sorted(batch.schema.names) != sorted(expected):
        msg = (
            f"{where}: a batch has columns {batch.schema.names}, expected {expected} "
            "(the columns of the first batch written). Select or rename columns before the sink."
        )
        raise SchemaError(msg)
    arrays = []
    for f in schema:
        col = batch.column(f.name)
        if col.type != f.type:
            if not (pa.types.is_null(col.type) or _kind(col.type) == _kind(f.type)):
                msg = (
                    f"{where}: column {f.name!r} has type {col.type}, expected {f.type} "
                    "(the type in the first batch written). Cast it before the sink."
                )
                raise SchemaError(msg)
            try:
                col = col.cast(f.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                msg = (
                    f"{where}: column {f.name!r} of type {col.type} cannot be cast safely to "
                    f"{f.type} (the type in the first batch written): {exc}. "
                    "Cast it before the sink."
                )
                raise SchemaError(msg) from exc
        arrays.append(col)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


@dataclass(frozen=True)
class ParquetSink:
    """Instance ``i`` writes Parquet part files into directory ``path`` (a local folder, a
    ``pyarrow.fs`` URI such as ``s3://bucket/out``, or a path on ``filesystem``), each through a
    hidden ``.tmp`` file, so a reader of ``path/*.parquet`` never sees a half-written or
    uncommitted part. On an object store the ``.tmp`` and rolled parts stay on the instance's
    local disk, pending parts are hidden objects, and publishing copies them to their visible
    name (see :mod:`raystream.part_store`).

    Without checkpoints an instance writes one ``part-{i:05d}.parquet``, published by ``close()``.
    With checkpoints, ``pre_commit(c)`` turns the open part into a hidden
    ``.part-{i:05d}-{c:08d}.parquet.pending`` and ``commit(c)`` renames it to
    ``part-{i:05d}-{c:08d}.parquet``; rows after the last checkpoint end in
    ``part-{i:05d}.parquet`` at ``close()``. Build it with :func:`parquet`.

    ``mode="upsert"`` writes changes to a table keyed by ``key`` (see :mod:`raystream.upsert`):
    the rows plus ``_change`` and ``_seq``, in the same part files.

    Rolling: with ``max_file_bytes`` and/or ``max_file_s`` an instance closes its open part once
    it holds that many bytes (checked after each batch) or once its first batch is that many
    seconds old (checked before each batch), and starts a new one. Every file's name then ends in
    ``-r{n:04d}`` (the instance's n-th part): ``part-{i:05d}-{c:08d}-r{n:04d}.parquet`` for the
    parts of checkpoint ``c``, ``part-{i:05d}-r{n:04d}.parquet`` for those published at
    ``close()``. A rolled part stays hidden (``.part-{i:05d}-r{n:04d}.parquet.rolled``) until the
    next checkpoint pre-commits it and its commit publishes it, so rolling keeps exactly-once;
    without checkpoints rolled parts are published at ``close()``."""

    path: str
    mode: str = "append"
    key: tuple[str, ...] = ()
    order_by: str | None = None
    kind_column: str | None = None
    max_file_bytes: int | None = None
    max_file_s: float | None = None
    filesystem: pafs.FileSystem | None = field(default=None, compare=False)  # not hashable
    partition_by: tuple[str, ...] = ()
    max_open_partitions: int = 64
    partition_commit: PartitionCommit | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            msg = f"parquet sink path must be a directory path or URI (str), got {self.path!r}"
            raise ConfigError(msg)
        if self.filesystem is not None and not isinstance(self.filesystem, pafs.FileSystem):
            msg = (
                "parquet sink filesystem must be a pyarrow.fs.FileSystem or None, got "
                f"{type(self.filesystem).__name__}"
            )
            raise ConfigError(msg)
        path = os.fspath(self.path)
        if self.filesystem is None:
            path = check_uri(path, "parquet sink")
        object.__setattr__(self, "path", path)
        size, age = self.max_file_bytes, self.max_file_s
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            msg = f"parquet sink max_file_bytes must be an int >= 1 (bytes) or None, got {size!r}"
            raise ConfigError(msg)
        if age is not None and (
            isinstance(age, bool)
            or not isinstance(age, (int, float))
            or not math.isfinite(age)
            or age <= 0
        ):
            msg = f"parquet sink max_file_s must be a number > 0 (seconds) or None, got {age!r}"
            raise ConfigError(msg)
        where = f"parquet({redact(self.path)!r}, mode={self.mode!r})"
        if self.mode == "upsert":
            key = check_upsert_spec(self.key, self.order_by, self.kind_column, where)
            object.__setattr__(self, "key", key)
        elif self.mode == "append":
            if self.key or self.order_by is not None or self.kind_column is not None:
                msg = (
                    f"{where}: key, order_by and kind_column are for mode='upsert'; an append "
                    "sink writes every row as it comes"
                )
                raise ConfigError(msg)
        else:
            msg = f"parquet sink mode must be 'append' or 'upsert', got {self.mode!r}"
            raise ConfigError(msg)
        self._check_partitioning(where)

    def _check_partitioning(self, where: str) -> None:
        cols = self.partition_by
        if isinstance(cols, str) or not isinstance(cols, (tuple, list)):
            msg = f"{where}: partition_by expects a list of column names, got {cols!r}"
            raise ConfigError(msg)
        cols = tuple(cols)
        object.__setattr__(self, "partition_by", cols)
        check_partition_names(cols, where)
        if cols and self.mode == "upsert":
            msg = (
                f"{where}: partition_by is not supported with mode='upsert' (a key's changes "
                "must stay in one folder for read_upsert); partition an append sink, or upsert "
                "into one folder per partition value"
            )
            raise ConfigError(msg)
        cap = self.max_open_partitions
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            msg = f"parquet sink max_open_partitions must be an int >= 1, got {cap!r}"
            raise ConfigError(msg)
        commit = self.partition_commit
        if commit is not None:
            if not isinstance(commit, PartitionCommit):
                msg = (
                    f"{where}: partition_commit expects rs.sinks.partition_commit(...), got "
                    f"{type(commit).__name__}"
                )
                raise ConfigError(msg)
            commit.check_columns(cols, where)

    def check_schema(self, schema: pa.Schema) -> None:
        """:class:`SchemaError` if the stream's ``schema`` cannot be written (with
        ``partition_by``: a partition column missing, or of a type that cannot name a folder)."""
        if self.partition_by:
            check_partition_schema(schema, self.partition_by, self.describe())

    def check_writable(self) -> None:
        """Create the output folder if missing and check it can be written (at the job's start):
        :class:`ConfigError` naming what was expected (a folder, a bucket, credentials)."""
        store = PartStore(self.path, self.filesystem)
        try:
            store.ensure_folder()
        finally:
            store.close()

    def open(self, index: int, parallelism: int) -> SinkWriter:
        _check_partition(index, parallelism)
        store = PartStore(self.path, self.filesystem)
        try:
            store.ensure_folder()
        except BaseException:
            store.close()
            raise
        if self.partition_by:
            size, age = self.max_file_bytes, self.max_file_s
            return PartitionedParquetWriter(
                store,
                index,
                self.partition_by,
                self.max_open_partitions,
                lambda sub: _ParquetWriter(sub, index, size, age, rolling=True),
                redact(self.describe()),
            )
        writer = _ParquetWriter(store, index, self.max_file_bytes, self.max_file_s)
        if self.mode == "append":
            return writer
        if self.order_by is None and parallelism > 1:
            msg = (
                f"{self.describe()} at sink parallelism {parallelism}: without order_by the "
                "sink numbers the changes as they arrive, which orders the changes of a key only "
                "at sink parallelism 1. Give the sink parallelism=1, or order_by a column that "
                "grows with every change of a key (a version kept in keyed state)."
            )
            raise ConfigError(msg)
        return UpsertWriter(writer, self.key, self.order_by, self.kind_column, self.describe())

    def describe(self) -> str:
        roll = "".join(
            f", {n}={v!r}"
            for n, v in (("max_file_bytes", self.max_file_bytes), ("max_file_s", self.max_file_s))
            if v is not None
        )
        if self.filesystem is not None:
            roll += f", filesystem={type(self.filesystem).__name__}"
        if self.partition_by:
            roll += f", partition_by={list(self.partition_by)!r}"
            if self.max_open_partitions != 64:
                roll += f", max_open_partitions={self.max_open_partitions!r}"
            if self.partition_commit is not None:
                roll += f", partition_commit={self.partition_commit.describe()}"
        path = redact(self.path)
        if self.mode == "append":
            return f"parquet({path!r}{roll})"
        extra = "".join(
            f", {n}={v!r}"
            for n, v in (("order_by", self.order_by), ("kind_column", self.kind_column))
            if v is not None
        )
        return f"parquet({path!r}, mode='upsert', key={list(self.key)!r}{extra}{roll})"


# part-<index>.parquet (final), part-<index>-<checkpoint>.parquet (committed), -r<n> before
# .parquet when the sink rolls; with a leading "." and ".pending" (pre-committed), ".rolled"
# (rolled, not pre-committed yet) or ".tmp" (being written) while not visible.
# Groups: 1 hidden, 2 index, 3 checkpoint, 4 roll number, 5 suffix.
_PART = re.compile(r"^(\.?)part-(\d+)(?:-(\d+))?(?:-r(\d+))?\.parquet(\.pending|\.rolled|\.tmp)?$")


class _ParquetWriter:
    def __init__(
        self,
        store: PartStore,
        index: int,
        max_file_bytes: int | None = None,
        max_file_s: float | None = None,
        *,
        rolling: bool = False,
    ) -> None:
        self._store = store
        self._dir = store.uri
        self._index = index
        self._max_bytes = max_file_bytes
        self._max_s = max_file_s
        self._rolling = rolling or max_file_bytes is not None or max_file_s is not None
        self._rolled: list[tuple[int, int]] = []  # (roll number, rows): hidden, not pre-committed
        self._roll_no = 0  # the number of the open part
        self._part_started = 0.0  # monotonic time of the open part's first batch
        self._final = self._file(None)
        self._tmp = store.stage(f".part-{index:05d}.parquet.tmp")
        self._writer: pq.ParquetWriter | None = None
        self._schema: pa.Schema | None = None
        self._part_rows = 0
        self._pending: list[dict[str, Any]] = []  # {"file", "checkpoint", "rows"}, in order
        # every file published: counted, with its rows; the newest PUBLISHED_PATHS_KEPT paths
        self._published = PublishedFiles()
        self._uploads: list[tuple[str, str]] = []  # (local file, pending name) not uploaded yet
        self._lock = threading.Lock()  # pending/published/uploads: commit may run in a thread
        self._upload_lock = threading.Lock()  # uploads run one at a time
        self._touched = False  # written, pre-committed or restored: restore() comes first
        self._open = True
        self._unfinished: str | None = None  # why a part closed in a thread is not complete

    def _file(self, checkpoint_id: int | None, *, pending: bool = False) -> str:
        """The name (in the output folder) of the part of ``checkpoint_id`` (None: the last)."""
        if checkpoint_id is None:
            name = f"part-{self._index:05d}.parquet"
        else:
            name = f"part-{self._index:05d}-{checkpoint_id:08d}.parquet"
        return f".{name}.pending" if pending else name

    def write(self, batch: pa.RecordBatch) -> None:
        if not self._open:
            raise _closed_error("write")
        if self._unfinished is not None:  # fail the instance: the job restarts from a checkpoint
            raise CheckpointError(self._unfinished)
        self._touched = True
        if self._schema is None:
            self._schema = batch.schema
        else:
            where = f"parquet sink {self._store.display(self._final)!r}"
            batch = _conform(batch, self._schema, redact(where))
        if (
            self._max_s is not None
            and self._writer is not None
            and time.monotonic() - self._part_started >= self._max_s
        ):
            self._roll()
        if self._writer is None:
            self._writer = pq.ParquetWriter(self._tmp, self._schema)
            self._part_started = time.monotonic()
        self._writer.write_batch(batch)
        self._part_rows += batch.num_rows
        if self._max_bytes is not None and os.path.getsize(self._tmp) >= self._max_bytes:
            self._roll()

    def _rolled_file(self, roll_no: int) -> str:
        """The local path of a rolled part (staged until a checkpoint or close hands it over)."""
        return self._store.stage(f".part-{self._index:05d}-r{roll_no:04d}.parquet.rolled")

    def _roll(self, *, keep_empty: bool = False) -> None:
        """Close the open part into a hidden rolled file (it waits for a checkpoint or close)."""
        done, rows = self._finish_part(keep_empty=keep_empty)
        if done:
            os.replace(self._tmp, self._rolled_file(self._roll_no))
            self._rolled.append((self._roll_no, rows))
            self._roll_no += 1

    def _finish_part(self, *, keep_empty: bool = False) -> tuple[bool, int]:
        """Close the open part (the .tmp file): (True, rows) if it holds rows (or
        ``keep_empty``), else drop it."""
        if self._writer is None:
            return False, 0
        writer, self._writer = self._writer, None
        rows, self._part_rows = self._part_rows, 0
        try:
            writer.close()
        except BaseException:
            self._remove_tmp()
            raise
        if rows == 0 and not keep_empty:
            self._remove_tmp()
            return False, 0
        return True, rows

    @property
    def slow_commit(self) -> bool:
        """Publishing talks to a remote store: the runtime calls ``commit`` in a thread."""
        return not self._store.local

    def pre_commit(self, checkpoint_id: int) -> dict[str, Any]:
        """Close the open part (if it has rows) as a hidden pending file of ``checkpoint_id``.
        Returns ``{"index", "checkpoint", "pending": [{"file", "checkpoint", "rows"}]}``: every
        file of this instance pre-committed and not committed yet (file names, JSON-able)."""
        state, upload = self.pre_commit_deferred(checkpoint_id)
        if upload is not None:
            upload()
        return state

    def pre_commit_deferred(
        self, checkpoint_id: int
    ) -> tuple[dict[str, Any], Callable[[], None] | None]:
        """:meth:`pre_commit` in two parts: the state (the open part closed, on local disk)
        and, on a remote store, the upload that makes the pending parts durable (None when
        there is none). The runtime runs the upload in a thread while records flow on, and
        acknowledges the checkpoint when it is done; an upload that fails is tried again by the
        next pre-commit."""
        if not self._open:
            raise _closed_error("pre_commit")
        if self._unfinished is not None:
            raise CheckpointError(self._unfinished)
        self._touched = True
        cid = int(checkpoint_id)
        entries: list[dict[str, Any]] = []
        if self._rolling:
            self._roll()
            for roll_no, rows in self._rolled:
                name = f".part-{self._index:05d}-{cid:08d}-r{roll_no:04d}.parquet.pending"
                self._hand_over(self._rolled_file(roll_no), name)
                entries.append({"file": name, "checkpoint": cid, "rows": rows})
            self._rolled = []
        else:
            done, rows = self._finish_part()
            if done:
                pending = self._file(cid, pending=True)
                self._hand_over(self._tmp, pending)
                entries.append({"file": pending, "checkpoint": cid, "rows": rows})
        with self._lock:
            self._pending.extend(entries)
            state = {
                "index": self._index,
                "checkpoint": cid,
                "pending": [dict(p) for p in self._pending],
            }
            uploads = list(self._uploads)
        if not uploads:
            return state, None

        def upload() -> None:
            with self._upload_lock:  # one upload at a time; one still running did its share
                for item in uploads:
                    with self._lock:
                        if item not in self._uploads:
                            continue
                    self._store.put(*item)
                    with self._lock:
                        self._uploads.remove(item)

        return state, upload

    def _hand_over(self, staged: str, name: str) -> None:
        """Pending part ``name`` from local file ``staged``: renamed now on a local folder,
        queued for upload (under a staging name of its own) on a remote store."""
        if self._store.local:
            self._store.put(staged, name)
            return
        own = self._store.stage(name)
        os.replace(staged, own)
        with self._lock:
            self._uploads.append((own, name))

    def pre_commit_split(
        self, checkpoint_id: int
    ) -> tuple[dict[str, Any], Callable[[], None] | None]:
        """:meth:`pre_commit` with its slow part split off, for a caller that goes on writing:
        in a local folder the open part is renamed to its pending name here (its writer keeps
        the open file), and ``finish()`` closes it (its last row group and footer) in a thread
        while :meth:`write` starts a new part; on a remote store ``finish()`` is the upload of
        :meth:`pre_commit_deferred`. The state may be recorded only after ``finish()``
        returned. Rolling parts are closed here, as by :meth:`pre_commit`."""
        if self._unfinished is not None:
            raise CheckpointError(self._unfinished)
        if (
            not self._store.local  # a remote store: the upload is the part split off
            or self._rolling
            or self._writer is None
            or not self._part_rows
            or not self._open
        ):
            return self.pre_commit_deferred(checkpoint_id)
        self._touched = True
        cid = int(checkpoint_id)
        writer, self._writer = self._writer, None
        rows, self._part_rows = self._part_rows, 0
        pending = self._file(cid, pending=True)
        self._store.put(self._tmp, pending)  # a rename: the writer's open file moves with it
        with self._lock:
            self._pending.append({"file": pending, "checkpoint": cid, "rows": rows})
            state = {
                "index": self._index,
                "checkpoint": cid,
                "pending": [dict(p) for p in self._pending],
            }

        def finish() -> None:
            try:
                writer.close()
            except BaseException as exc:
                self._unfinished = (
                    f"parquet sink {self._final!r}: closing part {pending!r} of checkpoint {cid} "
                    f"failed ({exc}); the job must restart from an earlier checkpoint"
                )
                raise

        return state, finish

    def commit(self, checkpoint_id: int) -> None:
        """Publish every file pre-committed at ``checkpoint_id`` or before. Idempotent; a no-op
        after ``close()``."""
        cid = int(checkpoint_id)
        with self._lock:
            ready = [p for p in self._pending if p["checkpoint"] <= cid]
        done = [(self._publish(p), p["rows"]) for p in ready]
        with self._lock:
            self._published.extend(done)
            self._pending = [p for p in self._pending if p["checkpoint"] > cid]

    def _publish(self, entry: dict[str, Any]) -> str:
        """Make one pending file visible under its final name (already done counts as done);
        returns how results name it."""
        name = entry["file"]
        match = _PART.match(name)
        if match is None or match.group(5) != ".pending":
            msg = f"parquet sink state lists {name!r}, which is not a pending part file name"
            raise CheckpointError(msg)
        final = name[1 : -len(".pending")]
        try:
            self._store.publish(name, final)
        except FileNotFoundError:
            if not self._store.exists(final):
                msg = (
                    f"parquet sink: the checkpoint lists {self._store.display(name)!r}, but "
                    f"neither it nor {final!r} is in {self._dir!r}; was the output "
                    "directory changed? Restore from a checkpoint whose files are intact."
                )
                raise CheckpointError(redact(msg)) from None
        return self._store.display(final)

    def restore(self, state: dict[str, Any] | None) -> None:
        """Recover from the checkpoint whose ``pre_commit`` state is ``state`` (None: no
        checkpoint): publish the files it lists (a crash may have come between the checkpoint and
        its commit), then delete every other file of this instance index written after that
        checkpoint: pending and ``.tmp`` files, and parts published without a checkpoint
        (``close()`` of the failed attempt; checkpoint parts numbered above the restored
        checkpoint). Files of other instances and parts committed at the restored checkpoint or
        before are left alone."""
        if not self._open:
            raise _closed_error("restore")
        if self._touched:
            msg = "restore() must come right after open(), before any write or pre_commit"
            raise RuntimeError(msg)
        self._touched = True
        restored = int(state["checkpoint"]) if state else -1
        keep = set()
        for p in (state or {}).get("pending", []):
            path = self._publish(p)
            self._published.add(path, int(p["rows"]))
            keep.add(p["file"][1 : -len(".pending")])
        for name in self._store.names():
            match = _PART.match(name)
            if match is None or int(match.group(2)) != self._index or name in keep:
                continue
            hidden, cid, suffix = match.group(1), match.group(3), match.group(5)
            # Pending or being written (hidden, suffix), or published after the checkpoint.
            if hidden or suffix or cid is None or int(cid) > restored:
                self._store.delete(name)

    def close(self) -> WrittenFile:
        """End of input (a final checkpoint): publish every pending file and the open part."""
        if not self._open:
            raise _closed_error("close")
        if self._unfinished is not None:
            raise CheckpointError(self._unfinished)
        self._open = False
        with self._upload_lock:  # pre-committed, upload not run (or failed)
            for item in list(self._uploads):
                self._store.put(*item)
                self._uploads.remove(item)
        self.commit(1 << 62)
        if self._rolling:
            # only empty batches and nothing else: an empty file still records the schema
            self._roll(keep_empty=not self._published and not self._rolled)
            for roll_no, rows in self._rolled:
                final = f"part-{self._index:05d}-r{roll_no:04d}.parquet"
                self._store.put(self._rolled_file(roll_no), final)
                self._published.add(self._store.display(final), rows)
            self._rolled = []
        # Only empty batches and nothing else published: an empty file still records the schema.
        done, rows = self._finish_part(keep_empty=not self._published)
        if done:
            try:
                self._store.put(self._tmp, self._final)
            except BaseException:
                self._remove_tmp()
                raise
            self._published.add(self._store.display(self._final), rows)
        self._store.close()
        done = self._published
        return WrittenFile(path=done.last, rows=done.rows, paths=done.paths, files=done.files)

    def abort(self) -> None:
        """Drop the parts not pre-committed yet; pending files stay for ``restore``."""
        self._open = False
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
            self._writer = None
        self._remove_tmp()
        for roll_no, _ in self._rolled:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._rolled_file(roll_no))
        self._rolled = []
        self._store.close()

    def _remove_tmp(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._tmp)


def parquet(
    path: str | os.PathLike[str],
    *,
    mode: str = "append",
    key: Sequence[str] = (),
    order_by: str | None = None,
    kind_column: str | None = None,
    max_file_bytes: int | None = None,
    max_file_s: float | None = None,
    filesystem: pafs.FileSystem | None = None,
    partition_by: Sequence[str] = (),
    max_open_partitions: int = 64,
    partition_commit: PartitionCommit | None = None,
) -> ParquetSink:
    """Write Parquet: ``path`` is a directory (a local path, or any ``pyarrow.fs`` URI:
    ``s3://bucket/out``, ``gs://bucket/out``, ``hdfs://host:port/out``, ``file:///abs/out``; or a
    path on ``filesystem``); instance ``i`` writes ``part-{i:05d}.parquet``
    (and, with checkpoints, ``part-{i:05d}-{checkpoint:08d}.parquet`` parts, see
    :class:`ParquetSink`). Read the output as ``path/*.parquet``.

    ``mode="upsert"`` for an updating result: every row is a change to the table keyed by
    ``key`` (column names), written with ``_change`` (``"upsert"``/``"delete"``) and ``_seq``
    (the order of a key's changes: the ``order_by`` column, or the arrival order at a sink of
    parallelism 1). ``kind_column`` names a column of Flink-style kinds (``+I``, ``-U``, ``+U``,
    ``-D``); without it every row is an upsert. Read the final table with
    :func:`raystream.read_upsert` or the DuckDB query in :mod:`raystream.upsert`.

    The schema is the first batch's; later batches may reorder columns or use another type of
    the same family (int32 for int64, large_string for string, ...), which is cast safely;
    other columns or types raise :class:`SchemaError`. An instance that got no batch writes no
    file (empty parts at checkpoints are skipped too). ``close()`` returns a :class:`WrittenFile`.

    ``partition_by=["dt", "hm"]`` writes Hive-style folders ``path/dt=<value>/hm=<value>/``
    holding the parts of the rows with those values, without the partition columns (read them
    back with ``pyarrow.dataset.dataset(path, partitioning="hive")`` or DuckDB
    ``read_parquet('path/**/*.parquet', hive_partitioning=true)``). Partition columns must be
    string, integer, boolean or date columns; null and empty values go to
    ``__HIVE_DEFAULT_PARTITION__``, and the characters Hive escapes (``/``, ``:``, ``=``, ``%``,
    ...) are written as ``%XX`` (see :mod:`raystream.partitioned_sink`). Each instance keeps
    one open part per folder and at most ``max_open_partitions`` open at once (the least
    recently written is closed and published by the next checkpoint); checkpoints publish
    every folder's parts exactly once, as without partitions. Part names always carry a roll
    number (``-r{n:04d}``). Not with ``mode="upsert"``.

    ``partition_commit=rs.sinks.partition_commit("partition-time", time_pattern="$dt $hm:00",
    delay_ms=60_000)`` commits a folder (an empty ``_SUCCESS`` in it, or ``on_commit``) once
    every instance's parts of it are published and the job-wide watermark passed its partition
    time plus the delay; at the end of input every folder written is committed (Flink's
    partition commit; see :mod:`raystream.partition_commit`).

    ``max_file_bytes`` / ``max_file_s`` roll part files by size or age (see
    :class:`ParquetSink`); rolled parts are published by the checkpoint after them, exactly once.
    On a local folder publishing is an atomic rename; on an object store a part appears under
    its visible name only once its checkpoint completed, in one piece (see
    :mod:`raystream.part_store`), so readers see every record once there too. For an
    S3-compatible store that is not AWS, put the endpoint in the URI
    (``s3://bucket/out?endpoint_override=host:9000&scheme=http``); credentials come from the
    environment of every node or from ``s3://KEY:SECRET@bucket/...``. An unknown scheme or a URI
    without a bucket raises :class:`ConfigError` here; a folder that cannot be written (no
    bucket, no credentials) raises it when the job starts.

    Example::

        >>> import tempfile, pyarrow as pa
        >>> w = parquet(tempfile.mkdtemp()).open(0, 1)
        >>> w.write(pa.record_batch({"key": [1, 2]}))
        >>> w.close().rows
        2
        >>> out = tempfile.mkdtemp()
        >>> w = parquet(out, partition_by=["dt"]).open(0, 1)
        >>> w.write(pa.record_batch({"dt": ["2015-07-15", "2015-07-16"], "v": [1, 2]}))
        >>> [os.path.relpath(p, out) for p in w.close().paths]
        ['dt=2015-07-15/part-00000-r0000.parquet', 'dt=2015-07-16/part-00000-r0000.parquet']
    """
    return ParquetSink(
        path=os.fspath(path),
        mode=mode,
        key=tuple(key) if not isinstance(key, str) else key,  # type: ignore[arg-type]
        order_by=order_by,
        kind_column=kind_column,
        max_file_bytes=max_file_bytes,
        max_file_s=max_file_s,
        filesystem=filesystem,
        partition_by=tuple(partition_by) if not isinstance(partition_by, str) else partition_by,  # type: ignore[arg-type]
        max_open_partitions=max_open_partitions,
        partition_commit=partition_commit,
    )


# --------------------------------------------------------------------------------------------
# null


@dataclass(frozen=True)
class NullSink:
    """Drops every record; ``close()`` returns the number of rows seen (for benchmarks)."""

    def open(self, index: int, parallelism: int) -> SinkWriter:
        _check_partition(index, parallelism)
        return _NullWriter()

    def describe(self) -> str:
        return "null()"


class _NullWriter:
    def __init__(self) -> None:
        self.rows = 0

    def write(self, batch: pa.RecordBatch) -> None:
        self.rows += batch.num_rows

    def pre_commit(self, checkpoint_id: int) -> dict[str, Any]:
        """``{"rows": n}``: rows seen up to this checkpoint (restored ones included)."""
        return {"rows": self.rows}

    def commit(self, checkpoint_id: int) -> None:
        """Nothing to publish."""

    def restore(self, state: dict[str, Any] | None) -> None:
        """Count from the rows seen up to the restored checkpoint."""
        self.rows = int(state["rows"]) if state else 0

    def close(self) -> int:
        return self.rows

    def abort(self) -> None:
        pass


def null() -> NullSink:
    """Count rows and drop them; each instance's ``close()`` returns its row count.

    Example::

        >>> import pyarrow as pa
        >>> w = null().open(0, 1)
        >>> w.write(pa.record_batch({"x": [1, 2, 3]}))
        >>> w.close()
        3
    """
    return NullSink()
