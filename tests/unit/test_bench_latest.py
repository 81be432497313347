"""The key-count benchmark's latest-count sink (bench/_latest.py): the table it returns is the
largest count per key (checked against DuckDB over every row written), and a write does not wait
for a compaction that runs in the writer's thread."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import bench._latest as latest  # noqa: E402
from bench._latest import LatestCountSink  # noqa: E402


def _batches(n: int, rows: int, keys: int, seed: int) -> list[pa.RecordBatch]:
    rng = np.random.default_rng(seed)
    return [
        pa.record_batch(
            {
                "key": pa.array(rng.integers(0, keys, rows)),
                "count": pa.array(rng.integers(0, 10**9, rows)),
                "other": pa.array(np.zeros(rows)),
            }
        )
        for _ in range(n)
    ]


def _oracle(batches: list[pa.RecordBatch]) -> pa.Table:
    rows = pa.Table.from_batches(batches)  # noqa: F841 - read by DuckDB by name
    return duckdb.sql(
        'SELECT key, max("count") AS "count" FROM rows GROUP BY key ORDER BY key'
    ).fetch_arrow_table()


@pytest.mark.parametrize("min_compact_rows", [1, 500, 10**9])
def test_the_table_is_the_largest_count_per_key(min_compact_rows: int) -> None:
    batches = _batches(200, 97, 3_000, seed=min_compact_rows % 7)
    w = LatestCountSink(min_compact_rows=min_compact_rows).open(0, 1)
    for b in batches:
        w.write(b)
    got = w.close()
    want = _oracle(batches)
    assert got.column_names == ["key", "count"]
    assert got["key"].to_pylist() == want["key"].to_pylist()
    assert got["count"].to_pylist() == want["count"].to_pylist()
    if min_compact_rows < 10**9:
        assert w.compactions >= 1


def test_writes_go_on_while_a_compaction_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compaction held in its thread: later writes return at once (their rows wait for the
    next compaction), none starts meanwhile, and the final table has every row."""
    release = threading.Event()
    started = threading.Event()
    real = latest.latest_counts

    def held(table: pa.Table) -> pa.Table:
        if threading.current_thread() is not threading.main_thread():
            started.set()
            assert release.wait(10), "the test did not release the compaction"
        return real(table)

    monkeypatch.setattr(latest, "latest_counts", held)
    batches = _batches(50, 100, 400, seed=3)
    w = LatestCountSink(min_compact_rows=1_000).open(0, 1)
    for b in batches[:10]:  # 1,000 rows: a compaction starts
        w.write(b)
    assert started.wait(10) and w.compactions == 1
    for b in batches[10:]:
        w.write(b)  # returns although the compaction is held
    assert w.compactions == 1
    release.set()
    got = w.close()
    want = _oracle(batches)
    assert got["key"].to_pylist() == want["key"].to_pylist()
    assert got["count"].to_pylist() == want["count"].to_pylist()


def test_a_failed_compaction_fails_the_writer_with_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(table: pa.Table) -> pa.Table:
        raise pa.ArrowInvalid("compaction failed on purpose")

    monkeypatch.setattr(latest, "latest_counts", broken)
    w = LatestCountSink(min_compact_rows=10).open(0, 1)
    with pytest.raises(pa.ArrowInvalid, match="on purpose"):
        for b in _batches(20, 10, 50, seed=1):
            w.write(b)
        w.close()
