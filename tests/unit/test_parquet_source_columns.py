"""rs.sources.parquet(path, columns=[...]): only those columns, in that order, rows as in the
file; a column the files lack is refused when the source is built."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raystream as rs


def test_projection_reads_the_named_columns_in_order(tmp_path: Path) -> None:
    table = pa.table({"a": range(1000), "b": [str(i) for i in range(1000)], "c": [1.5] * 1000})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=300)
    src = rs.sources.parquet(tmp_path / "t.parquet", batch_rows=128, columns=["c", "a"])
    assert src.schema().names == ["c", "a"]
    got = []
    for i in range(2):
        reader = src.open(i, 2)
        while (batch := reader.read(100)) is not None:
            got.append(batch)
    out = pa.Table.from_batches(got).sort_by("a")
    assert out.equals(table.select(["c", "a"]))
    with pytest.raises(rs.SchemaError, match="columns must be distinct column names"):
        rs.sources.parquet(tmp_path / "t.parquet", columns=["a", "zz"])
