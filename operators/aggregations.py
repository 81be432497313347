"""Aggregations for windows and keyed reductions, computed per group with numpy (no Ray here).

An aggregation works in three steps, so that partial results of different batches (or of a
window's state and a new batch) combine without seeing the records again:

* ``partial(rows, groups)``: one partial per group from the records of a batch;
* ``merge(parts, groups)``: one partial per group from several partial rows;
* ``result(parts)``: the output columns.

Partials are dicts of equal-length numpy arrays (object arrays where a partial is not a number).
The built-ins (:func:`count`, :func:`sum`, :func:`min`, :func:`max`, :func:`mean`, :func:`top_k`)
never loop over records in Python; :func:`aggregate` runs a user's functions per record.

Example::

    >>> import numpy as np, pyarrow as pa
    >>> from raystream.operators import aggregations as agg
    >>> rows = Rows(pa.record_batch({"x": [1, 5, 2]}))
    >>> g = Groups.of(np.array([0, 1, 0]))
    >>> agg.sum("x").result(agg.sum("x").partial(rows, g))
    {'x_sum': array([3, 5])}
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from raystream.errors import DataflowDefinitionError, SchemaError

__all__ = [
    "Aggregation",
    "Groups",
    "Rows",
    "aggregate",
    "as_aggregation",
    "count",
    "max",
    "mean",
    "min",
    "sum",
    "top_k",
]

Parts = dict[str, np.ndarray]


# ------------------------------------------------------------------------------------------
# groups and rows


@dataclass(frozen=True)
class Groups:
    """Rows assigned to dense group ids ``0..n-1``: ``order`` sorts the rows by group (stably),
    ``starts[g]`` is where group ``g`` begins in that order, ``ids`` the group of every row."""

    ids: np.ndarray
    order: np.ndarray
    starts: np.ndarray

    @property
    def n(self) -> int:
        return len(self.starts)

    @staticmethod
    def of(ids: np.ndarray) -> Groups:
        """Groups from dense ids (every id in ``0..ids.max()`` must occur)."""
        ids = np.asarray(ids, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        s = ids[order]
        starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]]) if len(s) else np.empty(0, np.int64)
        return Groups(ids, order, starts.astype(np.int64))

    @staticmethod
    def by_pairs(a: np.ndarray, b: np.ndarray) -> Groups:
        """Group rows by the pair ``(a[i], b[i])``; groups are numbered in (a, b) order."""
        n = len(a)
        if n == 0:
            e = np.empty(0, np.int64)
            return Groups(e, e, e)
        a0, b0 = int(a.min()), int(b.min())
        span_a, span_b = int(a.max()) - a0 + 1, int(b.max()) - b0 + 1
        if span_a * span_b < 1 << 62:  # one int64 code per pair: one sort instead of two
            code = (a.astype(np.int64) - a0) * span_b + (b.astype(np.int64) - b0)
            order = np.argsort(code, kind="stable")
            sc = code[order]
            new = np.r_[True, sc[1:] != sc[:-1]]
        else:
            order = np.lexsort((b, a))
            sa, sb = a[order], b[order]
            new = np.r_[True, (sa[1:] != sa[:-1]) | (sb[1:] != sb[:-1])]
        gid = np.cumsum(new) - 1
        ids = np.empty(n, np.int64)
        ids[order] = gid
        return Groups(ids, order.astype(np.int64), np.flatnonzero(new).astype(np.int64))

    @property
    def counts(self) -> np.ndarray:
        return np.diff(np.append(self.starts, len(self.ids)))

    def first(self) -> np.ndarray:
        """Index of the first row (in input order among equals) of every group."""
        return self.order[self.starts]

    def reduce(self, values: np.ndarray, ufunc: np.ufunc) -> np.ndarray:
        """``ufunc`` reduced over every group's values (``np.add``, ``np.minimum``, ...)."""
        if self.n == 0:
            return values[:0]
        return ufunc.reduceat(values[self.order], self.starts)

    def split(self, values: Any) -> list[Any]:
        """The values of every group, in group order (a list of arrays)."""
        v = np.asarray(values)[self.order]
        return np.split(v, self.starts[1:])


class Rows:
    """The records an aggregation reads: a record batch, optionally through a row index (a record
    that belongs to several windows is read several times). Columns are converted once."""

    def __init__(self, batch: pa.RecordBatch, index: np.ndarray | None = None) -> None:
        self.batch = batch
        self.index = index
        self._cols: dict[str, np.ndarray] = {}
        self._py: list[dict[str, Any]] | None = None

    def __len__(self) -> int:
        return self.batch.num_rows if self.index is None else len(self.index)

    def column(self, name: str) -> np.ndarray:
        got = self._cols.get(name)
        if got is None:
            if name not in self.batch.schema.names:
                msg = (
                    f"aggregation over column {name!r}, but the records have columns "
                    f"{self.batch.schema.names}"
                )
                raise SchemaError(msg)
            col = self.batch.column(name)
            if col.null_count:
                msg = (
                    f"column {name!r} holds {col.null_count} null(s); aggregations need values. "
                    "Filter the nulls out or fill them before the window."
                )
                raise SchemaError(msg)
            arr = col.to_numpy(zero_copy_only=False)
            got = arr if self.index is None else arr[self.index]
            self._cols[name] = got
        return got

    def records(self) -> list[dict[str, Any]]:
        """Every row as a dict (for user aggregations)."""
        if self._py is None:
            rows = self.batch.to_pylist()
            self._py = rows if self.index is None else [rows[i] for i in self.index.tolist()]
        return self._py


# ------------------------------------------------------------------------------------------
# the protocol


class Aggregation(Protocol):
    """What a window or reduction needs of an aggregation (see the module docstring)."""

    names: tuple[str, ...]

    def partial(self, rows: Rows, groups: Groups) -> Parts: ...

    def merge(self, parts: Parts, groups: Groups) -> Parts: ...

    def result(self, parts: Parts) -> dict[str, Any]: ...


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name:
        msg = f"{what} needs a non-empty column name (str), got {type(name).__name__}: {name!r}"
        raise DataflowDefinitionError(msg)
    return name


@dataclass(frozen=True)
class _Count:
    name: str = "count"

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def partial(self, rows: Rows, groups: Groups) -> Parts:
        return {"n": groups.counts.astype(np.int64)}

    def merge(self, parts: Parts, groups: Groups) -> Parts:
        return {"n": groups.reduce(parts["n"], np.add)}

    def result(self, parts: Parts) -> dict[str, Any]:
        return {self.name: parts["n"]}


@dataclass(frozen=True)
class _Reduce:
    column: str
    how: str  # sum | min | max
    name: str

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    @property
    def _ufunc(self) -> np.ufunc:
        return {"sum": np.add, "min": np.minimum, "max": np.maximum}[self.how]

    def partial(self, rows: Rows, groups: Groups) -> Parts:
        v = rows.column(self.column)
        if self.how == "sum" and v.dtype.kind in "iub":
            v = v.astype(np.int64)
        return {"v": groups.reduce(v, self._ufunc)}

    def merge(self, parts: Parts, groups: Groups) -> Parts:
        return {"v": groups.reduce(parts["v"], self._ufunc)}

    def result(self, parts: Parts) -> dict[str, Any]:
        return {self.name: parts["v"]}


@dataclass(frozen=True)
class _Mean:
    column: str
    name: str

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def partial(self, rows: Rows, groups: Groups) -> Parts:
        v = rows.column(self.column).astype(np.float64)
        return {"s": groups.reduce(v, np.add), "n": groups.counts.astype(np.int64)}

    def merge(self, parts: Parts, groups: Groups) -> Parts:
        return {"s": groups.reduce(parts["s"], np.add), "n": groups.reduce(parts["n"], np.add)}

    def result(self, parts: Parts) -> dict[str, Any]:
        return {self.name: parts["s"] / parts["n"]}


def _top(values: np.ndarray, groups: Groups, k: int, largest: bool) -> np.ndarray:
    """Per group, its ``k`` largest (or smallest) values, sorted best first (object array)."""
    if groups.n == 0:
        return np.empty(0, dtype=object)
    g = groups.ids
    # sort by group, then best value first; stable, so ties keep arrival order
    order = np.lexsort((-values if largest else values, g)) if values.dtype.kind in "iuf" else None
    if order is None:
        msg = f"top_k needs a numeric column, got values of dtype {values.dtype}"
        raise SchemaError(msg)
    sg = g[order]
    rank = np.arange(len(sg)) - groups.starts[sg]
    keep = order[rank < k]  # still sorted by group, every group present (k >= 1)
    pieces = np.split(values[keep], np.flatnonzero(np.diff(g[keep]) != 0) + 1)
    return _objects(pieces)


def _objects(items: list[Any]) -> np.ndarray:
    """A 1-d object array of ``items`` (numpy would otherwise stack equal-length arrays)."""
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


@dataclass(frozen=True)
class _TopK:
    column: str
    k: int
    largest: bool
    name: str

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def partial(self, rows: Rows, groups: Groups) -> Parts:
        return {"top": _top(rows.column(self.column), groups, self.k, self.largest)}

    def merge(self, parts: Parts, groups: Groups) -> Parts:
        tops = parts["top"]
        lens = np.fromiter((len(t) for t in tops), dtype=np.int64, count=len(tops))
        flat = np.concatenate(list(tops)) if len(tops) else np.empty(0)
        flat_groups = Groups.of(np.repeat(groups.ids, lens))
        return {"top": _top(flat, flat_groups, self.k, self.largest)}

    def result(self, parts: Parts) -> dict[str, Any]:
        return {self.name: [t.tolist() for t in parts["top"]]}


@dataclass(frozen=True)
class _UserAggregate:
    create: Callable[[], Any]
    add: Callable[[Any, dict[str, Any]], Any]
    merge_fn: Callable[[Any, Any], Any]
    result_fn: Callable[[Any], Any]
    name: str
    columns: tuple[str, ...] | None

    @property
    def names(self) -> tuple[str, ...]:
        return self.columns or (self.name,)

    def partial(self, rows: Rows, groups: Groups) -> Parts:
        recs = rows.records()
        out = np.empty(groups.n, dtype=object)
        order = groups.order.tolist()
        bounds = [*groups.starts.tolist(), len(order)]
        for gi in range(groups.n):
            acc = self.create()
            for i in order[bounds[gi] : bounds[gi + 1]]:
                acc = self.add(acc, recs[i])
            out[gi] = acc
        return {"acc": out}

    def merge(self, parts: Parts, groups: Groups) -> Parts:
        accs = parts["acc"]
        out = np.empty(groups.n, dtype=object)
        for gi, members in enumerate(groups.split(np.arange(len(accs)))):
            acc = accs[members[0]]
            for i in members[1:]:
                acc = self.merge_fn(acc, accs[i])
            out[gi] = acc
        return {"acc": out}

    def result(self, parts: Parts) -> dict[str, Any]:
        results = [self.result_fn(a) for a in parts["acc"]]
        if self.columns is None:
            return {self.name: results}
        cols: dict[str, list[Any]] = {c: [] for c in self.columns}
        for r in results:
            if not isinstance(r, dict) or set(r) != set(self.columns):
                msg = (
                    f"aggregate(columns={list(self.columns)}): result() must return a dict with "
                    f"exactly those keys, got {r!r}"
                )
                raise SchemaError(msg)
            for c in self.columns:
                cols[c].append(r[c])
        return cols


@dataclass(frozen=True)
class _Combined:
    """Several aggregations side by side; their partials are kept under ``"<i>.<name>"``."""

    parts: tuple[Any, ...] = field(default_factory=tuple)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for a in self.parts for n in a.names)

    def _each(self, parts: Parts, i: int) -> Parts:
        p = f"{i}."
        return {k[len(p) :]: v for k, v in parts.items() if k.startswith(p)}

    def partial(self, rows: Rows, groups: Groups) -> Parts:
        out: Parts = {}
        for i, a in enumerate(self.parts):
            out.update({f"{i}.{k}": v for k, v in a.partial(rows, groups).items()})
        return out

    def merge(self, parts: Parts, groups: Groups) -> Parts:
        out: Parts = {}
        for i, a in enumerate(self.parts):
            out.update({f"{i}.{k}": v for k, v in a.merge(self._each(parts, i), groups).items()})
        return out

    def result(self, parts: Parts) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i, a in enumerate(self.parts):
            out.update(a.result(self._each(parts, i)))
        return out


# ------------------------------------------------------------------------------------------
# the public constructors


def count(*, name: str = "count") -> Aggregation:
    """The number of records.

    Example::

        >>> rs.operators.windows.tumbling(60_000, count())      # column "count"
    """
    return _Count(_check_name(name, "count()"))


def sum(column: str, *, name: str | None = None) -> Aggregation:  # noqa: A001
    """The sum of a numeric column (int64 for integer columns, float64 for floats); column
    ``<column>_sum`` unless ``name`` is given.

    Example::

        >>> tumbling(60_000, sum("amount"))                     # column "amount_sum"
    """
    _check_name(column, "sum()")
    return _Reduce(column, "sum", name or f"{column}_sum")


def min(column: str, *, name: str | None = None) -> Aggregation:  # noqa: A001
    """The smallest value of a column; column ``<column>_min`` unless ``name`` is given.

    Example::

        >>> tumbling(60_000, min("price"))                      # column "price_min"
    """
    _check_name(column, "min()")
    return _Reduce(column, "min", name or f"{column}_min")


def max(column: str, *, name: str | None = None) -> Aggregation:  # noqa: A001
    """The largest value of a column; column ``<column>_max`` unless ``name`` is given.

    Example::

        >>> tumbling(60_000, max("price"))                      # column "price_max"
    """
    _check_name(column, "max()")
    return _Reduce(column, "max", name or f"{column}_max")


def mean(column: str, *, name: str | None = None) -> Aggregation:
    """The arithmetic mean (float64) of a numeric column; column ``<column>_mean``.

    Example::

        >>> sliding(60_000, 10_000, mean("latency_ms"))         # column "latency_ms_mean"
    """
    _check_name(column, "mean()")
    return _Mean(column, name or f"{column}_mean")


def top_k(column: str, k: int, *, largest: bool = True, name: str | None = None) -> Aggregation:
    """The ``k`` largest (``largest=False``: smallest) values of a numeric column, best first, as
    a list column ``<column>_top_k``. Ties keep the order the records arrived in.

    Example::

        >>> tumbling(60_000, top_k("score", 3))                 # e.g. [9.5, 9.1, 8.0]
    """
    _check_name(column, "top_k()")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        msg = f"top_k({column!r}, k) needs an int k >= 1, got {k!r}"
        raise DataflowDefinitionError(msg)
    return _TopK(column, k, bool(largest), name or f"{column}_top_k")


def aggregate(
    create: Callable[[], Any],
    add: Callable[[Any, dict[str, Any]], Any],
    merge: Callable[[Any, Any], Any],
    result: Callable[[Any], Any],
    *,
    name: str = "value",
    columns: Sequence[str] | None = None,
) -> Aggregation:
    """A user aggregation: ``create()`` a new accumulator, ``add(acc, record) -> acc`` one record
    (a dict), ``merge(a, b) -> acc`` two accumulators of the same key and window (in no
    particular order: make it commutative), ``result(acc)`` the output: one value (column
    ``name``) or, with ``columns=``, a dict with exactly those keys. Accumulators are pickled
    into keyed state.

    Example::

        >>> distinct_users = aggregate(
        ...     create=set,
        ...     add=lambda acc, r: acc | {r["user"]},
        ...     merge=lambda a, b: a | b,
        ...     result=len,
        ...     name="users",
        ... )
        >>> tumbling(60_000, distinct_users)
    """
    for what, fn in (("create", create), ("add", add), ("merge", merge), ("result", result)):
        if not callable(fn):
            msg = f"aggregate(): {what} must be a function, got {type(fn).__name__}: {fn!r}"
            raise DataflowDefinitionError(msg)
    cols = None
    if columns is not None:
        cols = tuple(_check_name(c, "aggregate(columns=...)") for c in columns)
        if not cols:
            msg = "aggregate(columns=...) needs at least one column name, got an empty list"
            raise DataflowDefinitionError(msg)
    return _UserAggregate(create, add, merge, result, _check_name(name, "aggregate()"), cols)


def as_aggregation(agg: Any, where: str) -> Aggregation:
    """One aggregation from ``agg``: an aggregation, or a list/tuple of them (side by side)."""
    if isinstance(agg, (list, tuple)):
        if not agg:
            msg = f"{where}: needs at least one aggregation, got an empty {type(agg).__name__}"
            raise DataflowDefinitionError(msg)
        items = tuple(as_aggregation(a, where) for a in agg)
        names = [n for a in items for n in a.names]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            msg = f"{where}: aggregations produce the same column name(s) {dup}; pass name=..."
            raise DataflowDefinitionError(msg)
        return items[0] if len(items) == 1 else _Combined(items)
    if all(hasattr(agg, a) for a in ("partial", "merge", "result", "names")):
        return agg  # type: ignore[no-any-return]
    msg = (
        f"{where}: expects an aggregation such as rs.operators.count() or "
        f"rs.operators.sum('x') (or a list of them), got {type(agg).__name__}: {agg!r}"
    )
    raise DataflowDefinitionError(msg)


_ = builtins  # the module shadows sum/min/max on purpose; builtins stay reachable
