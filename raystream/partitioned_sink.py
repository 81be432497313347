"""Partitioned Parquet output: rows go to Hive-style folders ``col=value/...`` by the values of
partition columns, as Spark's ``partitionBy``, Hive and ``pyarrow.dataset`` write them.

:func:`split_by_partition` splits a batch by its partition columns (vectorised: the columns are
dictionary-encoded, combined into one group code and sorted once) into ``(folder, rows)`` pairs,
the rows without the partition columns. :class:`PartitionedParquetWriter` hands each part to
one :class:`raystream.sinks._ParquetWriter` per folder, so every folder holds part files with
the exactly-once protocol of the unpartitioned sink, and combines their checkpoint states by
folder.

Folder names: ``col=value``, one level per partition column, in ``partition_by`` order. Values
of string, integer, boolean (``true``/``false``) and date (``2015-07-15``) columns (and
dictionary columns of those) can be folder names; a null or empty string becomes
``__HIVE_DEFAULT_PARTITION__``, and the characters Hive escapes (``/ \\ : = % # ? * " ' ^ { [ ]``,
control characters) are written as ``%XX``, so ``21:00`` is the folder ``hm=21%3A00``. Both
``pyarrow.dataset(path, partitioning="hive")`` and DuckDB ``read_parquet(...,
hive_partitioning=true)`` decode them.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raystream.errors import CheckpointError, ConfigError, SchemaError
from raystream.history import PublishedFiles

if TYPE_CHECKING:
    from raystream.part_store import PartStore
    from raystream.sinks import WrittenFile, _ParquetWriter

__all__ = [
    "DEFAULT_PARTITION",
    "PartitionedParquetWriter",
    "check_partition_names",
    "check_partition_schema",
    "folder_name",
    "split_by_partition",
]

DEFAULT_PARTITION = "__HIVE_DEFAULT_PARTITION__"
PARTITION_TYPES = "string, integer, boolean or date (or a dictionary of those)"

# The characters Hive's FileUtils.escapePathName writes as %XX (also Spark's and Flink's).
_ESCAPED = frozenset("\"#%'*/:=?\\\x7f{[]^") | frozenset(chr(c) for c in range(1, 32))


def _partition_type_ok(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return _partition_type_ok(t.value_type)
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_string_view(t)
        or pa.types.is_integer(t)
        or pa.types.is_boolean(t)
        or pa.types.is_date(t)
    )


def check_partition_names(columns: tuple[str, ...], where: str) -> None:
    """:class:`ConfigError` unless ``columns`` are distinct names that can start a folder."""
    if not columns:
        return
    for name in columns:
        if not isinstance(name, str) or not name:
            msg = f"{where}: partition_by expects column names (str), got {name!r}"
            raise ConfigError(msg)
        if name[0] in "._" or any(c in _ESCAPED for c in name):
            msg = (
                f"{where}: partition column {name!r} cannot name a folder: expected a name not "
                "starting with '.' or '_' (readers skip such folders) and without / \\ : = % and "
                "the other characters Hive escapes. Rename the column before the sink."
            )
            raise ConfigError(msg)
    if len(set(columns)) != len(columns):
        msg = f"{where}: partition_by lists a column twice: {list(columns)}"
        raise ConfigError(msg)


def check_partition_schema(schema: pa.Schema, columns: tuple[str, ...], where: str) -> None:
    """:class:`SchemaError` unless every partition column is in ``schema`` with a type that can
    be a folder name, and at least one column is left for the files."""
    missing = [c for c in columns if c not in schema.names]
    if missing:
        msg = (
            f"{where}: partition column(s) {missing} are not in the stream, which has columns "
            f"{schema.names}"
        )
        raise SchemaError(msg)
    for name in columns:
        t = schema.field(name).type
        if not _partition_type_ok(t):
            msg = (
                f"{where}: partition column {name!r} has type {t}; expected {PARTITION_TYPES} "
                "(a value must be a folder name). Format it as a string column before the sink, "
                "as q10 does with DATE_FORMAT."
            )
            raise SchemaError(msg)
    if len(set(schema.names) - set(columns)) == 0:
        msg = (
            f"{where}: every column ({schema.names}) is a partition column; expected at least "
            "one more column for the files"
        )
        raise SchemaError(msg)


def _escape(value: str) -> str:
    if not any(c in _ESCAPED for c in value):
        return value
    return "".join(f"%{ord(c):02X}" if c in _ESCAPED else c for c in value)


def _value_text(value: Any) -> str:
    if value is None or value == "":
        return DEFAULT_PARTITION
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _escape(value)
    if hasattr(value, "isoformat"):  # date
        return value.isoformat()
    return str(value)


def folder_name(columns: tuple[str, ...], values: tuple[Any, ...]) -> str:
    """The relative folder (``dt=2015-07-15/hm=21%3A00``) of one combination of values."""
    return "/".join(f"{c}={_value_text(v)}" for c, v in zip(columns, values, strict=True))


def _codes(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """One int code per row, equal for equal values (nulls share a code of their own)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not pa.types.is_dictionary(column.type):
        column = pc.dictionary_encode(column, null_encoding="encode")
    else:  # an existing dictionary may hold a value twice, and nulls in indices
        column = pc.dictionary_encode(column.dictionary_decode(), null_encoding="encode")
    return np.asarray(column.indices.to_numpy(zero_copy_only=False), dtype=np.int64)


def split_by_partition(
    batch: pa.RecordBatch, columns: tuple[str, ...]
) -> list[tuple[str, pa.RecordBatch]]:
    """``(folder, rows)`` for every combination of the partition ``columns`` in ``batch``, in
    the order of its first row; ``rows`` keep their order and drop the partition columns."""
    if batch.num_rows == 0:
        return []
    names = batch.schema.names
    data = batch.select([n for n in names if n not in columns])
    key = np.zeros(batch.num_rows, dtype=np.int64)
    for name in columns:
        codes = _codes(batch.column(name))
        width = int(codes.max()) + 1
        key = key * width + codes
        _, key = np.unique(key, return_inverse=True)  # back to [0, rows): no overflow
        key = key.astype(np.int64, copy=False)
    parts = []
    if key.min() == key.max():  # one partition (the usual case): no reordering
        firsts = [0]
        slices = [None]
    else:
        order = np.argsort(key, kind="stable")
        ordered = key[order]
        starts = np.concatenate(([0], np.flatnonzero(np.diff(ordered)) + 1))
        ends = np.append(starts[1:], len(order))
        runs = sorted(zip(starts, ends, strict=True), key=lambda se: order[se[0]])
        firsts = [int(order[s]) for s, _ in runs]
        slices = [order[s:e] for s, e in runs]
    for first, rows in zip(firsts, slices, strict=True):
        values = tuple(batch.column(n)[first].as_py() for n in columns)
        part = data if rows is None else data.take(pa.array(rows))
        parts.append((folder_name(columns, values), part))
    return parts


class PartitionedParquetWriter:
    """One sink instance of a partitioned :class:`raystream.sinks.ParquetSink`: a
    ``_ParquetWriter`` per partition folder (every one rolling, so a part can be closed when the
    instance holds too many open). At most ``max_open_partitions`` parts are open at a time:
    over that, the part written least recently is closed (hidden until the next checkpoint
    publishes it, as a rolled part). The checkpoint state is ``{"index", "checkpoint",
    "partitions": {folder: the folder writer's state}}`` (folders with pending parts)."""

    def __init__(
        self,
        store: PartStore,
        index: int,
        columns: tuple[str, ...],
        max_open_partitions: int,
        make_writer: Callable[[PartStore], _ParquetWriter],
        where: str,
    ) -> None:
        self._root = store
        self._index = index
        self._columns = columns
        self._max_open = max_open_partitions
        self._make_writer = make_writer
        self._where = where
        self._writers: dict[str, _ParquetWriter] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()  # open parts, least recent first
        # of folder writers dropped when idle: counted, the newest paths kept
        self._published = PublishedFiles()
        self._written: dict[str, None] = {}  # every folder this instance wrote rows into
        self._schema: pa.Schema | None = None
        self._lock = threading.Lock()  # _writers: commit may run in a thread
        self._touched = False
        self._open = True

    @property
    def slow_commit(self) -> bool:
        """Publishing talks to a remote store: the runtime calls ``commit`` in a thread."""
        return not self._root.local

    @property
    def open_partitions(self) -> int:
        """How many part files are open now (at most ``max_open_partitions``)."""
        with self._lock:
            writers = list(self._writers.values())
        return sum(1 for w in writers if w._writer is not None)

    def _writer_for(self, folder: str) -> _ParquetWriter:
        writer = self._writers.get(folder)
        if writer is None:
            store = self._root.child(folder)
            store.ensure_folder()
            writer = self._make_writer(store)
            with self._lock:
                self._writers[folder] = writer
        return writer

    def write(self, batch: pa.RecordBatch) -> None:
        if not self._open:
            msg = "write was called on a sink writer that is already closed or aborted"
            raise RuntimeError(msg)
        self._touched = True
        if self._schema is None:
            check_partition_schema(batch.schema, self._columns, self._where)
            self._schema = batch.schema
        elif not batch.schema.equals(self._schema, check_metadata=False):
            from raystream.sinks import _conform

            batch = _conform(batch, self._schema, self._where)
        for folder, rows in split_by_partition(batch, self._columns):
            self._writer_for(folder).write(rows)
            self._written[folder] = None
            self._recent[folder] = None
            self._recent.move_to_end(folder)
            while len(self._recent) > self._max_open:
                oldest, _ = self._recent.popitem(last=False)
                self._writers[oldest]._roll()  # closed; published by the next checkpoint

    def pre_commit(self, checkpoint_id: int) -> dict[str, Any]:
        """Close every open part as a pending file of ``checkpoint_id`` (see
        :meth:`pre_commit_deferred`); returns the state."""
        state, upload = self.pre_commit_deferred(checkpoint_id)
        if upload is not None:
            upload()
        return state

    def pre_commit_deferred(
        self, checkpoint_id: int
    ) -> tuple[dict[str, Any], Callable[[], None] | None]:
        """Every folder writer's ``pre_commit_deferred``: the combined state, and one upload
        running theirs (None when none has one)."""
        if not self._open:
            msg = "pre_commit was called on a sink writer that is already closed or aborted"
            raise RuntimeError(msg)
        self._touched = True
        self._drop_idle()
        cid = int(checkpoint_id)
        partitions: dict[str, Any] = {}
        uploads = []
        with self._lock:
            writers = list(self._writers.items())
        for folder, writer in writers:
            state, upload = writer.pre_commit_deferred(cid)
            if state["pending"]:
                partitions[folder] = state
            if upload is not None:
                uploads.append(upload)
        self._recent.clear()
        combined = {"index": self._index, "checkpoint": cid, "partitions": partitions}
        if not uploads:
            return combined, None

        def upload_all() -> None:
            for upload in uploads:
                upload()

        return combined, upload_all

    def _drop_idle(self) -> None:
        """Forget folder writers with nothing open, rolled or pending (keeps their results)."""
        with self._lock:
            for folder, writer in list(self._writers.items()):
                with writer._lock:
                    idle = not (writer._pending or writer._uploads)
                if idle and writer._writer is None and not writer._rolled:
                    with writer._lock:
                        self._published.merge(writer._published)
                    writer._store.close()
                    del self._writers[folder]

    def commit(self, checkpoint_id: int) -> None:
        """Publish, in every folder, the parts pre-committed at ``checkpoint_id`` or before."""
        with self._lock:
            writers = list(self._writers.values())
        for writer in writers:
            writer.commit(checkpoint_id)

    def restore(self, state: dict[str, Any] | None) -> None:
        """Restore every partition folder: publish what ``state`` lists, delete this instance's
        other files written after that checkpoint (in every folder, listed from the store)."""
        if not self._open:
            msg = "restore was called on a sink writer that is already closed or aborted"
            raise RuntimeError(msg)
        if self._touched:
            msg = "restore() must come right after open(), before any write or pre_commit"
            raise RuntimeError(msg)
        self._touched = True
        partitions = (state or {}).get("partitions", {})
        if state is not None and not isinstance(partitions, dict):
            msg = (
                f"{self._where}: the checkpoint state has no 'partitions' map (got "
                f"{sorted(state)}); it was taken by an unpartitioned sink. Restore into the "
                "dataflow the checkpoint was taken from."
            )
            raise CheckpointError(msg)
        prefixes = tuple(f"{c}=" for c in self._columns)
        folders = {
            f
            for f in self._root.folders(len(self._columns))
            if all(p.startswith(c) for p, c in zip(f.split("/"), prefixes, strict=True))
        }
        for folder in sorted(folders | set(partitions)):
            sub = partitions.get(folder)
            if sub is None and state is not None:
                sub = {"index": self._index, "checkpoint": state["checkpoint"], "pending": []}
            self._writer_for(folder).restore(sub)
        self._drop_idle()

    def close(self) -> WrittenFile:
        """End of input: every folder writer's ``close()``; one result for the instance."""
        from raystream.sinks import WrittenFile

        if not self._open:
            msg = "close was called on a sink writer that is already closed or aborted"
            raise RuntimeError(msg)
        self._open = False
        published = PublishedFiles()
        published.merge(self._published)
        with self._lock:
            writers = list(self._writers.values())
        for writer in writers:
            writer.close()
            published.merge(writer._published)
        self._root.close()
        return WrittenFile(
            path=published.last,
            rows=published.rows,
            paths=published.paths,
            partitions=tuple(self._written),
            files=published.files,
        )

    def abort(self) -> None:
        """Drop every folder's parts not pre-committed yet; pending files stay for restore."""
        self._open = False
        with self._lock:
            writers = list(self._writers.values())
        for writer in writers:
            with contextlib.suppress(Exception):
                writer.abort()
        self._root.close()

