"""Join logic over numpy and Arrow (no Ray): matching pairs of rows by key and time range, the
per-key buffers of each side, and the joined output rows.

Example::

    >>> import numpy as np
    >>> ia, ib = range_pairs(np.array([0, 1]), np.array([10, 0]), np.array([20, 5]),
    ...                      np.array([0, 0, 1]), np.array([15, 25, 5]))
    >>> ia.tolist(), ib.tolist()
    ([0, 1], [0, 2])
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["Buffers", "joined_rows", "range_pairs"]

EVENT_TIME = "event_time"
INGEST_TS = "ingest_ts"
_META = (EVENT_TIME, INGEST_TS)


def range_pairs(
    a_key: np.ndarray, a_lo: np.ndarray, a_hi: np.ndarray, b_key: np.ndarray, b_t: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Every pair ``(i, j)`` with ``a_key[i] == b_key[j]`` and ``a_lo[i] <= b_t[j] <= a_hi[i]``
    (keys: small non-negative ints, e.g. indexes of distinct keys). Vectorised: b sorted by
    (key, time) once, one binary search per a row for each end of its range."""
    e = np.empty(0, np.int64)
    if not len(a_key) or not len(b_key):
        return e, e
    uniq, inv = np.unique(np.concatenate([a_lo, a_hi, b_t]), return_inverse=True)
    n = len(a_key)
    r_lo, r_hi, r_b = inv[:n], inv[n : 2 * n], inv[2 * n :]
    span = len(uniq) + 1
    code_b = b_key.astype(np.int64) * span + r_b
    order = np.argsort(code_b, kind="stable")
    cb = code_b[order]
    a_base = a_key.astype(np.int64) * span
    lo = np.searchsorted(cb, a_base + r_lo, "left")
    hi = np.searchsorted(cb, a_base + r_hi, "right")
    cnt = np.maximum(hi - lo, 0)
    total = int(cnt.sum())
    if total == 0:
        return e, e
    ia = np.repeat(np.arange(n, dtype=np.int64), cnt)
    starts = np.cumsum(cnt) - cnt
    pos = np.arange(total, dtype=np.int64) - np.repeat(starts - lo, cnt)
    return ia, order[pos].astype(np.int64)


def equal_pairs(
    a_key: np.ndarray, a_val: np.ndarray, b_key: np.ndarray, b_val: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Every pair with equal key and equal value (e.g. the same window start)."""
    return range_pairs(a_key, a_val, a_val, b_key, b_val)


class Buffers:
    """The buffered records of one join side for a batch's distinct keys, as one batch.

    Stored per key as ``(key_column, RecordBatch)``; ``key`` is the distinct-key index of every
    row. ``keep(mask)`` drops rows; ``values(n, extra)`` gives the storable per-key values with
    the rows of ``extra`` (sorted by key, ``extra_offsets``) appended."""

    def __init__(self, values: list[Any]) -> None:
        self.key_column: str | None = None
        parts = []
        counts = np.zeros(len(values), np.int64)
        for i, v in enumerate(values):
            if v is not None:
                self.key_column = v[0]
                parts.append(v[1])
                counts[i] = v[1].num_rows
        self.records: pa.RecordBatch | None = pa.concat_batches(parts) if parts else None
        self.key = np.repeat(np.arange(len(values), dtype=np.int64), counts)
        self.changed = False

    def __len__(self) -> int:
        return len(self.key)

    def keep(self, mask: np.ndarray) -> None:
        if self.records is None or mask.all():
            return
        idx = np.flatnonzero(mask)
        self.records = self.records.take(pa.array(idx))
        self.key = self.key[idx]
        self.changed = True

    def values(
        self,
        n_keys: int,
        extra: pa.RecordBatch | None = None,
        extra_key: np.ndarray | None = None,
        key_column: str | None = None,
    ) -> list[Any]:
        """Per key ``(key_column, rows)`` or None: the buffered rows, then ``extra``'s."""
        pieces: list[tuple[pa.RecordBatch, np.ndarray]] = []
        if self.records is not None and len(self):
            pieces.append((self.records, self.key))
        if extra is not None and extra.num_rows:
            assert extra_key is not None
            pieces.append((extra, extra_key))
        out: list[Any] = [None] * n_keys
        if not pieces:
            return out
        if len(pieces) == 1:
            rows, key = pieces[0]
        else:
            rows = pa.concat_batches([p[0] for p in pieces])
            key = np.concatenate([p[1] for p in pieces])
        order = np.argsort(key, kind="stable")
        if not (len(order) == 0 or (np.diff(order) == 1).all()):
            rows = rows.take(pa.array(order))
            key = key[order]
        name = key_column or self.key_column
        bounds = np.flatnonzero(np.r_[True, key[1:] != key[:-1], True])
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            # a copy, not a slice: a pickled slice carries its parent's whole buffers
            out[int(key[a])] = (name, rows.take(pa.array(np.arange(a, b))))
        return out


def joined_rows(
    left: pa.RecordBatch,
    left_key: str | None,
    ia: np.ndarray,
    right: pa.RecordBatch,
    right_key: str | None,
    ib: np.ndarray,
    suffixes: tuple[str, str],
    extra: dict[str, Any] | None = None,
) -> pa.RecordBatch:
    """One row per pair ``(left[ia[i]], right[ib[i]])``: the left key column (named as on the
    left), then the other columns of both sides (a name on both sides gets its side's suffix),
    ``extra`` columns, ``event_time`` = the later of the two and ``ingest_ts`` = the earlier."""
    lt = left.take(pa.array(ia))
    rt = right.take(pa.array(ib))
    data: dict[str, Any] = {}
    if left_key is not None and left_key in lt.schema.names:
        data[left_key] = lt.column(left_key)
    lnames = [n for n in lt.schema.names if n not in _META and n != left_key]
    rnames = [n for n in rt.schema.names if n not in _META and n != right_key]
    both = set(lnames) & set(rnames)
    for n in lnames:
        data[n + suffixes[0] if n in both else n] = lt.column(n)
    for n in rnames:
        data[n + suffixes[1] if n in both else n] = rt.column(n)
    data.update(extra or {})
    for col, pick in ((EVENT_TIME, np.maximum), (INGEST_TS, np.minimum)):
        if col in lt.schema.names and col in rt.schema.names:
            data[col] = pick(
                lt.column(col).to_numpy(zero_copy_only=False),
                rt.column(col).to_numpy(zero_copy_only=False),
            )
    return pa.RecordBatch.from_pydict(data)
