"""Sinks: where records leave a dataflow.

A sink is a frozen, picklable spec. The runtime calls ``open(index, parallelism)`` in every sink
instance, feeds the writer record batches, and at the end calls ``close()``, whose small
picklable result goes back to the driver (``abort()`` instead when the job fails).

Built-in sinks: :func:`collect` (batches back to the driver as one table), :func:`parquet`
(one Parquet file per instance, written atomically) and :func:`null` (counts rows; benchmarks).

Example::

    >>> import pyarrow as pa
    >>> writer = collect().open(0, 1)
    >>> writer.write(pa.record_batch({"key": [1, 2]}))
    >>> writer.close().num_rows
    2
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa
import pyarrow.parquet as pq

from raystream.errors import ConfigError, SchemaError

__all__ = [
    "CollectSink",
    "NullSink",
    "ParquetSink",
    "Sink",
    "SinkWriter",
    "WrittenFile",
    "collect",
    "null",
    "parquet",
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

    def write(self, batch: pa.RecordBatch) -> None:
        if self._batches is None:
            raise _closed_error("write")
        self._batches.append(batch)

    def close(self) -> pa.Table | None:
        """All rows as one table (an empty one if only empty batches came); None if no batch."""
        if self._batches is None:
            raise _closed_error("close")
        batches, self._batches = self._batches, None
        if not batches:
            return None
        try:
            return pa.Table.from_batches(batches)
        except pa.ArrowInvalid as exc:
            msg = (
                f"collect() received batches with different schemas ({exc}); expected one schema "
                f"(the first was {batches[0].schema}). Cast the stream before the sink."
            )
            raise SchemaError(msg) from exc

    def abort(self) -> None:
        self._batches = None


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
    """What a Parquet sink instance wrote: the file (None if it got no batch) and its rows."""

    path: str | None
    rows: int


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
    """Instance ``i`` writes ``{path}/part-{i:05d}.parquet`` (through a ``.tmp`` file renamed
    on close, so a reader never sees a half-written part). Build it with :func:`parquet`."""

    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            msg = f"parquet sink path must be a directory path (str), got {self.path!r}"
            raise ConfigError(msg)
        object.__setattr__(self, "path", os.fspath(self.path))

    def open(self, index: int, parallelism: int) -> SinkWriter:
        _check_partition(index, parallelism)
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            msg = (
                f"parquet sink path {self.path!r} is a file; expected a directory (each sink "
                "instance writes part-NNNNN.parquet into it). Choose another path."
            )
            raise ConfigError(msg)
        os.makedirs(self.path, exist_ok=True)
        return _ParquetWriter(os.path.join(self.path, f"part-{index:05d}.parquet"))

    def describe(self) -> str:
        return f"parquet({self.path!r})"


class _ParquetWriter:
    def __init__(self, final_path: str) -> None:
        self._final = final_path
        self._tmp = final_path + ".tmp"
        self._writer: pq.ParquetWriter | None = None
        self._schema: pa.Schema | None = None
        self._rows = 0
        self._open = True

    def write(self, batch: pa.RecordBatch) -> None:
        if not self._open:
            raise _closed_error("write")
        if self._writer is None:
            self._schema = batch.schema
            self._writer = pq.ParquetWriter(self._tmp, batch.schema)
        else:
            assert self._schema is not None
            batch = _conform(batch, self._schema, f"parquet sink {self._final!r}")
        self._writer.write_batch(batch)
        self._rows += batch.num_rows

    def close(self) -> WrittenFile:
        if not self._open:
            raise _closed_error("close")
        self._open = False
        if self._writer is None:
            return WrittenFile(path=None, rows=0)
        try:
            self._writer.close()
            os.replace(self._tmp, self._final)
        except BaseException:
            self._remove_tmp()
            raise
        return WrittenFile(path=self._final, rows=self._rows)

    def abort(self) -> None:
        self._open = False
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
            self._writer = None
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._tmp)


def parquet(path: str | os.PathLike[str]) -> ParquetSink:
    """Write Parquet: ``path`` is a directory; instance ``i`` writes ``part-{i:05d}.parquet``.

    The schema is the first batch's; later batches may reorder columns or use another type of
    the same family (int32 for int64, large_string for string, ...), which is cast safely;
    other columns or types raise :class:`SchemaError`. An instance that got no batch writes no
    file. ``close()`` returns a :class:`WrittenFile`.

    Example::

        >>> import tempfile, pyarrow as pa
        >>> w = parquet(tempfile.mkdtemp()).open(0, 1)
        >>> w.write(pa.record_batch({"key": [1, 2]}))
        >>> w.close().rows
        2
    """
    return ParquetSink(path=os.fspath(path))


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
