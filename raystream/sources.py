"""Sources: where records enter a dataflow.

A source is a frozen, picklable spec. The runtime ships it to every source instance and calls
``open(index, parallelism)`` there; the returned :class:`SourceReader` yields Arrow record batches
of the partition instance ``index`` owns, until ``read`` returns ``None``.

Built-in sources:

* :func:`generator` - a deterministic key-count stream (bounded Zipf keys, optional hot key),
  the same events whatever the parallelism;
* :func:`parquet`, :func:`csv`, :func:`json` - files: one, a folder (recursively, hive
  partitions as columns), a glob, or an object-store URI (see :mod:`raystream.files`);
* :func:`from_table` - an in-memory Arrow table (tests, docs).

Example::

    >>> import raystream.sources as src
    >>> gen = src.generator(events=10, keys=3, seed=1)
    >>> reader = gen.open(0, 1)
    >>> reader.read(4).num_rows
    4
    >>> src.from_table(gen.generate_all()).schema().names
    ['key', 'seq']
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raystream.errors import ConfigError, SchemaError
from raystream.files import FileReader, FileSource

# the Parquet source is a file source (kept as a name: earlier code imports it)
ParquetSource = FileSource

__all__ = [
    "FileReader",
    "FileSource",
    "KeyCountGenerator",
    "ParquetSource",
    "Source",
    "SourceReader",
    "TableSource",
    "csv",
    "from_table",
    "generator",
    "json",
    "parquet",
    "push",
    "spark",
    "spark_stream",
]


@runtime_checkable
class SourceReader(Protocol):
    """Reads the partition of one source instance."""

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        """At most ``max_rows`` rows (never an empty batch); ``None`` once exhausted."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Source(Protocol):
    """A frozen, picklable source spec."""

    def schema(self) -> pa.Schema | None:
        """The schema, when known at definition time (used to check ``key_by`` columns)."""
        ...

    def open(self, index: int, parallelism: int) -> SourceReader:
        """The reader of the partition of source instance ``index`` of ``parallelism``."""
        ...

    @property
    def rate_eps(self) -> float:
        """Total target rate in events/s over all instances; 0 = unthrottled (the runtime paces)."""
        ...

    def describe(self) -> str: ...

    # optional: ``warm_up()``, called once in each source instance's process when it is built
    # (before the job runs), e.g. to import what its first read needs


# --------------------------------------------------------------------------------------------
# shared checks and helpers


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_rate(rate_eps: float) -> None:
    if isinstance(rate_eps, bool) or not isinstance(
        rate_eps, (int, float, np.integer, np.floating)
    ):
        msg = f"rate_eps must be a number >= 0 (events/s, 0 = unthrottled), got {rate_eps!r}"
        raise ConfigError(msg)
    if not math.isfinite(rate_eps) or rate_eps < 0:
        msg = (
            f"rate_eps must be a finite number >= 0 (events/s over all instances), "
            f"got {rate_eps!r}. Use 0 for an unthrottled source."
        )
        raise ConfigError(msg)


def _check_positive_int(name: str, value: object) -> None:
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        msg = f"{name} must be an int >= 1, got {value!r}"
        raise ConfigError(msg)


def _check_partition(index: int, parallelism: int) -> None:
    if not _is_int(parallelism) or parallelism < 1:
        msg = f"source parallelism must be an int >= 1, got {parallelism!r}"
        raise ConfigError(msg)
    if not _is_int(index) or not 0 <= index < parallelism:
        msg = f"source instance index must be an int in [0, {parallelism}), got {index!r}"
        raise ConfigError(msg)


def _check_rate_schedule(schedule: object, rate_eps: float) -> tuple[tuple[float, float], ...]:
    """``[(t_s, eps), ...]`` as a tuple of float pairs, checked."""
    if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Sequence):
        msg = f"rate_schedule must be a list of (t_s, eps) pairs, got {schedule!r}"
        raise ConfigError(msg)
    out: list[tuple[float, float]] = []
    for item in schedule:
        if not isinstance(item, Sequence) or len(item) != 2:
            msg = f"rate_schedule entries are (t_s, eps) pairs, got {item!r}"
            raise ConfigError(msg)
        t_s, eps = item
        ok_t = not isinstance(t_s, bool) and isinstance(t_s, (int, float, np.number)) and t_s >= 0
        ok_r = not isinstance(eps, bool) and isinstance(eps, (int, float, np.number)) and eps > 0
        if not (ok_t and ok_r and math.isfinite(t_s) and math.isfinite(eps)):
            msg = f"rate_schedule: expected (t_s >= 0, eps > 0), got {item!r}"
            raise ConfigError(msg)
        if out and t_s <= out[-1][0]:
            msg = f"rate_schedule times must increase, got {t_s} after {out[-1][0]}"
            raise ConfigError(msg)
        out.append((float(t_s), float(eps)))
    if out and out[0][0] > 0 and rate_eps <= 0:
        msg = (
            f"rate_schedule starts at {out[0][0]} s: set rate_eps for the time before it, or "
            "start the schedule at 0"
        )
        raise ConfigError(msg)
    return tuple(out)


@dataclass(frozen=True)
class RateSchedule:
    """A piecewise-constant rate: from ``starts_s[i]`` (seconds after the source starts) on,
    ``rates_eps[i]`` events/s. ``time_of_row(n)`` is when row ``n`` is due (vectorised).

    Example::

        >>> r = RateSchedule((0.0, 2.0), (10.0, 40.0))
        >>> r.time_of_row(np.array([0, 20, 60])).tolist(), r.rows_by(3.0), r.rate_at(5.0)
        ([0.0, 2.0, 3.0], 60.0, 40.0)
    """

    starts_s: tuple[float, ...]
    rates_eps: tuple[float, ...]

    @classmethod
    def of(cls, source: object, parallelism: int = 1) -> RateSchedule | None:
        """The pace of one of ``parallelism`` instances of ``source``; None when unthrottled."""
        rate = float(getattr(source, "rate_eps", 0) or 0)
        points = list(getattr(source, "rate_schedule", ()) or ())
        if not points or points[0][0] > 0:
            points.insert(0, (0.0, rate))
        if points[0][1] <= 0:
            return None
        return cls(tuple(t for t, _ in points), tuple(r / parallelism for _, r in points))

    def _rows_at_starts(self) -> np.ndarray:
        starts, rates = np.asarray(self.starts_s), np.asarray(self.rates_eps)
        return np.concatenate([[0.0], np.cumsum(np.diff(starts) * rates[:-1])])

    def time_of_row(self, n: np.ndarray | float) -> np.ndarray:
        rows = self._rows_at_starts()
        n = np.asarray(n, dtype=np.float64)
        i = np.searchsorted(rows, n, side="right") - 1
        return np.asarray(self.starts_s)[i] + (n - rows[i]) / np.asarray(self.rates_eps)[i]

    def rows_by(self, t_s: float) -> float:
        i = max(0, int(np.searchsorted(self.starts_s, t_s, side="right")) - 1)
        return float(self._rows_at_starts()[i] + (t_s - self.starts_s[i]) * self.rates_eps[i])

    def rate_at(self, t_s: float) -> float:
        i = max(0, int(np.searchsorted(self.starts_s, t_s, side="right")) - 1)
        return self.rates_eps[i]


def _check_max_rows(max_rows: int) -> None:
    if not _is_int(max_rows) or max_rows < 1:
        msg = f"read(max_rows) needs an int >= 1, got {max_rows!r}"
        raise ConfigError(msg)


def _concat(parts: list[pa.RecordBatch]) -> pa.RecordBatch:
    return parts[0] if len(parts) == 1 else pa.concat_batches(parts)


class _BatchSlicer:
    """Turns an iterator of record batches into reads of at most ``max_rows`` rows.

    Small batches are joined up to ``max_rows`` (batch size rules the cost of a channel hop);
    empty batches are skipped, so a read returns ``None`` only at the end.
    """

    def __init__(self, batches: Iterator[pa.RecordBatch]) -> None:
        self._batches = batches
        self._pending: pa.RecordBatch | None = None
        self._offset = 0
        self._done = False

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        _check_max_rows(max_rows)
        parts: list[pa.RecordBatch] = []
        need = max_rows
        while need > 0:
            if self._pending is None or self._offset >= self._pending.num_rows:
                nxt = None if self._done else next(self._batches, None)
                if nxt is None:
                    self._done = True
                    self._pending = None
                    break
                self._pending, self._offset = nxt, 0
                continue
            take = min(need, self._pending.num_rows - self._offset)
            parts.append(self._pending.slice(self._offset, take))
            self._offset += take
            need -= take
        if not parts:
            return None
        return _concat(parts)

    def close(self) -> None:
        self._pending = None
        self._done = True
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()


# --------------------------------------------------------------------------------------------
# key-count generator

_KEY_TYPES = ("int", "str")


@dataclass(frozen=True)
class KeyCountGenerator:
    """A deterministic key-count event stream; build it with :func:`generator`.

    The stream is ``ceil(events / chunk_rows)`` chunks; chunk ``c`` is drawn from
    ``np.random.default_rng([seed, c])``, so it is the same whatever the parallelism. Instance
    ``i`` of ``P`` owns chunks ``i, i + P, i + 2P, ...``.

    Keys follow a bounded Zipf law over ``keys`` distinct key ids: rank ``r`` (1-based) has
    probability proportional to ``1 / r**zipf`` (``zipf=0`` is uniform). Ranks map to key ids
    through a seeded permutation, so hot keys are spread over the key space. With
    ``hot_key_fraction=f``, each event independently (probability ``f``) goes to the key of
    rank 1 instead.

    Columns: ``key`` (int64 key id, or string ``f"k{id}"`` with ``key_type="str"``) and ``seq``
    (int64, the per-key sequence number 0, 1, 2, ... within one instance's stream, in read order).
    """

    events: int
    keys: int
    zipf: float = 1.1
    seed: int = 0
    rate_eps: float = 0.0
    key_type: str = "int"
    hot_key_fraction: float = 0.0
    chunk_rows: int = 65536
    rate_schedule: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.events) or self.events < 0:
            msg = f"events must be an int >= 0, got {self.events!r}"
            raise ConfigError(msg)
        _check_positive_int("keys", self.keys)
        if isinstance(self.zipf, bool) or not isinstance(self.zipf, (int, float, np.number)):
            msg = f"zipf must be a number >= 0 (0 = uniform, ~1.1 = skewed), got {self.zipf!r}"
            raise ConfigError(msg)
        if not math.isfinite(self.zipf) or self.zipf < 0:
            msg = (
                f"zipf must be a finite number >= 0 (0 = uniform, ~1.1 = skewed), got {self.zipf!r}"
            )
            raise ConfigError(msg)
        if not _is_int(self.seed) or self.seed < 0:
            msg = f"seed must be an int >= 0, got {self.seed!r}"
            raise ConfigError(msg)
        _check_rate(self.rate_eps)
        if self.key_type not in _KEY_TYPES:
            msg = f"key_type must be one of {list(_KEY_TYPES)}, got {self.key_type!r}"
            raise ConfigError(msg)
        f = self.hot_key_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float, np.number)) or not 0 <= f <= 1:
            msg = (
                f"hot_key_fraction must be a number in [0, 1], got {f!r}; "
                "0.5 sends half of all events to one key"
            )
            raise ConfigError(msg)
        _check_positive_int("chunk_rows", self.chunk_rows)
        sched = _check_rate_schedule(self.rate_schedule, self.rate_eps)
        object.__setattr__(self, "rate_schedule", sched)

    # -- the Source protocol ----------------------------------------------------------------

    def schema(self) -> pa.Schema:
        key_type = pa.int64() if self.key_type == "int" else pa.string()
        return pa.schema([("key", key_type), ("seq", pa.int64())])

    def open(self, index: int, parallelism: int) -> SourceReader:
        _check_partition(index, parallelism)
        draw = _KeyDraw(self, with_names=self.key_type == "str")
        return _GeneratorReader(self, draw, range(index, self.num_chunks, parallelism))

    def describe(self) -> str:
        return (
            f"generator(events={self.events}, keys={self.keys}, zipf={self.zipf}, "
            f"seed={self.seed}, key_type={self.key_type!r}, "
            f"hot_key_fraction={self.hot_key_fraction}, rate_eps={self.rate_eps}"
            + (f", rate_schedule={list(self.rate_schedule)})" if self.rate_schedule else ")")
        )

    # -- oracle helpers ---------------------------------------------------------------------

    @property
    def num_chunks(self) -> int:
        return -(-self.events // self.chunk_rows)

    def key_probabilities(self) -> np.ndarray:
        """Probability of each key id ``0 .. keys-1`` (float64, sums to 1), hot key included."""
        draw = _KeyDraw(self, with_names=False)
        pmf_by_rank = np.diff(draw.cdf, prepend=0.0) * (1.0 - self.hot_key_fraction)
        pmf_by_rank[0] += self.hot_key_fraction
        probs = np.empty(self.keys, dtype=np.float64)
        probs[draw.key_of_rank] = pmf_by_rank
        return probs

    def generate_all(self) -> pa.Table:
        """The whole stream as one table, in global chunk order (the test oracle's input).

        ``seq`` counts per key over the *whole* stream, so it equals the per-instance ``seq``
        only with parallelism 1; with more instances each instance counts its own chunks.
        """
        reader = self.open(0, 1)
        batches = []
        while (batch := reader.read(self.chunk_rows)) is not None:
            batches.append(batch)
        return pa.Table.from_batches(batches, schema=self.schema())

    def to_parquet(self, path: str | os.PathLike[str], *, row_group_rows: int | None = None) -> str:
        """Write the whole stream (as :meth:`generate_all`) to one Parquet file; returns its path.

        Streams chunk by chunk, so memory stays at one chunk. One row group per chunk unless
        ``row_group_rows`` says otherwise.
        """
        path = os.fspath(path)
        row_group_rows = row_group_rows or self.chunk_rows
        _check_positive_int("row_group_rows", row_group_rows)
        reader = self.open(0, 1)
        with pq.ParquetWriter(path, self.schema()) as writer:
            while (batch := reader.read(self.chunk_rows)) is not None:
                writer.write_batch(batch, row_group_size=row_group_rows)
        return path


GUIDE_BITS = 20  # a generator's guide table splits [0, 1) into 2**20 equal buckets (4 MB)
GUIDE_MIN_DRAWS = 1024  # fewer draws: a plain searchsorted is as fast (its fixed cost is lower)


def guide_table(cdf: np.ndarray, bits: int = GUIDE_BITS) -> np.ndarray:
    """For each of the ``2**bits`` equal buckets of [0, 1) and the end: the rank (0-based) a
    draw ``u`` at the bucket's start gets, ``searchsorted(cdf, j / 2**bits, "right")``; see
    :func:`inverse_cdf`."""
    m = 1 << bits
    edges = np.arange(m + 1, dtype=np.float64) / m  # exact: m is a power of two
    table = np.searchsorted(cdf, edges, side="right")
    return table.astype(np.int32 if len(cdf) < 1 << 31 else np.int64)


def inverse_cdf(
    cdf: np.ndarray, guide: np.ndarray, u: np.ndarray, min_draws: int = GUIDE_MIN_DRAWS
) -> np.ndarray:
    """``np.searchsorted(cdf, u, side="right")`` for draws ``0 <= u < 1`` (``cdf[-1] == 1``), the
    same ranks, found through the guide table (:func:`guide_table`): the bucket of ``u`` bounds
    its rank to a few ranks, resolved by a vectorised binary search over only those. A plain
    ``searchsorted`` of unsorted draws over a CDF of a million keys (8 MB) misses the CPU cache
    at each of its ~20 steps: it was a third of an unthrottled generator's time. Under
    ``min_draws`` draws the plain ``searchsorted`` runs."""
    if len(u) < min_draws:
        return np.searchsorted(cdf, u, side="right")
    m = len(guide) - 1
    b = (u * m).astype(np.int64)  # exact floor: b / m <= u < (b + 1) / m
    lo = guide[b].astype(np.int64)  # every cdf entry before lo is <= b / m <= u
    hi = np.minimum(guide[b + 1], len(cdf) - 1).astype(np.int64)  # cdf[hi] > u (or hi is last)
    todo = np.flatnonzero(lo < hi)
    if todo.size:
        lo_t, hi_t, u_t = lo[todo], hi[todo], u[todo]
        while True:
            open_ = lo_t < hi_t
            if not open_.any():
                break
            mid = (lo_t + hi_t) >> 1
            right = cdf[mid] <= u_t  # the rank is past mid
            lo_t = np.where(open_ & right, mid + 1, lo_t)
            hi_t = np.where(open_ & ~right, mid, hi_t)
        lo[todo] = lo_t
    return lo


class _KeyDraw:
    """The precomputed pieces of a generator: Zipf CDF, rank -> key id, key id -> string."""

    def __init__(self, spec: KeyCountGenerator, *, with_names: bool) -> None:
        ranks = np.arange(1, spec.keys + 1, dtype=np.float64)
        weights = ranks ** (-float(spec.zipf))
        cdf = np.cumsum(weights)
        cdf /= cdf[-1]
        cdf[-1] = 1.0  # u < 1 always lands on a valid rank
        self.cdf = cdf
        self.guide = guide_table(cdf)
        # A different entropy length than the chunk seeds [seed, c]: an independent stream.
        self.key_of_rank = np.random.default_rng([spec.seed, 0x5EED, 0xC0FFEE]).permutation(
            spec.keys
        )
        self.names: pa.Array | None = None
        if with_names:
            ids = pa.array(np.arange(spec.keys, dtype=np.int64)).cast(pa.string())
            self.names = pc.binary_join_element_wise("k", ids, "")

    def chunk_draws(
        self, spec: KeyCountGenerator, chunk: int
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The uniform draws of a chunk and which of its events go to the hot key (None: no hot
        key); :meth:`key_ids` turns any slice of them into key ids."""
        start = chunk * spec.chunk_rows
        n = min(spec.chunk_rows, spec.events - start)
        rng = np.random.default_rng([spec.seed, chunk])
        u = rng.random(n)
        hot = rng.random(n) < spec.hot_key_fraction if spec.hot_key_fraction > 0 else None
        return u, hot

    def key_ids(self, u: np.ndarray, hot: np.ndarray | None) -> np.ndarray:
        ranks = inverse_cdf(self.cdf, self.guide, u)
        if hot is not None:
            ranks[hot] = 0
        return self.key_of_rank[ranks]


def _cumcount(key_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(position of each row among the earlier rows of its key, distinct keys, their counts)."""
    enc = pc.dictionary_encode(pa.array(key_ids))
    if len(enc.dictionary) <= 1 << 16:  # rows by key with a radix sort of the key's index
        idx = enc.indices.to_numpy(zero_copy_only=False)
        order = np.argsort(idx.astype(np.uint16), kind="stable")
        counts = np.bincount(idx, minlength=len(enc.dictionary))
        starts = np.cumsum(counts) - counts
        within = np.empty(len(key_ids), np.int64)
        within[order] = np.arange(len(key_ids)) - starts[idx[order]]
        return within, enc.dictionary.to_numpy(zero_copy_only=False), counts
    order = np.argsort(key_ids, kind="stable")
    sorted_ids = key_ids[order]
    starts = np.flatnonzero(np.diff(sorted_ids, prepend=sorted_ids[:1] - 1))
    counts = np.diff(starts, append=len(sorted_ids))
    within_sorted = np.arange(len(sorted_ids)) - np.repeat(starts, counts)
    within = np.empty_like(within_sorted)
    within[order] = within_sorted
    return within, sorted_ids[starts], counts


class _GeneratorReader:
    """Reads a generator's chunks. A chunk's uniform draws are made when the chunk starts (cheap);
    its key ids per read, for the rows read: a source at a fixed rate reads a few hundred rows
    every few ms, and turning a whole 65,536-row chunk into key ids at once stalled it for
    ~10 ms every 0.65 s at 100k events/s (the largest part of that run's p99)."""

    def __init__(self, spec: KeyCountGenerator, draw: _KeyDraw, chunks: range) -> None:
        self._spec = spec
        self._draw = draw
        self._chunks = iter(chunks)
        self._u: np.ndarray | None = None  # the current chunk's uniform draws
        self._hot: np.ndarray | None = None  # ... and its hot-key events (None: none)
        self._offset = 0
        self._seen = np.zeros(spec.keys, dtype=np.int64)  # records per key id so far
        self._schema = spec.schema()

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        _check_max_rows(max_rows)
        if self._u is None or self._offset >= len(self._u):
            chunk = next(self._chunks, None)
            if chunk is None:
                self._u = self._hot = None
                return None
            (self._u, self._hot), self._offset = self._draw.chunk_draws(self._spec, chunk), 0
        end = self._offset + max_rows
        hot = None if self._hot is None else self._hot[self._offset : end]
        ids = self._draw.key_ids(self._u[self._offset : end], hot)
        self._offset += len(ids)
        within, distinct, counts = _cumcount(ids)
        seq = self._seen[ids] + within
        self._seen[distinct] += counts
        if self._draw.names is None:
            key: pa.Array = pa.array(ids, type=pa.int64())
        else:
            key = self._draw.names.take(pa.array(ids))
        return pa.RecordBatch.from_arrays(
            [key, pa.array(seq, type=pa.int64())], schema=self._schema
        )

    def close(self) -> None:
        self._u = self._hot = None
        self._chunks = iter(())


def generator(
    events: int,
    keys: int,
    zipf: float = 1.1,
    seed: int = 0,
    rate_eps: float = 0,
    key_type: str = "int",
    hot_key_fraction: float = 0.0,
    chunk_rows: int = 65536,
    rate_schedule: Sequence[tuple[float, float]] = (),
) -> KeyCountGenerator:
    """A deterministic key-count stream of ``events`` events over ``keys`` distinct keys.

    See :class:`KeyCountGenerator` for the distribution and the columns. The events are the same
    whatever the parallelism; ``generate_all()`` gives the whole stream for an oracle.

    ``rate_schedule=[(t_s, eps), ...]`` changes the total rate over time (a load step): from
    ``t_s`` seconds after the source started on, it delivers ``eps`` events/s (``rate_eps``
    applies before the first entry).

    Example::

        >>> gen = generator(events=1000, keys=10, zipf=0, seed=7)
        >>> t = gen.generate_all()
        >>> t.num_rows, sorted(set(t["key"].to_pylist())) == list(range(10))
        (1000, True)
        >>> generator(100, 5, hot_key_fraction=0.5).describe().startswith("generator(")
        True
    """
    return KeyCountGenerator(
        events=events,
        keys=keys,
        zipf=zipf,
        seed=seed,
        rate_eps=rate_eps,
        key_type=key_type,
        hot_key_fraction=hot_key_fraction,
        chunk_rows=chunk_rows,
        rate_schedule=tuple(rate_schedule),  # type: ignore[arg-type]
    )


# --------------------------------------------------------------------------------------------
# files: Parquet, CSV, JSON lines (see raystream.files)


def _file_source(
    path: str | os.PathLike[str],
    fmt: str,
    batch_rows: int,
    rate_eps: float,
    columns: Sequence[str] | None,
    **options: Any,
) -> FileSource:
    _check_positive_int("batch_rows", batch_rows)
    _check_rate(rate_eps)
    return FileSource.build(
        path,
        fmt,
        batch_rows=batch_rows,
        rate_eps=rate_eps,
        columns=None if columns is None else columns,
        **options,
    )


def parquet(
    path: str | os.PathLike[str],
    batch_rows: int = 65536,
    rate_eps: float = 0,
    columns: Sequence[str] | None = None,
    *,
    partitioning: object = "hive",
    filesystem: pafs.FileSystem | None = None,
) -> FileSource:
    """Read Parquet: a file, a folder (recursively, every ``*.parquet``; names starting with
    ``.`` or ``_`` skipped), a glob (``data/**/*.parquet``) or a URI (``s3://bucket/prefix``,
    ``gs://...``, ``hdfs://...``); see :mod:`raystream.files`. Folders named ``col=value`` add
    ``col`` (hive partitions; ``partitioning=None`` turns that off, a
    :func:`pyarrow.dataset.partitioning` sets their types). ``columns``: only these, in this
    order (the other columns are not read at all). ``filesystem``: a configured
    :class:`pyarrow.fs.FileSystem` (e.g. an ``S3FileSystem`` with its endpoint) ``path`` is on.

    Instances split the input by row group: each row group goes to exactly one instance.
    Raises :class:`SourceError` at once when nothing matches or a file is unreadable, and
    :class:`SchemaError` when the files disagree on their schema (naming both files).

    Example::

        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> d = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"key": [1, 2, 3]}), f"{d}/a.parquet")
        >>> src = parquet(d)
        >>> src.schema().names, src.open(0, 1).read(10).num_rows
        (['key'], 3)
    """
    return _file_source(
        path,
        "parquet",
        batch_rows,
        rate_eps,
        columns,
        partitioning=partitioning,
        filesystem=filesystem,
    )


def csv(
    path: str | os.PathLike[str],
    batch_rows: int = 65536,
    rate_eps: float = 0,
    columns: Sequence[str] | None = None,
    *,
    schema: pa.Schema | None = None,
    delimiter: str = ",",
    partitioning: object = "hive",
    filesystem: pafs.FileSystem | None = None,
) -> FileSource:
    """Read CSV files with a header line (``*.csv``, ``*.csv.gz``, ``*.tsv`` in a folder; paths,
    globs, URIs and partitions as :func:`parquet`). Types are inferred from each file's first
    block and must agree across files; ``schema=`` declares them instead (every file must then
    hold exactly those columns). Each file goes to exactly one instance.

    Example::

        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> _ = open(f"{d}/a.csv", "w").write("key,v\\n1,x\\n2,y\\n")
        >>> csv(d).open(0, 1).read(10).to_pydict()
        {'key': [1, 2], 'v': ['x', 'y']}
    """
    return _file_source(
        path,
        "csv",
        batch_rows,
        rate_eps,
        columns,
        schema=schema,
        delimiter=delimiter,
        partitioning=partitioning,
        filesystem=filesystem,
    )


def json(
    path: str | os.PathLike[str],
    batch_rows: int = 65536,
    rate_eps: float = 0,
    columns: Sequence[str] | None = None,
    *,
    schema: pa.Schema | None = None,
    partitioning: object = "hive",
    filesystem: pafs.FileSystem | None = None,
) -> FileSource:
    """Read JSON lines, one object a line (``*.json``, ``*.jsonl``, ``*.ndjson``, gzipped too, in
    a folder; paths, globs, URIs and partitions as :func:`parquet`). Types as :func:`csv`.

    Example::

        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> _ = open(f"{d}/a.jsonl", "w").write('{"key": 1}\\n{"key": 2}\\n')
        >>> json(d).open(0, 1).read(10).to_pydict()
        {'key': [1, 2]}
    """
    return _file_source(
        path,
        "json",
        batch_rows,
        rate_eps,
        columns,
        schema=schema,
        partitioning=partitioning,
        filesystem=filesystem,
    )


# --------------------------------------------------------------------------------------------
# in-memory table


@dataclass(frozen=True)
class TableSource:
    """An in-memory Arrow table; instance ``i`` of ``P`` reads the contiguous row slice
    ``[i * n // P, (i + 1) * n // P)``. Build it with :func:`from_table`."""

    table: pa.Table = field(repr=False)
    rate_eps: float = 0.0

    def __post_init__(self) -> None:
        _check_rate(self.rate_eps)

    def schema(self) -> pa.Schema:
        return self.table.schema

    def open(self, index: int, parallelism: int) -> SourceReader:
        _check_partition(index, parallelism)
        n = self.table.num_rows
        start, stop = index * n // parallelism, (index + 1) * n // parallelism
        return _BatchSlicer(iter(self.table.slice(start, stop - start).to_batches()))

    def describe(self) -> str:
        return f"from_table({self.table.num_rows} rows, columns={self.table.schema.names})"


def from_table(
    table_or_batches: pa.Table | pa.RecordBatch | Sequence[pa.RecordBatch],
    rate_eps: float = 0,
) -> TableSource:
    """An in-memory source over an Arrow table, a record batch or a non-empty list of batches.

    Example::

        >>> import pyarrow as pa
        >>> src = from_table(pa.table({"key": [1, 2, 3, 4]}))
        >>> src.open(1, 2).read(10).to_pydict()
        {'key': [3, 4]}
    """
    data = table_or_batches
    if isinstance(data, pa.RecordBatch):
        table = pa.Table.from_batches([data])
    elif isinstance(data, pa.Table):
        table = data
    elif isinstance(data, Sequence) and data and all(isinstance(b, pa.RecordBatch) for b in data):
        try:
            table = pa.Table.from_batches(list(data))
        except pa.ArrowInvalid as exc:
            msg = (
                f"from_table got record batches with different schemas ({exc}); "
                "expected one schema for all batches."
            )
            raise SchemaError(msg) from exc
    else:
        msg = (
            "from_table expects a pyarrow Table, a RecordBatch or a non-empty list of "
            f"RecordBatches, got {type(data).__name__}. Convert with pyarrow.table(...) or "
            "pyarrow.Table.from_pandas(...)."
        )
        raise ConfigError(msg)
    return TableSource(table=table, rate_eps=rate_eps)


# --------------------------------------------------------------------------------------------
# pushed in from outside: Spark (batch and Structured Streaming), or any writer


def spark(dataframe: object, **options: object) -> object:
    """A batch Spark DataFrame whose tasks push Arrow batches into the job; see
    :func:`raystream.spark.spark` for the options."""
    from raystream.spark import spark as _spark

    return _spark(dataframe, **options)  # type: ignore[arg-type]


def spark_stream(dataframe: object, **options: object) -> object:
    """A Structured Streaming DataFrame pushed in micro-batch by micro-batch, exactly once; see
    :func:`raystream.spark.spark_stream` for the options (``checkpoint_location`` is required)."""
    from raystream.spark import spark_stream as _spark_stream

    return _spark_stream(dataframe, **options)  # type: ignore[arg-type]


def push(schema: pa.Schema, *, capacity_rows: int = 400_000) -> object:
    """Rows that outside writers push into the source actors (see :mod:`raystream.ingest`)."""
    from raystream.ingest import push as _push

    return _push(schema, capacity_rows=capacity_rows)
