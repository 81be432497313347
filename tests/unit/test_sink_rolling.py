"""The Parquet sink rolling part files by size and by age, with and without checkpoints, and
exactly once across a crash and a restore. Oracle: DuckDB reading the published files. No Ray."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raystream as rs
from raystream import sinks
from raystream.errors import ConfigError


def batch(lo: int, n: int) -> pa.RecordBatch:
    ids = np.arange(lo, lo + n, dtype=np.int64)
    return pa.record_batch({"id": ids, "pad": pa.array([f"row-{i:08d}" for i in ids])})


def published_ids(directory: Path) -> list[int]:
    """Every id in the visible part files, with repeats (DuckDB skips hidden files)."""
    got = duckdb.sql(f"select id from read_parquet('{directory}/part-*.parquet')")
    return sorted(got.to_arrow_table()["id"].to_pylist())


def names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rolls_by_size_without_checkpoints(tmp_path: Path) -> None:
    writer = rs.sinks.parquet(tmp_path, max_file_bytes=6_000).open(3, 4)
    for i in range(40):
        writer.write(batch(i * 100, 100))
        assert not [n for n in names(tmp_path) if not n.startswith(".")]  # nothing visible yet
    result = writer.close()
    visible = names(tmp_path)
    assert visible == [f"part-00003-r{k:04d}.parquet" for k in range(len(visible))]
    assert len(visible) > 3
    assert list(result.paths) == [str(tmp_path / n) for n in visible]
    assert published_ids(tmp_path) == list(range(4000))
    sizes = [os.path.getsize(tmp_path / n) for n in visible]
    # every part but the last reached the bound; none grew more than one batch past it
    one_batch = max(
        pq.ParquetFile(tmp_path / n).metadata.row_group(0).total_byte_size for n in visible
    )
    assert all(s >= 6_000 - 4096 for s in sizes[:-1]), sizes
    assert all(s < 6_000 + one_batch + 4096 for s in sizes), sizes
    assert result.rows == 4000


def test_rolls_by_age_and_publishes_at_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    monkeypatch.setattr(sinks.time, "monotonic", clock)
    writer = rs.sinks.parquet(tmp_path, max_file_s=10).open(0, 1)
    for i in range(12):  # one batch every 3 s: a part holds the batches of <= 10 s
        writer.write(batch(i * 10, 10))
        clock.now += 3
    state = writer.pre_commit(1)
    assert [p["rows"] for p in state["pending"]] == [40, 40, 40]  # 0,3,6,9 | 12..21 | 24..33
    assert all(n.startswith(".") for n in names(tmp_path))  # pre-committed, not visible
    writer.commit(1)
    assert names(tmp_path) == [f"part-00000-00000001-r{k:04d}.parquet" for k in range(3)]
    assert published_ids(tmp_path) == list(range(120))
    writer.write(batch(120, 5))
    writer.close()
    assert published_ids(tmp_path) == list(range(125))


def test_rolled_parts_are_exactly_once_after_a_crash(tmp_path: Path) -> None:
    """Attempt 1 rolls parts, completes checkpoint 1, pre-commits checkpoint 2 (never
    completed), rolls more and dies. Attempt 2 restores checkpoint 1 and the source replays
    every row after it: the output holds each row once."""
    sink = rs.sinks.parquet(tmp_path, max_file_bytes=2_500)
    first = sink.open(0, 2)
    other = sink.open(1, 2)  # another instance's files must survive the restore untouched
    other.write(batch(10_000, 50))
    other.pre_commit(1)
    other.commit(1)
    for i in range(10):
        first.write(batch(i * 50, 50))
    at_1 = first.pre_commit(1)
    first.commit(1)
    assert len(at_1["pending"]) > 1
    for i in range(10, 20):
        first.write(batch(i * 50, 50))
    first.pre_commit(2)  # the checkpoint never completes
    for i in range(20, 27):
        first.write(batch(i * 50, 50))
    assert any(n.endswith(".rolled") for n in names(tmp_path))
    assert any(n.endswith(".pending") for n in names(tmp_path))
    # crash: no abort, no close. Attempt 2:
    again = sink.open(0, 2)
    again.restore(at_1)
    assert not [n for n in names(tmp_path) if n.startswith(".")]
    for i in range(10, 30):  # replay from checkpoint 1 on
        again.write(batch(i * 50, 50))
    again.close()
    counts = collections.Counter(published_ids(tmp_path))
    assert counts == collections.Counter(list(range(1500)) + list(range(10_000, 10_050)))


def test_abort_drops_rolled_parts_not_pre_committed(tmp_path: Path) -> None:
    writer = rs.sinks.parquet(tmp_path, max_file_bytes=5_000).open(0, 1)
    for i in range(6):
        writer.write(batch(i * 50, 50))
    writer.abort()
    assert names(tmp_path) == []


def test_rolling_upsert_reads_back_the_same_table(tmp_path: Path) -> None:
    rows = 3000
    keys = np.arange(rows) % 97
    changes = pa.table({"k": keys, "v": np.arange(rows)})
    for sub, roll in (("plain", {}), ("rolled", {"max_file_bytes": 4_000})):
        w = rs.sinks.parquet(tmp_path / sub, mode="upsert", key=["k"], **roll).open(0, 1)
        for b in changes.to_batches(max_chunksize=100):
            w.write(b)
        w.close()
    assert len(os.listdir(tmp_path / "rolled")) > 1
    plain = rs.read_upsert(tmp_path / "plain").sort_by("k")
    rolled = rs.read_upsert(tmp_path / "rolled").sort_by("k")
    assert rolled.equals(plain)
    want = duckdb.sql("select k, max(v) as v from changes group by k order by k").to_arrow_table()
    assert rolled.select(["k", "v"]).to_pylist() == want.to_pylist()


def test_only_empty_batches_still_record_the_schema(tmp_path: Path) -> None:
    writer = rs.sinks.parquet(tmp_path, max_file_s=5).open(0, 1)
    writer.write(batch(0, 0))
    writer.close()
    assert names(tmp_path) == ["part-00000-r0000.parquet"]
    assert pq.read_schema(tmp_path / "part-00000-r0000.parquet").names == ["id", "pad"]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_file_bytes": 0}, "max_file_bytes must be an int >= 1"),
        ({"max_file_bytes": 1.5}, "max_file_bytes must be an int >= 1"),
        ({"max_file_s": 0}, "max_file_s must be a number > 0"),
        ({"max_file_s": float("inf")}, "max_file_s must be a number > 0"),
    ],
)
def test_bad_rolling_options(tmp_path: Path, options: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        rs.sinks.parquet(tmp_path, **options)
