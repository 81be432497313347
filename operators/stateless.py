"""Stateless column helpers, vectorised over Arrow batches (``@rs.map_batches`` operators).

``event_time`` and ``ingest_ts`` ride along unless dropped on purpose. Example::

    from raystream.operators import stateless as st

    (stream.apply(st.select("user", "amount"))
           .apply(st.rename({"amount": "eur"}))
           .apply(st.where("eur", ">=", 100)))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

import raystream as rs
from raystream.errors import DataflowDefinitionError, SchemaError

__all__ = ["drop", "rename", "select", "where", "with_column"]

_META = ("event_time", "ingest_ts")
_OPS = {
    "==": pc.equal,
    "!=": pc.not_equal,
    "<": pc.less,
    "<=": pc.less_equal,
    ">": pc.greater,
    ">=": pc.greater_equal,
}


def _names(names: tuple[Any, ...], where: str) -> tuple[str, ...]:
    if not names or not all(isinstance(n, str) and n for n in names):
        msg = f"{where}: needs one or more column names (str), got {names!r}"
        raise DataflowDefinitionError(msg)
    return names


def _missing(batch: pa.RecordBatch, names: Any, where: str) -> None:
    gone = [n for n in names if n not in batch.schema.names]
    if gone:
        msg = f"{where}: no column(s) {gone} in the records (columns {batch.schema.names})"
        raise SchemaError(msg)


def select(*columns: str, name: str | None = None) -> rs.Operator:
    """Keep only ``columns`` (and ``event_time``/``ingest_ts``), in that order.

    Example::

        >>> stream.apply(select("user", "amount"))
    """
    cols = _names(columns, "select()")

    @rs.map_batches(name=name or "select")
    def select_step(batch: pa.RecordBatch) -> pa.RecordBatch:
        _missing(batch, cols, "select()")
        keep = [*cols, *(m for m in _META if m in batch.schema.names and m not in cols)]
        return batch.select(keep)

    return select_step


def drop(*columns: str, name: str | None = None) -> rs.Operator:
    """Drop ``columns`` (missing ones are an error).

    Example::

        >>> stream.apply(drop("debug_payload"))
    """
    cols = _names(columns, "drop()")

    @rs.map_batches(name=name or "drop")
    def drop_step(batch: pa.RecordBatch) -> pa.RecordBatch:
        _missing(batch, cols, "drop()")
        return batch.drop_columns(list(cols))

    return drop_step


def rename(mapping: dict[str, str], *, name: str | None = None) -> rs.Operator:
    """Rename columns ``{old: new}``.

    Example::

        >>> stream.apply(rename({"amount": "eur"}))
    """
    if not isinstance(mapping, dict) or not mapping:
        msg = f"rename() needs a non-empty dict {{old: new}}, got {mapping!r}"
        raise DataflowDefinitionError(msg)
    _names(tuple(mapping) + tuple(mapping.values()), "rename()")

    @rs.map_batches(name=name or "rename")
    def rename_step(batch: pa.RecordBatch) -> pa.RecordBatch:
        _missing(batch, mapping, "rename()")
        return batch.rename_columns([mapping.get(n, n) for n in batch.schema.names])

    return rename_step


def where(column: str, op: str, value: Any, *, name: str | None = None) -> rs.Operator:
    """Keep the records where ``column <op> value`` (``==``, ``!=``, ``<``, ``<=``, ``>``,
    ``>=``); nulls never pass.

    Example::

        >>> stream.apply(where("amount", ">=", 100))
    """
    _names((column,), "where()")
    if op not in _OPS:
        msg = f"where({column!r}, {op!r}, ...): op must be one of {list(_OPS)}, got {op!r}"
        raise DataflowDefinitionError(msg)
    compare = _OPS[op]

    @rs.map_batches(name=name or "where")
    def where_step(batch: pa.RecordBatch) -> pa.RecordBatch:
        _missing(batch, (column,), "where()")
        mask = pc.fill_null(compare(batch.column(column), pa.scalar(value)), False)
        return batch.filter(mask)

    return where_step


def with_column(
    column: str, fn: Callable[[pa.RecordBatch], Any], *, name: str | None = None
) -> rs.Operator:
    """Add (or replace) ``column`` with ``fn(batch)``: an array (or anything ``pa.array``
    takes) of one value per record.

    Example::

        >>> import pyarrow.compute as pc
        >>> stream.apply(with_column("eur", lambda b: pc.multiply(b["usd"], 0.92)))
    """
    _names((column,), "with_column()")
    if not callable(fn):
        msg = f"with_column({column!r}, fn): fn must be a function of the batch, got {fn!r}"
        raise DataflowDefinitionError(msg)

    @rs.map_batches(name=name or f"with_{column}")
    def with_step(batch: pa.RecordBatch) -> pa.RecordBatch:
        got = fn(batch)
        arr = got if isinstance(got, (pa.Array, pa.ChunkedArray)) else pa.array(got)
        if len(arr) != batch.num_rows:
            msg = (
                f"with_column({column!r}): fn returned {len(arr)} values for "
                f"{batch.num_rows} records; return one per record"
            )
            raise SchemaError(msg)
        if column in batch.schema.names:
            return batch.set_column(batch.schema.get_field_index(column), column, arr)
        return batch.append_column(column, arr)

    return with_step
