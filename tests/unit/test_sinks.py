"""Sinks: collect, Parquet (atomic parts, schema checks) and null, against pyarrow as the oracle."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raystream import sinks, sources
from raystream.errors import ConfigError, SchemaError


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
