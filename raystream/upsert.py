"""Upsert output: a changelog written as rows, and the final table read back from it.

An updating result (a regular join, a per-key aggregate, NEXMark's q4/q5/q9) is a stream of
changes to a table keyed by some columns. ``rs.sinks.parquet(path, mode="upsert", key=[...])``
writes each change as one row: the row's columns, ``_change`` (``"upsert"`` or ``"delete"``) and
``_seq`` (int64; the order of the changes of one key). The final table is, per key, the row with
the highest ``_seq``, unless that row is a delete. In DuckDB (``FINAL_TABLE_SQL``)::

    SELECT * EXCLUDE (_change, _seq)
    FROM read_parquet('out/*.parquet')
    QUALIFY row_number() OVER (PARTITION BY id ORDER BY _seq DESC) = 1 AND _change = 'upsert'

and in Python :func:`read_upsert` (``rs.read_upsert("out")``) returns it as a ``pyarrow.Table``.

Input rows may carry their change kind in a column (``kind_column``), as Flink's RowKind:
``"+I"`` / ``"+U"`` (or ``"upsert"``) write an upsert, ``"-D"`` (or ``"delete"``) a delete,
``"-U"`` (the retraction before an update) nothing: the ``+U`` that follows replaces the row.
Without ``kind_column`` every row is an upsert.

``_seq``: with ``order_by`` the values of that column of the input (a per-key version, e.g.
kept in keyed state so it moves with its key on a rescale; it must grow with every change of a
key); without it the sink numbers the rows in the order it receives them, which is the order of
the changes only if every change of a key reaches one sink instance in the order it was made
(the sink then needs parallelism 1, and no rescale of the step making the changes: a key's rows
from its old and new owner can overtake each other on their way to the sink).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raystream.errors import ConfigError, SchemaError
from raystream.part_store import check_uri, redact

__all__ = [
    "CHANGE",
    "DELETE",
    "FINAL_TABLE_SQL",
    "SEQ",
    "UPSERT",
    "UpsertWriter",
    "final_table",
    "final_table_sql",
    "read_upsert",
    "to_changes",
]

CHANGE = "_change"
SEQ = "_seq"
UPSERT = "upsert"
DELETE = "delete"
KEY_METADATA = b"raystream.upsert.key"

FINAL_TABLE_SQL = (
    "SELECT * EXCLUDE (_change, _seq)\n"
    "FROM read_parquet('{path}/*.parquet')\n"
    "QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY _seq DESC) = 1"
    " AND _change = 'upsert'"
)

# input kind -> written change (None: not written)
_KINDS: dict[str, str | None] = {
    "+I": UPSERT,
    "+U": UPSERT,
    UPSERT: UPSERT,
    "-D": DELETE,
    DELETE: DELETE,
    "-U": None,
}


def final_table_sql(path: str, key: Sequence[str]) -> str:
    """The DuckDB query of the final table of the upsert output in directory ``path``."""
    cols = ", ".join('"' + k.replace('"', '""') + '"' for k in key)
    return FINAL_TABLE_SQL.format(path=str(path).replace("'", "''"), key=cols)


def check_upsert_spec(
    key: Sequence[str], order_by: str | None, kind_column: str | None, where: str
) -> tuple[str, ...]:
    """``key`` as a tuple of column names; raises :class:`ConfigError` on a bad spec."""
    if isinstance(key, str) or not isinstance(key, Sequence) or not key:
        msg = f"{where}: key must be a non-empty list of column names, got {key!r}"
        raise ConfigError(msg)
    names = tuple(key)
    for name in (*names, order_by, kind_column):
        if name is not None and (not isinstance(name, str) or not name):
            msg = f"{where}: column names must be non-empty strings, got {name!r}"
            raise ConfigError(msg)
    reserved = {CHANGE, SEQ} & {*names, order_by, kind_column}
    if reserved:
        msg = f"{where}: {sorted(reserved)} are written by the upsert sink; rename those columns"
        raise ConfigError(msg)
    if len(set(names)) != len(names) or {order_by, kind_column} & set(names):
        msg = (
            f"{where}: key {list(names)}, order_by {order_by!r} and kind_column "
            f"{kind_column!r} must name different columns"
        )
        raise ConfigError(msg)
    return names


def to_changes(
    batch: pa.RecordBatch | pa.Table,
    key: Sequence[str],
    *,
    order_by: str | None = None,
    kind_column: str | None = None,
    next_seq: int = 0,
    where: str = "upsert sink",
) -> tuple[Any, int]:
    """``batch`` (a RecordBatch or Table) as written changes: ``-U`` rows dropped,
    ``kind_column`` and ``order_by`` replaced by ``_change`` and ``_seq`` (``next_seq``,
    ``next_seq + 1``, ... without ``order_by``); returns them and the next sequence number."""
    names = batch.schema.names
    missing = [c for c in (*key, order_by, kind_column) if c is not None and c not in names]
    if missing:
        msg = (
            f"{where}: the rows have no column {missing}; they have {names}. The upsert key, "
            "order_by and kind_column must be columns of the stream."
        )
        raise SchemaError(msg)
    if kind_column is not None:
        kinds = batch.column(kind_column)
        if not (pa.types.is_string(kinds.type) or pa.types.is_large_string(kinds.type)):
            msg = (
                f"{where}: kind column {kind_column!r} has type {kinds.type}, expected strings "
                f"({sorted(_KINDS)})"
            )
            raise SchemaError(msg)
        known = pc.is_in(kinds, pa.array(list(_KINDS)))
        if kinds.null_count or not pc.all(known).as_py():
            bad = sorted(set(kinds.filter(pc.invert(pc.fill_null(known, False))).to_pylist()))
            msg = (
                f"{where}: kind column {kind_column!r} has values {bad[:5]}; expected one of "
                f"{sorted(_KINDS)} (Flink's +I/-U/+U/-D, or upsert/delete)"
            )
            raise SchemaError(msg)
        keep = pc.not_equal(kinds, "-U")
        if not pc.all(keep).as_py():
            batch = batch.filter(keep)
            kinds = batch.column(kind_column)
        is_delete = pc.is_in(kinds, pa.array(["-D", DELETE]))
        change = pc.if_else(is_delete, DELETE, UPSERT)
    else:
        change = pa.repeat(pa.scalar(UPSERT, pa.string()), batch.num_rows)
    if order_by is not None:
        col = batch.column(order_by)
        if not (pa.types.is_integer(col.type) or pa.types.is_timestamp(col.type)):
            msg = (
                f"{where}: order_by column {order_by!r} has type {col.type}, expected an integer "
                "or timestamp (a version that grows with every change of a key)"
            )
            raise SchemaError(msg)
        if col.null_count:
            msg = f"{where}: order_by column {order_by!r} has nulls; every change needs one"
            raise SchemaError(msg)
        seq = col.cast(pa.int64())
    else:
        seq = pa.array(np.arange(next_seq, next_seq + batch.num_rows, dtype=np.int64))
        next_seq += batch.num_rows
    drop = {order_by, kind_column}
    arrays = [batch.column(i) for i, n in enumerate(names) if n not in drop]
    fields = [f for f in batch.schema if f.name not in drop]
    arrays += [change, seq]
    fields += [pa.field(CHANGE, pa.string(), nullable=False), pa.field(SEQ, pa.int64(), False)]
    meta = dict(batch.schema.metadata or {})
    meta[KEY_METADATA] = json.dumps(list(key)).encode()
    schema = pa.schema(fields, metadata=meta)
    return type(batch).from_arrays(arrays, schema=schema), next_seq


def final_table(changes: pa.Table, key: Sequence[str]) -> pa.Table:
    """The final table of ``changes`` (rows with ``_change`` and ``_seq``): per ``key`` the row
    of the highest ``_seq`` (the later row on a tie), dropped if it is a delete; without the
    ``_change`` and ``_seq`` columns, ordered by key."""
    key = list(key)
    missing = [c for c in (*key, CHANGE, SEQ) if c not in changes.schema.names]
    if missing:
        msg = (
            f"final_table: the changes have no column {missing}; expected the key {key} and "
            f"{CHANGE!r}, {SEQ!r} (rows written by parquet(..., mode='upsert'))"
        )
        raise SchemaError(msg)
    values = changes.drop_columns([CHANGE, SEQ])
    if changes.num_rows == 0:
        return values
    order = pc.sort_indices(changes, sort_keys=[(SEQ, "ascending")])  # stable: ties keep order
    ordered = changes.take(order)
    pos = pa.array(np.arange(ordered.num_rows, dtype=np.int64))
    last = (
        pa.table({**{k: ordered.column(k) for k in key}, "__pos": pos})
        .group_by(key, use_threads=False)
        .aggregate([("__pos", "max")])
        .column("__pos_max")
    )
    final = ordered.take(last)
    final = final.filter(pc.equal(final.column(CHANGE), UPSERT))
    final = final.take(pc.sort_indices(final, sort_keys=[(k, "ascending") for k in key]))
    return final.drop_columns([CHANGE, SEQ]).replace_schema_metadata(
        {k: v for k, v in (changes.schema.metadata or {}).items() if k != KEY_METADATA} or None
    )


# part-<index>[-<checkpoint>][-r<n>].parquet: the visible files a parquet sink publishes
_VISIBLE = re.compile(r"^part-\d+(?:-\d+)?(?:-r\d+)?\.parquet$")


def _visible_parts(
    path: str, filesystem: pafs.FileSystem | None
) -> tuple[pafs.FileSystem, list[str]]:
    """The filesystem and the published part files (``part-*.parquet``, sorted) of a parquet
    sink's output folder ``path`` (local, a URI, or a path on ``filesystem``)."""
    where = f"read_upsert: {redact(path)!r}"
    if filesystem is None:
        path = check_uri(path, "read_upsert")
    if filesystem is None and "://" not in path:
        if not os.path.isdir(path):
            msg = f"{where} is not a directory; expected a parquet sink's output"
            raise ConfigError(msg)
        names = sorted(f for f in os.listdir(path) if _VISIBLE.match(f))
        return pafs.LocalFileSystem(), [os.path.join(os.path.abspath(path), n) for n in names]
    try:
        fs, root = (filesystem, path) if filesystem is not None else pafs.FileSystem.from_uri(path)
        infos = fs.get_file_info(pafs.FileSelector(root.rstrip("/")))
    except (pa.ArrowException, OSError, ValueError) as exc:
        msg = f"{where} cannot be listed ({exc}); expected a parquet sink's output folder"
        raise ConfigError(msg) from exc
    names = sorted(
        i.path for i in infos if i.type == pafs.FileType.File and _VISIBLE.match(i.base_name)
    )
    return fs, names


def read_upsert(
    path: str | os.PathLike[str],
    key: Sequence[str] | None = None,
    *,
    filesystem: pafs.FileSystem | None = None,
) -> pa.Table:
    """The final table of the upsert output in directory ``path`` (see the module docstring);
    ``key`` defaults to the one the sink recorded in the files. An empty table (no columns) if
    the sink published no file. ``path`` may be a ``pyarrow.fs`` URI (``s3://bucket/out``) or a
    path on ``filesystem``, as for the sink; only published parts (``part-*.parquet``) are read,
    never the hidden pending ones.

    Example::

        >>> import tempfile, pyarrow as pa
        >>> from raystream.sinks import parquet
        >>> out = tempfile.mkdtemp()
        >>> w = parquet(out, mode="upsert", key=["id"], kind_column="op").open(0, 1)
        >>> w.write(pa.record_batch({"id": [1, 2, 1, 2], "v": [10, 20, 11, 0],
        ...                          "op": ["+I", "+I", "+U", "-D"]}))
        >>> _ = w.close()
        >>> read_upsert(out).to_pydict()
        {'id': [1], 'v': [11]}
    """
    directory = os.fspath(path)
    fs, files = _visible_parts(directory, filesystem)
    if not files:
        return pa.table({})
    tables = [pq.read_table(f, filesystem=fs) for f in files]
    try:
        changes = pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowInvalid as exc:
        msg = f"read_upsert: the files in {redact(directory)!r} have different schemas ({exc})"
        raise SchemaError(msg) from exc
    if key is None:
        recorded = (tables[0].schema.metadata or {}).get(KEY_METADATA)
        if recorded is None:
            msg = (
                f"read_upsert: {redact(directory)!r} holds no upsert key in its files (not "
                "written by parquet(..., mode='upsert')?); pass key=[...]"
            )
            raise SchemaError(msg)
        key = json.loads(recorded)
    return final_table(changes, list(key))  # type: ignore[arg-type]


class UpsertWriter:
    """A parquet sink writer in upsert mode: turns each batch into changes (:func:`to_changes`)
    and hands them to the append writer ``inner``. Takes part in the two-phase commit: its
    pre-commit state is the inner one plus the next sequence number, so rows replayed after a
    restore get the numbers they had."""

    def __init__(
        self,
        inner: Any,
        key: tuple[str, ...],
        order_by: str | None,
        kind_column: str | None,
        where: str,
    ) -> None:
        self._inner = inner
        self._key = key
        self._order_by = order_by
        self._kind_column = kind_column
        self._where = where
        self._seq = 0

    def write(self, batch: pa.RecordBatch) -> None:
        changes, self._seq = to_changes(
            batch,
            self._key,
            order_by=self._order_by,
            kind_column=self._kind_column,
            next_seq=self._seq,
            where=self._where,
        )
        self._inner.write(changes)

    def pre_commit(self, checkpoint_id: int) -> dict[str, Any]:
        state = dict(self._inner.pre_commit(checkpoint_id))
        state["next_seq"] = self._seq
        return state

    @property
    def slow_commit(self) -> bool:
        return bool(getattr(self._inner, "slow_commit", False))

    def pre_commit_deferred(self, checkpoint_id: int) -> tuple[dict[str, Any], Any]:
        state, upload = self._inner.pre_commit_deferred(checkpoint_id)
        return {**state, "next_seq": self._seq}, upload

    def commit(self, checkpoint_id: int) -> None:
        self._inner.commit(checkpoint_id)

    def restore(self, state: dict[str, Any] | None) -> None:
        self._inner.restore(state)
        self._seq = int(state.get("next_seq", 0)) if state else 0

    def close(self) -> Any:
        return self._inner.close()

    def abort(self) -> None:
        self._inner.abort()
