"""A Parquet sink that publishes a file per checkpoint for days keeps the newest paths only:
its result counts every file (``files``) and row (``rows``) exactly, ``paths`` lists the newest
``PUBLISHED_PATHS_KEPT``; the folder itself is the oracle (files listed, rows read back)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

import raystream as rs
from raystream import history
from raystream.history import PublishedFiles
from raystream.status_view import describe_sink_result

KEEP = 4


@pytest.fixture
def small_keep(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(history, "PUBLISHED_PATHS_KEPT", KEEP)
    return KEEP


def ids(lo: int, hi: int) -> pa.RecordBatch:
    v = np.arange(lo, hi, dtype=np.int64)
    return pa.record_batch({"id": v, "day": [f"d{i % 3}" for i in range(lo, hi)]})


def visible(path: Path) -> list[str]:
    """Every published part file under ``path`` (relative), sorted."""
    return sorted(
        os.path.relpath(os.path.join(here, f), path)
        for here, _, files in os.walk(path)
        for f in files
        if f.endswith(".parquet") and not f.startswith(".")
    )


def test_published_files_count_all_and_keep_the_newest() -> None:
    a, b = PublishedFiles(keep=3), PublishedFiles(keep=3)
    a.extend([("x1", 1), ("x2", 2)])
    b.extend([("y1", 10), ("y2", 20), ("y3", 30), ("y4", 40)])
    a.merge(b)
    assert (a.files, a.rows, a.paths, a.last) == (6, 103, ("y2", "y3", "y4"), "y4")
    empty = PublishedFiles(keep=3)
    assert not empty and empty.last is None and empty.paths == ()
    with pytest.raises(rs.errors.ConfigError, match="keep must be an int >= 1"):
        PublishedFiles(keep=0)


def test_a_file_per_checkpoint_is_counted_with_its_rows_and_the_newest_paths_listed(
    tmp_path: Path, small_keep: int
) -> None:
    out = tmp_path / "out"
    writer = rs.sinks.parquet(out).open(0, 1)
    written = 0
    for cid in range(1, 11):
        writer.write(ids(written, written + 7 * cid))
        written += 7 * cid
        writer.pre_commit(cid)
        writer.commit(cid)
    writer.write(ids(written, written + 5))  # after the last checkpoint: the final part
    written += 5
    state = writer.pre_commit(11)  # the crash comes between this checkpoint and its commit
    writer.write(ids(written, written + 3))
    writer.abort()

    again = rs.sinks.parquet(out).open(0, 1)
    again.restore(state)  # publishes checkpoint 11's file
    again.write(ids(written, written + 3))  # replayed
    written += 3
    result = again.close()

    on_disk = visible(out)
    table = pq.read_table(out)
    assert sorted(table.column("id").to_pylist()) == list(range(written))  # exactly once
    # the restoring writer counts what it published (checkpoint 11's file, its last part)
    assert result.files == 2
    assert result.rows == 5 + 3
    assert [os.path.basename(p) for p in result.paths] == on_disk[-2:]
    assert result.path == result.paths[-1]

    # one writer that published more files than it lists
    out2 = tmp_path / "out2"
    writer = rs.sinks.parquet(out2).open(0, 1)
    for cid in range(1, 11):
        writer.write(ids(cid * 100, cid * 100 + cid))
        writer.pre_commit(cid)
        writer.commit(cid)
    writer.write(ids(5000, 5004))
    result = writer.close()
    on_disk = visible(out2)
    assert result.files == len(on_disk) == 11
    assert result.rows == pq.read_table(out2).num_rows == sum(range(1, 11)) + 4
    # publishing order is checkpoint order, then the final part (named so it sorts last)
    assert [os.path.basename(p) for p in result.paths] == on_disk[-small_keep:]
    assert describe_sink_result([result]).endswith(f"... ({len(on_disk)} files)")


def test_a_partitioned_sink_counts_every_folders_files(tmp_path: Path, small_keep: int) -> None:
    out = tmp_path / "out"
    w = rs.sinks.parquet(out, partition_by=["day"], max_open_partitions=2).open(0, 1)
    n = 0
    for cid in range(1, 7):
        w.write(ids(n, n + 10 * cid))
        n += 10 * cid
        w.pre_commit(cid)
        w.commit(cid)
    w.write(ids(n, n + 4))
    n += 4
    result = w.close()
    on_disk = visible(out)
    back = ds.dataset(str(out), format="parquet", partitioning="hive").to_table()
    assert sorted(back.column("id").to_pylist()) == list(range(n))
    assert result.files == len(on_disk) > small_keep
    assert result.rows == n
    assert len(result.paths) == small_keep
    assert {os.path.relpath(p, out) for p in result.paths} <= set(on_disk)
    assert sorted(result.partitions) == ["day=d0", "day=d1", "day=d2"]


def test_written_file_counts_its_paths_when_files_is_not_given() -> None:
    w = rs.sinks.WrittenFile("/o/b.parquet", 3, ("/o/a.parquet", "/o/b.parquet"))
    assert w.files == 2
    assert rs.sinks.WrittenFile(None, 0).files == 0
