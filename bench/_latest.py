"""A sink that keeps only the latest count per key, in bounded memory.

A key-count emits a growing count per key and batch; the final answer is the last (= largest)
count of every key. The writer buffers the ``key``/``count`` columns and compacts them with a
pyarrow ``group_by(...).aggregate(max)`` whenever the buffer outgrows the compacted table, so its
memory stays O(distinct keys). ``close()`` returns the final table (``key``, ``count``), sorted
by key.

A compaction runs in a thread of the writer (Arrow's kernels release the GIL) while writes go on
into a new buffer: compacting a table of a million rows takes 100-300 ms, which in the writer's
own call stalled every batch behind it (and, chained to the count, the count too). One runs at a
time; its result is taken by the next write after it finished, or by ``close()``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["LatestCountSink", "latest_counts"]


def latest_counts(table: pa.Table, key: str = "key", count: str = "count") -> pa.Table:
    """One row per key with its largest count, sorted by key (columns ``key``, ``count``)."""
    if table.num_rows == 0:
        return pa.table({"key": table[key], "count": table[count]})
    agg = table.select([key, count]).group_by(key).aggregate([(count, "max")])
    agg = agg.rename_columns({key: "key", f"{count}_max": "count"}).select(["key", "count"])
    return agg.take(pc.sort_indices(agg, sort_keys=[("key", "ascending")]))


@dataclass(frozen=True)
class LatestCountSink:
    """Keeps the latest ``count`` per ``key``; each instance's ``close()`` returns a table."""

    min_compact_rows: int = 1_000_000

    def open(self, index: int, parallelism: int) -> _LatestWriter:
        return _LatestWriter(self.min_compact_rows)

    def describe(self) -> str:
        return "latest_count()"


class _LatestWriter:
    def __init__(self, min_compact_rows: int) -> None:
        self._min = min_compact_rows
        self._compacted: pa.Table | None = None
        self._compacting: Future[pa.Table] | None = None  # a compaction running in the thread
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self.rows_seen = 0
        self.compactions = 0
        self._since: list[pa.Table] = []  # rows written since the last pre_commit

    def write(self, batch: pa.RecordBatch) -> None:
        part = pa.Table.from_batches([batch.select(["key", "count"])])
        self._pending.append(part)
        self._since.append(part)
        self._pending_rows += part.num_rows
        self.rows_seen += part.num_rows
        if self._compacting is not None:
            if not self._compacting.done():
                return  # the running compaction's input is fixed; these rows wait for the next
            self._take_compacted()
        base = self._compacted.num_rows if self._compacted is not None else 0
        if self._pending_rows >= max(self._min, base):
            self._start_compaction()

    def _start_compaction(self) -> None:
        """Compact the table and the buffered rows in the thread; writes go on meanwhile."""
        parts = ([self._compacted] if self._compacted is not None else []) + self._pending
        self._pending, self._pending_rows = [], 0
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="latest-compact")
        self._compacting = self._pool.submit(lambda: latest_counts(pa.concat_tables(parts)))
        self.compactions += 1

    def _take_compacted(self) -> None:
        """The running compaction's table (waits for it; raises its error)."""
        running, self._compacting = self._compacting, None
        if running is not None:
            self._compacted = running.result()

    def _compact(self) -> None:
        """Everything written, compacted now (in the caller)."""
        self._take_compacted()
        parts = ([self._compacted] if self._compacted is not None else []) + self._pending
        self._pending, self._pending_rows = [], 0
        if parts:
            self._compacted = latest_counts(pa.concat_tables(parts))

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---- two-phase commit (jobs with checkpoints): the rows that came since the last checkpoint
    # (their latest count per key) are a blob of that checkpoint; a recovery gives back every
    # committed blob, and the largest count per key over all of them is the table. Cost: the rows
    # of one interval, not the whole table (no join against the previous checkpoint), computed
    # in the checkpoint's upload thread (``{"rows": fn}``) while writes go on.
    def pre_commit(self, checkpoint_id: int) -> dict[str, Callable[[], pa.Table]]:
        since, self._since = self._since, []

        def rows() -> pa.Table:
            if not since:
                schema = {"key": pa.array([], pa.int64()), "count": pa.array([], pa.int64())}
                return pa.table(schema)
            return latest_counts(pa.concat_tables(since))

        return {"rows": rows}

    def commit(self, checkpoint_id: int) -> None:
        """Nothing to publish: the table is returned by ``close``."""

    def restore(self, state: dict[str, list[pa.Table]] | None) -> None:
        tables = (state or {}).get("tables") or []
        if self._compacting is not None:  # what it compacts is replaced by the restored table
            self._compacting.exception()
            self._compacting = None
        self._pending, self._pending_rows = [], 0
        self._compacted = latest_counts(pa.concat_tables(tables)) if tables else None
        self._since = []

    def close(self) -> pa.Table | None:
        try:
            self._compact()
        finally:
            self._shutdown()
        return self._compacted

    def abort(self) -> None:
        if self._compacting is not None:
            self._compacting.cancel()
            self._compacting = None
        self._shutdown()
        self._compacted, self._pending, self._since = None, [], []
