"""Sinks: collect, Parquet (atomic parts, schema checks) and null, against pyarrow as the oracle."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raystream import sinks, sources
from raystream.errors import CheckpointError, ConfigError, SchemaError


def batches_of(n: int, size: int, start: int = 0) -> list[pa.RecordBatch]:
    out = []
    for lo in range(start, start + n, size):
        ids = np.arange(lo, min(lo + size, start + n), dtype=np.int64)
        out.append(pa.record_batch({"id": ids, "v": ids.astype(np.float64) / 2}))
    return out


# ------------------------------------------------------------------------------------------
# collect


def test_collect_concatenates_batches() -> None:
    batches = batches_of(1000, 128)
    writer = sinks.collect().open(0, 1)
    for b in batches:
        writer.write(b)
    assert writer.close().equals(pa.Table.from_batches(batches))


def test_collect_empty_results() -> None:
    writer = sinks.collect().open(0, 1)
    assert writer.close() is None
    writer = sinks.collect().open(0, 1)
    empty = pa.record_batch({"id": pa.array([], pa.int64())})
    writer.write(empty)
    table = writer.close()
    assert table.num_rows == 0 and table.schema == empty.schema


def test_collect_abort_and_reuse_after_close() -> None:
    writer = sinks.collect().open(0, 1)
    writer.write(batches_of(3, 3)[0])
    writer.abort()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(batches_of(3, 3)[0])


# ------------------------------------------------------------------------------------------
# parquet


def test_parquet_sink_roundtrip_over_instances(tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = pickle.loads(pickle.dumps(sinks.parquet(out)))
    inputs = [batches_of(700, 100, start=0), batches_of(300, 64, start=10_000)]
    results = []
    for i, batches in enumerate(inputs):
        writer = sink.open(i, 2)
        for b in batches:
            writer.write(b)
        results.append(writer.close())
    assert sorted(os.listdir(out)) == ["part-00000.parquet", "part-00001.parquet"]
    assert [r.rows for r in results] == [700, 300]
    for r, batches in zip(results, inputs, strict=True):
        assert pq.read_table(r.path).equals(pa.Table.from_batches(batches))
    # Our own directory source reads the whole output back.
    everything = pa.Table.from_batches([b for bs in inputs for b in bs])
    reader = sources.parquet(out).open(0, 1)
    back = pa.Table.from_batches(list(iter(lambda: reader.read(10_000), None)))
    assert back.sort_by("id").equals(everything.sort_by("id"))


def test_parquet_sink_is_atomic_and_abort_leaves_nothing(tmp_path: Path) -> None:
    writer = sinks.parquet(tmp_path).open(3, 4)
    writer.write(batches_of(10, 10)[0])
    assert not (tmp_path / "part-00003.parquet").exists()  # only the .tmp so far
    writer.abort()
    assert os.listdir(tmp_path) == []


def test_parquet_sink_without_batches_writes_no_file(tmp_path: Path) -> None:
    result = sinks.parquet(tmp_path / "d").open(0, 1).close()
    assert result == sinks.WrittenFile(path=None, rows=0)
    assert os.listdir(tmp_path / "d") == []


def test_parquet_sink_casts_compatible_batches(tmp_path: Path) -> None:
    writer = sinks.parquet(tmp_path).open(0, 1)
    writer.write(pa.record_batch({"id": pa.array([1], pa.int64()), "s": pa.array(["a"])}))
    writer.write(
        pa.record_batch({"s": pa.array(["b"], pa.large_string()), "id": pa.array([2], pa.int32())})
    )
    writer.write(
        pa.record_batch({"id": pa.array([3], pa.int64()), "s": pa.array([None], pa.null())})
    )
    result = writer.close()
    t = pq.read_table(result.path)
    assert t.schema == pa.schema([("id", pa.int64()), ("s", pa.string())])
    assert t.to_pydict() == {"id": [1, 2, 3], "s": ["a", "b", None]}


@pytest.mark.parametrize(
    ("batch", "fragment"),
    [
        (
            pa.record_batch({"id": pa.array([1], pa.int64())}),
            r"columns \['id'\], expected \['id', 's'\]",
        ),
        (
            pa.record_batch({"id": pa.array(["1"]), "s": pa.array(["x"])}),
            "'id' has type string, expected int64",
        ),
        (pa.record_batch({"id": pa.array([1.5]), "s": pa.array(["x"])}), "'id' has type double"),
    ],
)
def test_parquet_sink_rejects_other_schemas(
    tmp_path: Path, batch: pa.RecordBatch, fragment: str
) -> None:
    writer = sinks.parquet(tmp_path).open(0, 1)
    writer.write(pa.record_batch({"id": pa.array([1], pa.int64()), "s": pa.array(["a"])}))
    with pytest.raises(SchemaError, match=fragment):
        writer.write(batch)
    writer.abort()
    assert os.listdir(tmp_path) == []


def test_parquet_sink_rejects_unsafe_casts(tmp_path: Path) -> None:
    writer = sinks.parquet(tmp_path).open(0, 1)
    writer.write(pa.record_batch({"id": pa.array([1], pa.int8())}))
    with pytest.raises(SchemaError, match="cannot be cast safely"):
        writer.write(pa.record_batch({"id": pa.array([1000], pa.int64())}))
    writer.abort()


def test_parquet_sink_path_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file; expected a directory"):
        sinks.parquet(f).open(0, 1)


# ------------------------------------------------------------------------------------------
# null


def test_null_sink_counts_rows() -> None:
    writer = sinks.null().open(0, 1)
    for b in batches_of(1234, 100):
        writer.write(b)
    assert writer.close() == 1234
    assert isinstance(sinks.null(), sinks.Sink)
    assert isinstance(writer, sinks.SinkWriter)


# ------------------------------------------------------------------------------------------
# two-phase commit (checkpoints)


def visible(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.parquet") if not p.name.startswith("."))


def read_all(directory: Path) -> pa.Table:
    """What a reader of the output sees: DuckDB over dir/*.parquet."""
    import duckdb

    if not visible(directory):
        return pa.table({"id": pa.array([], pa.int64()), "v": pa.array([], pa.float64())})
    out = duckdb.sql(f"SELECT id, v FROM read_parquet('{directory}/*.parquet') ORDER BY id")
    return out.to_arrow_table()


def oracle(*ranges: tuple[int, int]) -> pa.Table:
    ids = np.sort(np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in ranges]))
    return pa.table({"id": ids, "v": ids.astype(np.float64) / 2})


def write_range(writer: sinks.SinkWriter, a: int, b: int) -> None:
    for batch in batches_of(b - a, 50, start=a):
        writer.write(batch)


def test_parquet_publishes_only_on_commit(tmp_path: Path) -> None:
    writer = sinks.parquet(tmp_path).open(0, 1)
    assert isinstance(writer, sinks.CommittingSinkWriter)
    write_range(writer, 0, 100)
    s1 = writer.pre_commit(1)
    assert s1 == {
        "index": 0,
        "checkpoint": 1,
        "pending": [{"file": ".part-00000-00000001.parquet.pending", "checkpoint": 1, "rows": 100}],
    }
    assert visible(tmp_path) == [] and read_all(tmp_path).num_rows == 0
    write_range(writer, 100, 130)
    s2 = writer.pre_commit(2)
    assert [p["checkpoint"] for p in s2["pending"]] == [1, 2]  # 1 not committed yet
    assert writer.pre_commit(3)["pending"] == s2["pending"]  # no rows since: no new part
    writer.commit(1)
    assert visible(tmp_path) == ["part-00000-00000001.parquet"]
    assert read_all(tmp_path).equals(oracle((0, 100)))
    writer.commit(1)  # idempotent
    writer.commit(3)  # everything pre-committed at 3 or before
    writer.commit(3)
    assert read_all(tmp_path).equals(oracle((0, 130)))
    write_range(writer, 130, 140)
    result = writer.close()
    assert visible(tmp_path) == [
        "part-00000-00000001.parquet",
        "part-00000-00000002.parquet",
        "part-00000.parquet",
    ]
    assert result.rows == 140 and result.path == str(tmp_path / "part-00000.parquet")
    assert [os.path.basename(p) for p in result.paths] == visible(tmp_path)
    assert read_all(tmp_path).equals(oracle((0, 140)))
    writer.commit(4)  # a late notification after close is a no-op
    assert sorted(os.listdir(tmp_path)) == visible(tmp_path)


def test_parquet_close_publishes_pending_parts(tmp_path: Path) -> None:
    writer = sinks.parquet(tmp_path).open(2, 3)
    write_range(writer, 0, 60)
    writer.pre_commit(7)  # end of input before checkpoint 7 completed
    result = writer.close()
    assert result == sinks.WrittenFile(
        path=str(tmp_path / "part-00002-00000007.parquet"),
        rows=60,
        paths=(str(tmp_path / "part-00002-00000007.parquet"),),
    )
    assert read_all(tmp_path).equals(oracle((0, 60)))


def test_parquet_abort_keeps_pre_committed_parts(tmp_path: Path) -> None:
    writer = sinks.parquet(tmp_path).open(0, 1)
    write_range(writer, 0, 10)
    writer.pre_commit(1)
    write_range(writer, 10, 20)
    writer.abort()
    assert sorted(os.listdir(tmp_path)) == [".part-00000-00000001.parquet.pending"]


def test_parquet_restore_publishes_listed_pending_and_deletes_the_rest(tmp_path: Path) -> None:
    sink = sinks.parquet(tmp_path)
    w0 = sink.open(0, 2)
    write_range(w0, 0, 100)
    w0.pre_commit(1)
    w0.commit(1)
    write_range(w0, 100, 200)
    s2 = json.loads(json.dumps(w0.pre_commit(2)))  # as stored in a manifest
    # checkpoint 2 completes, the process dies before commit(2) renames the file
    write_range(w0, 200, 300)
    w0.pre_commit(3)  # checkpoint 3 never completes
    write_range(w0, 300, 350)  # in the .tmp file
    # instance 1: its own committed, pending and in-progress files
    w1 = sink.open(1, 2)
    write_range(w1, 10_000, 10_050)
    w1.pre_commit(2)
    w1.commit(2)
    write_range(w1, 10_050, 10_070)
    w1.pre_commit(3)
    write_range(w1, 10_070, 10_080)
    others = {p.name: p.read_bytes() for p in tmp_path.iterdir() if "part-00001" in p.name}
    assert len(others) == 3
    del w0  # crash: no close, no abort

    for _attempt in range(2):  # a crash during recovery: restoring again gives the same files
        again = sink.open(0, 2)
        again.restore(s2)
        assert sorted(p.name for p in tmp_path.iterdir() if "part-00000" in p.name) == [
            "part-00000-00000001.parquet",
            "part-00000-00000002.parquet",
        ]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if "part-00001" in p.name} == others
    # the replay after checkpoint 2
    write_range(again, 200, 350)
    result = again.close()
    assert result.rows == 250  # the part restored (checkpoint 2) and the replayed rows
    assert read_all(tmp_path).equals(oracle((0, 350), (10_000, 10_050)))
    with pytest.raises(RuntimeError, match="right after open"):
        w = sink.open(0, 2)
        w.write(batches_of(1, 1)[0])
        w.restore(s2)


def test_parquet_restore_without_checkpoint_drops_a_failed_attempts_output(
    tmp_path: Path,
) -> None:
    sink = sinks.parquet(tmp_path)
    first = sink.open(0, 2)
    write_range(first, 0, 40)
    first.close()  # this instance finished, then another instance failed the job
    other = sink.open(1, 2)
    write_range(other, 100, 110)
    other.close()
    again = sink.open(0, 2)
    again.restore(None)
    assert visible(tmp_path) == ["part-00001.parquet"]
    write_range(again, 0, 40)
    again.close()
    assert read_all(tmp_path).equals(oracle((0, 40), (100, 110)))


def test_parquet_restore_rejects_missing_files(tmp_path: Path) -> None:
    writer = sinks.parquet(tmp_path).open(0, 1)
    write_range(writer, 0, 10)
    state = writer.pre_commit(1)
    os.remove(tmp_path / state["pending"][0]["file"])
    with pytest.raises(CheckpointError, match="neither it nor 'part-00000-00000001.parquet'"):
        sinks.parquet(tmp_path).open(0, 1).restore(state)


@pytest.mark.parametrize("seed", range(4))
def test_parquet_exactly_once_over_crashes(tmp_path: Path, seed: int) -> None:
    """A source of ids 0..n-1 read in batches, a checkpoint every few batches recording the
    source offset and the sink state; crashes at random points (also between a checkpoint's
    completion and its commit). After recovery from the last complete checkpoint the source
    replays from its offset. The reader must see every id exactly once."""
    rng = np.random.default_rng(seed)
    n, size = 3000, 37
    sink = sinks.parquet(tmp_path / "out")
    complete: dict | None = None  # {"offset", "sink"} of the latest complete checkpoint
    cid = 0
    crashes = 0
    while True:
        writer = sink.open(0, 1)
        writer.restore(complete["sink"] if complete else None)
        offset = complete["offset"] if complete else 0
        crashed = False
        while offset < n:
            hi = min(offset + size, n)
            writer.write(oracle((offset, hi)).to_batches()[0])
            offset = hi
            if rng.random() < 0.3:
                cid += 1
                state = json.loads(json.dumps(writer.pre_commit(cid)))
                if rng.random() < 0.8:  # the checkpoint completes
                    complete = {"offset": offset, "sink": state}
                    if rng.random() < 0.8:
                        writer.commit(cid)
            if crashes < 5 and rng.random() < 0.05:
                crashes += 1
                crashed = True
                break  # the writer is dropped: no close, no abort
        if not crashed:
            writer.close()
            break
    seen = read_all(tmp_path / "out")
    assert seen.equals(oracle((0, n)))
    assert crashes >= 1
    assert not [p for p in os.listdir(tmp_path / "out") if p.startswith(".")]


def test_collect_two_phase() -> None:
    writer = sinks.collect().open(0, 1)
    assert isinstance(writer, sinks.CommittingSinkWriter)
    first = writer.pre_commit(1)["rows"]
    assert first.num_rows == 0
    write_range(writer, 0, 120)
    rows1 = writer.pre_commit(2)["rows"]
    assert rows1.equals(oracle((0, 120)))
    write_range(writer, 120, 130)
    rows2 = writer.pre_commit(3)["rows"]
    assert rows2.equals(oracle((120, 130)))
    assert writer.pre_commit(4)["rows"].num_rows == 0
    writer.commit(3)
    write_range(writer, 130, 150)
    del writer  # crash after checkpoint 3; rows 130..150 are replayed
    again = sinks.collect().open(0, 1)
    again.restore({"tables": [first, rows1, rows2]})
    write_range(again, 130, 160)
    assert again.close().equals(oracle((0, 160)))
    nothing = sinks.collect().open(0, 1)
    nothing.restore(None)
    assert nothing.close() is None


def test_null_two_phase() -> None:
    writer = sinks.null().open(0, 1)
    assert isinstance(writer, sinks.CommittingSinkWriter)
    write_range(writer, 0, 70)
    state = writer.pre_commit(1)
    writer.commit(1)
    write_range(writer, 70, 90)
    again = sinks.null().open(0, 1)
    again.restore(state)
    write_range(again, 70, 100)
    assert again.close() == 100


def test_parquet_restore_of_another_index_publishes_its_files(tmp_path: Path) -> None:
    """Recovery at a lower parallelism: instance 0 restores the state instance 1 recorded."""
    sink = sinks.parquet(tmp_path)
    w1 = sink.open(1, 2)
    write_range(w1, 0, 30)
    state = w1.pre_commit(4)
    write_range(w1, 30, 40)  # after the checkpoint, in instance 1's .tmp
    del w1
    w0 = sink.open(0, 1)
    w0.restore(state)
    assert visible(tmp_path) == ["part-00001-00000004.parquet"]
    assert (tmp_path / ".part-00001.parquet.tmp").exists()  # not index 0's to delete
    write_range(w0, 30, 40)
    assert w0.close().rows == 40
    assert read_all(tmp_path).equals(oracle((0, 40)))


def test_parquet_pre_commit_split_closes_the_part_in_a_thread_while_writes_go_on(
    tmp_path: Path,
) -> None:
    """The part is renamed to its pending name at once; it is closed in a thread while the next
    part takes writes; the state lists it as ``pre_commit`` would; commits and close publish
    every row once. A part whose close failed fails the next write."""
    import threading

    writer = sinks.parquet(tmp_path).open(0, 1)
    write_range(writer, 0, 100)
    state, finish = writer.pre_commit_split(1)
    assert finish is not None
    assert state == {
        "index": 0,
        "checkpoint": 1,
        "pending": [{"file": ".part-00000-00000001.parquet.pending", "checkpoint": 1, "rows": 100}],
    }
    closer = threading.Thread(target=finish)
    closer.start()
    write_range(writer, 100, 180)  # into a new part while the old one closes
    closer.join()
    assert visible(tmp_path) == []
    again, nothing = writer.pre_commit_split(2)
    assert nothing is not None
    nothing()
    assert [p["checkpoint"] for p in again["pending"]] == [1, 2]
    assert writer.pre_commit_split(3) == (writer.pre_commit(3), None)  # no rows: done at once
    writer.commit(2)
    assert read_all(tmp_path).equals(oracle((0, 180)))
    write_range(writer, 180, 200)
    assert writer.close().rows == 200
    assert read_all(tmp_path).equals(oracle((0, 200)))

    broken = sinks.parquet(tmp_path / "b").open(0, 1)
    write_range(broken, 0, 10)
    _, finish = broken.pre_commit_split(1)
    assert finish is not None
    real_close = pq.ParquetWriter.close

    def failing_close(self: pq.ParquetWriter) -> None:
        raise OSError("no space left on device")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pq.ParquetWriter, "close", failing_close)
        with pytest.raises(OSError, match="no space"):
            finish()
    with pytest.raises(CheckpointError, match="closing part"):
        write_range(broken, 10, 20)  # the instance fails: the job restarts from a checkpoint
    with pytest.raises(CheckpointError, match="closing part"):
        broken.pre_commit_split(2)
    assert real_close is pq.ParquetWriter.close
    broken.abort()
